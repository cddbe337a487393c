"""Signed model updates on a device: a full install, the negative matrix, resumable downloads and crashes
at every step. Real bundles of the tiny model, a real HTTP Range server, real Ed25519 signatures."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import wire
from agent.updates.trust import load_trusted_keys, verify_job
from agent.updates import download
from agent.updates.jobs import UpdateJob
from agent.updates.model_store import ModelStore
from agent.updates.service import UpdateService, recover
from agent.wire import JobDocument, JobState
from fleet.artifacts import ArtifactServer, RangeHandler
from fleet.signing import keygen, load_private_key, sign_job
from updates_support import Device, build_bundles, job, make_keys


@pytest.fixture(scope="module")
def bundles(tiny_checkpoint, tmp_path_factory):
    return build_bundles(tiny_checkpoint, tmp_path_factory.mktemp("upd"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def server(tmp_path):
    s = ArtifactServer(tmp_path / "artifacts").start()
    yield s
    s.stop()


def write_raw_journal(store: ModelStore, entry) -> None:
    """The journal as it lies on disk, written by this agent, an older one or a damaged card."""
    store.journal.write_text(json.dumps(entry))


def test_install_succeeds_and_keeps_previous(tmp_path, bundles, keys, server):
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v2.manifest.version
    assert dev.store.link("current").name.endswith(v2.manifest.version)
    assert dev.store.link("previous").name.endswith(v1.manifest.version)
    steps = [r.step.value for r in dev.reports if r.step]
    assert steps[0] == "downloading" and steps[-1] == "activating"
    assert {"verifying", "loading", "health_check"} <= set(steps)
    assert dev.reports[-1].state is JobState.SUCCEEDED and "decode_tokens_per_s" in dev.reports[-1].figures
    assert dev.staging_empty()
    # and back again
    assert UpdateJob(dev.ctx, JobDocument(job_id="rb", operation="rollback")).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v1.manifest.version


def test_a_repeated_rollback_leaves_the_rollback_in_place(tmp_path, bundles, keys, server):
    """A rollback is done once per model installed: a command retried after a timeout, a copy the broker
    redelivers or a replay must not undo the rollback it repeats by swapping the links back."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    for i in range(3):
        assert UpdateJob(dev.ctx, JobDocument(job_id=f"rb-{i}", operation="rollback")).run() is JobState.SUCCEEDED
        assert dev.serving.manifest.version == v1.manifest.version
        assert dev.store.link("current").name.endswith(v1.manifest.version)
        assert dev.store.link("previous").name.endswith(v2.manifest.version)  # kept, and deployable again
    assert dev.reports[-1].figures == {"rolled_back_to": dev.store.link("current").name, "already": True}
    # a new model makes rolling back possible again
    url = server.publish_dir(v2.path, "tiny-v2-again")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0, job_id="again")
                     ).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v2.manifest.version
    # ...and so does v1 deployed again, although the links then name what they named after the rollback
    url = server.publish_dir(v1.path, "tiny-v1-again")
    assert UpdateJob(dev.ctx, job(v1.manifest, keys / "fleet.key", url, min_tokens_per_s=0, job_id="v1-again",
                                  allow_downgrade=True)).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v1.manifest.version
    assert UpdateJob(dev.ctx, JobDocument(job_id="rb-9", operation="rollback")).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v2.manifest.version and "already" not in dev.reports[-1].figures


def _tamper_manifest(m: wire.Manifest, **changes) -> wire.Manifest:
    return wire.Manifest.model_validate(m.model_dump() | changes)


NEGATIVE = {
    # name: (how to make the job, expected state, words in the reason)
    "tampered file": ("tamper_file", JobState.FAILED, "sha256"),
    "tampered manifest": ("tamper_manifest", JobState.REJECTED, "bad signature"),
    "unknown key": ("unknown_key", JobState.REJECTED, "unknown key"),
    "no signature": ("unsigned", JobState.REJECTED, "no signed manifest"),
    "sha256 mismatch": ("wrong_sha", JobState.FAILED, "sha256"),
    "truncated download": ("truncated", JobState.FAILED, "incomplete"),
    "too large for budget": ("small_budget", JobState.REJECTED, "memory_budget_mb"),
    "downgrade": ("downgrade", JobState.REJECTED, "downgrade"),
    "golden mismatch": ("golden", JobState.FAILED, "golden"),
    "tps below floor": ("slow", JobState.FAILED, "below the floor"),
    "path escape": ("escape", JobState.REJECTED, "unsafe file name"),
    # a body longer than the signed size is cut at it, not written in full (a disk filler)
    "longer than signed": ("oversize", JobState.FAILED, "sent more than the 100 bytes"),
    # a file shorter than signed fails at once: not a network fault, retrying gets the same
    "shorter than signed": ("undersize", JobState.FAILED, "the signed manifest lists"),
}


class TruncatingHandler(RangeHandler):
    """Serves every file one byte short, forever."""

    def send_head(self):
        f = super().send_head()
        if f is not None:
            self._remaining = max(self._remaining - 1, 0)
        return f


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_negative_matrix_leaves_the_old_model_serving(case, tmp_path, bundles, keys, server, monkeypatch):
    monkeypatch.setattr(download, "DOWNLOAD_STALL_S", 1.0)
    v1, v2 = bundles
    how, expected, words = NEGATIVE[case]
    dev = Device(tmp_path, v1, keys, budget_mb=1 if how == "small_budget" else 4096)
    before = dev.model_dirs()
    url = server.publish_dir(v2.path, "tiny-v2")
    m, key, kw = v2.manifest, keys / "fleet.key", {"min_tokens_per_s": 0}
    if how == "tamper_file":
        with open(server.root / "tiny-v2" / wire.GRAPH_DATA, "r+b") as f:
            f.seek(64)
            f.write(b"\x13\x37")
    elif how == "tamper_manifest":
        doc = job(m, key, url, **kw)
        doc = doc.model_copy(update={"manifest": _tamper_manifest(m, precision="fp32")})
    elif how == "unknown_key":
        key = keys / "other.key"
    elif how == "unsigned":
        key = None
    elif how == "wrong_sha":
        files = dict(m.files)
        files[wire.TOKENIZER] = files[wire.TOKENIZER].model_copy(update={"sha256": "0" * 64})
        m = _tamper_manifest(m, files={k: v.model_dump() for k, v in files.items()})
    elif how == "truncated":
        server.stop()
        server = ArtifactServer(server.root, handler=TruncatingHandler).start()
        url = f"{server.base_url}/tiny-v2"
    elif how == "downgrade":
        m = _tamper_manifest(m, created_at="2000-01-01T00:00:00+00:00")
    elif how == "golden":
        golden = m.golden.model_copy(update={"continuation_ids": [1] * 32})
        m = _tamper_manifest(m, golden=golden.model_dump())
    elif how == "slow":
        kw = {"min_tokens_per_s": 1e9}
    elif how == "oversize":
        files = dict(m.files)
        files[wire.GRAPH_DATA] = files[wire.GRAPH_DATA].model_copy(update={"size_bytes": 100})
        m = _tamper_manifest(m, files={k: v.model_dump() for k, v in files.items()})
    elif how == "undersize":
        files = dict(m.files)
        files[wire.GRAPH_DATA] = files[wire.GRAPH_DATA].model_copy(
            update={"size_bytes": files[wire.GRAPH_DATA].size_bytes + 1000})
        m = _tamper_manifest(m, files={k: v.model_dump() for k, v in files.items()})
    elif how == "escape":
        files = dict(m.files)
        files["../../escaped.bin"] = files.pop(wire.TOKENIZER)
        m = _tamper_manifest(m, files={k: v.model_dump() for k, v in files.items()})
    if how != "tamper_manifest":
        doc = job(m, key, url, **kw)
    state = UpdateJob(dev.ctx, doc).run()
    assert state is expected, dev.reports[-1]
    assert words in dev.reports[-1].reason
    assert dev.serving.manifest.version == v1.manifest.version
    assert dev.store.link("current").name.endswith(v1.manifest.version)
    # a download the network cut short is kept for the next job for that manifest to resume; nothing else is
    assert dev.model_dirs() == before and dev.staging_empty() is (how != "truncated")
    assert not (tmp_path / "escaped.bin").exists()
    if how == "truncated":
        server.stop()


class DroppingHandler(RangeHandler):
    """Drops the connection part-way through the first three responses; counts the bytes it sent."""

    drops_left = 3
    sent = 0

    def copyfile(self, source, outputfile):
        if DroppingHandler.drops_left > 0 and self._remaining > 4096:
            DroppingHandler.drops_left -= 1
            chunk = source.read(self._remaining // 3)
            outputfile.write(chunk)
            DroppingHandler.sent += len(chunk)
            self.close_connection = True
            self.connection.shutdown(2)  # the socket dies mid-body
            return
        DroppingHandler.sent += self._remaining
        super().copyfile(source, outputfile)


def test_download_resumes_after_three_drops_without_refetching(tmp_path, bundles, keys):
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    server = ArtifactServer(tmp_path / "artifacts", handler=DroppingHandler).start()
    try:
        url = server.publish_dir(v2.path, "tiny-v2")
        state = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run()
    finally:
        server.stop()
    total = sum(f.size_bytes for f in v2.manifest.files.values())
    print(f"bundle {total} bytes, served {DroppingHandler.sent} bytes over 3 dropped connections")
    assert state is JobState.SUCCEEDED and DroppingHandler.drops_left == 0
    assert DroppingHandler.sent <= total  # each drop resumed where it stopped: nothing fetched twice


class OutageHandler(RangeHandler):
    """Sends half of the first file it is asked for and drops the connection, then answers 503 while `down`;
    records each request's Range header."""

    down = True
    ranges: list = []

    def send_head(self):
        OutageHandler.ranges.append(self.headers.get("Range"))
        if OutageHandler.down and len(OutageHandler.ranges) > 1:
            self.send_error(503, "down")
            return None
        return super().send_head()

    def copyfile(self, source, outputfile):
        if OutageHandler.down:
            outputfile.write(source.read(self._remaining // 2))
            self.close_connection = True
            self.connection.shutdown(2)
            return
        super().copyfile(source, outputfile)


@pytest.fixture
def outage(tmp_path, bundles):
    """v2 published by a server in an outage (OutageHandler: half a file, then 503s): its URL."""
    OutageHandler.down, OutageHandler.ranges = True, []
    server = ArtifactServer(tmp_path / "artifacts", handler=OutageHandler).start()
    try:
        yield server.publish_dir(bundles[1].path, "tiny-v2")
    finally:
        server.stop()


def test_a_download_the_network_cut_short_is_resumed_by_the_next_job_even_after_a_restart(tmp_path, bundles, keys,
                                                                                           outage, monkeypatch):
    """What a job got before the network failed, or a restart cut it off, is kept: the next job for the same
    model resumes it rather than fetching it all again (as Ollama and Mender do)."""
    monkeypatch.setattr(download, "DOWNLOAD_STALL_S", 1.0)
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    first = job(v2.manifest, keys / "fleet.key", outage, job_id="first", min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, first).run() is JobState.FAILED and "no progress" in dev.reports[-1].reason
    assert not dev.staging_empty()
    recover(dev.ctx)  # a restart keeps it too
    recover(dev.ctx)
    assert not dev.staging_empty()
    OutageHandler.down, OutageHandler.ranges = False, []
    again = job(v2.manifest, keys / "fleet.key", outage, job_id="again", min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, again).run() is JobState.SUCCEEDED
    assert OutageHandler.ranges[0] is not None and OutageHandler.ranges[0].startswith("bytes=")  # resumed
    assert dev.serving.manifest.version == v2.manifest.version and dev.staging_empty()


def test_a_stop_during_a_download_pauses_the_job_and_the_restart_resumes_it(tmp_path, bundles, keys, outage):
    """A stop during a download (which may retry for minutes) pauses the job: the restart resumes it, and it is
    not reported FAILED ('interrupted by an agent restart'), a failure for its rollout."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    svc = UpdateService(dev.ctx)
    svc.start()
    svc.offer(job(v2.manifest, keys / "fleet.key", outage, job_id="j", min_tokens_per_s=0).wire_bytes())
    deadline = time.monotonic() + 20
    while len(OutageHandler.ranges) < 3 and time.monotonic() < deadline:  # cut, then 503s
        time.sleep(0.05)
    t0 = time.monotonic()
    svc.stop()
    assert time.monotonic() - t0 < 3 and not svc._thread.is_alive()
    assert not [r for r in dev.reports if r.state in wire.TERMINAL_JOB_STATES]
    assert dev.store.read_journal().paused
    OutageHandler.down, OutageHandler.ranges = False, []
    restarted = UpdateService(dev.ctx)
    restarted.start()
    try:
        final = dev.wait_report(lambda r: r.state in wire.TERMINAL_JOB_STATES, 30)
    finally:
        restarted.stop()
    assert final.state is JobState.SUCCEEDED and OutageHandler.ranges[0].startswith("bytes=")  # resumed
    assert [r.state for r in dev.reports if r.state in wire.TERMINAL_JOB_STATES] == [JobState.SUCCEEDED]


def test_another_models_download_replaces_a_kept_one(tmp_path, bundles, keys, server):
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    stale = dev.store.staging_root / ("0" * 32)
    stale.mkdir()
    (stale / wire.GRAPH_DATA).write_bytes(b"x" * 1000)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    assert dev.staging_empty()


CRASH_SCRIPT = """
import os, signal, sys, json
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from agent import wire
from agent.engine.bundle import open_bundle
from agent.engine.golden import measure_golden
from agent.updates.trust import load_trusted_keys
from agent.updates.jobs import UpdateContext, UpdateJob
from agent.updates.model_store import ModelStore
store = ModelStore(Path(sys.argv[1]))
doc = wire.JobDocument.model_validate_json(Path(sys.argv[2]).read_text())
crash_at = sys.argv[3]
serving = [store.bootable()]
if crash_at == "moved_in":  # right after the verified bundle is renamed from staging into models/
    replace = os.replace
    def replace_then_die(src, dst):
        replace(src, dst)
        if Path(dst).parent == store.models:
            os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace_then_die
def report(u):
    if u.step is not None and u.step.value == crash_at:
        os.kill(os.getpid(), signal.SIGKILL)
ctx = UpdateContext(device_id="dev1", store=store, trusted_keys=load_trusted_keys([Path(sys.argv[5])]),
                    memory_budget_mb=4096, current=lambda: serving[0], report=report,
                    swap=lambda b, check=None: (check and check(b), serving.__setitem__(0, b)),
                    measure=lambda b, n: measure_golden(b, 1, n))
UpdateJob(ctx, doc).run()
"""


@pytest.mark.parametrize("step", ["downloading", "verifying", "health_check", "activating"])
def test_sigkill_at_each_step_recovers_on_a_verified_model(step, tmp_path, bundles, keys, server):
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    docfile = tmp_path / "job.json"
    docfile.write_text(job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0).model_dump_json())
    r = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(dev.store.root), str(docfile), step,
                        str(Path(__file__).parent.parent), str(keys / "fleet.key.pub")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    update = recover(dev.ctx)  # the restarted agent settles the job...
    bundle = dev.store.bootable()  # ...and comes up on a verified model
    assert update is not None and update.job_id == "job-1"
    assert update.state is JobState.FAILED and step in update.reason
    assert bundle.manifest.version == v1.manifest.version
    assert dev.model_dirs() == [f"tiny@{v1.manifest.version}"]
    # what it had downloaded stays for the next job for that manifest to resume, and nothing else
    assert len(list(dev.store.staging_root.iterdir())) == (step in ("downloading", "verifying"))


def test_sigkill_just_after_the_bundle_moved_into_models_leaves_no_orphan(tmp_path, bundles, keys, server):
    """The journal names the bundle's place in models/ before the rename into it, so a crash in between leaves
    no bundle there that neither link names (~90 MB a time for SmolLM2)."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    docfile = tmp_path / "job.json"
    url = server.publish_dir(v2.path, "tiny-v2")
    docfile.write_text(job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0).model_dump_json())
    r = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(dev.store.root), str(docfile), "moved_in",
                        str(Path(__file__).parent.parent), str(keys / "fleet.key.pub")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert f"tiny@{v2.manifest.version}" in dev.model_dirs()  # it was moved in
    update = recover(dev.ctx)
    assert update.state is JobState.FAILED and dev.store.bootable().manifest.version == v1.manifest.version
    assert dev.staging_empty() and dev.model_dirs() == [f"tiny@{v1.manifest.version}"]


def test_recovery_keeps_the_previous_model_when_the_interrupted_job_reinstalled_it(tmp_path, bundles, keys):
    """A job deploying the version `previous` names journals that directory as its target before touching
    it; a crash there must not cost the device its rollback target."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    older = dev.store.models / f"tiny@{v2.manifest.version}"
    shutil.copytree(v2.path, older)
    dev.store.activate(older)
    dev.store.activate(dev.store.models / f"tiny@{v1.manifest.version}")  # previous: v2, current: v1
    write_raw_journal(dev.store, {"job_id": "j", "state": JobState.IN_PROGRESS.value, "step": "activating",
                                  "target": str(older)})
    assert recover(dev.ctx).state is JobState.FAILED
    assert older.is_dir() and dev.store.link("previous") == older.resolve()


def swap_failing_on(dev, version: str, calls: list | None = None):
    """A swap whose engine cannot start `version` (after its check ran); any other bundle serves."""
    def swap(bundle, check=None):
        if calls is not None:
            calls.append(bundle.manifest.version)
        if check:
            check(bundle)
        if bundle.manifest.version == version:
            raise RuntimeError("engine failed to start")
        dev.serving = bundle
    return swap


def test_activation_failure_rolls_back_automatically(tmp_path, bundles, keys, server):
    """The new model passed its checks but the engine cannot run it: the device goes back on its own."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    calls = []
    dev.ctx.swap = swap_failing_on(dev, v2.manifest.version, calls)
    fallback = dev.store.models / "tiny@fallback"  # the model before v1: the device's rollback target
    shutil.copytree(v1.path, fallback)
    current = dev.store.link("current")
    dev.store.activate(fallback)
    dev.store.activate(current)
    url = server.publish_dir(v2.path, "tiny-v2")
    state = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run()
    assert state is JobState.FAILED and "rolled back" in dev.reports[-1].reason
    assert calls == [v2.manifest.version, v1.manifest.version]
    assert dev.serving.manifest.version == v1.manifest.version
    # Both links are as they were (v2 is not `previous`, the next rollback's target, and the model `previous`
    # named is kept), and v2 is gone.
    assert (dev.store.link("current"), dev.store.link("previous")) == (current, fallback.resolve())
    assert dev.model_dirs() == sorted([current.name, fallback.name])
    state = UpdateJob(dev.ctx, JobDocument(job_id="rb", operation="rollback")).run()
    assert state is JobState.SUCCEEDED and dev.serving.path.resolve() == fallback.resolve()
    assert dev.store.link("current") == fallback.resolve()


@pytest.mark.parametrize("kv_dtypes", [("int8",), ("fp32", "int8")], ids=["running", "after-a-restart"])
def test_a_bundle_without_the_kv_graph_the_device_runs_fails_its_health_check(tmp_path, bundles, keys, server,
                                                                              kv_dtypes):
    """The health check runs the fp32-KV graph whatever the device runs, so a bundle without the int8 KV graph
    of a `kv_dtype = "int8"` device is refused before the engine swap; so is one without the graph a kv_dtype
    edit waiting for a restart asks for, which would fail every later start."""
    v1, v2 = bundles
    assert not (v2.path / "model.int8kv.onnx").exists()
    dev = Device(tmp_path, v1, keys)
    swapped = []

    def swap(bundle, check=None):
        check(bundle)
        swapped.append(bundle)
    dev.ctx.swap = swap
    dev.ctx.kv_dtypes = lambda: kv_dtypes
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.FAILED
    assert 'kv_dtype = "int8"' in dev.reports[-1].reason and "model.int8kv.onnx" in dev.reports[-1].reason
    assert swapped == [] and dev.store.bootable().manifest.version == v1.manifest.version
    assert dev.model_dirs() == [f"tiny@{v1.manifest.version}"] and dev.staging_empty()


def test_the_kv_types_a_new_model_is_checked_for_include_the_config_files():
    from agent.api.backend import Backend
    from agent.config import AgentConfig
    from agent.service.serve import _kv_dtypes

    started = AgentConfig.model_validate({"engine": {"kv_dtype": "fp32"}})
    edited = AgentConfig.model_validate({"engine": {"kv_dtype": "int8"}})
    backend = Backend(None)

    def unreadable():
        raise ValueError("a bad edit")
    assert _kv_dtypes(backend, started, lambda: edited) == ("fp32", "int8")
    assert _kv_dtypes(backend, started, lambda: started) == ("fp32",)
    assert _kv_dtypes(backend, started, unreadable) == ("fp32",)
    assert _kv_dtypes(backend, edited, None) == ("int8",)


def test_the_download_step_is_journaled_before_its_first_byte(tmp_path, bundles, keys, server):
    """The downloading step is journalled before the first byte (the first progress report comes after a MiB
    or a whole file), so a restart during the first MiB is not reported as 'interrupted ... before it started'."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    journaled = []
    write = dev.store.write_journal
    dev.store.write_journal = lambda entry: (journaled.append(entry.step), write(entry))
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    downloading = [r for r in dev.reports if r.step is wire.JobStep.DOWNLOADING]
    assert downloading[0].percent == 0.0 and journaled[:2] == [None, "downloading"]


def test_a_link_that_cannot_move_puts_both_back_and_the_old_model_serves(tmp_path, bundles, keys, server,
                                                                          monkeypatch):
    """A failure between the two link renames (a full disk) puts both links back, so the next start boots the
    model that serves, not the bundle the job reported FAILED."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    before = dev.store.link("current"), dev.store.link("previous")
    real_set_link, calls = dev.store._set_link, []

    def set_link_then_fail(name, target):
        calls.append(name)
        real_set_link(name, target)
        if len(calls) == 2:  # after `previous` and `current` moved, the fsync fails
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(dev.store, "_set_link", set_link_then_fail)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.FAILED
    assert (dev.store.link("current"), dev.store.link("previous")) == before
    assert dev.serving.manifest.version == v1.manifest.version and dev.model_dirs() == [f"tiny@{v1.manifest.version}"]


def test_a_job_document_delivered_twice_while_it_runs_runs_once(tmp_path, bundles, keys, server):
    """A QoS 1 redelivery of a running job is not queued again: a second run would report REJECTED ('already
    the current model') after the first SUCCEEDED, and the fleet would keep that."""

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    payload = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "tiny-v2"), job_id="twice",
                  min_tokens_per_s=0).model_dump_json().encode()
    svc = UpdateService(dev.ctx)
    svc.start()
    try:
        svc.offer(payload)
        svc.offer(payload)
        assert dev.wait_report(lambda r: r.step is None and r.state is JobState.SUCCEEDED, 60) is not None
        n = len(dev.reports)
        svc.offer(payload)  # after it ended: its final state again
        assert dev.wait_report(lambda r: r.state is JobState.SUCCEEDED, 10, since=n) is not None
    finally:
        svc.stop()
    finals = [r.state for r in dev.reports if r.step is None and r.state is not JobState.QUEUED]
    assert finals == [JobState.SUCCEEDED, JobState.SUCCEEDED] and dev.store.read_journal().state == "SUCCEEDED"


def test_reinstalling_a_model_the_agent_was_started_with_replaces_its_link(tmp_path, bundles, keys, server):
    """`serve --model DIR` seeds models/NAME@VERSION as a link to DIR; re-deploying that version after another
    replaces the link (shutil.rmtree refuses a link) and leaves DIR untouched."""
    from agent.service.serve import boot_model

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    shutil.rmtree(dev.root / "state")
    dev.store = dev.ctx.store = ModelStore(dev.root / "state")
    boot_model(dev.store, v1.path)
    seeded = dev.store.models / f"{v1.manifest.name}@{v1.manifest.version}"
    assert seeded.is_symlink()
    up = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "v2"), min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, up).run() is JobState.SUCCEEDED
    back = job(v1.manifest, keys / "fleet.key", server.publish_dir(v1.path, "v1"), job_id="back", min_tokens_per_s=0,
               allow_downgrade=True)
    assert UpdateJob(dev.ctx, back).run() is JobState.SUCCEEDED, dev.reports[-1]
    assert not seeded.is_symlink() and seeded.is_dir() and v1.path.is_dir()  # DIR itself is untouched
    assert dev.serving.manifest.version == v1.manifest.version and dev.staging_empty()


def test_a_journal_that_cannot_be_written_fails_the_job_with_the_reason(tmp_path, bundles, keys, server, monkeypatch):
    """On a full disk the job reports QUEUED, then FAILED with the journal's error, not 'internal error'."""
    import errno

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)

    def full(entry):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dev.store, "write_journal", full)
    doc = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "tiny-v2"), min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, doc).run() is JobState.FAILED
    assert [r.state for r in dev.reports] == [JobState.QUEUED, JobState.FAILED]
    assert "cannot write the update journal" in dev.reports[-1].reason and "No space left" in dev.reports[-1].reason
    assert dev.serving.manifest.version == v1.manifest.version and dev.staging_empty()


# ---- slow, cut and refused downloads; crashes mid-job ---------------------------------------------------------
def send_slowly(source, outputfile, block: int, pause_s: float) -> None:
    """Copy source in blocks of `block` bytes, `pause_s` apart, until it ends or the device gives up."""
    try:
        while data := source.read(block):
            outputfile.write(data)
            outputfile.flush()
            time.sleep(pause_s)
    except OSError:
        pass  # the device gave up on us


class TricklingHandler(RangeHandler):
    """Sends 4 kB, then a byte every 0.3 s: never a socket timeout, never the end. `forever=False`: only the
    first response trickles."""

    forever = True
    requests = 0

    def copyfile(self, source, outputfile):
        TricklingHandler.requests += 1
        if not TricklingHandler.forever and TricklingHandler.requests > 1:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(4096))
        send_slowly(source, outputfile, 1, 0.3)


@pytest.mark.parametrize("forever", [False, True])
def test_a_trickling_server_is_cut_off_and_resumed_or_given_up_on(forever, tmp_path, bundles, keys, monkeypatch):
    """A server sending a byte every few seconds held the update thread (and every job behind it) for days."""
    monkeypatch.setattr(download, "LOW_SPEED_WINDOW_S", 1.0)
    monkeypatch.setattr(download, "MIN_DOWNLOAD_BYTES_PER_S", 1 << 30)  # every attempt is cut after its window
    monkeypatch.setattr(download, "DOWNLOAD_STALL_S", 5.0)
    TricklingHandler.forever, TricklingHandler.requests = forever, 0
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    server = ArtifactServer(tmp_path / "artifacts", handler=TricklingHandler).start()
    t0 = time.monotonic()
    try:
        url = server.publish_dir(v2.path, "tiny-v2")
        state = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run()
    finally:
        server.stop()
    if forever:
        assert state is JobState.FAILED and "no progress for 5 s" in dev.reports[-1].reason
        assert time.monotonic() - t0 < 30 and dev.serving.manifest.version == v1.manifest.version
    else:
        assert state is JobState.SUCCEEDED and TricklingHandler.requests >= 2


class CrawlingHandler(RangeHandler):
    """Sends 8 kB every 0.1 s (80 kB/s), whatever the file's size."""

    def copyfile(self, source, outputfile):
        send_slowly(source, outputfile, 8192, 0.1)


def test_a_crawling_download_is_cut_off_by_its_recent_rate_not_the_files_size(tmp_path, monkeypatch):
    """An attempt is cut by its rate over the last window, not on average over the whole file, which lets a
    51 MB download crawling at 200 B/s hold the updater (and every job behind it) for ~52 minutes, reporting 0%
    all along. Scaled down here: a 1 MB/s floor over 1 s windows, a 40 MB file at 80 kB/s. A whole-file average
    allows this attempt 40 s; it ends within its first window, with progress reported by time."""
    monkeypatch.setattr(download, "LOW_SPEED_WINDOW_S", 1.0)
    monkeypatch.setattr(download, "MIN_DOWNLOAD_BYTES_PER_S", 1 << 20)
    monkeypatch.setattr(download, "PROGRESS_EVERY_S", 0.3)
    size = 40 << 20
    (tmp_path / "files").mkdir()
    with open(tmp_path / "files" / "big.bin", "wb") as f:
        f.truncate(size)
    server = ArtifactServer(tmp_path / "files", handler=CrawlingHandler).start()
    reports = []
    try:
        with pytest.raises(TimeoutError, match="slower than 1024 kB/s"):
            download.fetch_attempt(f"{server.base_url}/big.bin", tmp_path / "big.part", 0, size, reports.append)
    finally:
        server.stop()
    got = (tmp_path / "big.part").stat().st_size
    assert 0 < got < 1 << 20  # cut in its first window: ~80 kB of the 40 MB arrived
    assert len(reports) >= 2 and reports == sorted(reports) and reports[-1] <= got


def test_a_body_cut_off_mid_chunk_is_resumed(tmp_path, bundles, keys, server, monkeypatch):
    """http.client.IncompleteRead (a chunked body cut off) and BadStatusLine escaped as "internal error"."""
    import http.client

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    get = download.fetch_attempt
    failures = [http.client.IncompleteRead(b"x" * 10), http.client.BadStatusLine("garbage")]

    def flaky(url, path, have, size, progress, stopped):
        if failures:
            raise failures.pop()
        return get(url, path, have, size, progress, stopped)

    monkeypatch.setattr(download, "fetch_attempt", flaky)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    assert not failures


class OftenDroppingHandler(RangeHandler):
    """Drops the connection after 2 kB of the weights file, eight times over."""

    drops_left = 8

    def copyfile(self, source, outputfile):
        if self.path.endswith(wire.GRAPH_DATA) and OftenDroppingHandler.drops_left > 0 and self._remaining > 2048:
            OftenDroppingHandler.drops_left -= 1
            outputfile.write(source.read(2048))
            self.close_connection = True
            self.connection.shutdown(2)
            return
        super().copyfile(source, outputfile)


def test_a_download_that_keeps_progressing_is_not_cut_at_five_attempts(tmp_path, bundles, keys, monkeypatch):
    """Five attempts a file were allowed even when each got further than the last: a flaky link failed."""
    monkeypatch.setattr(download, "CHUNK_BYTES", 1024)  # so that an attempt adding 2 kB made progress
    v1, v2 = bundles
    assert v2.manifest.files[wire.GRAPH_DATA].size_bytes > 9 * 2048
    dev = Device(tmp_path, v1, keys)
    OftenDroppingHandler.drops_left = 8
    server = ArtifactServer(tmp_path / "artifacts", handler=OftenDroppingHandler).start()
    try:
        url = server.publish_dir(v2.path, "tiny-v2")
        state = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run()
    finally:
        server.stop()
    assert state is JobState.SUCCEEDED and OftenDroppingHandler.drops_left == 0, dev.reports[-1]


def test_an_empty_file_in_a_signed_manifest_installs(tmp_path, bundles, keys, server):
    """With no file on disk, 0 bytes 'had' equalled the signed size, so it was never created."""
    import hashlib

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    src = tmp_path / "v2-notice"
    shutil.copytree(v2.path, src)
    (src / "NOTICE").write_bytes(b"")
    files = {**{k: v.model_dump() for k, v in v2.manifest.files.items()},
             "NOTICE": {"sha256": hashlib.sha256(b"").hexdigest(), "size_bytes": 0}}
    m = _tamper_manifest(v2.manifest, files=files)
    (src / wire.MANIFEST).write_text(m.model_dump_json(indent=2))
    url = server.publish_dir(src, "tiny-v2")
    assert UpdateJob(dev.ctx, job(m, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED, \
        dev.reports[-1]
    assert (dev.store.link("current") / "NOTICE").stat().st_size == 0


class Crash(BaseException):
    """The process dying mid-step (nothing of ours catches a BaseException)."""


def test_a_crash_in_a_rollback_after_the_links_moved_is_recovered_as_succeeded(tmp_path, bundles, keys, server):
    """The rollback journalled no target, so recovery reported FAILED for a rollback that had happened."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED

    def crash(bundle, check=None):
        raise Crash()

    dev.ctx.swap = crash
    with pytest.raises(Crash):
        UpdateJob(dev.ctx, JobDocument(job_id="rb", operation="rollback")).run()
    assert dev.store.link("current").name.endswith(v1.manifest.version)  # the links had moved
    settled = recover(dev.ctx)
    assert settled.job_id == "rb" and settled.state is JobState.SUCCEEDED, settled


def test_recovery_on_a_full_disk_still_reports_and_lets_the_agent_start(tmp_path, bundles, keys, monkeypatch):
    import errno

    v1, _ = bundles
    dev = Device(tmp_path, v1, keys)
    write_raw_journal(dev.store, {"job_id": "j", "state": "IN_PROGRESS", "step": "downloading", "target": None})

    def full(entry):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dev.store, "write_journal", full)
    settled = recover(dev.ctx)
    assert settled.state is JobState.FAILED and dev.reports[-1] == settled


def test_each_update_deletes_the_bundle_no_link_names_any_more(tmp_path):
    """Every update left the bundle it displaced from `previous` in models/: months of them filled the disk."""
    store = ModelStore(tmp_path / "state")
    outside = tmp_path / "seeded"  # `serve --model DIR`: the user's directory, never deleted
    dirs = [outside, *(store.models / name for name in ("a", "b", "c"))]
    for d in dirs:
        d.mkdir()
    for d in dirs:
        store.activate(d)
    assert outside.exists() and not (store.models / "a").exists()
    assert sorted(p.name for p in store.models.iterdir() if p.name != ".staging") == ["b", "c"]
    store.activate(store.models / "b")  # re-activating the previous one displaces nothing
    assert (store.models / "c").exists() and store.link("current").name == "b"


def test_a_job_for_the_model_already_running_succeeds_without_a_download(tmp_path, bundles, keys):
    """The fleet's wish already holds: SUCCEEDED, as Mender skips an installed artifact. REJECTED would be a
    failure to the fleet, so re-running a halted rollout (whose first devices were updated) would halt again."""
    v1, _ = bundles
    dev = Device(tmp_path, v1, keys)
    doc = job(v1.manifest, keys / "fleet.key", "http://127.0.0.1:9/nothing-here", min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, doc).run() is JobState.SUCCEEDED
    assert "already the current model" in dev.reports[-1].reason and dev.serving.manifest.version == v1.manifest.version


def test_the_shipped_config_naming_current_still_falls_back_to_previous(tmp_path, bundles, keys, server):
    """systemd/agent.toml sets model = /var/lib/edge-agent/current: boot_model goes through the store, so a
    damaged current serves previous instead of stopping the agent (a restart loop)."""
    from agent.engine.bundle import open_bundle
    from agent.service.serve import boot_model

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    up = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "v2"), min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, up).run() is JobState.SUCCEEDED
    damaged = dev.store.link("current")
    (damaged / wire.GRAPH).write_bytes(b"damaged")
    served = boot_model(dev.store, dev.store.root / "current")
    assert not damaged.exists()  # deleted, also on an agent without an updater
    assert open_bundle(served).manifest.version == v1.manifest.version
    assert dev.store.link("current") == served.resolve()
    # said (store.fallback, for the fleet's model_fallback event), and the only model left, not both links naming it
    assert dev.store.link("previous") is None and dev.store.fallback["to"] == served.resolve().name
    assert "current: " in dev.store.fallback["reason"]
    with pytest.raises(Exception, match="no previous model"):
        dev.store.rollback()


def test_the_devices_health_check_tokens_is_a_floor_the_job_cannot_lower(tmp_path, bundles, keys, server):
    """[updates] health_check_tokens is the least the golden check compares, whatever the job asks."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    dev.ctx.health_check_tokens = 24
    up = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "v2"), min_tokens_per_s=0)  # asks 16
    assert UpdateJob(dev.ctx, up).run() is JobState.SUCCEEDED
    assert dev.reports[-1].figures["golden_tokens"] == 24


# ---- durability, restarts, the queue and the job's timing ----------------------------------------------------
def test_an_update_is_on_disk_before_the_fleet_hears_it_succeeded(tmp_path, bundles, keys, server, monkeypatch):
    """rename(2) is atomic against a crash, not durable against a power cut: ext4 may commit the rename before
    the renamed files' data. So by the time SUCCEEDED is reported, every file of the new bundle must have been
    fsynced, and every directory a name was renamed into (models/, the links' and the journal's) fsynced
    after that rename: a directory fsync before it does not make the new name durable."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    events: list[tuple[str, tuple[int, int]]] = []  # ("fsync", inode) and ("rename", inode of the directory)
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def node(p) -> tuple[int, int]:
        st = os.stat(p)
        return st.st_dev, st.st_ino

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        real["fsync"](fd)

    def renaming(name):
        def rename(src, dst, **kw):
            real[name](src, dst, **kw)
            events.append(("rename", node(Path(dst).parent)))
        return rename

    problems: list[str] = []
    report = dev.ctx.report

    def check_then_report(update):
        if update.state is JobState.SUCCEEDED:
            final = dev.store.link("current")
            synced = {n for kind, n in events if kind == "fsync"}
            problems.extend(f"not synced: {p}" for p in final.rglob("*") if p.is_file() and node(p) not in synced)
            for i, (kind, directory) in enumerate(events):
                if kind == "rename" and ("fsync", directory) not in events[i + 1:]:
                    problems.append(f"a rename into {directory} not followed by that directory's fsync")
        report(update)

    monkeypatch.setattr(os, "fsync", fsync)
    for name in ("replace", "rename"):
        monkeypatch.setattr(os, name, renaming(name))
    dev.ctx.report = check_then_report
    doc = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "tiny-v2"), min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, doc).run() is JobState.SUCCEEDED
    assert dev.store.link("current").name.endswith(v2.manifest.version)
    assert sum(kind == "rename" for kind, _ in events) >= 4  # bundle, previous, current, journal
    assert problems == []


@pytest.mark.parametrize("journal, reported", [
    ({"job_id": "j", "state": "SUCCEEDED", "step": None, "target": None}, ("SUCCEEDED", None)),
    ({"job_id": "j", "state": "REJECTED", "step": None, "target": None, "reason": "downgrade"}, ("REJECTED", "downgrade")),
    ({"job_id": "j", "state": "QUEUED", "step": None, "target": None},
     ("FAILED", "interrupted by an agent restart before it started")),
])
def test_a_restart_reports_how_the_last_job_ended_again(journal, reported, tmp_path, bundles, keys):
    """A job's final status lives only in the MQTT client's memory until the broker takes it, so a restart
    reports it again from the journal (a job that ended offline, or just before a power cut, would otherwise
    be timed out by the fleet); a job journalled QUEUED is reported FAILED, not forgotten."""
    v1, _ = bundles
    dev = Device(tmp_path, v1, keys)
    write_raw_journal(dev.store, journal)
    settled = recover(dev.ctx)
    assert dev.reports == [settled] and (settled.job_id, settled.state.value, settled.reason) == ("j", *reported)
    assert dev.store.bootable().manifest.version == v1.manifest.version and dev.staging_empty()


@pytest.mark.parametrize("damaged", ["[1, 2]", '"text"', "7", '{"job_id": "j", "state": "QUEUED", "target": 5}',
                                     '{"job_id": "j", "state": []}', '{"job_id": 5, "state": "QUEUED"}',
                                     '{"job_id": ["x"], "state": "SUCCEEDED"}',
                                     # keys and values no agent writes: the journal is damaged, not guessed at
                                     '{"job_id": "j", "state": "QUEUED", "staging": "/x"}',
                                     '{"job_id": "j", "state": "IN_PROGRESS", "step": "unpacking"}',
                                     '{"job_id": "j", "state": "QUEUED", "paused": "maybe"}'])
def test_a_damaged_journal_does_not_stop_the_agent_from_starting(damaged, tmp_path, bundles, keys):
    v1, _ = bundles
    dev = Device(tmp_path, v1, keys)
    dev.store.journal.write_text(damaged)
    svc = UpdateService(dev.ctx)
    svc.start()  # recover() and the queue: no exception, so the agent starts
    svc.stop()
    assert dev.store.bootable().manifest.version == v1.manifest.version and dev.reports == []


@pytest.mark.parametrize("written", [
    {"job_id": "j", "state": "IN_PROGRESS", "step": "downloading", "ts": 1.7e9, "target": "/s/models/.staging/ab"},
    {"job_id": "j", "state": "FAILED", "step": None, "ts": 1.7e9, "target": None, "reason": "golden output mismatch"},
    {"job_id": "j", "state": "IN_PROGRESS", "step": "loading", "target": "/s/models/tiny@2"},  # before the move
    {"job_id": "j", "state": "QUEUED", "step": "downloading", "target": "/s/models/.staging/ab", "paused": True},
    {"job_id": "j", "state": "FAILED", "step": None, "target": None},  # settled by recover()
])
def test_every_journal_an_agent_writes_reads_back_as_written(written, tmp_path):
    """The journal's shapes, as this agent and earlier ones wrote them: each validates, and is written back
    with the same keys and values."""
    store = ModelStore(tmp_path / "state")
    write_raw_journal(store, written)
    entry = store.read_journal()
    assert entry is not None and json.loads(entry.model_dump_json(exclude_unset=True)) == written
    store.write_journal(entry)
    assert json.loads(store.journal.read_text()) == written


def test_a_restart_removes_model_directories_no_link_names(tmp_path, bundles, keys):
    """A power cut between a rollback's two link swaps (both links then name one bundle), or during a deletion,
    leaves a bundle in models/ that no link names: the restart removes it (~90 MB of an SD card each time)."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    half_deleted = dev.store.models / f"tiny@{v2.manifest.version}"
    shutil.copytree(v2.path, half_deleted)
    (half_deleted / "model.onnx").unlink()
    user_dir = tmp_path / "user-bundle"
    shutil.copytree(v2.path, user_dir)
    (dev.store.models / "seeded").symlink_to(user_dir)
    recover(dev.ctx)
    assert dev.model_dirs() == [f"tiny@{v1.manifest.version}"] and user_dir.is_dir()
    assert dev.store.bootable().manifest.version == v1.manifest.version


def test_jobs_accepted_before_a_restart_still_run_after_it(tmp_path, bundles, keys, server):
    """A job document is acknowledged to the broker once queued, so it is saved on disk first: jobs waiting
    behind a running one survive a restart (or power cut) rather than being timed out by the fleet."""

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    interrupted = job(v2.manifest, keys / "fleet.key", url, job_id="a", min_tokens_per_s=0)
    waiting = job(v2.manifest, keys / "fleet.key", url, job_id="b", min_tokens_per_s=0)
    before = UpdateService(dev.ctx)  # its thread never starts: both stay queued, as behind a long download
    before.offer(interrupted.model_dump_json().encode())
    before.offer(waiting.model_dump_json().encode())
    write_raw_journal(dev.store, {"job_id": "a", "state": "IN_PROGRESS", "step": "downloading", "target": None})

    after = UpdateService(dev.ctx)  # the restarted agent
    after.start()
    try:
        final = dev.wait_report(lambda r: r.job_id == "b" and r.state in wire.TERMINAL_JOB_STATES, 60)
    finally:
        after.stop()
    assert final is not None and final.state is JobState.SUCCEEDED, final
    assert [r.state for r in dev.reports if r.job_id == "a"] == [JobState.FAILED]  # settled, not run again
    assert dev.serving.manifest.version == v2.manifest.version
    assert list(dev.store.queue.iterdir()) == []


def test_a_job_queued_when_the_agent_stops_waits_for_the_restart(tmp_path, bundles, keys, server, monkeypatch):
    """A job queued when SIGTERM comes does not begin during the shutdown (the exit would cut it off, and it
    would be reported FAILED, 'interrupted by an agent restart', which can halt a rollout). The running job
    finishes; a queued one runs after the restart."""
    import threading

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    ran, release = [], threading.Event()

    def run(self):
        ran.append(self.doc.job_id)
        release.wait(30)  # job a: a long health check
        return JobState.SUCCEEDED

    monkeypatch.setattr(UpdateJob, "run", run)
    svc = UpdateService(dev.ctx)
    svc.start()
    svc.offer(job(v2.manifest, keys / "fleet.key", url, job_id="a", min_tokens_per_s=0).model_dump_json().encode())
    svc.offer(job(v2.manifest, keys / "fleet.key", url, job_id="b", min_tokens_per_s=0).model_dump_json().encode())
    deadline = time.monotonic() + 10
    while ran != ["a"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stopping = threading.Thread(target=svc.stop)
    stopping.start()
    time.sleep(0.2)  # SIGTERM while a runs and b waits
    release.set()
    stopping.join(10)
    assert ran == ["a"]
    assert [doc.job_id for _, doc in dev.store.queued()] == ["b"]

    after = UpdateService(dev.ctx)  # the restarted agent runs it
    after.start()
    try:
        deadline = time.monotonic() + 10
        while "b" not in ran and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        after.stop()
    assert ran == ["a", "b"]


def test_an_unsigned_job_that_outlived_its_notice_while_queued_is_refused(tmp_path, bundles, keys, server):
    """A job that waited behind another until its notice expired (the fleet has counted it TIMED_OUT and may
    have halted the rollout) is refused, unsigned too: it has no expires_at of its own."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    svc = UpdateService(dev.ctx)  # not started: as while a long job runs
    svc.offer(job(v2.manifest, keys / "fleet.key", url, job_id="late", min_tokens_per_s=0).wire_bytes(), expiry_s=1)
    time.sleep(1.2)
    svc.start()
    try:
        final = dev.wait_report(lambda r: r.job_id == "late" and r.state in wire.TERMINAL_JOB_STATES, 30)
    finally:
        svc.stop()
    assert final.state is JobState.REJECTED and "expired" in final.reason
    assert dev.serving.manifest.version == v1.manifest.version


def test_a_fleet_signed_job_on_a_device_without_job_keys_is_not_held_to_its_expires_at(tmp_path, bundles, keys,
                                                                                       server):
    """The expiry of an unsigned job is its notice's, not the document's expires_at, which a fleet with
    --job-key sets by its own clock: a device without job keys whose clock runs ahead must not refuse every job."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    doc = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "tiny-v2"), min_tokens_per_s=0)
    doc = doc.model_copy(update={"expires_at": time.time() - 3600})
    assert UpdateJob(dev.ctx, doc).run() is JobState.SUCCEEDED


def test_a_rollback_to_a_model_without_the_kv_graph_the_device_will_run_is_refused(tmp_path, bundles, keys, server):
    """A rollback is checked for the KV graph the config file asks for, as an install is: moving to a model
    without it would fail the next start."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    links = dev.store.link("current"), dev.store.link("previous")
    dev.ctx.kv_dtypes = lambda: ("fp32", "int8")  # kv_dtype = "int8" edited in, waiting for a restart
    assert UpdateJob(dev.ctx, JobDocument(job_id="rb", operation="rollback")).run() is JobState.FAILED
    assert "refused" in dev.reports[-1].reason and "model.int8kv.onnx" in dev.reports[-1].reason
    assert (dev.store.link("current"), dev.store.link("previous")) == links
    assert dev.serving.manifest.version == v2.manifest.version


def test_the_last_jobs_end_is_replayed_with_its_own_time_and_not_as_news(tmp_path, bundles, keys, server):
    """The replay at each start goes through replay(), not report(), which the agent records as a model_change
    (or error) event: one for a months-old job at every boot. And it keeps the job's own time: the boot's
    clock, on a device without an RTC, can be behind, and the fleet would take it for an older report."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    doc = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "tiny-v2"), min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, doc).run() is JobState.SUCCEEDED
    ended = dev.reports[-1]
    replayed, reported = [], len(dev.reports)
    dev.ctx.replay = replayed.append
    recover(dev.ctx)
    assert len(dev.reports) == reported and [(r.job_id, r.state, r.ts) for r in replayed] == [
        (ended.job_id, JobState.SUCCEEDED, ended.ts)]
    write_raw_journal(dev.store, {"job_id": "j", "state": "FAILED", "ts": "soon"})  # damaged: reported at boot time
    assert recover(dev.ctx).state is JobState.FAILED and replayed[-1].job_id == "j"
    write_raw_journal(dev.store, {"job_id": 5, "state": "SUCCEEDED"})  # nothing to report: no crash either
    assert recover(dev.ctx) is None


def test_a_device_can_refuse_what_the_unsigned_job_fields_ask_for(tmp_path, bundles, keys, server):
    """A job's allow_downgrade, min_tokens_per_s and base_url are outside the manifest's signature, so whoever may
    publish job notices could ask for an older signed model, wave a slow one through, or have it downloaded
    from anywhere: [updates] allow_downgrade = false, min_tokens_per_s and artifacts_url let a device refuse
    all three (docs/fleet.md, "Update security")."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    dev.ctx.min_tokens_per_s = 1e9
    slow = job(v2.manifest, keys / "fleet.key", url, job_id="slow", min_tokens_per_s=0)  # the job's floor: none
    assert UpdateJob(dev.ctx, slow).run() is JobState.FAILED and "below the floor" in dev.reports[-1].reason
    dev.ctx.min_tokens_per_s = 0.0
    dev.ctx.artifacts_url = "http://fleet.example:8080/"
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, job_id="elsewhere",
                                  min_tokens_per_s=0)).run() is JobState.REJECTED
    assert "not under this device's [updates] artifacts_url" in dev.reports[-1].reason and dev.staging_empty()
    dev.ctx.artifacts_url = server.base_url
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    dev.ctx.allow_downgrade = False
    older = _tamper_manifest(v1.manifest, created_at="2000-01-01T00:00:00Z")  # signed as it is, by the key
    back = job(older, keys / "fleet.key", server.publish_dir(v1.path, "tiny-v1"), job_id="back",
               min_tokens_per_s=0, allow_downgrade=True)
    assert UpdateJob(dev.ctx, back).run() is JobState.REJECTED
    assert "refused by this device ([updates] allow_downgrade)" in dev.reports[-1].reason
    assert dev.serving.manifest.version == v2.manifest.version


def test_a_device_that_trusts_job_keys_takes_only_jobs_signed_for_it(tmp_path, bundles, keys, server):
    """With [updates] job_keys the whole job is signed by the fleet's online job key, not only the manifest:
    an unsigned job, one with a signed field changed, one for another device, an expired one, one signed by
    a key the device does not trust for jobs (the manifest key) and an older job replayed, also after a
    restart, are REJECTED before any download; the signed ones install and roll back."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    keygen(tmp_path / "job.key")
    job_key = load_private_key(tmp_path / "job.key")
    dev.ctx.job_keys = load_trusted_keys([tmp_path / "job.key.pub"])
    url = server.publish_dir(v2.path, "tiny-v2")
    now = time.time()

    def signed(doc: JobDocument, device_id: str = "dev1", issued_at: float = now, ttl_s: float = 600,
               key=job_key) -> JobDocument:
        return sign_job(doc, key, device_id, issued_at, ttl_s)

    plain = job(v2.manifest, keys / "fleet.key", url, job_id="j", min_tokens_per_s=0)
    refused = {
        "the job is not signed": plain,
        "bad signature: the job is not what the key signed": signed(plain).model_copy(update={"allow_downgrade": True}),
        "the job is for device 'dev2', not this one (dev1)": signed(plain, device_id="dev2"),
        "the job expired": signed(plain, issued_at=now - 700),
        "the job is signed by unknown key": signed(plain, key=load_private_key(keys / "fleet.key")),
    }
    for reason, doc in refused.items():
        # through the wire format, as a device receives it
        assert UpdateJob(dev.ctx, JobDocument.model_validate_json(doc.wire_bytes())).run() is JobState.REJECTED
        assert dev.reports[-1].reason.startswith(reason), (reason, dev.reports[-1].reason)
        assert dev.staging_empty() and dev.serving.manifest.version == v1.manifest.version
    assert dev.store.last_run() is None  # nothing refused counts as run

    assert UpdateJob(dev.ctx, signed(plain, issued_at=now + 1)).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v2.manifest.version
    rollback = JobDocument(job_id="rb", operation="rollback")
    assert UpdateJob(dev.ctx, rollback).run() is JobState.REJECTED  # the unsigned rollback too
    assert dev.serving.manifest.version == v2.manifest.version
    older = signed(rollback.model_copy(update={"job_id": "rb-old"}), issued_at=now)  # issued before the install
    dev.ctx.store = ModelStore(dev.store.root)  # a restart: what was run is known from disk
    assert UpdateJob(dev.ctx, older).run() is JobState.REJECTED
    assert "issued before the last one this device ran" in dev.reports[-1].reason
    assert UpdateJob(dev.ctx, signed(rollback, issued_at=now + 2)).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v1.manifest.version


def test_a_fleet_with_a_job_key_signs_each_devices_job_and_unsigned_jobs_keep_the_old_wire_format(tmp_path):
    """The document one device gets is bound to it; without a job key the JSON is what agents from before
    job signing accept (their schema forbids unknown fields)."""
    from fleet.updates import RolloutDriver
    keygen(tmp_path / "job.key")
    doc = JobDocument(job_id="j", operation="rollback")
    assert set(json.loads(doc.wire_bytes())) == {"job_id", "operation", "manifest", "signature", "key_id", "base_url",
                                                 "min_tokens_per_s", "golden_tokens", "allow_downgrade"}
    plain = RolloutDriver(tmp_path / "fleet.db", lambda *a: True, "http://x")
    assert plain._for(doc, "dev1", 60) is doc
    driver = RolloutDriver(tmp_path / "fleet.db", lambda *a: True, "http://x",
                           job_key=load_private_key(tmp_path / "job.key"))
    sent = JobDocument.model_validate_json(driver._for(doc, "dev7", 60).wire_bytes())
    assert sent.device_id == "dev7" and sent.expires_at - sent.issued_at == pytest.approx(60)
    verify_job(sent, load_trusted_keys([tmp_path / "job.key.pub"]), "dev7", time.time())


@pytest.fixture
def job_key(tmp_path):
    keygen(tmp_path / "job.key")
    return load_private_key(tmp_path / "job.key"), load_trusted_keys([tmp_path / "job.key.pub"])


def test_unverified_documents_never_take_a_job_id_or_a_queue_slot(tmp_path, bundles, keys, server, job_key):
    """With job_keys, a document that fails verification is only logged: never queued, saved, reported
    REJECTED or remembered under the job id it claims. Otherwise whoever may publish on the topic could take a
    rollout's job id before the fleet's document arrives (the real job then "already REJECTED") or fill the
    queue of 16 so that the fleet's next job is refused."""
    v1, v2 = bundles
    priv, pubs = job_key
    dev = Device(tmp_path, v1, keys)
    dev.ctx.job_keys = pubs
    plain = job(v2.manifest, keys / "fleet.key", server.publish_dir(v2.path, "tiny-v2"), job_id="job-1",
                min_tokens_per_s=0)
    svc = UpdateService(dev.ctx)
    svc.start()
    try:
        for forged in [json.dumps({"job_id": "job-1", "operation": "rollback"}).encode(),
                       sign_job(plain, priv, "dev2", time.time(), 600).wire_bytes(),  # another device's copy
                       b'{"job_id": "job-1", "nonsense": 1}',
                       *(json.dumps({"job_id": f"junk-{i}", "operation": "rollback"}).encode() for i in range(20))]:
            svc.offer(forged)
        assert dev.reports == [] and not list(dev.store.queue.glob("*.json"))
        svc.offer(sign_job(plain, priv, "dev1", time.time(), 600).wire_bytes())
        end = dev.wait_report(lambda r: r.state in wire.TERMINAL_JOB_STATES, 60)
        assert end.state is JobState.SUCCEEDED and dev.serving.manifest.version == v2.manifest.version, end
    finally:
        svc.stop()


def test_a_signed_job_this_devices_clock_refuses_is_reported_once_and_never_run(tmp_path, bundles, keys, job_key):
    """A device whose clock runs ahead of the fleet's by more than the job's timeout (an RTC kept in local
    time) refuses every signed job as expired; it says so, or the fleet sees only a timeout. A job signed for
    this device but refused by its clock is REJECTED with the reason, once; what fails verification itself is
    only logged."""
    v1, _ = bundles
    priv, pubs = job_key
    dev = Device(tmp_path, v1, keys)
    dev.ctx.job_keys = pubs
    svc = UpdateService(dev.ctx)  # not started: nothing may be queued to run
    two_hours_behind = sign_job(JobDocument(job_id="rb-1", operation="rollback"), priv, "dev1",
                                time.time() - 7200, 1800)
    svc.offer(two_hours_behind.wire_bytes())
    svc.offer(two_hours_behind.wire_bytes())  # QoS 1 again, or the clock set right meanwhile: still refused
    assert [(r.job_id, r.state) for r in dev.reports] == [("rb-1", JobState.REJECTED)]
    assert "expired" in dev.reports[0].reason and "clock" in dev.reports[0].reason
    svc.offer(sign_job(JobDocument(job_id="rb-2", operation="rollback"), priv, "dev2", time.time() - 7200,
                       1800).wire_bytes())  # another device's: not ours to answer
    assert len(dev.reports) == 1 and svc._queue.empty() and not list(dev.store.queue.glob("*.json"))


def test_a_signed_job_refused_for_a_full_queue_is_not_run_by_a_later_replay(tmp_path, bundles, keys, job_key):
    """The fleet records REJECTED ("too many queued jobs"), so the same document sent again later, before it
    expires, must not run."""
    v1, _ = bundles
    priv, pubs = job_key
    dev = Device(tmp_path, v1, keys)
    dev.ctx.job_keys = pubs
    now = time.time()
    docs = [sign_job(JobDocument(job_id=f"rb-{i}", operation="rollback"), priv, "dev1", now + i, 600)
            for i in range(17)]
    svc = UpdateService(dev.ctx)  # its thread not started yet: as while a long job runs
    for doc in docs:
        svc.offer(doc.wire_bytes())
    assert dev.reports[-1].job_id == "rb-16" and dev.reports[-1].reason == "too many queued jobs"
    svc.start()
    try:
        dev.wait_report(lambda r: r.job_id == "rb-15" and r.state in wire.TERMINAL_JOB_STATES, 60)
        n = len(dev.reports)
        svc.offer(docs[16].wire_bytes())  # the replay
        assert dev.wait_report(lambda r: r.job_id == "rb-16", 10, since=n).state is JobState.REJECTED
        time.sleep(0.5)
        assert [r.state for r in dev.reports[n:]] == [JobState.REJECTED]  # re-reported, never run
    finally:
        svc.stop()


def test_a_restart_before_a_signed_job_journalled_anything_runs_it_and_not_as_a_replay(tmp_path, bundles, keys,
                                                                                       job_key):
    """The job's issue time is recorded before the job journals anything; an agent stopped in between finds
    the job still queued at its next start and must run it, not refuse it as a replay of itself."""
    v1, _ = bundles
    priv, pubs = job_key
    dev = Device(tmp_path, v1, keys)
    dev.ctx.job_keys = pubs
    real = sign_job(JobDocument(job_id="job-real", operation="rollback"), priv, "dev1", time.time(), 600)
    UpdateService(dev.ctx).offer(real.wire_bytes())  # accepted and saved in updates/queue
    UpdateJob(dev.ctx, real)._check_job()  # the updater begins it, and the agent is killed here
    dev.ctx.store = ModelStore(dev.store.root)
    svc = UpdateService(dev.ctx)
    svc.start()
    try:
        end = dev.wait_report(lambda r: r.state in wire.TERMINAL_JOB_STATES, 10)
        assert end.job_id == "job-real" and "replay" not in (end.reason or ""), end  # it ran (and found no
        # previous model to roll back to)
    finally:
        svc.stop()


def test_a_job_issued_far_ahead_of_the_device_clock_is_refused_and_not_recorded(tmp_path, bundles, keys, job_key):
    """A job from a fleet whose clock runs years ahead is not recorded as the last one run: recorded, it would
    make the device refuse every correctly timed job after it as "issued before the last one"."""
    v1, _ = bundles
    priv, pubs = job_key
    dev = Device(tmp_path, v1, keys)
    dev.ctx.job_keys = pubs
    ahead = sign_job(JobDocument(job_id="ahead", operation="rollback"), priv, "dev1", time.time() + 10 * 365 * 86400, 600)
    assert UpdateJob(dev.ctx, ahead).run() is JobState.REJECTED
    assert "ahead of this device's clock" in dev.reports[-1].reason and dev.store.last_run() is None
    ok = sign_job(JobDocument(job_id="now", operation="rollback"), priv, "dev1", int(time.time()), 600)  # an int
    UpdateJob(dev.ctx, JobDocument.model_validate_json(ok.wire_bytes())).run()
    assert "issued" not in (dev.reports[-1].reason or "") and "signature" not in (dev.reports[-1].reason or "")
    assert dev.store.last_run() == (float(int(ok.issued_at)), "now")


def test_check_config_refuses_the_manifest_key_as_a_job_key(tmp_path, bundles, keys):
    """The job key lives on the online fleet server; the manifest key is meant to stay offline."""
    from agent.service.preflight import environment_problems
    from agent.service.serve import load_agent_config
    v1, _ = bundles
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'model = "{v1.path}"\n[telemetry]\nstate_dir = "{tmp_path / "state"}"\n'
                   f'[api]\nsocket = "{tmp_path / "s.sock"}"\n'
                   f'[updates]\ntrusted_keys = ["{keys / "fleet.key.pub"}"]\njob_keys = ["{keys / "fleet.key.pub"}"]\n')
    problems = environment_problems(load_agent_config(cfg))
    assert any("is also a manifest key" in p for p in problems), problems


def test_a_read_only_card_fails_jobs_with_the_reason_and_updates_go_on(tmp_path, bundles, keys, server, monkeypatch):
    """On a card ext4 remounted read-only after an I/O error (as SD cards do): a download fails at once with
    the reason, not retried as a network fault ("no progress"); a failed activation says the storage failed,
    not "internal error"; and the updates thread outlives a queued copy it cannot remove, so later jobs run."""
    import errno
    from pathlib import Path as P

    from agent import durable

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    read_only = OSError(errno.EROFS, "Read-only file system")

    def refuse(*args, **kwargs):
        raise read_only

    with monkeypatch.context() as m:  # the download's writes
        m.setattr(download, "fetch_attempt", refuse)
        assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.FAILED
    assert "cannot write" in dev.reports[-1].reason and "Read-only" in dev.reports[-1].reason

    svc = UpdateService(dev.ctx)
    real_unlink = P.unlink
    with monkeypatch.context() as m:  # activation (the bundle's sync) and the queue's clean-up
        m.setattr(durable, "replace_tree", refuse)
        m.setattr(P, "unlink", lambda self, *a, **k: refuse() if self.parent == dev.store.queue else real_unlink(self, *a, **k))
        svc.start()
        try:
            svc.offer(job(v2.manifest, keys / "fleet.key", url, job_id="j2", min_tokens_per_s=0).model_dump_json().encode())
            failed = dev.wait_report(lambda r: r.job_id == "j2" and r.state is JobState.FAILED, 60)
            assert failed is not None and failed.reason.startswith("the device's storage failed")
            svc.offer(JobDocument(job_id="rb", operation="rollback").model_dump_json().encode())
            assert dev.wait_report(lambda r: r.job_id == "rb" and r.state in wire.TERMINAL_JOB_STATES, 30) is not None
        finally:
            svc.stop()
    assert dev.serving.manifest.version == v1.manifest.version and dev.store.link("current").name.endswith(
        v1.manifest.version)


# ---- the job's state machine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["model", "adapter"])
def test_the_job_transition_table_is_closed_and_every_phase_can_end(kind):
    """Each kind of job (agent.updates.jobs, agent.updates.adapter_job) has its own table over its own phases."""
    from agent.updates.adapter_job import AdapterJob
    from agent.updates.jobs import JobPhase, UpdateJob

    table = {"model": UpdateJob, "adapter": AdapterJob}[kind].TRANSITIONS
    phases = set(table)
    assert all(nxt <= phases for nxt in table.values())
    ends = {phase for phase, nxt in table.items() if not nxt}
    assert ends == {JobPhase.PAUSED, JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.REJECTED, JobPhase.ROLLED_BACK}

    def reachable(start):
        seen, todo = {start}, [start]
        while todo:
            for nxt in table[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert reachable(JobPhase.QUEUED) == phases
    assert all(reachable(phase) & ends for phase in phases)


@pytest.fixture
def phases(monkeypatch):
    """Every phase a job enters, in order."""
    seen = []
    enter = UpdateJob._enter

    def record(self, phase):
        enter(self, phase)
        seen.append(phase)

    monkeypatch.setattr(UpdateJob, "_enter", record)
    return seen


def test_a_job_goes_through_its_phases_in_order(tmp_path, bundles, keys, server, phases):
    import threading

    from agent.updates.jobs import JobPhase as P

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, None, url, job_id="unsigned")).run() is JobState.REJECTED
    assert phases == [P.CHECKING, P.REJECTED]
    stopping = threading.Event()
    stopping.set()  # the agent is stopping: the download pauses before its first byte
    paused = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, job_id="p", min_tokens_per_s=0),
                       stopping=stopping)
    phases.clear()
    assert paused.run() is JobState.QUEUED and phases == [P.CHECKING, P.DOWNLOADING, P.PAUSED]
    phases.clear()
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    assert phases == [P.CHECKING, P.DOWNLOADING, P.VERIFYING, P.STAGING, P.HEALTH_CHECKING, P.SWAPPING, P.SUCCEEDED]
    phases.clear()
    assert UpdateJob(dev.ctx, JobDocument(job_id="rb", operation="rollback")).run() is JobState.SUCCEEDED
    assert phases == [P.CHECKING, P.ROLLING_BACK, P.SUCCEEDED]


def test_an_activation_that_fails_after_the_links_moved_ends_rolled_back_and_reports_failed(tmp_path, bundles, keys,
                                                                                            server, phases):
    from agent.updates.jobs import JobPhase as P

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    dev.ctx.swap = swap_failing_on(dev, v2.manifest.version)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.FAILED
    assert phases[-3:] == [P.SWAPPING, P.REVERTING, P.ROLLED_BACK] and "rolled back" in dev.reports[-1].reason
    assert dev.serving.manifest.version == v1.manifest.version


def test_an_illegal_job_transition_is_an_internal_error(tmp_path, bundles, keys):
    from agent.updates.jobs import JobPhase

    v1, _ = bundles
    dev = Device(tmp_path, v1, keys)
    rollback = UpdateJob(dev.ctx, JobDocument(job_id="rb", operation="rollback"))
    assert not rollback.can_enter(JobPhase.SUCCEEDED)
    with pytest.raises(AssertionError, match="queued -> succeeded"):
        rollback._enter(JobPhase.SUCCEEDED)
    assert rollback.phase is JobPhase.QUEUED
    assert rollback.run() is JobState.FAILED and rollback.phase is JobPhase.FAILED  # no previous model
    with pytest.raises(AssertionError, match="failed -> checking"):  # a job that ended does not run again
        rollback.run()


def test_a_download_the_server_refuses_reports_retrying_with_the_reason_until_it_fails(tmp_path, bundles, keys,
                                                                                       monkeypatch):
    """With the artifact server refusing connections, a device sent no status between its first 0% and the
    failure DOWNLOAD_STALL_S (five minutes) later: the fleet could not tell a download that retries from a device
    gone quiet, while the jobs behind it waited. Scaled down: a status every 0.2 s, a give-up after 3 s."""
    from broker import free_port

    monkeypatch.setattr(download, "PROGRESS_EVERY_S", 0.2)
    monkeypatch.setattr(download, "DOWNLOAD_STALL_S", 3.0)
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    refusing = f"http://127.0.0.1:{free_port()}/tiny-v2"  # nothing listens there: every connection is refused
    refused = job(v2.manifest, keys / "fleet.key", refusing, min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, refused).run() is JobState.FAILED
    downloading = [r for r in dev.reports if r.step is wire.JobStep.DOWNLOADING]
    first, retrying = downloading[0], downloading[1:]
    assert first.percent == 0.0 and first.reason is None
    assert len(retrying) >= 5, [r.reason for r in retrying]  # ~15 in 3 s at one per 0.2 s
    for r in retrying:
        assert r.state is JobState.IN_PROGRESS and r.percent == 0.0
        assert r.reason.startswith("retrying: Connection refused (no progress for "), r.reason
    end = dev.reports[-1]
    assert end.state is JobState.FAILED and "no progress for 3 s" in end.reason
    gaps_s = [b.ts - a.ts for a, b in zip(downloading, downloading[1:] + [end])]
    assert max(gaps_s) < 1.0, gaps_s  # every 0.2 s, whatever the backoff between attempts (up to 1.6 s here)
