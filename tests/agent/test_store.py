"""The telemetry store on real SQLite: migrations, durable appends, the outbox flags, retention and the read side.

Run: .venv/bin/pytest tests/agent/test_store.py -q
"""
from __future__ import annotations

import json
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from agent.link import migrations as migrations_module
from agent.link import reader as reader_module
from agent.link import store as store_module
from agent.service.cli import cli
from agent.config import TelemetryConfig
from agent.link.migrations import ROW_OVERHEAD_BYTES, migrate
from agent.link.reader import TelemetryReader
from agent.link.store import MAX_RECORD_BYTES, TelemetryStore, max_file_bytes
from agent.link.telemetry import DB_NAME, Telemetry, format_summary, parse_window, summary
from agent.wire import EventRecord, RequestFigures, RequestRecord, SampleRecord, TelemetryRecord

REPO = Path(__file__).resolve().parents[2]


def figures(ttft_ms: float = 100.0, tps: float = 20.0, reason: str = "stop", tokens: int = 16) -> RequestFigures:
    return RequestFigures(prompt_tokens=8, completion_tokens=tokens, queue_ms=1.0, ttft_ms=ttft_ms,
                          prefill_tokens_per_s=400.0, decode_tokens_per_s=tps, itl_p50_ms=50.0, itl_p95_ms=60.0,
                          e2e_ms=ttft_ms + 800, kv_bytes=1 << 20, finish_reason=reason)


def request(model="smollm2", version="int4-aaaa", **kw) -> RequestRecord:
    return RequestRecord(model=model, version=version, figures=figures(**kw))


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / DB_NAME


# ---- migrations -------------------------------------------------------------------------------------------
def test_migrations_run_once_in_order_and_are_recorded(db_path):
    store = TelemetryStore(db_path, "dev-1")
    names = [r["name"] for r in store.db.query("SELECT name FROM migrations ORDER BY rowid")]
    assert names == [name for name, _ in migrations_module.MIGRATIONS]
    assert migrate(store.db) == []  # nothing left to do
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()
    assert migrate(TelemetryStore(db_path, "dev-1").db) == []


def test_a_failing_migration_changes_nothing(db_path, monkeypatch):
    TelemetryStore(db_path, "dev-1").close()

    def broken(db):
        db.execute("CREATE TABLE half_done (x INTEGER)")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(migrations_module, "MIGRATIONS", [*migrations_module.MIGRATIONS, ("0099_broken", broken)])
    with pytest.raises(RuntimeError, match="disk on fire"):
        TelemetryStore(db_path, "dev-1")
    conn = sqlite3.connect(db_path)
    assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'half_done'").fetchall()
    assert not conn.execute("SELECT 1 FROM migrations WHERE name = '0099_broken'").fetchall()


# ---- appending and the outbox ------------------------------------------------------------------------------
def test_a_corrupt_database_is_set_aside_and_a_new_one_started(db_path):
    """A damaged telemetry.db (a power cut on an SD card) kept the agent from ever starting."""
    garbage = bytes(range(256)) * 32
    db_path.write_bytes(garbage)
    store = TelemetryStore(db_path, "dev-1")
    assert store.recovered_from is not None and store.recovered_from.read_bytes() == garbage  # kept, untouched
    assert store.recovered_from.parent == db_path.parent and ".corrupt-" in store.recovered_from.name
    store.append(request())
    assert store.db.execute("SELECT count(*) FROM records").fetchone()[0] == 1
    store.close()
    assert TelemetryStore(db_path, "dev-1").recovered_from is None  # the new file is fine on the next start


def test_damage_inside_the_file_is_found_at_start(db_path):
    """Damage past the header and schema (8 kB overwritten mid-file) opened without a word,
    then failed every retention pass, so the file grew, and records were lost unreported."""
    store = TelemetryStore(db_path, "dev-1")
    for i in range(3000):
        store.append(EventRecord(kind="tick", detail={"i": i, "pad": "x" * 200}))
    store.close()
    data = bytearray(db_path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8192] = bytes(range(256)) * 32
    db_path.write_bytes(bytes(data))
    store = TelemetryStore(db_path, "dev-1")
    assert store.recovered_from is not None and store.recovered_from.stat().st_size == len(data)
    store.append(request())
    store.close()


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


def test_a_database_that_cannot_be_opened_is_an_error_and_left_alone(tmp_path):
    path = tmp_path / "telemetry.db"
    path.mkdir()  # not a file at all: SQLite cannot open it, nothing is corrupt
    with pytest.raises(sqlite3.OperationalError):
        TelemetryStore(path, "dev-1")
    assert path.is_dir() and list(tmp_path.iterdir()) == [path]


def test_append_is_committed_before_it_returns(db_path):
    store = TelemetryStore(db_path, "dev-1")
    record = store.append(request())
    assert (record.kind, record.seq, record.boot_id) == ("request", 0, store.boot_id)
    other = sqlite3.connect(db_path)  # another connection (another process) sees it at once
    body, sent = other.execute("SELECT body, sent FROM records WHERE seq = 0").fetchone()
    assert TelemetryRecord.model_validate_json(body) == record and sent == 0


def test_seq_counts_from_zero_per_boot_and_boot_seq_is_unique(db_path):
    first = TelemetryStore(db_path, "dev-1")
    assert [first.append(EventRecord(kind="tick")).seq for _ in range(3)] == [0, 1, 2]
    first.close()
    second = TelemetryStore(db_path, "dev-1")
    assert second.boot_id != first.boot_id
    assert second.append(SampleRecord(interval_s=10, rss_mb=100, cpu_percent=5, kv_utilization=0.1, queue_depth=0,
                                      running=1, tokens_per_s=3)).seq == 0
    with pytest.raises(sqlite3.IntegrityError):
        second.db.execute("INSERT INTO records (device_id, boot_id, seq, ts, kind, body) VALUES (?, ?, 0, 0, "
                          "'event', '{}')", ["dev-1", second.boot_id])


def test_unsent_rows_page_by_id_and_only_marked_rows_count_as_sent(db_path):
    store = TelemetryStore(db_path, "dev-1")
    for i in range(10):
        store.append(EventRecord(kind="tick", detail={"i": i}))
    page = store.unsent(4)
    assert [r.record.seq for r in page] == [0, 1, 2, 3]
    assert [r.record.seq for r in store.unsent(4, after=page[-1].row_id)] == [4, 5, 6, 7]
    store.mark_sent([r.row_id for r in page])
    assert store.count_unsent() == 6 and store.unsent(1)[0].record.seq == 4
    assert store.db.execute("SELECT count(*) FROM records WHERE sent = 1 AND sent_at IS NOT NULL").fetchone()[0] == 4


def test_connection_counter_persists_across_starts(db_path):
    store = TelemetryStore(db_path, "dev-1")
    assert [store.next_connection() for _ in range(3)] == [1, 2, 3]
    store.close()
    assert TelemetryStore(db_path, "dev-1").next_connection() == 4


def test_connections_are_counted_in_memory_while_the_file_takes_no_writes(db_path):
    """On a full disk the count's write failed the connection attempt, so the device stayed
    off MQTT for as long as the disk was full. The number still only grows within the run."""
    store = TelemetryStore(db_path, "dev-1")
    assert [store.next_connection() for _ in range(2)] == [1, 2]
    store.db.execute("PRAGMA query_only = 1")  # every write fails, as on a full disk
    assert [store.next_connection() for _ in range(2)] == [3, 4]
    store.db.execute("PRAGMA query_only = 0")
    assert store.next_connection() == 5  # not 3: the file's count catches up
    store.close()
    assert TelemetryStore(db_path, "dev-1").next_connection() == 6


def test_a_record_too_large_for_one_batch_is_refused(db_path):
    store = TelemetryStore(db_path, "dev-1")
    with pytest.raises(ValueError, match="exceeds"):
        store.append(EventRecord(kind="error", detail={"trace": "x" * MAX_RECORD_BYTES}))
    assert store.count_unsent() == 0 and store.append(EventRecord(kind="tick")).seq == 0  # no seq was used


# ---- retention --------------------------------------------------------------------------------------------
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


def test_rows_an_older_agent_wrote_that_no_longer_parse_are_dropped_counted_and_do_not_block(db_path):
    """A row this agent's schema refuses (here a NaN figure, accepted before 2026-12-03)
    raised in the outbox on every pass, so nothing after it was ever delivered."""
    store = TelemetryStore(db_path, "dev-1")
    for i in range(6):
        store.append(EventRecord(kind="tick", detail={"i": i}))
    ids = [r.row_id for r in store.unsent(100)]
    bad = '{"boot_id": "old", "seq": 0, "ts": NaN, "kind": "event", "event": {"kind": "tick"}}'
    store.db.conn.executemany("UPDATE records SET body = ? WHERE id = ?", [(bad, i) for i in ids[:4]])
    batch = store.unsent(2)  # a whole first page is invalid: the next valid rows come back
    assert [r.record.event.detail["i"] for r in batch] == [4, 5]
    events = [r.record.event for r in store.unsent(100) if r.record.event.kind == "dropped_rows"]
    assert [e.detail for e in events] == [{"count": 2, "total": 2, "unwritten": 0, "invalid": 2},
                                          {"count": 2, "total": 4, "unwritten": 0, "invalid": 2}]
    assert store.dropped_undelivered == 4 and store.count_unsent() == 4  # 2 ticks + 2 events, all deliverable


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


class Clocks:
    """A wall clock and the time since boot, moved by the test."""

    def __init__(self, wall: float):
        self.wall, self.up = wall, 100.0

    def tick(self, s: float) -> None:
        self.wall += s
        self.up += s


def stamps(store: TelemetryStore) -> list[tuple[str, int, float, float]]:
    """(boot_id, seq, ts column, ts in the body) of every row."""
    return [(boot, seq, ts, json.loads(body)["ts"]) for boot, seq, ts, body in
            store.db.execute("SELECT boot_id, seq, ts, body FROM records ORDER BY id").fetchall()]


def test_a_clock_step_moves_this_boots_stamps_with_it(db_path):
    # An RTC-less box boots in 1970 and NTP steps it later: left as they were, those stamps fell to the
    # fleet's retention (and our own, once sent) as soon as they arrived
    clocks = Clocks(wall=60.0)
    earlier = TelemetryStore(db_path, "dev-1", clock=lambda: clocks.wall, uptime=lambda: clocks.up)
    earlier.append(EventRecord(kind="start"))  # a previous boot's row: it cannot be placed
    earlier.close()
    store = TelemetryStore(db_path, "dev-1", clock=lambda: clocks.wall, uptime=lambda: clocks.up)
    for _ in range(3):
        store.append(EventRecord(kind="tick"))
        clocks.tick(10.0)
    store.mark_sent([store.unsent(1)[0].row_id])
    step = 1_764_000_000.0
    clocks.wall += step  # NTP steps the clock
    store.append(EventRecord(kind="tick"))
    rows = stamps(store)
    assert rows[0][2:] == (60.0, 60.0)  # the earlier boot's row
    assert [r[2] for r in rows[1:]] == [60.0 + step, 70.0 + step, 80.0 + step, 90.0 + step]
    assert all(r[2] == r[3] for r in rows)  # what is sent says the same as the column
    assert [r.record.ts for r in store.unsent(10)][-3:] == [70.0 + step, 80.0 + step, 90.0 + step]
    clocks.tick(10.0)
    clocks.wall -= 3600.0  # and back: the clock was an hour ahead
    store.append(EventRecord(kind="tick"))
    assert [r[2] for r in stamps(store)[1:]] == [t + step - 3600.0 for t in (60.0, 70.0, 80.0, 90.0, 100.0)]


@pytest.mark.parametrize("wall_s, up_s", [(10.0 + 0.9, 10.0),  # jitter and NTP's slewing
                                          (86_400 * 1.0004, 86_400.0),  # 400 ppm over a day
                                          (7200.0, 7200.0)])  # a suspended box: uptime counts the suspend
def test_a_slewed_clock_keeps_its_stamps(db_path, wall_s, up_s):
    clocks = Clocks(wall=1_764_000_000.0)
    store = TelemetryStore(db_path, "dev-1", clock=lambda: clocks.wall, uptime=lambda: clocks.up)
    first = store.append(EventRecord(kind="tick"))
    clocks.wall += wall_s
    clocks.up += up_s
    store.append(EventRecord(kind="tick"))
    assert stamps(store)[0][2] == first.ts


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


# ---- the read side ---------------------------------------------------------------------------------------
def fill_requests(db_path: Path, now: float) -> TelemetryStore:
    store = TelemetryStore(db_path, "dev-1")
    rng = np.random.default_rng(0)
    for i in range(60):
        store.append(request(ttft_ms=float(rng.uniform(50, 500)), tps=float(rng.uniform(5, 30)),
                             reason="length" if i % 3 else "stop"), ts=now - 60 * i)
    store.append(request(model="other", version="fp32-bbbb", reason="cancelled"), ts=now - 10)
    store.append(request(reason="error"), ts=now - 10 * 86400)  # outside a day's window
    return store


def test_summary_gives_percentiles_by_model_version_and_hour_and_finish_reasons(db_path):
    now = 1_700_000_000.0  # 22:13:20 UTC
    store = fill_requests(db_path, now)
    result = summary(db_path.parent, since_s=86400, now=now)
    assert result["finish_reasons"] == {"length": 40, "stop": 20, "cancelled": 1}
    by = {(r["model"], r["hour"]): r for r in result["by_hour"]}
    assert sum(r["requests"] for r in result["by_hour"]) == 61 and by[("other", "2023-11-14T22:00Z")]["requests"] == 1
    rows = [json.loads(b)["request"]["figures"] for (b,) in store.db.execute(
        "SELECT body FROM records WHERE json_extract(body, '$.request.model') = 'smollm2' AND "
        "strftime('%H', ts, 'unixepoch') = '21'")]
    got = by[("smollm2", "2023-11-14T21:00Z")]
    assert got["requests"] == len(rows) == 60 - 14  # 22:13 back to 21:00 is 13 rows; the rest in 21:xx
    assert got["ttft_ms_p95"] == pytest.approx(np.percentile([r["ttft_ms"] for r in rows], 95))
    assert got["decode_tokens_per_s_p50"] == pytest.approx(np.percentile([r["decode_tokens_per_s"] for r in rows], 50))
    assert result["store"] == {"records": 62, "unsent": 62, "dropped_undelivered": 0}


def test_requests_without_a_token_count_in_no_ttft_or_speed_percentile(db_path):
    """A shed request (no token, ttft_ms 0) counted as a 0 ms TTFT and a 0 tok/s decode, so the
    more a device refused the faster it looked. A model with only such requests shows '-'."""
    now = 1_700_000_000.0
    store = TelemetryStore(db_path, "dev-1")
    for i in range(3):
        store.append(request(ttft_ms=400.0 + i, tps=20.0), ts=now - i)
    for i in range(5):
        store.append(request(ttft_ms=0.0, tps=0.0, reason="error", tokens=0), ts=now - 10 - i)
    store.append(request(model="shed", ttft_ms=0.0, tps=0.0, reason="error", tokens=0), ts=now - 20)
    result = summary(db_path.parent, since_s=3600, now=now)
    by = {r["model"]: r for r in result["by_hour"]}
    assert by["smollm2"]["requests"] == 8
    assert by["smollm2"]["ttft_ms_p50"] == 401.0 and by["smollm2"]["decode_tokens_per_s_p50"] == 20.0
    assert by["shed"]["ttft_ms_p50"] is None
    shed_line, = [line for line in format_summary(result).splitlines() if line.startswith("shed ")]
    assert shed_line.split()[-4:] == ["-", "-", "-", "-"]


def test_parse_window():
    assert [parse_window(w) for w in ("90s", "30m", "6h", "2d", "1.5h")] == [90, 1800, 21600, 172800, 5400]
    with pytest.raises(ValueError, match="unit"):
        parse_window("6 hours")
    with pytest.raises(ValueError, match="at most 100 years"):  # was an OverflowError further on
        parse_window("999999999999999999d")


def test_cli_telemetry_prints_a_table_and_json(db_path):
    import time

    fill_requests(db_path, time.time())
    out = CliRunner().invoke(cli, ["telemetry", "--state-dir", str(db_path.parent), "--since", "2h"])
    assert out.exit_code == 0, out.output
    assert "smollm2" in out.output and "finish reasons: length" in out.output
    out = CliRunner().invoke(cli, ["telemetry", "--state-dir", str(db_path.parent), "--since", "1d", "--json"])
    assert json.loads(out.output)["finish_reasons"]["stop"] == 20
    out = CliRunner().invoke(cli, ["telemetry", "--state-dir", str(db_path.parent / "nowhere")])
    assert out.exit_code == 1 and "no telemetry database" in out.output


def test_reader_does_not_write(db_path):
    TelemetryStore(db_path, "dev-1").append(request())
    reader = TelemetryReader(db_path)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.db.execute("DELETE FROM records")


def test_the_documented_queries_run(db_path):
    """Every `sqlite-utils query telemetry.db "..."` line in docs/telemetry.md works on a real store."""
    import time

    fill_requests(db_path, time.time()).close()
    lines = [line.strip() for line in (REPO / "docs" / "telemetry.md").read_text().splitlines()
             if line.strip().startswith("sqlite-utils query telemetry.db")]
    assert len(lines) >= 4
    exe = Path(sys.executable).parent / "sqlite-utils"
    for line in lines:
        args = shlex.split(line)
        done = subprocess.run([str(exe), *args[1:]], cwd=db_path.parent, capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stderr)
        assert re.match(r"^\[", done.stdout.strip()), line


def test_samples_are_committed_a_few_at_a_time_each_stamped_when_taken(tmp_path, monkeypatch):
    """A commit (an fsync of ~5 pages) per sample wrote ~250 MB a day to an idle box's SD
    card. Samples now wait for SAMPLES_PER_COMMIT of them (or the stop), each stamped when it was taken."""
    import time

    import agent.link.telemetry as telemetry_module

    monkeypatch.setattr(telemetry_module, "SAMPLES_PER_COMMIT", 4)
    store = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    telemetry = Telemetry(store, TelemetryConfig(state_dir=tmp_path, sample_interval_s=0.2))
    samples = lambda: [ts for (ts,) in store.db.execute(  # noqa: E731
        "SELECT ts FROM records WHERE kind = 'sample' ORDER BY id").fetchall()]
    telemetry.start()
    deadline = time.monotonic() + 10
    while len(telemetry._pending_samples) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert samples() == []  # taken, not yet committed
    while len(samples()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    committed = samples()
    assert len(committed) == 4 and all(0.15 < b - a < 0.5 for a, b in zip(committed, committed[1:])), committed
    telemetry.stop()  # what was taken since goes in at the stop
    again = TelemetryReader(tmp_path / DB_NAME)
    assert again.counts()["records"] >= 6  # start, 4+ samples, stop
    again.close()


def test_a_store_that_cannot_be_written_is_said_once_and_retention_waits_its_interval(tmp_path, caplog):
    """On a card remounted read-only: a traceback for every request recorded, and a failed
    retention pass retried every second, each with a traceback (~86,000 a day)."""
    import time

    store = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    passes = []

    def read_only(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    def failing_pass(*args, **kwargs):
        passes.append(time.monotonic())
        raise sqlite3.OperationalError("disk I/O error")

    store.append_all, store.enforce = read_only, failing_pass
    telemetry = Telemetry(store, TelemetryConfig(state_dir=tmp_path, sample_interval_s=600, retention_interval_s=1))
    figures = RequestFigures(prompt_tokens=5, completion_tokens=3, queue_ms=1, ttft_ms=2, prefill_tokens_per_s=3,
                             decode_tokens_per_s=4, itl_p50_ms=5, itl_p95_ms=6, e2e_ms=7, kv_bytes=8,
                             finish_reason="stop")
    for _ in range(50):
        telemetry.record_request("m", "v", figures)
    telemetry.start()
    time.sleep(3.5)
    telemetry._stop.set()
    telemetry._thread.join()
    said = sorted(r.getMessage() for r in caplog.records if r.name == "agent.link.telemetry" and r.levelname == "ERROR")
    assert len(said) == 2 and "could not be stored" in said[0] and "retention failed" in said[1], said
    assert not any(r.exc_info for r in caplog.records) and store.dropped_total >= 50

    def too_big(*args, **kwargs):
        raise ValueError("a request record of 300000 bytes exceeds the limit")

    store.append_all = too_big  # another kind of failure, not hidden by the first's hour
    telemetry.record_request("m", "v", figures)
    assert sum("could not be stored" in r.getMessage() for r in caplog.records) == 2
    assert 2 <= len(passes) <= 4, passes  # once a retention interval (1 s here), not at every 1 s wake-up only


def test_the_reader_reads_a_database_on_a_read_only_file_system(tmp_path, monkeypatch):
    """`edge-agent telemetry` on a card remounted read-only said "not a telemetry database
    (unable to open database file)": SQLite cannot make the WAL index there. It reads the file as immutable
    then, and says how much of the WAL it could not read; anywhere else it reads as before (a user who may
    not write the directory still sees the WAL's rows)."""
    from agent.wire import EventRecord

    store = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    store.append(EventRecord(kind="tick"))
    store.close()  # a clean stop: checkpointed, no -wal or -shm left
    running = TelemetryStore(tmp_path / DB_NAME, "dev-1")  # an agent killed (or running) with rows in its WAL
    for _ in range(3):
        running.append(EventRecord(kind="tick"))
    assert TelemetryReader(tmp_path / DB_NAME).counts()["records"] == 4  # writable: WAL and all
    real_open = reader_module._open_reading

    def as_on_a_read_only_disk(path, mode):
        if mode == "ro":  # what SQLite says there without the WAL index
            raise sqlite3.OperationalError("unable to open database file")
        return real_open(path, mode)

    monkeypatch.setattr(reader_module, "_open_reading", as_on_a_read_only_disk)
    monkeypatch.setattr(reader_module, "writable_dir", lambda d: Path(d) != tmp_path)
    result = summary(tmp_path, 3600)
    assert result["store"]["records"] == 1 and result["unread_wal_bytes"] > 0
    assert "not counted:" in format_summary(result)
    running.close()
    (tmp_path / "junk.db").write_bytes(b"not sqlite" * 100)
    with pytest.raises(ValueError, match="junk.db is not a telemetry database .on a read-only file system"):
        TelemetryReader(tmp_path / "junk.db")


def test_a_store_whose_disk_goes_read_only_goes_on_in_memory_with_its_undelivered_rows(tmp_path, monkeypatch):
    """When the card went read-only under a running agent, every record after that was
    dropped and the fleet never learned why. The store moves to memory with the file's undelivered rows (their
    ids kept: the outbox names them) and the fleet gets a store_in_memory event."""
    from sqlite_utils import Database

    from agent.wire import EventRecord

    store = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    telemetry = Telemetry(store, TelemetryConfig(state_dir=tmp_path))
    for i in range(5):
        store.append(EventRecord(kind="tick", detail={"i": i}))
    first_two = [r.row_id for r in store.unsent(2)]
    store.mark_sent(first_two)
    top = store.unsent(10)[-1].row_id
    # the card goes read-only: the connection can still read, every write fails
    store.db.close()
    store.db = Database(sqlite3.connect(f"file:{tmp_path / DB_NAME}?mode=ro", uri=True, check_same_thread=False))
    monkeypatch.setattr(store_module, "writable_dir", lambda d: Path(d) != tmp_path)
    telemetry.record_event("after", {})
    assert store.in_memory_because is not None
    rows = store.unsent(50)
    kinds = [(r.record.event.kind, r.record.event.detail.get("i")) for r in rows]
    assert kinds == [("tick", 2), ("tick", 3), ("tick", 4), ("store_in_memory", None), ("after", None)]
    assert [r.row_id for r in rows[:3]] == [first_two[-1] + 1, first_two[-1] + 2, top] and rows[3].row_id > top
    store.mark_sent([r.row_id for r in rows])
    assert store.count_unsent() == 0 and store.dropped_total == 0


def test_writable_dir_makes_a_file_to_know(tmp_path, monkeypatch):
    """access(2) says W_OK on ext4 remounted read-only after an error ("emergency_ro")."""
    import errno
    import os

    assert store_module.writable_dir(tmp_path) and list(tmp_path.iterdir()) == []  # the probe is gone
    real_open = os.open

    def failing(path, flags, *args):
        if str(path).startswith(str(tmp_path)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", failing)
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # as on emergency_ro
    assert not store_module.writable_dir(tmp_path)
