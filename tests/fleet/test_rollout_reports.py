"""The rollout driver recording device status reports: ordering, replays, reports that arrive while the database is
locked, the driver stopped or the fleet down."""
from __future__ import annotations

import time

import pytest

from agent.wire import JobState
from fleet_support import wait_until
from rollout_support import F, P, S, published_store, recorded, report, report_only, sent_job


def test_a_replayed_or_older_report_never_revives_a_finished_device(tmp_path):
    """Found in review: the device's retained IN_PROGRESS, replayed when the fleet reconnected, turned a
    SUCCEEDED device back into IN_PROGRESS (and a TIMED_OUT one too, so the job never ended)."""
    from fleet.updates import RolloutDriver

    store = published_store(tmp_path)
    job_id = sent_job(store, ["dev-a"])
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    report(driver, job_id, P, ts=100)
    report(driver, job_id, S, ts=200)
    report(driver, job_id, P, ts=100)  # the retained in-progress report again, replayed by the broker
    assert recorded(store, job_id) == "SUCCEEDED"
    report(driver, job_id, P, ts=300)  # not older, but a finished device does not start again
    assert recorded(store, job_id) == "SUCCEEDED"

    late = sent_job(store, ["dev-a"])
    report(driver, late, P, ts=100)
    store.db.execute("update job_devices set state = 'TIMED_OUT' where job_id = ?", [late])
    store.db.conn.commit()
    report(driver, late, P, ts=150)
    assert recorded(store, late) == "TIMED_OUT"
    report(driver, late, F, ts=160)  # how it really ended, after the fleet had given up on it
    assert recorded(store, late) == "FAILED"
    report(driver, late, S, ts=170)
    assert recorded(store, late) == "FAILED"


def test_a_final_report_stamped_before_the_progress_it_ends_is_recorded(tmp_path):
    """Found in review: the device's clock stepped back between its last progress report and its end (NTP,
    or a reboot with no RTC after a power cut mid-install, when recovery reports the install), and the
    fleet ignored the SUCCEEDED as older, timed the device out and failed the rollout. Progress reports are
    still kept in order."""
    from agent.wire import JobStatusUpdate, JobStep, topic
    from fleet.updates import RolloutDriver

    store = published_store(tmp_path)
    job_id = sent_job(store, ["dev-a", "dev-b"])
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")

    def progress(step: JobStep, ts: float) -> None:
        u = JobStatusUpdate(job_id=job_id, device_id="dev-a", state=P, step=step, ts=ts)
        driver.on_status(topic("dev-a", "jobs", "update"), u.model_dump_json().encode())
        assert driver.apply_reports() == 0

    progress(JobStep.ACTIVATING, ts=1_000_000)
    progress(JobStep.DOWNLOADING, ts=999_000)  # an older progress report, delivered late: not applied
    assert store.db["job_devices"].get((job_id, "dev-a"))["step"] == JobStep.ACTIVATING.value
    report(driver, job_id, S, ts=90.0)  # recovery after a reboot with the clock at 1970
    report(driver, job_id, F, ts=999_999, device_id="dev-b")
    report(driver, job_id, P, ts=1_000_500, device_id="dev-b")  # a replay after the end: ignored
    assert (recorded(store, job_id), recorded(store, job_id, "dev-b")) == ("SUCCEEDED", "FAILED")
    assert store.db["job_devices"].get((job_id, "dev-a"))["reported_ts"] == 90.0


def test_a_report_that_arrives_while_the_database_is_locked_is_recorded_once_it_is_free(tmp_path):
    """Found in review: reports were written on the MQTT thread, and one that met a database locked past the
    busy timeout (a backup, a replica) was lost, though acknowledged: the device later timed out."""
    import sqlite3

    from fleet.updates import RolloutDriver

    store = published_store(tmp_path)
    job_id = sent_job(store, ["dev-a"])
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused", interval_s=0.05)
    holder = sqlite3.connect(tmp_path / "fleet.db")
    holder.execute("BEGIN IMMEDIATE")  # as `sqlite3 fleet.db .backup` or a second replica would
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("fleet.updates.BUSY_TIMEOUT_S", 0.1)  # the lock outlasts it, as a long backup's does
        driver.start()
        try:
            report_only(driver, job_id, S, ts=100)
            time.sleep(0.5)  # the driver tried and met the lock, more than once
            assert recorded(store, job_id) != "SUCCEEDED"
            holder.rollback()
            wait_until(lambda: recorded(store, job_id) == "SUCCEEDED", 10)
        finally:
            driver.stop()
            holder.close()


def test_reports_queued_when_the_driver_stops_are_recorded(tmp_path):
    """Found in review: stop() left the reports that came in during the last pass unrecorded, though the broker
    had already handed them over."""
    from fleet.updates import RolloutDriver

    store = published_store(tmp_path)
    job_id = sent_job(store, ["dev-a"])
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused", interval_s=0.05)

    def last_pass(db):  # the report arrives while the pass waits for a PUBACK, and serve stops meanwhile
        report_only(driver, job_id, S, ts=100)
        driver._stop.set()

    driver._pass = last_pass
    driver.start()
    wait_until(lambda: not driver._thread.is_alive(), 5)
    driver.stop()
    assert recorded(store, job_id) == "SUCCEEDED"


def test_a_report_from_a_device_not_yet_notified_is_ignored(tmp_path):
    """Found in review: a later wave's device, handed someone else's document under the rollout's job id (seen
    in wave 1), reported REJECTED before the fleet had sent it anything; the fleet recorded it, never notified
    the device and failed the rollout. The device cannot have the job from the fleet yet: it is ignored."""
    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    job_id = create_job(store.db, "m@v", ["dev-a", "dev-b"], 1, 0.0)  # wave 0: dev-a; wave 1: dev-b
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    report(driver, job_id, JobState.REJECTED, ts=100, device_id="dev-b")
    assert recorded(store, job_id, "dev-b") == "QUEUED"  # still to be notified with wave 1
    store.db.execute("update job_devices set notified = 1 where job_id = ? and device_id = 'dev-b'", [job_id])
    store.db.conn.commit()
    report(driver, job_id, JobState.REJECTED, ts=200, device_id="dev-b")  # once sent, its answer counts
    assert recorded(store, job_id, "dev-b") == "REJECTED"


def test_reports_sent_while_the_fleet_is_down_are_all_recorded_when_it_returns(tmp_path, broker, devices):
    """Found in review: the driver's MQTT session was not persistent, so of the reports a device sent while
    the fleet was down only its last (retained) one arrived: a job that finished before another one timed
    out, and its rollout failed although the device ran it."""
    from fleet.db import open_database

    from agent.wire import JobStatusUpdate, topic
    from fleet.consumer import jobs_link
    from agent.mqtt_link import Credentials
    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    jobs = [create_job(store.db, "m@v", ["dev-a"], 1, 0.0) for _ in range(2)]
    store.db.execute("update job_devices set notified = 1, notified_at = ?", [time.time()])
    store.db.conn.commit()

    def fleet() -> tuple:
        driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
        link = jobs_link(broker.url, "fleet-test", Credentials(), driver.on_status)
        link.start()
        assert link.wait_ready(10)
        return link, driver.start()

    for part in fleet():  # its session exists from here on
        part.stop()
    device = devices("dev-a")
    for job_id in jobs:  # both end while the fleet is down; retained, as the agent publishes them
        done = JobStatusUpdate(job_id=job_id, device_id="dev-a", state=JobState.SUCCEEDED, ts=time.time())
        device._publish_other(topic("dev-a", "jobs", "update"), done.model_dump_json(), retain=True).wait_for_publish(5)
    link, driver = fleet()
    try:
        db = open_database(tmp_path / "fleet.db")
        wait_until(lambda: [r["state"] for r in db.query("select state from job_devices order by job_id")]
                   == ["SUCCEEDED", "SUCCEEDED"], 10, message="both reports recorded")
    finally:
        link.stop()
        driver.stop()
