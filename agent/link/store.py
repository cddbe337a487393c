"""The device's telemetry store and outbox: every record is committed to SQLite before anything sends it.

One table of records (request, sample and event TelemetryRecords as JSON, each with its delivery flag) and
a meta table of counters, built by agent.link.migrations. `append()` returns only once the row is
committed (durable before delivered); agent.link.outbox reads `unsent()` rows, publishes them and calls
`mark_sent()` on PUBACK. `enforce()` keeps the file inside its age and byte caps, deleting delivered rows
first; undelivered rows it must drop are counted and reported as a `dropped_rows` event, so the loss is
itself delivered. A full disk (or the file's hard limit, `max_file_bytes`) makes `append()` raise StoreFull; a record
given up on is counted (`count_unwritten()`) and the next `enforce()` reports it with the others. The
read side, for `edge-agent telemetry`, is agent.link.reader; the schema, for `sqlite-utils query
telemetry.db "..."`, is documented in docs/telemetry.md.

Example:
    store = TelemetryStore(Path("/var/lib/edge-agent/telemetry.db"), "dev-1")
    store.append(EventRecord(kind="start"))
    rows = store.unsent(200); store.mark_sent([r.row_id for r in rows])
"""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pydantic import ValidationError
from sqlite_utils import Database

from agent import durable
from agent.link.migrations import ROW_OVERHEAD_BYTES, migrate
from agent.wire import MAX_PAYLOAD_BYTES, EventRecord, RequestRecord, SampleRecord, TelemetryRecord

log = logging.getLogger(__name__)

# WAL + synchronous=FULL: a committed record survives a power cut, not just a crash, at one fsync per
# append; requests finish seconds apart and samples come every ~10 s, so the cost is small on a device.
SYNCHRONOUS = "FULL"
ENVELOPE_BYTES = 4096  # room a TelemetryBatch envelope needs around its records
MAX_RECORD_BYTES = MAX_PAYLOAD_BYTES - ENVELOPE_BYTES  # a record must fit one batch on its own
BUSY_TIMEOUT_S = 10.0  # another process (the CLI, a backup) may hold the write lock briefly
WAL_LIMIT_BYTES = 4 << 20  # the WAL beside the capped file: kept to this after each checkpoint
# A wall clock that moved this much more (or less) than the time since boot, beyond what NTP may slew (at most
# 500 ppm), was stepped: an edge box without an RTC boots in 1970 (or at its last shutdown) until NTP sets it.
CLOCK_STEP_S = 1.0
MAX_SLEW = 500e-6

_KINDS = {RequestRecord: "request", SampleRecord: "sample", EventRecord: "event"}


class StoreFull(Exception):
    """The record was not written: the disk, or the file's hard limit (max_page_count), is full."""


def uptime() -> float:
    """Seconds since boot, suspend included (CLOCK_BOOTTIME): monotonic would read a suspend as a clock step."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def max_file_bytes(max_bytes: int) -> int:
    """The file's hard limit for a soft cap of max_bytes: room for pages' slack and indexes (a row's
    estimate in stored_bytes() is its body plus ROW_OVERHEAD_BYTES) before retention catches up."""
    return 2 * max_bytes + (1 << 20)


def is_full(e: sqlite3.Error) -> bool:
    """SQLITE_FULL: what SQLite says both for a full disk and for a file at its max_page_count."""
    return _primary_code(e) == SQLITE_FULL


# ---- the store --------------------------------------------------------------------------------------
class OutboxRow(NamedTuple):
    row_id: int
    body: str  # the TelemetryRecord as JSON, exactly as appended
    record: TelemetryRecord  # body, parsed


@dataclass(frozen=True)
class RetentionReport:
    deleted_delivered: int
    dropped_undelivered: int  # in this pass (deleted or refused by a full disk); lifetime: TelemetryStore's
    stored_bytes: int  # after the pass (estimate: body + ROW_OVERHEAD_BYTES per row)


# SQLite's primary result codes (sqlite3 names them only from Python 3.11, as it sets sqlite_errorcode)
SQLITE_IOERR, SQLITE_CORRUPT, SQLITE_FULL, SQLITE_NOTADB = 10, 11, 13, 26


def _primary_code(e: sqlite3.Error) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF
# Where records go when the file cannot be opened for lack of space: memory, capped at this (soft; the
# hard limit is max_file_bytes() of it), until a start finds room again.
MEMORY_FALLBACK_BYTES = 1 << 20
FALLBACK_HARD_LIMIT = max_file_bytes(MEMORY_FALLBACK_BYTES)


def _connect(path: Path) -> Database:
    db = Database(sqlite3.connect(str(path), check_same_thread=False, timeout=BUSY_TIMEOUT_S))
    try:
        db.enable_wal()
        db.execute(f"PRAGMA synchronous = {SYNCHRONOUS}")
        db.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")  # the WAL is truncated back to this
        # Damage inside the file (a power cut on an SD card) passes the header and schema reads; left to be
        # met later, it fails every retention pass, the file grows and records are lost unreported
        problem = db.execute("PRAGMA quick_check(1)").fetchone()[0]
        if problem != "ok":
            err = sqlite3.DatabaseError(f"database disk image is malformed: {problem}")
            err.sqlite_errorcode = SQLITE_CORRUPT
            raise err
        migrate(db)
    except BaseException:
        db.close()
        raise
    return db


def writable_dir(directory: Path) -> bool:
    """Whether a file can be made in directory now, by making one. access(2) is not enough: ext4 remounted
    read-only after an I/O error (errors=remount-ro, "emergency_ro" in /proc/mounts) still passes W_OK.
    A full disk counts as writable here: StoreFull deals with that."""
    probe = Path(directory) / f".write-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        pass
    except OSError as e:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    try:
        probe.unlink()
    except OSError as e:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return True


def _move_aside(path: Path) -> Path:
    """Rename the database and its WAL/SHM files to `<name>.corrupt-<unix time>[-wal|-shm]`."""
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    # the database last: interrupted (a power cut) after the WAL, it is moved aside again at the next start;
    # the other way round, the old WAL would meet a new database
    for suffix in ("-wal", "-shm", ""):
        src = path.with_name(path.name + suffix)
        if src.exists():
            src.rename(aside.with_name(aside.name + suffix))
    durable.fsync_path(path.parent)
    return aside


class TelemetryStore:
    """The records of one device. A new boot id per instance (each agent start); seq counts from 0 within it.

    Thread-safe: one connection behind one lock (appends come from the engine's and the sampler's threads,
    mark_sent from the outbox's).
    """

    def __init__(self, path: Path, device_id: str, clock: Callable[[], float] = time.time,
                 max_file_bytes: int | None = None, uptime: Callable[[], float] = uptime):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.device_id, self.clock, self.uptime = path, device_id, clock, uptime
        self._last_stamp: tuple[float, float] | None = None  # (wall clock, uptime) at the last append
        self.clock_steps: list[float] = []  # steps of the wall clock seen in this run, seconds, in order
        self._connections, self._connections_counted = 0, True  # the last connection number handed out
        self.recovered_from: Path | None = None  # where a corrupt database was moved, if it was
        self.in_memory_because: str | None = None  # why the file could not be used, if it could not
        hard_limit = max_file_bytes
        try:
            # Checked first: SQLite opens a WAL file in a read-only directory read-only without a word, and then
            # every write fails. That is an SD card ext4 remounted read-only after an I/O error, and a start
            # must still serve the model there (the store goes on in memory).
            if not writable_dir(path.parent):
                raise sqlite3.OperationalError(f"{path.parent} is read-only")
            self.db = _connect(path)
        except sqlite3.DatabaseError as e:
            code = _primary_code(e)
            if code in (SQLITE_FULL, SQLITE_IOERR) or not writable_dir(path.parent):
                self.db = self._in_memory(path, e)
                hard_limit = FALLBACK_HARD_LIMIT
            elif code in (SQLITE_CORRUPT, SQLITE_NOTADB):
                # An unattended device must not stay down over its telemetry (a power cut on an SD card):
                # as journald does with a corrupt journal, keep the file aside for inspection and start anew.
                self.recovered_from = _move_aside(path)
                log.error("telemetry database %s is corrupt (%s): moved to %s, starting a new one", path, e,
                          self.recovered_from)
                self.db = _connect(path)
            else:
                raise  # locked, unreadable: the file may be fine, so it is left alone
        if hard_limit is not None:
            # A hard ceiling under the soft byte cap of enforce(): retention runs only every few minutes,
            # and the device's disk must never fill with telemetry in between.
            page = self.db.execute("PRAGMA page_size").fetchone()[0]
            self.db.execute(f"PRAGMA max_page_count = {max(16, hard_limit // page)}")
        self.boot_id = str(uuid.uuid4())
        self._next_seq = 0
        self._unwritten = 0  # records refused by a full disk since the last enforce(), not yet in meta
        self._unwritten_counted = 0  # ... and those already in meta: the next enforce() reports both
        self._lock = threading.RLock()

    def _in_memory(self, path: Path, e: Exception, what: str = "opened") -> Database:
        """A full or read-only disk: a clean stop removed the WAL index (-shm), which SQLite cannot create again,
        and every start failed, leaving the device without its API and without MQTT to be fixed remotely. The
        file is left as it is; records are kept in memory (and delivered from there) until a start can use it."""
        self.in_memory_because = str(e)
        log.error("telemetry database %s cannot be %s (%s): telemetry is kept in memory (at most %d MiB) "
                  "until the agent starts with room on a writable disk", path, what, e, FALLBACK_HARD_LIMIT >> 20)
        return _connect(Path(":memory:"))

    def move_to_memory(self, e: Exception) -> bool:
        """Go on in memory once the file's directory cannot be written any more (an SD card ext4 remounted
        read-only under a running agent), so that records go on reaching the fleet, and with them the reason
        (a store_in_memory event). The undelivered rows come along with their ids (the outbox's cursor and in-flight
        batches name them), as many as fit; those that do not stay in the file for the next start. False if
        the store was in memory already or the directory is writable (the failure is something else)."""
        with self._lock:
            if self.in_memory_because is not None or writable_dir(self.path.parent):
                return False
            memory = self._in_memory(self.path, e, "written any more")
            page = memory.execute("PRAGMA page_size").fetchone()[0]
            memory.execute(f"PRAGMA max_page_count = {max(16, FALLBACK_HARD_LIMIT // page)}")
            columns = "id, device_id, boot_id, seq, ts, kind, body"
            try:
                kept = [(k, self._meta(k)) for k in ("dropped_undelivered", "connections")]
                unsent = self.db.execute(f"SELECT {columns} FROM records WHERE sent = 0 ORDER BY id").fetchall()
                top = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
            except sqlite3.Error:
                kept, unsent, top = [], [], None  # unreadable too: they wait in the file
            with memory.atomic():
                memory.conn.executemany("UPDATE meta SET value = ? WHERE key = ?", [(v, k) for k, v in kept])
                # new rows' ids go on from the file's: the outbox's cursor skips ids below the last it sent
                memory.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('records', ?)", [top[0] if top else 0])
                for row in unsent:
                    try:
                        memory.execute(f"INSERT INTO records ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?)", row)
                    except sqlite3.OperationalError as full:
                        if not is_full(full):
                            raise
                        break
            self.db.close()
            self.db = memory
            return True

    def count_unwritten(self, n: int = 1) -> None:
        """Records given up on after StoreFull: counted in the file at once when it takes the change (an update
        in place needs no new page), else in memory until enforce(); the next enforce() reports them either way.
        Kept only in memory, a restart before that pass lost the count, and the fleet never heard of them."""
        with self._lock:
            try:
                self._meta_add("dropped_undelivered", n)
                self._unwritten_counted += n
            except sqlite3.Error:
                self._unwritten += n

    def close(self) -> None:
        with self._lock:
            self.db.close()

    # ---- writing ----
    def append(self, body: RequestRecord | SampleRecord | EventRecord, ts: float | None = None) -> TelemetryRecord:
        """Commit one record and return it; the kind follows the body's type."""
        kind = _KINDS[type(body)]
        with self._lock:
            if ts is None:
                ts = self._stamp()
            record = TelemetryRecord(boot_id=self.boot_id, seq=self._next_seq, ts=ts, kind=kind, **{kind: body})
            text = record.model_dump_json()
            if len(text.encode()) > MAX_RECORD_BYTES:
                raise ValueError(f"a {kind} record of {len(text.encode())} bytes exceeds the "
                                 f"{MAX_RECORD_BYTES}-byte limit of one telemetry batch")
            try:
                self.db.execute(  # autocommits (or joins the caller's transaction, see enforce)
                    "INSERT INTO records (device_id, boot_id, seq, ts, kind, body) VALUES (?, ?, ?, ?, ?, ?)",
                    [self.device_id, record.boot_id, record.seq, record.ts, kind, text])
            except sqlite3.OperationalError as e:
                if not is_full(e):
                    raise
                raise StoreFull(f"telemetry database full ({e}): a {kind} record was not written") from None
            self._next_seq += 1
        return record

    def append_all(self, items: list[tuple[RequestRecord | SampleRecord | EventRecord, float]]) -> list[TelemetryRecord]:
        """Commit (record, age in seconds) pairs in one transaction, each stamped its age before now: samples
        are committed a few at a time, one fsync for several (an idle agent committing a sample every 10 s
        writes ~250 MB a day to its SD card). All or none are written."""
        with self._lock:
            now = self._stamp()
            try:
                with self.db.atomic():
                    return [self.append(body, ts=now - age) for body, age in items]
            except sqlite3.OperationalError as e:  # the COMMIT itself can meet the full disk
                if not is_full(e):
                    raise
                raise StoreFull(f"telemetry database full ({e}): {len(items)} record(s) not written") from None

    def _stamp(self) -> float:
        """The wall clock now; if it was stepped since the last append, this boot's rows are restamped first."""
        wall, up = self.clock(), self.uptime()
        if self._last_stamp is not None:
            last_wall, last_up = self._last_stamp
            step = (wall - last_wall) - (up - last_up)
            if abs(step) > CLOCK_STEP_S + MAX_SLEW * abs(up - last_up):
                self._restamp(step)
        self._last_stamp = (wall, up)
        return wall

    def _restamp(self, step: float) -> None:
        """Move this boot's rows by a clock step, as if stamped by the clock as it is now. Left stamped in 1970,
        they were deleted by the fleet's retention (and ours, once sent) as soon as they arrived. Rows of
        earlier boots cannot be placed and are left as they are; the fleet replaces stamps before any set clock.
        A failed write leaves the stamps as they were: stamps are worth less than the record being written."""
        try:
            with self.db.atomic():
                n = self.db.execute("UPDATE records SET ts = ts + ?, body = json_set(body, '$.ts', ts + ?) "
                                    "WHERE boot_id = ?", [step, step, self.boot_id]).rowcount
        except sqlite3.Error as e:
            log.warning("the clock stepped %+.0f s; this boot's records keep their stamps (%s)", step, e)
            return
        self.clock_steps.append(step)
        log.info("the clock stepped %+.0f s: moved this boot's %d records with it", step, n)

    def mark_sent(self, row_ids: Iterable[int]) -> None:
        """Flag rows as delivered (the broker acknowledged them). Rows deleted meanwhile are ignored."""
        now = self.clock()
        with self._lock, self.db.atomic():
            self.db.conn.executemany("UPDATE records SET sent = 1, sent_at = ? WHERE id = ? AND sent = 0",
                                     [(now, i) for i in row_ids])

    def next_connection(self) -> int:
        """Count one more connection attempt and return the count (the DeviceState `connection`), which only
        grows within a run. On a full disk the count goes on in memory: a failed write must not fail the
        connection attempt, or the device stays off MQTT for as long as the disk is full."""
        with self._lock:
            at_least = self._connections + 1
            try:
                with self.db.atomic():
                    self.db.execute("UPDATE meta SET value = MAX(value + 1, ?) WHERE key = 'connections'", [at_least])
                    self._connections = self._meta("connections")
            except sqlite3.Error as e:
                if self._connections_counted:
                    log.warning("telemetry database: cannot count a connection (%s); counting in memory", e)
                self._connections_counted, self._connections = False, at_least
                return at_least
            self._connections_counted = True
            return self._connections

    def _meta_add(self, key: str, n: int) -> int:
        with self._lock, self.db.atomic():
            self.db.execute("UPDATE meta SET value = value + ? WHERE key = ?", [n, key])
            return self._meta(key)

    def _meta(self, key: str) -> int:
        return next(self.db.query("SELECT value FROM meta WHERE key = ?", [key]))["value"]

    # ---- reading ----
    def unsent(self, limit: int, after: int = 0) -> list[OutboxRow]:
        """Up to `limit` undelivered rows with id > after, oldest first.

        A row that no longer parses as a TelemetryRecord is deleted, counted and reported as retention
        reports the rows it drops: an older agent wrote it and this one's schema refuses it (NaN figures,
        refused since 2026-12-03, say). It could never be delivered, and left in place it would hold up
        every row after it for good.
        """
        with self._lock:
            while True:
                rows = self.db.execute("SELECT id, body FROM records WHERE sent = 0 AND id > ? ORDER BY id LIMIT ?",
                                       [after, limit]).fetchall()
                parsed, invalid = [], []
                for row_id, body in rows:
                    try:
                        parsed.append(OutboxRow(row_id, body, TelemetryRecord.model_validate_json(body)))
                    except ValidationError as e:
                        log.warning("telemetry: row %d cannot be delivered and is dropped: %s", row_id,
                                    e.errors(include_url=False)[0]["msg"])
                        invalid.append(row_id)
                if invalid:
                    self.drop_undeliverable(invalid, "invalid")
                if parsed or len(rows) < limit:
                    return parsed
                after = rows[-1][0]  # a whole page of invalid rows: look further

    def count_unsent(self) -> int:
        with self._lock:
            return self.db.execute("SELECT count(*) FROM records WHERE sent = 0").fetchone()[0]

    @property
    def dropped_undelivered(self) -> int:
        with self._lock:
            return self._meta("dropped_undelivered")

    @property
    def dropped_total(self) -> int:
        """Records lost for good, lifetime: deleted undelivered, plus refused by a full disk (not yet in meta)."""
        with self._lock:
            return self._meta("dropped_undelivered") + self._unwritten

    @property
    def connections(self) -> int:
        with self._lock:
            return self._meta("connections")

    def stored_bytes(self) -> int:
        """Every row's body plus ROW_OVERHEAD_BYTES, as the triggers of migration 0004 keep it."""
        with self._lock:
            return self._meta("stored_bytes")

    # ---- retention ----
    def enforce(self, max_age_s: float, max_bytes: int) -> RetentionReport:
        """Delete delivered rows older than max_age_s, then the oldest rows while over max_bytes: delivered
        ones first, undelivered ones only if that was not enough (counted, and reported as an event).

        Undelivered rows are never deleted for age alone: a device offline for a month keeps its records
        up to the byte cap, and delivers them when it is back.
        """
        if self.in_memory_because is not None:
            max_bytes = min(max_bytes, MEMORY_FALLBACK_BYTES)
        try:
            return self._enforce(max_age_s, max_bytes)
        except sqlite3.OperationalError as e:
            if not is_full(e):
                raise
            raise StoreFull(f"telemetry database full ({e}): retention could not run") from None

    def _enforce(self, max_age_s: float, max_bytes: int) -> RetentionReport:
        with self._lock:
            unwritten, counted = self._unwritten, self._unwritten_counted
            with self.db.atomic():
                aged = self.db.execute("DELETE FROM records WHERE sent = 1 AND ts < ?",
                                       [self.clock() - max_age_s]).rowcount
                excess = self.stored_bytes() - max_bytes
                delivered, freed = self._delete_oldest(sent=1, excess_bytes=excess)
                dropped, _ = self._delete_oldest(sent=0, excess_bytes=excess - freed)
                lost = dropped + unwritten + counted
                if lost:
                    self._report_dropped(lost, unwritten + counted, already_counted=counted)
            self._unwritten -= unwritten  # only now: a full disk can fail the COMMIT itself
            self._unwritten_counted -= counted
            if aged or delivered or dropped:  # give the WAL's pages back too, but never wait for a reader:
                # this holds the store's lock, and a reader (a sqlite3 shell) made every append wait 10 s
                self.db.execute("PRAGMA busy_timeout = 0")
                try:
                    self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    self.db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            return RetentionReport(aged + delivered, lost, self.stored_bytes())

    def _delete_oldest(self, sent: int, excess_bytes: int) -> tuple[int, int]:
        """Delete the fewest oldest rows (of this delivery state) that free excess_bytes: (rows, bytes). Reads
        only the rows it deletes, a page at a time: a running sum over the whole table took ~0.2 s at the cap."""
        count = freed = after = 0
        while freed < excess_bytes:
            # sent as a literal: SQLite uses a partial index (records_sent, records_unsent) only for a query whose
            # WHERE names its constant
            page = self.db.execute(f"SELECT id, length(CAST(body AS BLOB)) FROM records WHERE sent = {int(sent)} "
                                   "AND id > ? ORDER BY id LIMIT 512", [after]).fetchall()
            for after, size in page:
                count, freed = count + 1, freed + size + ROW_OVERHEAD_BYTES
                if freed >= excess_bytes:
                    break
            if len(page) < 512:
                break
        if count:
            self.db.execute("DELETE FROM records WHERE sent = ? AND id <= ?", [sent, after])
        return count, freed

    def drop_undeliverable(self, row_ids: list[int], why: str) -> None:
        """Delete rows that can never be delivered, counted and reported under detail[why] ("invalid": no
        longer parses; "too_large": over the broker's packet limit)."""
        with self._lock, self.db.atomic():  # the outbox thread's call: other threads share the connection
            self.db.conn.executemany("DELETE FROM records WHERE id = ?", [(i,) for i in row_ids])
            self._report_dropped(len(row_ids), 0, {why: len(row_ids)})

    def _report_dropped(self, count: int, unwritten: int, undeliverable: dict[str, int] | None = None,
                        already_counted: int = 0) -> None:
        """Count rows deleted undelivered, records a full disk refused and rows that could never be
        delivered: all are lost to the fleet. already_counted of them are in meta already (count_unwritten)."""
        total = self._meta_add("dropped_undelivered", count - already_counted)
        detail = {"count": count, "total": total, "unwritten": unwritten} | (undeliverable or {})
        self.append(EventRecord(kind="dropped_rows", detail=detail))
