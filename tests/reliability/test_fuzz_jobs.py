"""Bad input everywhere (part of the reliability suite): model-update job documents on a device.

Every payload goes to UpdateService.offer, as the MQTT link hands it over: (a) arbitrary bytes, arbitrary
JSON, deep nesting and JobDocument-shaped objects with odd values; (b) mutations of a valid install job for
the tiny v2 bundle signed by the key the device trusts: any manifest field, a file's hash, size or name,
the signature bytes, key_id, base_url, operation, golden_tokens, min_tokens_per_s, the JSON text itself;
some mutated manifests are signed again by the trusted key (a fleet mistake, not an attack). For every case:
offer() returns, a terminal job status is reported (or, without a usable job id, "malformed job document" is
logged and nothing reported), the updater thread lives on, and the model the device would boot verifies and
carries a signature of the trusted key. The figures (cases per final state) are printed.

Run: .venv/bin/python -m pytest -q tests/reliability/test_fuzz_jobs.py
"""
from __future__ import annotations

import base64
import copy
import json
import logging
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import wire
from agent.updates.trust import verify_manifest
from agent.updates import download
from agent.updates.service import UpdateService
from agent.wire import JobDocument, JobState
from fleet.artifacts import ArtifactServer
from fleet.signing import load_private_key, sign_manifest
from loglines import LogLines
from updates_support import Device, build_bundles, job, make_keys

ARBITRARY_CASES = 500
MUTATED_CASES = 1000
TERMINAL_TIMEOUT_S = 60.0  # a download that makes no progress gives up after STALL_S; a health check takes < 1 s
STALL_S = 2.0  # the rig's DOWNLOAD_STALL_S: 5 minutes on a device, where the network can come back
COUNT: Counter = Counter()  # what became of each payload: a terminal state's name, or "dropped" (no job id)
SIGNED: dict[bytes, str] = {}  # canonical manifest bytes -> the trusted key's signature over them
VALID: dict = {}  # the valid signed job as JSON data, its URL and keys: filled by the `rig` fixture


@dataclass
class Rig:
    device: Device
    service: UpdateService
    logs: LogLines
    v2_path: Path  # the v2 bundle, copied in as `previous` for the cases that start with one


def sign(manifest: wire.Manifest, key: str = "fleet.key") -> tuple[str, str]:
    sig, kid = sign_manifest(manifest, load_private_key(VALID["keys"] / key))
    if key == "fleet.key":
        SIGNED[manifest.canonical_bytes()] = sig
    return sig, kid


@pytest.fixture(scope="module")
def rig(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("fzjobs")
    v1, v2 = build_bundles(tiny_checkpoint, root)
    keys = make_keys(tmp_path_factory.mktemp("fzkeys"))
    server = ArtifactServer(root / "artifacts").start()
    url = server.publish_dir(v2.path, "tiny-v2")
    VALID.update(keys=keys, url=url, v1=v1.manifest)
    sign(v1.manifest)
    sign(v2.manifest)
    VALID["doc"] = job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0).model_dump(mode="json")
    device = Device(root / "device", v1, keys)
    stall_s, download.DOWNLOAD_STALL_S = download.DOWNLOAD_STALL_S, STALL_S
    logs = LogLines()
    logging.getLogger("agent.updates").addHandler(logs)
    service = UpdateService(device.ctx)
    service.start()
    try:
        yield Rig(device, service, logs, v2.path)
    finally:
        download.DOWNLOAD_STALL_S = stall_s
        service.stop()
        server.stop()
        logging.getLogger("agent.updates").removeHandler(logs)


# ---- one case ------------------------------------------------------------------------------------------------
def offer_and_settle(rig: Rig, payload: bytes) -> wire.JobStatusUpdate | None:
    """Offer one payload and check everything a bad payload must not break; returns its final status (None:
    dropped, as it names no usable job id)."""
    dev = rig.device
    n_reports, n_logs = len(dev.reports), len(rig.logs.lines)
    rig.service.offer(payload)  # must not raise, whatever the bytes
    try:
        doc = JobDocument.model_validate_json(payload)
    except ValueError:
        doc = None
    if doc is None:
        assert any("malformed job document" in line for line in rig.logs.lines[n_logs:]), rig.logs.lines[n_logs:]
        new = dev.reports[n_reports:]
        assert len(new) <= 1 and all(r.state is JobState.REJECTED and r.reason == "malformed job document"
                                     for r in new), new
        final = new[0] if new else None
    else:
        final = dev.wait_report(lambda r: r.job_id == doc.job_id and r.state in wire.TERMINAL_JOB_STATES,
                                TERMINAL_TIMEOUT_S, since=n_reports)
        assert final is not None, f"no terminal status for {doc.job_id} within {TERMINAL_TIMEOUT_S} s"
        assert final.reason != "internal error", rig.logs.lines[n_logs:]  # the updater's catch-all for a crash
    assert not any("crashed" in line for line in rig.logs.lines[n_logs:]), rig.logs.lines[n_logs:]
    assert rig.service._thread.is_alive(), "the updater thread died"
    assert_boots_a_signed_model(dev)
    return final


def assert_boots_a_signed_model(dev: Device) -> None:
    """What the device would boot verifies (files against manifest), was signed by the trusted key, lives in
    the store's models directory, and is what the engine serves now."""
    bundle = dev.store.bootable()
    sig = SIGNED.get(bundle.manifest.canonical_bytes())
    assert sig is not None, f"{bundle.path} boots a manifest the trusted key never signed"
    verify_manifest(bundle.manifest, sig, VALID["doc"]["key_id"], dev.ctx.trusted_keys)
    assert bundle.path.parent == dev.store.models.resolve(), bundle.path
    assert dev.serving.manifest == bundle.manifest
    assert len(list(dev.store.staging_root.iterdir())) <= 1  # at most one download kept for a later job to resume


def start_with_previous(rig: Rig) -> None:
    """current -> v1, previous -> an installed copy of v2 (so that a rollback has somewhere to go)."""
    store = rig.device.store
    m = wire.Manifest.read(rig.v2_path)
    v1_dir, v2_dir = store.link("current"), store.models / f"{m.name}@{m.version}"
    shutil.copytree(rig.v2_path, v2_dir)
    store.activate(v2_dir)
    store.activate(v1_dir)


def run_case(rig: Rig, payload: bytes, with_previous: bool = False) -> wire.JobStatusUpdate | None:
    """One fuzz case from a device on v1 (and v2 as previous, if asked), counted by its final state."""
    if with_previous:
        start_with_previous(rig)
    try:
        final = offer_and_settle(rig, payload)
    finally:
        rig.device.reset()  # every case starts on v1 alone
    COUNT[final.state.value if final else "dropped"] += 1
    return final


# ---- (a) arbitrary payloads ----------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)
ODD = JSON_VALUES | st.sampled_from([0, -1, 2**63, -(2**64), 1e308, float("nan"), float("inf"), "", "\x00",
                                     "\ud7ff\U0001f600" * 20, "a" * 65, [], {}, [1, "a"], {"x": None}])
JOB_IDS = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)
BASE_URLS = st.text(max_size=30) | st.sampled_from([
    "", "not a url", "ftp://127.0.0.1/x", "file:///etc", "javascript:alert(1)", "//127.0.0.1/x", "http:///x",
    "http://[::1", "http://127.0.0.1:abc/x", "http://127.0.0.1:99999/x", "http://127.0.0.1:-1/x",
    "http://a b/x", "http://127.0.0.1/\x00", "http://127.0.0.1/é", "http://127.0.0.1/x\n", "HTTP://127.0.0.1/x",
    "$url", "$url/", "$url/elsewhere", "$url/../tiny-v2", "$url?x=1", "$url#frag", "$url%2F..", "$url/%00"])


def from_valid(field: str):
    """The valid job's value of `field` (drawn when the test runs, after the fixture filled VALID)."""
    return st.builds(lambda: copy.deepcopy(VALID["doc"][field]))


def resolve_url(value):
    return value.replace("$url", VALID["url"], 1) if isinstance(value, str) and value.startswith("$url") else value


def one_in(n: int, rare, common):
    """rare once in n draws, else common (st.one_of(a, a, a, b) would not do it: it drops repeated branches)."""
    return st.integers(1, n).flatmap(lambda k: rare if k == 1 else common)


def mostly(plausible):
    """Plausible values 3 times in 4 (so that some documents validate and reach the updater), else odd ones."""
    return one_in(4, ODD, plausible)


JOB_SHAPED = st.fixed_dictionaries({"job_id": JOB_IDS}, optional={  # a usable job id: the updater must answer
    "operation": mostly(st.sampled_from(["install", "rollback", "INSTALL", "update"])),
    "manifest": mostly(from_valid("manifest")),
    "signature": mostly(from_valid("signature") | st.text(max_size=90)),
    "key_id": mostly(from_valid("key_id")),
    "base_url": mostly(BASE_URLS),
    "min_tokens_per_s": mostly(st.floats()),
    "golden_tokens": mostly(st.integers(-2, 70)),
    "allow_downgrade": mostly(st.booleans()),
    "unexpected": ODD})
DEEP = st.builds(lambda opener, n: opener * min(n, wire.MAX_PAYLOAD_BYTES // len(opener)),  # as the link passes it
                 st.sampled_from([b"[", b'{"job_id":', b'{"a":[', b'{"job_id":"x","manifest":{"golden":[']),
                 st.integers(1, 100_000))
ARBITRARY = one_in(2, st.one_of(st.binary(max_size=300), JSON_VALUES.map(lambda v: json.dumps(v).encode()), DEEP),
                   JOB_SHAPED.map(lambda d: json.dumps({k: resolve_url(v) for k, v in d.items()}).encode()))


@settings(max_examples=ARBITRARY_CASES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(payload=ARBITRARY, with_previous=st.booleans())
def test_arbitrary_job_payloads_end_in_a_clear_state(rig, payload, with_previous):
    run_case(rig, payload, with_previous)


# ---- (b) mutations of a valid signed install job -------------------------------------------------------------
MANIFEST_PATHS = ([("manifest", f) for f in wire.Manifest.model_fields] + [("manifest", "unexpected")]
                  + [("manifest", "golden", f) for f in wire.Golden.model_fields]
                  + [("manifest", "quality", f) for f in wire.Quality.model_fields]
                  + [("manifest", "quant", "precision"), ("manifest", "quant", "block_size")])
PLAUSIBLE = {  # values a manifest field could really hold, so that a re-signed manifest still validates
    "name": st.text(max_size=12) | st.sampled_from(["tiny", "tiny/../x", "../x", "a/b", ".", "..", "x\x00y",
                                                     "n" * 300]),
    "version": st.text(max_size=12) | st.sampled_from(["", "v/2", "../../x", "x\x00", "v" * 300]),
    "created_at": st.sampled_from(["2000-01-01T00:00:00+00:00", "2999-01-01T00:00:00+00:00", "", "yesterday"]),
    "schema_version": st.integers(-1, 3),
    "prompt_ids": st.lists(st.integers(-5, 2**40), max_size=6) | st.just([]),
    "continuation_ids": st.lists(st.integers(-5, 300), max_size=6),
    "precision": st.sampled_from(["fp32", "int8", "int4", "", "fp64"]),
}
FILE_NAMES = st.text(max_size=16) | st.sampled_from([
    "../x", "/etc/passwd", "model.onnx/..", "", ".", "a\x00b", "tokenizer.json ", "sub/dir/f.bin", "a b#?%.bin",
    "model.onnx.extra", "é.bin", "x" * 300])
UNSIGNED_EDITS = st.one_of(  # fields outside the signed manifest: a job that changes only these may succeed
    st.tuples(st.just("set"), st.just(("job_id",)), JOB_IDS | ODD),
    st.tuples(st.just("set"), st.just(("operation",)), st.sampled_from(["install", "rollback", "Install", ""])),
    st.tuples(st.just("set"), st.just(("base_url",)), BASE_URLS),
    st.tuples(st.just("set"), st.just(("golden_tokens",)), st.integers(-2, 70) | ODD),
    st.tuples(st.just("set"), st.just(("min_tokens_per_s",)), st.none() | st.floats() | st.sampled_from([1e9])),
    st.tuples(st.just("set"), st.just(("allow_downgrade",)), st.booleans() | ODD),
    st.tuples(st.just("set"), st.just(("unexpected",)), ODD),
    st.tuples(st.just("drop"), st.sampled_from([(f,) for f in wire.JobDocument.model_fields]), st.none()),
)
MANIFEST_EDITS = st.one_of(  # inside the signed manifest: breaks the signature unless signed again
    st.tuples(st.just("set"), st.sampled_from(MANIFEST_PATHS), ODD),
    *[st.tuples(st.just("set"), st.sampled_from([p for p in MANIFEST_PATHS if p[-1] == field]), values)
      for field, values in PLAUSIBLE.items()],
    st.tuples(st.just("drop"), st.sampled_from(MANIFEST_PATHS), st.none()),
    st.tuples(st.just("hash"), st.integers(0, 9), st.tuples(st.integers(0, 63), st.integers(1, 15))),
    st.tuples(st.just("rename"), st.integers(0, 9), FILE_NAMES),
    st.tuples(st.just("drop_file"), st.integers(0, 9), st.none()),
    st.tuples(st.just("add_file"), FILE_NAMES, st.integers(0, 2**40)),
)
SIZE_EDITS = st.tuples(st.just("size"), st.integers(0, 9), st.integers(-2000, 2000).filter(bool)
                       | st.sampled_from([2**40, 2**63, -(2**63)]))  # never re-signed: see MUTATED
SIGNATURE_EDITS = st.one_of(
    st.tuples(st.just("flip_bit"), st.integers(0, 63), st.integers(0, 7)),
    st.tuples(st.just("cut_signature"), st.integers(0, 87), st.none()),
    st.tuples(st.just("set"), st.just(("signature",)), st.text(max_size=90) | ODD),
    st.tuples(st.just("set"), st.just(("key_id",)), st.text(max_size=20) | ODD | st.sampled_from(["0" * 16])),
    st.tuples(st.sampled_from(["v1_signature", "other_key", "other_key_as_fleet"]), st.none(), st.none()),
)
RAW_EDITS = st.one_of(st.tuples(st.just("truncate"), st.integers(0, 4000), st.just(0)),
                      st.tuples(st.just("xor"), st.integers(0, 4000), st.integers(1, 255)))


def set_at(doc: dict, path: tuple[str, ...], value) -> None:
    node = doc
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = resolve_url(value)


def drop_at(doc: dict, path: tuple[str, ...]) -> None:
    node = doc
    for key in path[:-1]:
        node = node.get(key) if isinstance(node.get(key), dict) else {}
    node.pop(path[-1], None)


def edit_file(files: dict, kind: str, a, b) -> None:
    if kind == "add_file":
        files[a] = {"sha256": "ab" * 32, "size_bytes": b}
        return
    name = a if isinstance(a, str) else sorted(files)[a % len(files)]  # a file's name, or an index
    if kind == "hash":
        at, step = b
        digits = files[name]["sha256"]
        files[name]["sha256"] = digits[:at] + format((int(digits[at], 16) + step) % 16, "x") + digits[at + 1:]
    elif kind == "size":
        files[name]["size_bytes"] += b
    elif kind == "rename":
        files[b] = files.pop(name)
    elif kind == "drop_file":
        del files[name]


def edit_signature(doc: dict, kind: str, a, b) -> None:
    if kind == "flip_bit":
        raw = bytearray(base64.b64decode(doc["signature"], validate=True))
        raw[a % len(raw)] ^= 1 << b
        doc["signature"] = base64.b64encode(bytes(raw)).decode()
    elif kind == "cut_signature":
        doc["signature"] = doc["signature"][:a]
    elif kind == "v1_signature":  # a real signature of the trusted key, over another manifest
        doc["signature"] = sign(VALID["v1"])[0]
    else:  # signed by a key the device does not trust, naming that key or pretending to be the fleet's
        sig, kid = sign(wire.Manifest.model_validate(doc["manifest"]), "other.key")
        doc["signature"] = sig
        doc["key_id"] = kid if kind == "other_key" else doc["key_id"]


def apply(doc: dict, edit: tuple) -> None:
    """One edit; an edit that does not fit what earlier edits left (a file edit once `files` is a number, a bit
    flip in a signature that is no longer base64) leaves the document as it is."""
    kind, a, b = edit
    try:
        if kind == "set":
            set_at(doc, a, b)
        elif kind == "drop":
            drop_at(doc, a)
        elif kind in ("hash", "size", "rename", "drop_file", "add_file"):
            edit_file(doc["manifest"]["files"], kind, a, b)
        else:
            edit_signature(doc, kind, a, b)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError):
        pass


def resign(doc: dict) -> None:
    """The fleet signs the mutated manifest with the trusted key (if it is still a manifest at all)."""
    try:
        manifest = wire.Manifest.model_validate(doc["manifest"])
    except (ValueError, KeyError, TypeError):
        return
    doc["signature"], doc["key_id"] = sign(manifest)


def raw_edit(payload: bytes, edit: tuple) -> bytes:
    kind, at, arg = edit
    if kind == "truncate":
        return payload[:at % len(payload)]
    b = bytearray(payload)
    b[at % len(b)] ^= arg
    return bytes(b)


ANY_EDIT = st.one_of(MANIFEST_EDITS, SIZE_EDITS, SIGNATURE_EDITS, UNSIGNED_EDITS)
MUTATED = st.one_of(  # (how, edits to the JSON data, an edit of the JSON text or None)
    st.tuples(st.just("as signed"), st.just([]), st.none()),
    st.tuples(st.just("tampered"), st.lists(ANY_EDIT, min_size=1, max_size=3), st.none()),
    st.tuples(st.just("unsigned fields"), st.lists(UNSIGNED_EDITS, min_size=1, max_size=3), st.none()),
    # Sizes are never re-signed: a signed size the server cannot match ends FAILED only after the download's
    # five attempts (~6 s each case); test_updates' "truncated download" covers it once.
    st.tuples(st.just("re-signed"), st.lists(st.one_of(MANIFEST_EDITS, UNSIGNED_EDITS), min_size=1, max_size=3),
              st.none()),
    st.tuples(st.just("text"), st.lists(ANY_EDIT, max_size=2), RAW_EDITS),
)


@settings(max_examples=MUTATED_CASES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=MUTATED, with_previous=st.booleans())
def test_mutated_signed_jobs_never_install_a_tampered_manifest(rig, case, with_previous):
    how, edits, raw = case
    doc = copy.deepcopy(VALID["doc"])
    doc["job_id"] = f"mut-{sum(COUNT.values())}"
    for edit in edits:
        apply(doc, edit)
    if how == "re-signed":
        resign(doc)
    payload = json.dumps(doc).encode()
    run_case(rig, raw_edit(payload, raw) if raw else payload, with_previous)


# ---- explicit regressions found by the fuzz ------------------------------------------------------------------
def test_deeply_nested_payload_is_dropped_with_a_reason(rig):
    """Found by the fuzz: json.loads (looking for a job id to reject) raised RecursionError out of offer()."""
    assert offer_and_settle(rig, b"[" * 100_000) is None


FOUND = {  # name: (edits, signed again by the trusted key, expected state, words in the reason); each of them
    # once ended in an exception out of UpdateJob.run ("internal error") or, for base_url, in the download
    "base_url without a scheme": ([("set", ("base_url",), "0")], False, JobState.REJECTED, "malformed"),
    "base_url with a bad port": ([("set", ("base_url",), "http://127.0.0.1:abc/x")], False, JobState.REJECTED,
                                 "malformed"),
    "base_url with a space": ([("set", ("base_url",), "$url/a b")], False, JobState.REJECTED, "malformed"),
    "a '/' in the model name": ([("set", ("manifest", "name"), "tin/")], True, JobState.REJECTED,
                                "unsafe model name"),
    "a manifest without model.onnx": ([("drop_file", wire.GRAPH, None)], True, JobState.FAILED,
                                      "could not run the model"),
    "a control character in a file name": ([("rename", wire.TOKENIZER, "\x1b")], True, JobState.FAILED, "HTTP 404"),
    "a NUL in a file name": ([("rename", wire.TOKENIZER, "\x00")], True, JobState.REJECTED, "unsafe file name"),
    "the empty file name": ([("add_file", "", 0)], True, JobState.REJECTED, "unsafe file name"),
    "a 300-character file name": ([("add_file", "x" * 300, 0)], True, JobState.FAILED, "File name too long"),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_found_by_the_fuzz(rig, name):
    edits, signed_again, state, words = FOUND[name]
    doc = copy.deepcopy(VALID["doc"])
    doc["job_id"] = f"found-{list(FOUND).index(name)}"
    for edit in edits:
        apply(doc, edit)
    if signed_again:
        resign(doc)
    try:
        final = offer_and_settle(rig, json.dumps(doc).encode())
    finally:
        rig.device.reset()
    assert final is not None and final.state is state and words in final.reason, final


def test_report_job_case_counts(figures):
    total = sum(COUNT.values())
    states = ", ".join(f"{n} {state}" + (" (no usable job id: logged, not reported)" if state == "dropped" else "")
                       for state, n in COUNT.most_common())
    figures.append(f"job payloads: {total} fuzzed documents ({ARBITRARY_CASES} arbitrary, {MUTATED_CASES} mutated "
                   f"signed jobs): {states}, no crash")
    assert total >= ARBITRARY_CASES + MUTATED_CASES
