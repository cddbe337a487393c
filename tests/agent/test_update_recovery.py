"""A model update interrupted and recovered: SIGKILL at every step, crashes in a rollback, the journal (damaged,
unwritable, replayed at restart), a full disk or a read-only card, and the update on disk before the fleet hears it
succeeded."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent import wire
from agent.updates import download
from agent.updates.jobs import UpdateJob
from agent.updates.model_store import ModelStore
from agent.updates.service import UpdateService, recover
from agent.wire import JobDocument, JobState
from updates_support import Device, job, write_raw_journal


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
