"""Which job documents a device takes: jobs signed for it with a job key, unsigned jobs and the fields a device may
refuse, expiry and clock checks, replays, and documents that never take a job id or a queue slot unverified."""
from __future__ import annotations

import json
import time

import pytest

from agent import wire
from agent.updates.trust import load_trusted_keys, verify_job
from agent.updates.jobs import UpdateJob
from agent.updates.model_store import ModelStore
from agent.updates.service import UpdateService
from agent.wire import JobDocument, JobState
from fleet.signing import keygen, load_private_key, sign_job
from updates_support import Device, job, _tamper_manifest


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
