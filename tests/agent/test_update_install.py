"""Signed model updates installed on a device: a full install, the negative matrix, activation and its automatic
rollback, the KV graphs a new model is checked for, links that cannot move, which bundles are kept. Real bundles of
the tiny model, a real HTTP Range server, real Ed25519 signatures."""
from __future__ import annotations

import shutil

import pytest

from agent import wire
from agent.updates import download
from agent.updates.jobs import UpdateJob
from agent.updates.model_store import ModelStore
from agent.wire import JobDocument, JobState
from fleet.artifacts import ArtifactServer, RangeHandler
from updates_support import Device, job, _tamper_manifest, swap_failing_on


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
