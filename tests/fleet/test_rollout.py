"""Rollout waves and the failure-rate halt, as pure decisions."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from agent.wire import JobState
from fleet.rollout import decide, plan_waves
from fleet_support import wait_until

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
    assert d.job_state is F and d.cancel == ["c", "d"] and "1 of 2 devices started failed" in d.reason


def test_the_rate_counts_the_devices_started_so_far_not_the_whole_fleet():
    """Found in review: a first wave of 2 that failed entirely let a 20-device rollout go on at a 25% limit."""
    devs = plan_waves([f"dev-{i:02d}" for i in range(20)], wave_size=2)
    d = decide(states(devs, **{"dev-00": F, "dev-01": F}), {"dev-00", "dev-01"}, max_failure_rate=0.25)
    assert d.job_state is F and d.notify == [] and len(d.cancel) == 18


def test_a_failure_within_the_rate_lets_the_next_wave_start_once_the_wave_ended():
    devs = plan_waves(["a", "b", "c", "d"], wave_size=2)
    assert decide(states(devs, a=F, b=P), {"a", "b"}, max_failure_rate=0.5).notify == []
    d = decide(states(devs, a=F, b=S), {"a", "b"}, max_failure_rate=0.5)
    assert d.job_state is P and d.notify == ["c", "d"]
    d = decide(states(devs, a=F, b=S, c=S, d=S), {"a", "b", "c", "d"}, max_failure_rate=0.5)
    assert d.job_state is F and "1 of 4" in d.reason


def test_a_silent_device_times_out_and_the_job_ends(tmp_path):
    """The driver marks a notified device that never reports as TIMED_OUT, and the job then FAILS."""
    from fleet.db import open_database

    from fleet.store import FleetStore
    from fleet.updates import RolloutDriver, create_job

    store = FleetStore(tmp_path / "fleet.db")
    store.db["models"].insert({"name": "m", "version": "v", "manifest": "{}", "signature": "", "key_id": "",
                               "published_at": 0.0})
    job_id = create_job(store.db, "m@v", ["quiet"], 1, 0.0, device_timeout_s=1.0)
    store.db.execute("update job_devices set notified = 1, notified_at = 0 where job_id = ?", [job_id])
    store.db.conn.commit()
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    db = open_database(tmp_path / "fleet.db")
    driver._pass(db)
    assert db["job_devices"].get((job_id, "quiet"))["state"] == "TIMED_OUT"
    assert db["jobs"].get(job_id)["state"] == "FAILED"


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


def test_progress_reports_do_not_extend_the_device_timeout(tmp_path):
    """Found in review: the timeout ran from the last report, so a device that kept reporting progress (or a
    retained report replayed at every reconnect) kept its job from ever ending."""
    from fleet.db import open_database

    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    job_id = create_job(store.db, "m@v", ["dev-a"], 1, 0.0, device_timeout_s=1.0)
    store.db.execute("update job_devices set notified = 1, notified_at = ? where job_id = ?",
                     [time.time() - 2.0, job_id])
    store.db.conn.commit()
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    report(driver, job_id, P, ts=time.time())  # reported just now, notified 2 s ago
    db = open_database(tmp_path / "fleet.db")
    driver._pass(db)
    assert recorded(store, job_id) == "TIMED_OUT" and db["jobs"].get(job_id)["state"] == "FAILED"


def test_a_device_still_installing_when_its_rollout_halted_times_out_too(tmp_path):
    """Found in review: the timeout pass looked only at jobs in progress, so a halted job's devices that were
    still installing (and then went silent) showed IN_PROGRESS for good."""
    from fleet.db import open_database

    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    job_id = create_job(store.db, "m@v", ["dev-a", "dev-b"], 2, 0.0, device_timeout_s=1.0)
    store.db.execute("update job_devices set notified = 1, notified_at = ? where job_id = ?",
                     [time.time() - 2.0, job_id])
    store.db.execute("update jobs set state = 'FAILED' where id = ?", [job_id])  # halted by dev-b's failure
    store.db.execute("update job_devices set state = 'IN_PROGRESS' where device_id = 'dev-a'")
    store.db.execute("update job_devices set state = 'FAILED' where device_id = 'dev-b'")
    store.db.conn.commit()
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    db = open_database(tmp_path / "fleet.db")
    driver._pass(db)
    assert recorded(store, job_id) == "TIMED_OUT" and recorded(store, job_id, "dev-b") == "FAILED"


def published_store(tmp_path):
    from fleet.store import FleetStore

    store = FleetStore(tmp_path / "fleet.db")
    store.db["models"].insert({"name": "m", "version": "v", "manifest": "{}", "signature": "", "key_id": "",
                               "published_at": 0.0})
    return store


@pytest.mark.parametrize("devices, kwargs, message", [
    (["bad#id"], {}, "not a device id: 'bad#id'"),  # found in review: an MQTT wildcard stalled every rollout
    (["a"], {"min_tokens_per_s": -1.0}, "min tokens/s must be a number >= 0"),
    (["a"], {"device_timeout_s": float("inf")}, "device timeout must be a positive number"),
    (["a"], {"max_failure_rate": 1.5}, "max failure rate must be in [0, 1]"),
    (["a"], {"wave_size": 0}, "wave size must be at least 1"),
])
def test_a_job_the_driver_could_not_carry_out_is_refused_and_nothing_is_written(tmp_path, devices, kwargs, message):
    from fleet.updates import create_job

    store = published_store(tmp_path)
    args = {"wave_size": 1, "max_failure_rate": 0.0} | kwargs
    with pytest.raises(ValueError) as e:
        create_job(store.db, "m@v", devices, args.pop("wave_size"), args.pop("max_failure_rate"), **args)
    assert message in str(e.value)
    assert store.db["jobs"].count == 0 and store.db["job_devices"].count == 0


def test_a_device_named_twice_is_deployed_to_once_and_a_huge_wave_is_the_whole_job(tmp_path):
    from fleet.updates import create_job

    store = published_store(tmp_path)
    job_id = create_job(store.db, "m@v", ["a", "b", "a"], 10**20, 0.0)  # found in review: a half-written job
    rows = list(store.db.query("select device_id, wave from job_devices where job_id = ?", [job_id]))
    assert rows == [{"device_id": "a", "wave": 0}, {"device_id": "b", "wave": 0}]


def test_a_job_that_fails_in_the_driver_ends_and_the_others_go_on(tmp_path):
    from fleet.db import open_database

    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    broken = create_job(store.db, "m@v", ["x"], 1, 0.0)
    fine = create_job(store.db, None, ["y"], 1, 0.0, operation="rollback", device_timeout_s=90.0)
    sent, expiries = [], []

    def publish(topic, payload, expiry_s):
        if "/x/" in topic:
            raise ValueError("Publish topic cannot contain wildcards.")  # what paho raised for a bad id
        sent.append(topic)
        expiries.append(expiry_s)
        return True

    driver = RolloutDriver(tmp_path / "fleet.db", publish, "http://unused", interval_s=0.05).start()
    try:
        db = open_database(tmp_path / "fleet.db")
        deadline = time.monotonic() + 10
        while not sent or db["jobs"].get(broken)["state"] == "IN_PROGRESS":
            assert time.monotonic() < deadline, (sent, db["jobs"].get(broken))
            time.sleep(0.05)
    finally:
        driver.stop()
    assert sent == ["edge/v1/y/jobs/notify"] and db["jobs"].get(fine)["state"] == "IN_PROGRESS"
    assert expiries == [90.0]  # the notice expires with the device timeout: no install after the job gave up
    job = db["jobs"].get(broken)
    assert job["state"] == "FAILED" and "cannot be carried out" in job["reason"]


def test_a_notice_the_broker_refuses_fails_the_device_with_the_reason(tmp_path):
    """Found in review: a notice the broker's ACL refused counted as sent; the device timed out much later with
    'no final status' and nothing said why."""
    from fleet.db import open_database

    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    job_id = create_job(store.db, None, ["dev-a"], 1, 0.0, operation="rollback")
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: "the broker refused it: Not authorized",
                           "http://unused")
    driver._pass(open_database(tmp_path / "fleet.db"))
    row = store.db["job_devices"].get((job_id, "dev-a"))
    assert row["state"] == "FAILED" and "Not authorized" in row["reason"]
    driver._pass(open_database(tmp_path / "fleet.db"))  # the next pass ends the job
    assert store.db["jobs"].get(job_id)["state"] == "FAILED"


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


def test_device_timeouts_run_on_the_monotonic_clock(tmp_path, monkeypatch):
    """Found in review: the device timeout compared wall-clock times, so a fleet clock stepped two hours
    forward timed every device out at once, and notices sent while the clock ran a year ahead never timed
    out once NTP set it right (the rollout hung for a year)."""
    from fleet.db import open_database

    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    ahead = create_job(store.db, None, ["dev-a"], 1, 0.0, operation="rollback", device_timeout_s=0.5)
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    db = open_database(tmp_path / "fleet.db")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 365 * 86400)  # the fleet's clock a year ahead
    driver._pass(db)
    assert db["job_devices"].get((ahead, "dev-a"))["notified"] == 1
    monkeypatch.setattr(time, "time", real)  # NTP sets it right
    steady = create_job(store.db, None, ["dev-b"], 1, 0.0, operation="rollback", device_timeout_s=600)
    driver._pass(db)
    assert db["job_devices"].get((steady, "dev-b"))["notified"] == 1
    monkeypatch.setattr(time, "time", lambda: real() + 7200)  # then a step two hours forward
    time.sleep(0.6)
    driver._pass(db)
    assert recorded(store, ahead) == "TIMED_OUT"  # half a second of real time after its notice
    assert recorded(store, steady, "dev-b") != "TIMED_OUT"  # not two hours of it
    restarted = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    restarted._pass(db)  # a new process counts from the stored time: two hours of wall clock, within 600 s
    assert recorded(store, steady, "dev-b") == "TIMED_OUT"


def test_a_running_driver_times_a_silent_device_out_once_its_timeout_has_passed(tmp_path):
    """Passes one after another time a device out after its timeout: not never (a count restarted at each
    pass), not at once. A final report another replica commits while a pass runs is not overwritten, what
    timed out leaves the driver's memory, and a restart whose wall clock is behind a notice's stamp counts
    from the restart (found in review of the monotonic timeout)."""
    from fleet.db import open_database

    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)
    job = create_job(store.db, None, ["dev-a", "dev-b"], 2, 1.0, operation="rollback", device_timeout_s=0.4)
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    db = open_database(tmp_path / "fleet.db")
    other = open_database(tmp_path / "fleet.db")  # another replica's connection

    class Racing:  # the other replica records dev-b's SUCCEEDED between the pass's read and its update
        def __getattr__(self, name):
            return getattr(db, name)

        def query(self, sql, params=()):
            rows = list(db.query(sql, params))
            other.execute("update job_devices set state = 'SUCCEEDED' where device_id = 'dev-b'")
            other.conn.commit()
            return rows

    start = time.monotonic()
    driver._pass(db)  # notifies both
    while time.monotonic() - start < 0.3:
        time.sleep(0.05)
        driver._pass(db)
    assert recorded(store, job) != "TIMED_OUT"
    time.sleep(max(0.0, start + 0.45 - time.monotonic()))
    driver._time_out_devices(Racing())
    assert [recorded(store, job, d) for d in ("dev-a", "dev-b")] == ["TIMED_OUT", "SUCCEEDED"]
    assert driver._notified == {}

    later = create_job(store.db, None, ["dev-d"], 1, 1.0, operation="rollback", device_timeout_s=0.4)
    driver._pass(db)
    store.db.execute("update job_devices set notified_at = ? where job_id = ?", [time.time() + 3600, later])
    store.db.conn.commit()  # stamped by a clock an hour ahead, which NTP then set right
    restarted = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")
    restarted._pass(db)
    assert recorded(store, later, "dev-d") != "TIMED_OUT"
    time.sleep(0.45)
    restarted._pass(db)
    assert recorded(store, later, "dev-d") == "TIMED_OUT"


def test_a_device_that_connects_anew_without_answering_its_notice_is_notified_again(tmp_path):
    """Found in review: a device away longer than its broker session (7 days) lost the job notice with the
    session, and after its return the fleet waited out the whole device timeout. A new connection of a
    device that has not answered gets the notice again, once, with what is left of its timeout."""
    from fleet.db import open_database

    from agent.wire import DeviceState
    from fleet.store import Ingest
    from fleet.updates import RolloutDriver, create_job

    store = published_store(tmp_path)

    def connected(connection: int, status: str = "online") -> None:
        ingest = Ingest()
        ingest.add_state(DeviceState(device_id="dev-a", status=status, connection=connection, boot_id="b",
                                     ts=time.time(), model="m", version="v0", precision="int4"), time.time(), live=True)
        store.commit(ingest)

    connected(3, "offline")
    job_id = create_job(store.db, None, ["dev-a"], 1, 0.0, operation="rollback", device_timeout_s=600)
    sent = []
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: sent.append(e) or True, "http://unused")
    run = lambda: driver._pass(open_database(tmp_path / "fleet.db"))  # noqa: E731
    run()
    run()
    assert len(sent) == 1 and sent[0] == 600  # notified while away; its session holds it
    connected(4)  # back, on a fresh session
    run()
    run()
    assert len(sent) == 2 and 590 < sent[1] <= 600  # once, with what is left of the timeout
    report_only(driver, job_id, JobState.SUCCEEDED, time.time())
    driver.apply_reports()
    connected(5)
    run()
    assert len(sent) == 2  # it answered: nothing more to send


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


@pytest.mark.parametrize("status", ["online", "offline"])
def test_a_notice_no_session_takes_fails_an_online_device_at_once(tmp_path, status):
    """Found in review: the broker's PUBACK said no session subscribed to the notice, and the device was
    counted as notified and timed out after the whole device timeout. Online, it fails at once; offline, its
    session may have expired, and it is notified again when it connects anew."""
    from fleet.db import open_database

    from agent.wire import DeviceState
    from fleet.store import Ingest
    from fleet.updates import NO_JOB_SUBSCRIBER, RolloutDriver, create_job

    store = published_store(tmp_path)
    ingest = Ingest()
    ingest.add_state(DeviceState(device_id="dev-a", status=status, connection=1, boot_id="b", ts=time.time(),
                                 model="m", version="v0", precision="int4"), time.time(), live=True)
    store.commit(ingest)
    job_id = create_job(store.db, None, ["dev-a"], 1, 0.0, operation="rollback")
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: NO_JOB_SUBSCRIBER, "http://unused")
    driver._pass(open_database(tmp_path / "fleet.db"))
    row = store.db["job_devices"].get((job_id, "dev-a"))
    if status == "online":
        assert row["state"] == "FAILED" and "not subscribed to its job notices" in row["reason"]
    else:
        assert (row["state"], row["notified"]) == ("QUEUED", 1)


def test_a_cancel_during_a_notice_keeps_tracking_the_device_it_reached_and_sends_no_more(tmp_path):
    """Found in review: a cancel committed while the driver waited for a notice's PUBACK left that device
    CANCELED though it had the job, so its reports were ignored while it installed it; and the driver went on
    notifying the rest of the wave."""
    from fleet.db import open_database

    from fleet.updates import RolloutDriver, cancel_job, create_job

    store = published_store(tmp_path)
    job_id = create_job(store.db, None, ["dev-a", "dev-b"], 2, 0.0, operation="rollback")
    sent = []

    def publish(t, p, e):
        sent.append(t)
        cancel_job(open_database(tmp_path / "fleet.db"), job_id)  # the operator, meanwhile
        return True
    driver = RolloutDriver(tmp_path / "fleet.db", publish, "http://unused")
    driver._pass(open_database(tmp_path / "fleet.db"))
    rows = {r["device_id"]: (r["state"], r["notified"]) for r in store.db.query("select * from job_devices")}
    assert len(sent) == 1 and rows == {"dev-a": ("QUEUED", 1), "dev-b": ("CANCELED", 0)}
    assert store.db["jobs"].get(job_id)["state"] == "CANCELED"
    report_only(driver, job_id, JobState.SUCCEEDED, time.time())
    driver.apply_reports()
    assert store.db["job_devices"].get((job_id, "dev-a"))["state"] == "SUCCEEDED"


def test_the_upgrade_to_renotifying_does_not_send_every_pending_notice_again(tmp_path, monkeypatch):
    """Notices sent before migration 0008 count from the device's connection at the upgrade (found in review:
    each device that had not answered was sent its notice again at the first pass)."""
    from fleet.db import open_database

    import fleet.store as store_module
    from agent.wire import DeviceState
    from fleet.store import FleetStore, Ingest
    from fleet.updates import RolloutDriver, create_job

    before = tuple(m for m in store_module.MIGRATIONS if m[0] < "0008")
    monkeypatch.setattr(store_module, "MIGRATIONS", before)  # the fleet before it
    store = published_store(tmp_path)
    ingest = Ingest()
    ingest.add_state(DeviceState(device_id="dev-a", status="online", connection=4, boot_id="b", ts=time.time(),
                                 model="m", version="v0", precision="int4"), time.time(), live=True)
    store.commit(ingest)
    create_job(store.db, None, ["dev-a"], 1, 0.0, operation="rollback")
    store.db.execute("update job_devices set notified = 1, notified_at = ?", [time.time()])
    store.db.conn.commit()
    store.close()
    monkeypatch.undo()
    FleetStore(tmp_path / "fleet.db").close()  # the upgrade
    sent = []
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: sent.append(t) or True, "http://unused")
    driver._pass(open_database(tmp_path / "fleet.db"))
    assert sent == []


def test_a_pass_reads_job_devices_through_indexes_not_the_whole_table(tmp_path):
    """Found in review: the driver's pass (every 0.5 s) scanned every device of every rollout ever run, 23 ms
    at 100,000 rows and growing. Every query of a pass that touches job_devices must search an index."""
    from fleet.db import open_database

    from fleet.store import FleetStore
    from fleet.updates import RolloutDriver, create_job

    store = FleetStore(tmp_path / "fleet.db")
    store.db["models"].insert({"name": "m", "version": "v", "manifest": "{}", "signature": "", "key_id": "",
                               "published_at": 0.0})
    job_id = create_job(store.db, "m@v", ["a", "b"], 1, 0.0, device_timeout_s=1000.0)
    store.db.execute("update job_devices set notified = 1, notified_at = ? where job_id = ?", [time.time(), job_id])
    store.db.conn.commit()
    db = open_database(tmp_path / "fleet.db")
    statements = []
    db.conn.set_trace_callback(statements.append)
    RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: True, "http://unused")._pass(db)
    db.conn.set_trace_callback(None)
    reads = [s for s in statements if s.lstrip().lower().startswith("select") and "job_devices" in s]
    assert len(reads) >= 2  # the time-outs and the returned devices, at least
    for sql in reads:
        plan = " / ".join(row[3] for row in db.conn.execute("explain query plan " + sql))
        assert "SCAN job_devices" not in plan and "SCAN jd" not in plan, (sql, plan)
