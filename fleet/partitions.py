"""Time partitions of the telemetry tables on PostgreSQL: each of requests, samples and events is range-partitioned
by day on `sent_ts`, so retention drops a day's partition instead of deleting its rows one by one.

The partition key is `sent_ts`, the record's `ts` as the device sent it, not the stored `ts`: the store replaces
the stamp of a clock never set or running ahead with the record's arrival time (fleet.store.Ingest.add_records),
which differs between two deliveries of one message, and a unique constraint on a partitioned table must hold
the partition key. With `(device_id, boot_id, seq, sent_ts)` as the key, a record the broker redelivers, or that
reaches two replicas, has the same key both times and is stored once. Invariant, from the restamping rule:
`ts <= sent_ts` unless `sent_ts < UNSET_CLOCK_BEFORE_TS`. So `ts >= X` implies `sent_ts >= X or sent_ts <
UNSET_CLOCK_BEFORE_TS` (`from_ts`), which lets the planner skip the partitions wholly before a query's window.

Partitions are whole UTC days (PARTITION_S; `requests_p20261207`), from the first day of the data the migration
found to AHEAD_DAYS after today; `upkeep` (the consumer, hourly, one replica at a time) adds the days ahead.
A row whose sent_ts no partition covers (a clock never set, far ahead, or older than the first partition) lands
in the DEFAULT partition (`requests_default`); a new partition takes its rows from there when it is made.
Retention (`prune_step`) works in whole days: a day's partition is dropped once the whole day is older than the
retention, and the rows elsewhere stamped before that day's end (the default partition's, and restamped rows
whose sent_ts is later than their ts) are deleted in batches. A row is so kept up to a day longer than `--keep`
says; SQLite, unpartitioned, deletes to the second. Daily, not weekly: a week would keep up to 7 days more (half
again of the samples' 14-day default), while 90 days of daily partitions per table is well within what the
planner prunes quickly.

A record the agent re-sends with another stamp (it moves an unacknowledged record's stamp when NTP steps its
clock) has another key here, and is stored under each stamp; and a row stored restamped before migration 0015
has its stored ts as its sent_ts, so its replay after the upgrade is stored again. Both need a delivery left
unacknowledged across the event.
"""
from __future__ import annotations

import logging
import math
import re
from datetime import datetime, timezone

from fleet.db import Database, Dialect, unavailable_errors
from fleet.migrations import UNSET_CLOCK_BEFORE_TS

log = logging.getLogger(__name__)

KEY_COLUMN = "sent_ts"
PARTITION_S = 86400  # a UTC day (why not a week: the docstring)
AHEAD_DAYS = 3  # partitions made past today: rows keep landing in their own while upkeep fails for this long
# DDL on a partitioned table waits for the queries reading it and holds up every commit behind it in the lock
# queue: past this it gives up, and the next pass tries again
LOCK_TIMEOUT_MS = 500
UPKEEP_LOCK_KEY = 0x7061727473  # pg_try_advisory_lock key of partition upkeep ("parts"): one replica at a time
_BOUND = re.compile(r"FOR VALUES FROM \('?([-\d.e+]+)'?\) TO \('?([-\d.e+]+)'?\)")
_INDEX = re.compile(r"CREATE (UNIQUE )?INDEX (\w+) ON \S+ USING (\w+) \((.*)\)$")


def day_of(ts: float) -> int:
    return math.floor(ts / PARTITION_S) * PARTITION_S


def cutoff(dialect: Dialect, before_ts: float) -> float:
    """What retention deletes before: before_ts itself, or on partitioned tables the start of its day (whole days
    go)."""
    return float(day_of(before_ts)) if dialect.partitioned else before_ts


def from_ts(dialect: Dialect, since_ts: float) -> str:
    """The condition that `ts >= since_ts` implies on the partition key, for a where clause that has it: '' when
    the tables are not partitioned. A literal, not a parameter: the planner prunes partitions at plan time."""
    if not dialect.partitioned:
        return ""
    return f" and ({KEY_COLUMN} >= {float(since_ts)!r} or {KEY_COLUMN} < {UNSET_CLOCK_BEFORE_TS!r})"


def partition_name(table: str, start_ts: int) -> str:
    return f"{table}_p{datetime.fromtimestamp(start_ts, timezone.utc):%Y%m%d}"


def ranges(db: Database, table: str) -> list[tuple[str, float, float]]:
    """table's day partitions: (name, start_ts, end_ts), oldest first (the default partition is not one)."""
    found = []
    for name, bound in db.execute("select c.relname, pg_get_expr(c.relpartbound, c.oid) from pg_inherits i join "
                                  "pg_class c on c.oid = i.inhrelid where i.inhparent = ?::regclass", [table]):
        match = _BOUND.fullmatch(bound)
        if match:
            found.append((name, float(match.group(1)), float(match.group(2))))
    return sorted(found, key=lambda p: p[1])


# ---- the migration ------------------------------------------------------------------------------------------
def partition_tables(db: Database, tables: tuple[str, ...], now: float) -> None:
    """Migration 0015's body on PostgreSQL (nothing on SQLite): each table becomes a partitioned table of the same
    columns plus sent_ts (its rows' ts: their stamps as stored are the best there is), with the same indexes, a
    default partition and a day partition for each day that has rows and for today to AHEAD_DAYS after it."""
    if db.dialect.name != "postgresql":
        return
    for table in tables:
        old = f"{table}_unpartitioned"
        indexes = _secondary_indexes(db, table)
        db.execute(f"alter table {table} rename to {old}")
        db.execute(f"alter index {table}_pkey rename to {old}_pkey")
        key = ", ".join(c for c in db.primary_key(old))
        db.execute(f"create table {table} (like {old} including defaults, {KEY_COLUMN} double precision not null, "
                   f"primary key ({key}, {KEY_COLUMN})) partition by range ({KEY_COLUMN})")
        db.execute(f"create table {table}_default partition of {table} default")
        # the days that have rows (a gap between them stays a gap: its late rows go to the default partition)
        days = {r[0] for r in db.execute(f"select distinct floor(ts / {PARTITION_S})::bigint * {PARTITION_S} from {old} "
                                         "where ts >= ? and ts < ?", [UNSET_CLOCK_BEFORE_TS, day_of(now)])}
        for start_ts in sorted(days) + list(_days_ahead(now)):
            db.execute(f"create table {partition_name(table, start_ts)} partition of {table} for values from "
                       f"({start_ts}) to ({start_ts + PARTITION_S})")
        db.execute(f"insert into {table} select *, ts from {old}")
        db.execute(f"drop table {old}")
        for name, method, columns in indexes:  # after the rows: one sorted build per partition, not row by row
            db.execute(f"create index {name} on {table} using {method} ({columns})")
        db.execute(f"analyze {table}")


def _secondary_indexes(db: Database, table: str) -> list[tuple[str, str, str]]:
    """(name, method, column list) of table's indexes other than its primary key's."""
    found = []
    for name, definition in db.execute("select indexname, indexdef from pg_indexes where schemaname = "
                                       "current_schema() and tablename = ? order by indexname", [table]):
        match = _INDEX.fullmatch(definition)
        if name != f"{table}_pkey":
            assert match and not match.group(1), f"an index migration 0015 cannot copy: {definition}"
            found.append((name, match.group(3), match.group(4)))
    return found


def _days_ahead(now: float) -> range:
    """The starts of today and the AHEAD_DAYS days after it."""
    return range(day_of(now), day_of(now) + (AHEAD_DAYS + 1) * PARTITION_S, PARTITION_S)


# ---- upkeep -------------------------------------------------------------------------------------------------
def upkeep(db: Database, tables: tuple[str, ...], now: float) -> int:
    """Make the day partitions missing from today to AHEAD_DAYS ahead, each in its own transaction; returns how many
    were made. One replica at a time: under a session advisory lock, which another replica finds taken and then
    does nothing (the lock goes with a connection that dies). Raises the database's error when a partition could
    not be made (its lock timed out): the caller tries again later."""
    if not db.dialect.partitioned:
        return 0
    if not db.execute("select pg_try_advisory_lock(?)", [UPKEEP_LOCK_KEY]).fetchone()[0]:
        return 0
    try:
        made = 0
        for table in tables:
            have = {start for _, start, _ in ranges(db, table)}
            made += sum(_make_partition(db, table, start_ts) for start_ts in _days_ahead(now) if start_ts not in have)
        return made
    finally:
        db.execute("select pg_advisory_unlock(?)", [UPKEEP_LOCK_KEY])


def _make_partition(db: Database, table: str, start_ts: int) -> int:
    """A new day partition, made apart and attached (which locks the parent SHARE UPDATE EXCLUSIVE: commits go
    on), with the default partition's rows of that day moved into it first (attaching checks there are none)."""
    name, end_ts = partition_name(table, start_ts), start_ts + PARTITION_S
    with db.transaction(immediate=True):
        db.execute(f"set local lock_timeout = {LOCK_TIMEOUT_MS}")
        db.execute(f"create table {name} (like {table} including defaults)")
        in_day = f"{KEY_COLUMN} >= {start_ts} and {KEY_COLUMN} < {end_ts}"
        db.execute(f"insert into {name} select * from {table}_default where {in_day}")
        db.execute(f"delete from {table}_default where {in_day}")
        db.execute(f"alter table {table} attach partition {name} for values from ({start_ts}) to ({end_ts})")
    return 1


# ---- retention ----------------------------------------------------------------------------------------------
def prune_step(db: Database, table: str, before_ts: float, max_rows: int) -> int:
    """One step of table's retention: every day partition wholly before cutoff(before_ts) dropped, or else up to
    max_rows rows stamped before it deleted from the partitions that stay; returns the rows gone (0: none left).
    Dropping waits at most LOCK_TIMEOUT_MS for the table's readers; if it could not, the partitions are left for
    the next pass and their rows are not deleted one by one meanwhile."""
    until_ts = cutoff(db.dialect, before_ts)
    partitions = ranges(db, table)
    expired = [name for name, _, end_ts in partitions if end_ts <= until_ts]
    if expired:
        try:
            with db.transaction(immediate=True):
                db.execute(f"set local lock_timeout = {LOCK_TIMEOUT_MS}")
                dropped = sum(db.execute(f"select count(*) from {name}").fetchone()[0] for name in expired)
                db.execute(f"drop table {', '.join(expired)}")
        except unavailable_errors() as e:
            log.warning("retention: %s not dropped yet (%s); the next pass tries again", ", ".join(expired),
                        str(e).strip())
            dropped = 0
        if dropped:
            return dropped
    kept = [f"{table}_default"] + [name for name, _, end_ts in partitions if end_ts > until_ts]
    with db.transaction(immediate=True):
        for name in kept:  # one partition at a time: a ctid names a row only within its partition
            n = db.execute(f"delete from {name} where ctid in (select ctid from {name} where ts < ? limit ?)",
                           [until_ts, max_rows]).rowcount
            if n:
                return n
    return 0
