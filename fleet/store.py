"""The fleet database: device registry, telemetry and rejected-message counts in one SQLite file.

Schema changes only through the ordered, named migrations in fleet.migrations (never edit one that has
shipped). Writes come in `Ingest` batches, each committed in one IMMEDIATE transaction; telemetry rows are
keyed by (device_id, boot_id, seq) and inserted with INSERT OR IGNORE, so a batch the broker or a device
sends twice is stored once. WAL mode lets `edge-fleet` queries read while the consumer writes, and lets several
consumer replicas share the file (writers queue on the busy timeout).

Read it with docs/fleet.md's schema: `sqlite-utils query fleet.db "select ..."`.
"""
from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import sqlite_utils

from agent.wire import DeviceState, TelemetryRecord
from fleet.migrations import KEY, MIGRATIONS, REQUEST_FIGURES_COLUMNS, SAMPLE_COLUMNS

BUSY_TIMEOUT_S = 30.0  # replicas sharing one file wait this long for the write lock before failing a commit

# ---- limits (the schema and its migrations are in fleet/migrations.py) ------------------------------------
CLOCK_SLACK_S = 300.0  # how far ahead of the fleet's clock a device's stamp may be before it is replaced
# A stamp before this (2020-01-01) is a clock that was never set (a box without an RTC boots in 1970): no set
# clock running this software reads earlier. The agent restamps its rows when NTP steps its clock, but rows it
# sent before that arrive stamped so, and retention deleted them as soon as they arrived.
UNSET_CLOCK_BEFORE_TS = 1_577_836_800.0
WAL_SIZE_LIMIT_BYTES = 64 << 20
TELEMETRY_TABLES = ("requests", "samples", "events")  # what retention prunes; the registry and jobs stay
TABLE_OF_KIND = {"request": "requests", "sample": "samples", "event": "events"}  # a record's kind -> its table
EXPIRED = "expired"  # the rejected reason of a record older than its table keeps (counted per record)
PRUNE_BATCH_ROWS = 5000  # rows deleted per transaction (~0.1-0.7 s on a large database): the consumer runs one
# between two of its commits, and another replica's commits wait at most that long


# ---- what one commit writes --------------------------------------------------------------------------------
@dataclass
class Ingest:
    """Everything gathered from up to ~50 ms of messages, written by one `FleetStore.commit`."""

    records: list[tuple[str, TelemetryRecord]] = field(default_factory=list)  # (device_id, record)
    states: list[tuple[DeviceState, bool]] = field(default_factory=list)  # (state, live: sent by the device just now)
    seen: dict[str, float] = field(default_factory=dict)  # device -> latest contact, s since the epoch
    rejected: Counter = field(default_factory=Counter)  # (device_id, reason) -> messages
    kept_s: dict[str, float] = field(default_factory=dict)  # table -> retention (the consumer's --keep)

    def add_records(self, device_id: str, records: list[TelemetryRecord], seen_at: float) -> None:
        # A stamp ahead of the fleet's clock is the device's clock running ahead (no RTC, NTP not yet synced):
        # stored as it was, it put the device's whole history into every "last hour", stretched the report's
        # time axis and escaped retention. Such records, and those of a clock never set, are stamped with
        # their arrival instead.
        latest = seen_at + CLOCK_SLACK_S
        for r in records:
            r = r if UNSET_CLOCK_BEFORE_TS <= r.ts <= latest else r.model_copy(update={"ts": seen_at})
            if r.ts < seen_at - self.kept_s.get(TABLE_OF_KIND[r.kind], float("inf")):
                # older than its table keeps (the backlog of a device offline for weeks): stored, the next
                # prune would delete it uncounted. Refused and counted per device, as Loki and Prometheus do.
                self.reject(device_id, EXPIRED)
                continue
            self.records.append((device_id, r))
        self.mark_seen(device_id, seen_at)

    def add_state(self, state: DeviceState, seen_at: float, live: bool = False) -> None:
        """live: the device itself sent it just now (not a retained copy, not a Will the broker sent for it)."""
        self.states.append((state, live))
        self.mark_seen(state.device_id, seen_at)

    def mark_seen(self, device_id: str, seen_at: float) -> None:
        self.seen[device_id] = max(seen_at, self.seen.get(device_id, 0.0))

    def reject(self, device_id: str, reason: str) -> None:
        self.rejected[(device_id, reason)] += 1

    @property
    def num_records(self) -> int:
        return len(self.records)


@dataclass(frozen=True)
class Committed:
    inserted: int  # telemetry rows new to the database
    duplicates: int  # telemetry rows already there (replays), dropped
    rejected: int  # bad messages counted
    states_applied: int  # device states that changed the registry (late Wills are not)


ENDED = ("offline", "stopped")  # a connection ends with its Will (offline) or a clean stop


def is_newer_state(current: dict | None, state: DeviceState, live: bool = False) -> bool:
    """Whether `state` should replace the registry's row (`current`: its status, connection, boot_id and
    state_ts). The connection counter grows on every connect, so a Will the broker publishes late for an
    older connection (smaller counter) of the same boot is ignored. Across boots the clock decides: a
    re-imaged device restarts its counter, and a retained state of an earlier boot may arrive after the
    new boot's birth. Except that a live state (`live`: the device sent it just now) of another boot
    replaces a row whose connection has ended, whatever the clocks say: the device is up now. A boot whose clock ran ahead (no RTC, set
    by NTP later) otherwise kept the device "offline" until the new boot's clock passed the old one's.
    Within one connection, once it has ended no replayed birth reopens it (two replicas may apply the
    same messages in either order)."""
    if current is None or current["connection"] is None:
        return True
    if state.boot_id != current["boot_id"]:
        # another boot: the clock decides, not the counter (a re-imaged device restarts its counter, and a
        # retained state of an earlier boot can arrive after the new boot's birth)
        return state.ts > (current["state_ts"] or 0.0) or (live and current["status"] in ENDED)
    if state.connection != current["connection"]:
        return state.connection > current["connection"]
    return not (current["status"] in ENDED and state.status == "online")


# ---- rows ---------------------------------------------------------------------------------------------------
def _key(device_id: str, r: TelemetryRecord) -> tuple:
    return device_id, r.boot_id, r.seq, r.ts


def request_row(device_id: str, r: TelemetryRecord) -> tuple:
    figures = r.request.figures
    return (*_key(device_id, r), r.request.model, r.request.version,
            *(getattr(figures, c) for c in REQUEST_FIGURES_COLUMNS))


def sample_row(device_id: str, r: TelemetryRecord) -> tuple:
    return (*_key(device_id, r), *(getattr(r.sample, c) for c in SAMPLE_COLUMNS))


def event_row(device_id: str, r: TelemetryRecord) -> tuple:
    return (*_key(device_id, r), r.event.kind, json.dumps(r.event.detail, sort_keys=True))


def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    # INSERT OR IGNORE: a (device_id, boot_id, seq) already stored is a replay and is dropped
    return f"insert or ignore into {table} ({', '.join(columns)}) values ({', '.join('?' * len(columns))})"


# record kind -> (insert statement, row builder). The hot path uses executemany with these fixed statements:
# sqlite-utils' insert_all inspects every value of every row, which made it 5x slower than validation.
ROW_WRITERS = {
    "request": (_insert_sql("requests", (*KEY, "model", "version", *REQUEST_FIGURES_COLUMNS)), request_row),
    "sample": (_insert_sql("samples", (*KEY, *SAMPLE_COLUMNS)), sample_row),
    "event": (_insert_sql("events", (*KEY, "kind", "detail")), event_row),
}


def state_row(state: DeviceState) -> dict:
    return {"id": state.device_id, "status": state.status, "connection": state.connection, "state_ts": state.ts,
            "boot_id": state.boot_id, "model": state.model, "version": state.version, "precision": state.precision,
            "hardware": state.hardware.model_dump_json() if state.hardware else None,
            "agent_version": state.agent_version}


# ---- the store ---------------------------------------------------------------------------------------------
def connect(path: Path | str, busy_timeout_s: float = BUSY_TIMEOUT_S) -> sqlite_utils.Database:
    conn = sqlite3.connect(str(path), timeout=busy_timeout_s, check_same_thread=False)
    return sqlite_utils.Database(conn)


class StoreError(ValueError):
    """The fleet database cannot be opened; the message names the file."""


class FleetStore:
    """Owned by one thread at a time (the consumer's writer)."""

    def __init__(self, path: Path | str, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        try:
            self._open(busy_timeout_s)
        except sqlite3.DatabaseError as e:  # "unable to open database file", "file is not a database": which?
            raise StoreError(f"fleet database {self.path}: {e}") from e

    def _open(self, busy_timeout_s: float) -> None:
        self.db = connect(self.path, busy_timeout_s)
        self.db.enable_wal()
        # WAL + FULL: a commit survives a power cut, not only a crash. The consumer PUBACKs a batch after its
        # commit and the device marks it sent for good, so a commit NORMAL left unsynced in the WAL was lost.
        self.db.execute("PRAGMA synchronous=FULL")
        # A long read (a 90-day report) keeps the WAL from restarting; it can grow to 1.8 GB and, the
        # consumer's connection never closing, would stay that size. Truncated to this after checkpoints.
        self.db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
        self.migrate()

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE takes the write lock up front, so two replicas never deadlock upgrading a read."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.rollback()
            raise
        self.db.execute("COMMIT")

    def prune(self, before: dict[str, float]) -> int:
        """Delete the rows of each table in `before` (some of TELEMETRY_TABLES) stamped before its time (the
        device's clock), a batch per transaction; returns how many rows went. Devices, jobs and rejected
        counts are kept."""
        deleted = 0
        while n := self.prune_step(before):
            deleted += n
        return deleted

    def prune_step(self, before: dict[str, float]) -> int:
        """One transaction of prune(): at most PRUNE_BATCH_ROWS rows; 0 when nothing is left to delete.
        The consumer runs one between its commits, so a long prune never holds up ingest."""
        for table, before_ts in before.items():
            if table not in TELEMETRY_TABLES:
                raise ValueError(f"{table!r} is not a telemetry table")
            with self._transaction():
                n = self.db.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE ts < ? "
                                    f"LIMIT ?)", [before_ts, PRUNE_BATCH_ROWS]).rowcount
            if n:
                return n
        return 0

    def migrate(self) -> list[str]:
        """Apply the migrations this file has not seen, in order, each in its own transaction."""
        applied = []
        for name, step in MIGRATIONS:
            with self._transaction():
                self.db["_migrations"].create({"name": str, "applied_at": float}, pk="name", if_not_exists=True)
                if self.db["_migrations"].count_where("name = ?", [name]):
                    continue
                step(self.db)
                self.db["_migrations"].insert({"name": name, "applied_at": time.time()})
                applied.append(name)
        return applied

    def applied_migrations(self) -> list[str]:
        return [r["name"] for r in self.db.query("select name from _migrations order by name")]

    def commit(self, ingest: Ingest) -> Committed:
        """Write one batch in one transaction: telemetry (replays dropped), device states, last-seen times
        and rejected counts."""
        with self._transaction():
            before = self.db.conn.total_changes
            self._insert_records(ingest.records)
            inserted = self.db.conn.total_changes - before
            states_applied = sum(self._apply_state(s, live) for s, live in ingest.states)
            self._mark_seen(ingest.seen)
            self._count_rejected(ingest.rejected)
        return Committed(inserted=inserted, duplicates=ingest.num_records - inserted,
                         rejected=sum(ingest.rejected.values()), states_applied=states_applied)

    def _insert_records(self, records: list[tuple[str, TelemetryRecord]]) -> None:
        rows: dict[str, list[tuple]] = {kind: [] for kind in ROW_WRITERS}
        for device_id, record in records:
            rows[record.kind].append(ROW_WRITERS[record.kind][1](device_id, record))
        for kind, kind_rows in rows.items():
            if kind_rows:
                self.db.conn.executemany(ROW_WRITERS[kind][0], kind_rows)

    def _apply_state(self, state: DeviceState, live: bool) -> bool:
        current = next(self.db.query("select status, connection, boot_id, state_ts from devices where id = ?",
                                     [state.device_id]), None)
        if not is_newer_state(current, state, live):
            return False
        self.db["devices"].upsert(state_row(state), pk="id")
        return True

    def _mark_seen(self, seen: dict[str, float]) -> None:
        self.db.conn.executemany(
            "insert into devices (id, first_seen, last_seen) values (?, ?, ?) on conflict(id) do update set "
            "last_seen = max(coalesce(last_seen, 0), excluded.last_seen), "
            "first_seen = coalesce(first_seen, excluded.first_seen)",
            [(device_id, ts, ts) for device_id, ts in seen.items()])

    def _count_rejected(self, rejected: Counter) -> None:
        now = time.time()
        self.db.conn.executemany(
            "insert into rejected (device_id, reason, count, first_ts, last_ts) values (?, ?, ?, ?, ?) "
            "on conflict(device_id, reason) do update set count = count + excluded.count, last_ts = excluded.last_ts",
            [(device_id, reason, n, now, now) for (device_id, reason), n in rejected.items()])
