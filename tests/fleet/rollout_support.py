"""What the rollout tests share: job-state shorthands, a store with one published model, a job whose notices
were sent, and a device's status report delivered the way the driver's MQTT thread delivers it."""
from __future__ import annotations

import time

from agent.wire import JobState


S, F, Q, P = JobState.SUCCEEDED, JobState.FAILED, JobState.QUEUED, JobState.IN_PROGRESS


def report_only(driver, job_id: str, state: JobState, ts: float, device_id: str = "dev-a") -> None:
    """What the MQTT thread does with a device's jobs/update message."""
    from agent.wire import JobStatusUpdate, topic

    driver.on_status(topic(device_id, "jobs", "update"),
                     JobStatusUpdate(job_id=job_id, device_id=device_id, state=state, ts=ts).model_dump_json().encode())


def report(driver, job_id: str, state: JobState, ts: float, device_id: str = "dev-a") -> None:
    report_only(driver, job_id, state, ts, device_id)
    assert driver.apply_reports() == 0  # what the driver's thread does next


def recorded(store, job_id: str, device_id: str = "dev-a") -> str:
    return store.db["job_devices"].get((job_id, device_id))["state"]


def sent_job(store, devices: list[str]) -> str:
    """A one-wave job whose notices the driver has sent (reports from devices not notified are ignored)."""
    from fleet.updates import create_job

    job_id = create_job(store.db, "m@v", devices, len(devices), 0.0)
    store.db.execute("update job_devices set notified = 1, notified_at = ? where job_id = ?", [time.time(), job_id])
    store.db.conn.commit()
    return job_id


def published_store(tmp_path):
    from fleet.store import FleetStore

    store = FleetStore(tmp_path / "fleet.db")
    store.db["models"].insert({"name": "m", "version": "v", "manifest": "{}", "signature": "", "key_id": "",
                               "published_at": 0.0})
    return store
