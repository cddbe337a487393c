"""The telemetry store on real SQLite: migrations, a damaged file, durable appends, the outbox flags and the clock
stamps.

Run: .venv/bin/pytest tests/agent/test_store.py -q
"""
from __future__ import annotations

import json
import sqlite3

import pytest

from agent.link import migrations as migrations_module
from agent.config import TelemetryConfig
from agent.link.migrations import migrate
from agent.link.reader import TelemetryReader
from agent.link.store import MAX_RECORD_BYTES, TelemetryStore
from agent.link.telemetry import DB_NAME, Telemetry
from agent.wire import EventRecord, SampleRecord, TelemetryRecord
from store_support import request


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
