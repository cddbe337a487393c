"""Rollout waves and the failure-rate halt, as pure decisions."""
from __future__ import annotations

from dataclasses import replace

from agent.wire import JobState
from fleet.rollout import decide, plan_waves

S, F, Q, P = JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED, JobState.IN_PROGRESS


def states(devices, **by_id):
    return [replace(d, state=by_id.get(d.device_id, d.state)) for d in devices]


def test_waves_start_one_after_another():
    devs = plan_waves(["a", "b", "c", "d"], wave_size=2)
    d = decide(devs, set(), 0.5)
    assert d.notify == ["a", "b"] and d.job_state is P
    d = decide(states(devs, a=P, b=P), {"a", "b"}, 0.5)
    assert d.notify == [] and d.job_state is P  # wave 0 still running
    d = decide(states(devs, a=S, b=S), {"a", "b"}, 0.5)
    assert d.notify == ["c", "d"]
    d = decide(states(devs, a=S, b=S, c=S, d=S), {"a", "b", "c", "d"}, 0.5)
    assert d.job_state is S


def test_halts_when_failures_exceed_the_rate():
    devs = plan_waves(["a", "b", "c", "d"], wave_size=2)
    d = decide(states(devs, a=F, b=S), {"a", "b"}, max_failure_rate=0.2)
    assert d.job_state is F and d.cancel == ["c", "d"] and "1 of 4" in d.reason


def test_a_failure_within_the_rate_lets_the_next_wave_start_once_the_wave_ended():
    devs = plan_waves(["a", "b", "c", "d"], wave_size=2)
    assert decide(states(devs, a=F, b=P), {"a", "b"}, max_failure_rate=0.5).notify == []
    d = decide(states(devs, a=F, b=S), {"a", "b"}, max_failure_rate=0.5)
    assert d.job_state is P and d.notify == ["c", "d"]
    d = decide(states(devs, a=F, b=S, c=S, d=S), {"a", "b", "c", "d"}, max_failure_rate=0.5)
    assert d.job_state is F and "1 of 4" in d.reason


def test_a_silent_device_times_out_and_the_job_ends(tmp_path):
    """The driver marks a notified device that never reports as TIMED_OUT, and the job then FAILS."""
    import sqlite_utils

    from fleet.store import FleetStore
    from fleet.updates import RolloutDriver, create_job

    store = FleetStore(tmp_path / "fleet.db")
    store.db["models"].insert({"name": "m", "version": "v", "manifest": "{}", "signature": "", "key_id": "",
                               "published_at": 0.0})
    job_id = create_job(store.db, "m@v", ["quiet"], 1, 0.0, device_timeout_s=1.0)
    store.db.execute("update job_devices set notified = 1, updated_at = 0 where job_id = ?", [job_id])
    store.db.conn.commit()
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p: True, "http://unused")
    db = sqlite_utils.Database(tmp_path / "fleet.db")
    job = db["jobs"].get(job_id)
    driver._advance(db, job)
    db.conn.commit()
    assert db["job_devices"].get((job_id, "quiet"))["state"] == "TIMED_OUT"
    assert db["jobs"].get(job_id)["state"] == "FAILED"
