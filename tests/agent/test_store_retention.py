"""The telemetry store's retention and size limits on real SQLite: delivered rows go first, the hard file limit, a
full disk, the byte count kept exact, a pass's cost at any size."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from agent.link import migrations as migrations_module
from agent.config import TelemetryConfig
from agent.link.migrations import ROW_OVERHEAD_BYTES
from agent.link.store import TelemetryStore, max_file_bytes
from agent.link.telemetry import DB_NAME, Telemetry
from agent.wire import EventRecord
from store_support import figures, request


def test_retention_never_waits_for_a_reader_holding_the_wal(db_path):
    """The WAL checkpoint waited out the 10 s busy timeout behind a reader (a sqlite3 shell),
    holding the store's lock, so every append (one on the API's event loop) waited too."""
    import time

    store = TelemetryStore(db_path, "dev-1")
    for i in range(50):
        store.append(EventRecord(kind="tick", detail={"i": i}))
    store.mark_sent([r.row_id for r in store.unsent(50)])
    reader = sqlite3.connect(db_path)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM records").fetchone()  # a read transaction stays open
    t0 = time.monotonic()
    report = store.enforce(max_age_s=1e9, max_bytes=0)
    assert report.deleted_delivered == 50 and time.monotonic() - t0 < 2
    reader.close()
    store.close()


def sizes(store: TelemetryStore) -> list[int]:
    """Each row's counted bytes, oldest first."""
    return [n + ROW_OVERHEAD_BYTES for (n,) in store.db.execute(
        "SELECT length(CAST(body AS BLOB)) FROM records ORDER BY id")]


def test_retention_deletes_delivered_rows_first(db_path):
    store = TelemetryStore(db_path, "dev-1")
    for i in range(100):
        store.append(EventRecord(kind="tick", detail={"i": f"{i:04d}"}))
    size = sizes(store)
    cap = sum(size[30:])  # exactly the 30 oldest rows too many
    store.mark_sent([r.row_id for r in store.unsent(40)])  # seq 0..39 delivered
    report = store.enforce(max_age_s=1e9, max_bytes=cap)
    assert (report.deleted_delivered, report.dropped_undelivered) == (30, 0)
    seqs = [r[0] for r in store.db.execute("SELECT seq FROM records ORDER BY id")]
    assert seqs == list(range(30, 100))  # the oldest delivered went; every undelivered row is still there
    assert store.dropped_undelivered == 0 and report.stored_bytes == cap


def test_retention_drops_undelivered_rows_only_when_over_the_cap_and_reports_it(db_path):
    """(f) The disk cap is reached with few rows delivered: those go first, then the oldest undelivered ones;
    the loss is counted in meta and reported as an event that is itself queued for delivery."""
    store = TelemetryStore(db_path, "dev-1")
    for i in range(100):
        store.append(EventRecord(kind="tick", detail={"i": f"{i:04d}"}))
    cap = sum(sizes(store)[60:])  # room for the newest 40 rows only
    store.mark_sent([r.row_id for r in store.unsent(10, after=store.unsent(1)[0].row_id + 19)])  # seq 20..29
    report = store.enforce(max_age_s=1e9, max_bytes=cap)
    assert (report.deleted_delivered, report.dropped_undelivered) == (10, 50)
    remaining = [json.loads(b) for (b,) in store.db.execute("SELECT body FROM records ORDER BY id")]
    ticks = [r["seq"] for r in remaining if r["event"]["kind"] == "tick"]
    assert ticks == list(range(60, 100))  # 0..19 and 30..59 were the oldest undelivered
    (event,) = [r for r in remaining if r["event"]["kind"] == "dropped_rows"]
    assert event["event"]["detail"] == {"count": 50, "total": 50, "unwritten": 0} and event["seq"] == 100
    assert store.dropped_undelivered == 50
    assert store.unsent(1000)[-1].record.event.kind == "dropped_rows"  # queued for delivery like any record
    store.close()
    assert TelemetryStore(db_path, "dev-1").dropped_undelivered == 50  # the count survives a restart


def test_the_file_never_passes_its_hard_limit_and_telemetry_never_raises(tmp_path, caplog):
    """A burst between retention passes: at the file's hard limit retention runs at once, deleting the oldest
    undelivered rows (counted), so appends keep succeeding and the file stays under max_file_bytes."""
    config = TelemetryConfig(state_dir=tmp_path, max_bytes=1 << 16)
    telemetry = Telemetry(TelemetryStore(tmp_path / DB_NAME, "dev-1", max_file_bytes=max_file_bytes(1 << 16)), config)
    for i in range(3000):
        telemetry.record_request("smollm2", f"int4-{i:06d}", figures())
    store = telemetry.store
    assert (tmp_path / DB_NAME).stat().st_size <= max_file_bytes(1 << 16)
    assert store.dropped_undelivered > 0 and store.count_unsent() == store.db.execute(
        "SELECT count(*) FROM records").fetchone()[0]
    versions = [r[0] for r in store.db.execute("SELECT version FROM requests ORDER BY id")]
    assert versions[-1] == "int4-002999"  # the newest are kept
    kept = len(versions)
    events = [json.loads(b)["event"]["detail"] for (b,) in store.db.execute(
        "SELECT body FROM records WHERE kind = 'event'")]
    # every record kept or counted: each pass that dropped rows appended one dropped_rows event, which a later
    # pass may have dropped in turn (counted like any record); the last event carries the lifetime total
    passes = sum("undelivered records, deleted to stay under" in r.getMessage() for r in caplog.records)
    assert kept + len(events) + store.dropped_undelivered == 3000 + passes
    assert events[-1]["total"] == store.dropped_undelivered


def test_a_full_disk_drops_records_counts_them_and_reports_them_when_room_returns(tmp_path):
    """SQLITE_FULL with nothing to delete (the disk itself is full): record_request() returns, the record is
    counted, and the first retention pass with room reports the count as a dropped_rows event."""
    config = TelemetryConfig(state_dir=tmp_path)
    telemetry = Telemetry(TelemetryStore(tmp_path / DB_NAME, "dev-1"), config)
    telemetry.record_request("smollm2", "int4-a", figures())
    db = telemetry.store.db
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full: not one more page
    for _ in range(200):
        telemetry.record_request("smollm2", "int4-a", figures(tokens=1000))
    kept = db.execute("SELECT count(*) FROM requests").fetchone()[0]
    assert kept < 201
    db.execute("PRAGMA max_page_count = 1000000")  # room again
    report = telemetry.enforce_retention()
    # a dropped_rows event is smaller than a request: one may have found room while requests did not
    details = [json.loads(b)["event"]["detail"] for (b,) in db.execute("SELECT body FROM records WHERE kind = 'event'")]
    assert sum(d["count"] for d in details) == 201 - kept == telemetry.store.dropped_undelivered
    assert details[-1] == {"count": report.dropped_undelivered, "total": 201 - kept,
                           "unwritten": report.dropped_undelivered}


def test_records_a_full_file_refused_stay_counted_across_a_restart(tmp_path):
    """The count of refused records lived only in memory until the next retention pass, so a
    restart before it lost the count and the fleet never heard of those records."""
    config = TelemetryConfig(state_dir=tmp_path)
    telemetry = Telemetry(TelemetryStore(tmp_path / DB_NAME, "dev-1"), config)
    telemetry.record_request("smollm2", "int4-a", figures())
    db = telemetry.store.db
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    for _ in range(50):
        telemetry.record_request("smollm2", "int4-a", figures(tokens=1000))
    refused = 51 - db.execute("SELECT count(*) FROM requests").fetchone()[0]
    assert refused > 0 and telemetry.store.dropped_total == refused
    telemetry.store.close()  # the agent restarts before any retention pass
    again = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    assert again.dropped_undelivered == refused == again.dropped_total


def test_age_retention_spares_undelivered_rows(db_path):
    now = [1_000_000.0]
    store = TelemetryStore(db_path, "dev-1", clock=lambda: now[0])
    old = [store.append(EventRecord(kind="tick"), ts=now[0] - 7200) for _ in range(4)]
    store.append(EventRecord(kind="tick"))
    store.mark_sent([r.row_id for r in store.unsent(2)])  # two of the old ones delivered
    report = store.enforce(max_age_s=3600, max_bytes=1 << 30)
    assert report.deleted_delivered == 2 and report.dropped_undelivered == 0
    assert [r.record.seq for r in store.unsent(10)] == [old[2].seq, old[3].seq, 4]


def test_stored_bytes_counts_body_plus_overhead(db_path):
    store = TelemetryStore(db_path, "dev-1")
    record = store.append(request())
    assert store.stored_bytes() == len(record.model_dump_json().encode()) + ROW_OVERHEAD_BYTES


def summed_bytes(store: TelemetryStore) -> int:
    return store.db.execute(f"SELECT COALESCE(SUM(length(CAST(body AS BLOB)) + {ROW_OVERHEAD_BYTES}), 0) "
                            "FROM records").fetchone()[0]


def test_stored_bytes_stays_the_sum_of_the_rows_through_every_change(db_path, monkeypatch):
    """Kept by triggers since it cost a table scan per retention pass: appends, deliveries,
    a clock step that rewrites bodies, rows dropped as undeliverable, retention, and an upgrade of a
    database that older agents filled."""
    monkeypatch.setattr(migrations_module, "MIGRATIONS", [m for m in migrations_module.MIGRATIONS if m[0] < "0004"])
    old = TelemetryStore(db_path, "dev-1")
    for i in range(50):
        old.append(EventRecord(kind="tick", detail={"i": "x" * (i % 7)}))
    old.close()
    monkeypatch.undo()
    store = TelemetryStore(db_path, "dev-1")  # the upgrade
    assert store.stored_bytes() == summed_bytes(store) > 0
    for i in range(200):
        store.append(request(tokens=i + 1) if i % 3 else EventRecord(kind="tick", detail={"n": "y" * i}))
    store.mark_sent([r.row_id for r in store.unsent(120)])
    store._restamp(123456.789)  # json_set changes the bodies' lengths
    store.drop_undeliverable([r.row_id for r in store.unsent(5)], "invalid")
    assert store.stored_bytes() == summed_bytes(store)
    cap = summed_bytes(store) // 3
    report = store.enforce(max_age_s=1e9, max_bytes=cap)
    assert report.deleted_delivered and report.dropped_undelivered
    # at the cap, but for the dropped_rows event the pass itself appends
    assert report.stored_bytes == store.stored_bytes() == summed_bytes(store) <= cap + 1024


def retention_steps(path: Path, rows: int, delivered: int) -> int:
    """SQLite VM steps of one retention pass that must delete one row, over a store of `rows` rows of which
    the oldest `delivered` were delivered."""
    store = TelemetryStore(path, "dev-1")
    store.db.execute("PRAGMA synchronous = OFF")  # filling fast; what is measured is the pass
    store.append_all([(request(tokens=i % 50 + 1), 0.0) for i in range(rows)])
    if delivered:
        store.mark_sent([r.row_id for r in store.unsent(delivered)])
    steps = [0]
    store.db.conn.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 100)
    report = store.enforce(max_age_s=1e9, max_bytes=store.stored_bytes() - 1)
    store.db.conn.set_progress_handler(None, 0)
    assert report.deleted_delivered + report.dropped_undelivered == 1
    store.close()
    return steps[0] * 100


@pytest.mark.parametrize("delivered", [0, 100])
def test_a_retention_pass_costs_the_same_at_any_size(tmp_path, delivered):
    """Each pass summed every row's size, twice, and ran a window over the whole table, under
    the lock appends wait for (0.4-0.6 s at the cap, requests' replies held meanwhile); then, on a device
    offline at its cap (nothing delivered), the oldest delivered row was looked for through every row.
    A pass over 10x the rows takes about the same number of steps."""
    small = retention_steps(tmp_path / "small.db", 1_000, delivered)
    large = retention_steps(tmp_path / "large.db", 10_000, delivered)
    assert large < 1.5 * small + 2_000, (small, large)
