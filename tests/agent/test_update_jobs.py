"""Update jobs as a queue and a state machine: a document delivered twice runs once, queued jobs survive a restart,
the last job's end is replayed as it was, the transition table is closed and every phase comes in order."""
from __future__ import annotations

import time

import pytest

from agent import wire
from agent.updates.jobs import UpdateJob
from agent.updates.service import UpdateService, recover
from agent.wire import JobDocument, JobState
from updates_support import Device, job, swap_failing_on, write_raw_journal


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
