"""The rollout driver timing out devices that stay silent, on the monotonic clock."""
from __future__ import annotations

import time

from rollout_support import P, published_store, recorded, report


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
