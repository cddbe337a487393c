"""The fleet database: device registry, telemetry and rejected-message counts, in one SQLite file or one
PostgreSQL database (fleet.db's seam; `--db` takes a path or a postgresql:// URL).

Schema changes only through the ordered, named migrations in fleet.migrations (never edit one that has
shipped). Writes come in `Ingest` batches, each committed in one IMMEDIATE transaction; telemetry rows are
keyed by (device_id, boot_id, seq) and inserted with ON CONFLICT DO NOTHING, so a batch the broker or a
device sends twice is stored once, whichever replica it reaches. SQLite: WAL mode lets `edge-fleet` queries read
while the consumer writes, and lets several consumer replicas share the file (writers queue on the busy
timeout). PostgreSQL: replicas write concurrently; each transaction touches the registry's rows in device
order, so two replicas' commits queue on a row rather than deadlock.

Read it with docs/fleet.md's schema: `sqlite-utils query fleet.db "select ..."`.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from agent.wire import DeviceState, TelemetryRecord
from fleet import partitions, rollups
from fleet.db import BUSY_TIMEOUT_S, Database, SqliteDatabase, StoreError, database_errors, describe, open_database
from fleet.migrations import (KEY, MIGRATIONS, REQUEST_FIGURES_COLUMNS, SAMPLE_COLUMNS, TELEMETRY_TABLES,
                              UNSET_CLOCK_BEFORE_TS)

__all__ = ["BUSY_TIMEOUT_S", "StoreError", "FleetStore", "Ingest", "Committed"]

# ---- limits (the schema and its migrations are in fleet/migrations.py) ------------------------------------
CLOCK_SLACK_S = 300.0  # how far ahead of the fleet's clock a device's stamp may be before it is replaced
# UNSET_CLOCK_BEFORE_TS (fleet.migrations): the agent restamps its rows when NTP steps its clock, but rows it sent
# before that arrive stamped before it, and retention deleted them as soon as they arrived.
WAL_SIZE_LIMIT_BYTES = 64 << 20
TABLE_OF_KIND = {"request": "requests", "sample": "samples", "event": "events"}  # a record's kind -> its table
EXPIRED = "expired"  # the rejected reason of a record older than its table keeps (counted per record)
PRUNE_BATCH_ROWS = 5000  # rows deleted per transaction (~0.1-0.7 s on a large database): the consumer runs one
# between two of its commits, and another replica's commits wait at most that long


# ---- what one commit writes --------------------------------------------------------------------------------
@dataclass
class Ingest:
    """Everything gathered from up to ~50 ms of messages, written by one `FleetStore.commit`."""

    # (device_id, record as stored, its ts as the device sent it: PostgreSQL's partition key, fleet.partitions)
    records: list[tuple[str, TelemetryRecord, float]] = field(default_factory=list)
    # (state, live: sent by the device just now, broker: the URL it came through, None when not known)
    states: list[tuple[DeviceState, bool, str | None]] = field(default_factory=list)
    seen: dict[str, float] = field(default_factory=dict)  # device -> latest contact, s since the epoch
    rejected: Counter = field(default_factory=Counter)  # (device_id, reason) -> messages
    kept_s: dict[str, float] = field(default_factory=dict)  # table -> retention (the consumer's --keep)

    def add_records(self, device_id: str, records: list[TelemetryRecord], seen_at: float) -> None:
        # A stamp ahead of the fleet's clock is the device's clock running ahead (no RTC, NTP not yet synced):
        # stored as it was, it put the device's whole history into every "last hour", stretched the report's
        # time axis and escaped retention. Such records, and those of a clock never set, are stamped with
        # their arrival instead.
        latest = seen_at + CLOCK_SLACK_S
        for sent in records:
            r = sent if UNSET_CLOCK_BEFORE_TS <= sent.ts <= latest else sent.model_copy(update={"ts": seen_at})
            if r.ts < seen_at - self.kept_s.get(TABLE_OF_KIND[r.kind], float("inf")):
                # older than its table keeps (the backlog of a device offline for weeks): stored, the next
                # prune would delete it uncounted. Refused and counted per device, as Loki and Prometheus do.
                self.reject(device_id, EXPIRED)
                continue
            self.records.append((device_id, r, sent.ts))
        self.mark_seen(device_id, seen_at)

    def add_state(self, state: DeviceState, seen_at: float, live: bool = False, broker: str | None = None) -> None:
        """live: the device itself sent it just now (not a retained copy, not a Will the broker sent for it)."""
        self.states.append((state, live, broker))
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
            *(_number(getattr(figures, c)) for c in REQUEST_FIGURES_COLUMNS), r.request.adapter)


def _number(value):
    """A flag stored as 0/1: PostgreSQL takes no bool into a bigint column (SQLite stored True as 1)."""
    return int(value) if value.__class__ is bool else value


def sample_row(device_id: str, r: TelemetryRecord) -> tuple:
    return (*_key(device_id, r), *(getattr(r.sample, c) for c in SAMPLE_COLUMNS))


def event_row(device_id: str, r: TelemetryRecord) -> tuple:
    return (*_key(device_id, r), r.event.kind, json.dumps(r.event.detail, sort_keys=True))


def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    # a (device_id, boot_id, seq) already stored is a replay and is dropped
    return (f"insert into {table} ({', '.join(columns)}) values ({', '.join('?' * len(columns))}) "
            f"on conflict do nothing")


_COLUMNS_OF_KIND = {"request": ("requests", (*KEY, "model", "version", *REQUEST_FIGURES_COLUMNS, "adapter")),
                    "sample": ("samples", (*KEY, *SAMPLE_COLUMNS)), "event": ("events", (*KEY, "kind", "detail"))}
_ROW_OF_KIND = {"request": request_row, "sample": sample_row, "event": event_row}
# record kind -> (insert statement, row builder of (device_id, record, sent_ts)). The hot path uses executemany with
# these fixed statements: sqlite-utils' insert_all inspects every value of every row, which made it 5x slower than
# validation. Partitioned tables (PostgreSQL) take the stamp the device sent as their last column.
ROW_WRITERS = {kind: (_insert_sql(table, columns), lambda d, r, sent_ts, row=_ROW_OF_KIND[kind]: row(d, r))
               for kind, (table, columns) in _COLUMNS_OF_KIND.items()}
PARTITIONED_ROW_WRITERS = {
    kind: (_insert_sql(table, (*columns, partitions.KEY_COLUMN)),
           lambda d, r, sent_ts, row=_ROW_OF_KIND[kind]: (*row(d, r), sent_ts))
    for kind, (table, columns) in _COLUMNS_OF_KIND.items()}


def state_row(state: DeviceState) -> dict:
    return {"id": state.device_id, "status": state.status, "connection": state.connection, "state_ts": state.ts,
            "boot_id": state.boot_id, "model": state.model, "version": state.version, "precision": state.precision,
            "hardware": state.hardware.model_dump_json() if state.hardware else None,
            "agent_version": state.agent_version}


# ---- the store ---------------------------------------------------------------------------------------------
class FleetStore:
    """Owned by one thread at a time (the consumer's writer). target: a SQLite path or a postgresql:// URL."""

    def __init__(self, target: Path | str, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.target = describe(target)
        self.db: Database | None = None
        try:
            self.db = open_database(target, busy_timeout_s=busy_timeout_s)
            if isinstance(self.db, SqliteDatabase):
                _tune_sqlite(self.db)
            self.migrate()
        except database_errors() as e:  # "unable to open database file", "file is not a database": which?
            if self.db is not None:
                self.db.close()
            raise StoreError(f"fleet database {self.target}: {str(e).strip()}") from e

    @property
    def path(self) -> Path:
        return Path(self.target)  # a SQLite store's file

    def close(self) -> None:
        self.db.close()

    def _transaction(self):
        """SQLite: BEGIN IMMEDIATE takes the write lock up front, so two replicas never deadlock upgrading a read."""
        return self.db.transaction(immediate=True)

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
        The consumer runs one between its commits, so a long prune never holds up ingest. The request
        rollups of periods wholly before the requests' time go in the last step (fleet.rollups.prune).
        PostgreSQL's partitioned tables go by whole days: a day's partition is dropped in one step once the
        whole day is before the time (fleet.partitions.prune_step)."""
        for table, before_ts in before.items():
            if table not in TELEMETRY_TABLES:
                raise ValueError(f"{table!r} is not a telemetry table")
            n = (partitions.prune_step(self.db, table, before_ts, PRUNE_BATCH_ROWS) if self.db.dialect.partitioned
                 else self._delete_before(table, before_ts))
            if n:
                return n
        if "requests" in before:  # the pass's last step: one statement, not counted with the telemetry rows
            with self._transaction():
                rollups.prune(self.db, partitions.cutoff(self.db.dialect, before["requests"]))
        return 0

    def _delete_before(self, table: str, before_ts: float) -> int:
        with self._transaction():
            row_id = self.db.dialect.row_id
            return self.db.execute(f"DELETE FROM {table} WHERE {row_id} IN (SELECT {row_id} FROM {table} "
                                   f"WHERE ts < ? LIMIT ?)", [before_ts, PRUNE_BATCH_ROWS]).rowcount

    def prepare_partitions(self, now: float | None = None) -> int:
        """PostgreSQL: make the day partitions due from today on (fleet.partitions.upkeep); returns how many were
        made (0 on SQLite, which has none)."""
        return partitions.upkeep(self.db, TELEMETRY_TABLES, time.time() if now is None else now)

    def migrate(self) -> list[str]:
        """Apply the migrations this database has not seen, in order, each in its own transaction; under the
        migration lock, so that of several replicas starting together one migrates and the others find it
        done. A database migrated by a newer edge-fleet is refused: this code would misread its schema."""
        applied = []
        with self.db.migration_lock():
            with self._transaction():  # SQLite: another replica's check waits for this one's create
                if "_migrations" not in self.db.table_names():
                    self.db.create_table("_migrations", {"name": str, "applied_at": float}, "name")
            known = {name for name, _ in MIGRATIONS}
            newer = sorted(set(self.applied_migrations()) - known)
            if newer:
                raise StoreError(f"fleet database {self.target} was migrated by a newer edge-fleet ({', '.join(newer)}):"
                                 f" upgrade this one to use it")
            for name, step in MIGRATIONS:
                with self._transaction():
                    if self.db["_migrations"].count_where("name = ?", [name]):
                        continue
                    step(self.db)
                    self.db["_migrations"].insert({"name": name, "applied_at": time.time()})
                    applied.append(name)
        return applied

    def applied_migrations(self) -> list[str]:
        return [r["name"] for r in self.db.query("select name from _migrations order by name")]

    def commit(self, ingest: Ingest) -> Committed:
        """Write one batch in one transaction: telemetry (replays dropped), device states, last-seen times and
        rejected counts, and last the stale marks of its request rollups (fleet.rollups.mark). Last: on
        PostgreSQL the refresh's claim waits for the commits holding the marks table, and one that has marked
        then waits on nothing else, so no lock cycle can form through it."""
        with self._transaction():
            inserted, requests = self._insert_records(ingest.records)
            # the registry's rows locked in device order first (every device with a state was seen), then
            # each device's states in arrival order: two replicas' commits queue on a row, never deadlock
            self._mark_seen(ingest.seen)
            states = sorted(ingest.states, key=lambda s: s[0].device_id)  # stable: arrival order per device
            states_applied = sum(self._apply_state(*state) for state in states)
            self._count_rejected(ingest.rejected)
            if requests:
                rollups.mark(self.db, requests, time.time())
        return Committed(inserted=inserted, duplicates=ingest.num_records - inserted,
                         rejected=sum(ingest.rejected.values()), states_applied=states_applied)

    def _insert_records(self, records: list[tuple[str, TelemetryRecord, float]]) -> tuple[int, list[tuple]]:
        """(rows new to the database, the request rows). In key order: two replicas inserting the same
        replayed keys take their locks in one order."""
        writers = PARTITIONED_ROW_WRITERS if self.db.dialect.partitioned else ROW_WRITERS
        rows: dict[str, list[tuple]] = {kind: [] for kind in writers}
        for device_id, record, sent_ts in records:
            rows[record.kind].append(writers[record.kind][1](device_id, record, sent_ts))
        requests = sorted(rows["request"], key=lambda r: r[:3])
        return sum(self.db.executemany(writers[kind][0], sorted(kind_rows, key=lambda r: r[:3]))
                   for kind, kind_rows in rows.items() if kind_rows), requests

    def refresh_rollups(self, now: float | None = None) -> int:
        """One transaction of the request rollups' refresh (fleet.rollups.refresh_step): stale hour buckets
        re-rolled; 0 when none is due. The consumer runs one between its commits."""
        return rollups.refresh_step(self.db, time.time() if now is None else now)

    def rollup_backlog(self, now: float | None = None) -> rollups.Backlog:
        return rollups.backlog(self.db, time.time() if now is None else now)

    def _apply_state(self, state: DeviceState, live: bool, broker: str | None) -> bool:
        # the row locked until the commit (PostgreSQL): another replica's newer state waits, then compares
        current = next(self.db.query("select status, connection, boot_id, state_ts from devices where id = ?"
                                     + self.db.dialect.lock_row, [state.device_id]), None)
        if not is_newer_state(current, state, live):
            return False
        # the broker comes with the newest state: a retained state left on a broker the device has moved from
        # is an older connection's, and never takes it back there
        self.db["devices"].upsert(state_row(state) | ({"broker": broker} if broker else {}), pk="id")
        return True

    def _mark_seen(self, seen: dict[str, float]) -> None:
        self.db.executemany(
            "insert into devices (id, first_seen, last_seen) values (?, ?, ?) on conflict(id) do update set "
            f"last_seen = {self.db.dialect.greatest('coalesce(devices.last_seen, 0)', 'excluded.last_seen')}, "
            "first_seen = coalesce(devices.first_seen, excluded.first_seen)",
            [(device_id, ts, ts) for device_id, ts in sorted(seen.items())])

    def _count_rejected(self, rejected: Counter) -> None:
        now = time.time()
        self.db.executemany(
            "insert into rejected (device_id, reason, count, first_ts, last_ts) values (?, ?, ?, ?, ?) "
            "on conflict(device_id, reason) do update set count = rejected.count + excluded.count, "
            "last_ts = excluded.last_ts",
            [(device_id, reason, n, now, now) for (device_id, reason), n in sorted(rejected.items())])


def _tune_sqlite(db: SqliteDatabase) -> None:
    db.utils.enable_wal()
    # WAL + FULL: a commit survives a power cut, not only a crash. The consumer PUBACKs a batch after its
    # commit and the device marks it sent for good, so a commit NORMAL left unsynced in the WAL was lost.
    db.execute("PRAGMA synchronous=FULL")
    # A long read (a 90-day report) keeps the WAL from restarting; it can grow to 1.8 GB and, the
    # consumer's connection never closing, would stay that size. Truncated to this after checkpoints.
    db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT_BYTES}")
