"""Request rollups: per (hour or day, device, model, version, adapter) the request, error and token counts and
log-spaced histograms of TTFT and decode speed, so that a 90-day question reads thousands of rollup rows, not
millions of requests (the continuous aggregates of time-series stores).

Maintained off the ingest commit path, as continuous aggregates and recording rules are: FleetStore.commit only
marks the hour buckets its request rows fall in as stale (`mark`: insert-or-ignore on (hour, device, model,
version, adapter), no rollup row read or locked). The consumer's writer runs `refresh_step` every few seconds
between its commits: it claims the marks of ended hours, recomputes those hours' rollups from the raw rows and their
days from the hours, and clears the claims, a batch per transaction; recomputing (never incrementing) makes a
refresh idempotent, so replays and a replica dying mid-refresh count nothing twice. Invariant: an hour rollup
equals its raw rows while none of its buckets is marked, and a day rollup the sum of its hours while none of
its hours is. Migration 0017 builds the rollups of rows stored before it (`backfill`). The adapter is the
request's NAME@VERSION, NO_ADAPTER ('') for the base alone (NULL in the requests table). Rollups follow the
requests table's retention, deleted with the raw rows by the store's prune (`prune`).

Queries over a window take whole days and whole hours from the rollups and only the partial hours at the
window's edges from raw rows (`plan`, `summaries`), and the hours still marked stale from raw rows too, so an
answer never waits for a refresh. Percentiles come from the merged histograms: bins are
HISTOGRAM_GROWTH (1%) wide, and the value of a rank is placed inside its bin, so every percentile in
[HISTOGRAM_MIN, HISTOGRAM_MAX] is within 1% (relative) of numpy's linear-interpolated one over the raw rows
(the two ranks it interpolates between are each within their bin); values below HISTOGRAM_MIN count as 0.

    mark(db, request_rows, time.time())                 # in the ingest commit
    while refresh_step(db, time.time()): pass           # in the background
    by_version = summaries(db, since_ts, now, lambda t, device, model, version, adapter: f"{model}@{version}")
"""
from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

from agent.figures import has_decode_speed, has_ttft
from fleet import partitions
from fleet.db import Database, unavailable_errors
from fleet.migrations import (KEY, NO_ADAPTER, REQUEST_FIGURES_COLUMNS, REQUEST_ROLLUP_COLUMNS,
                              REQUEST_ROLLUP_DIRTY_COLUMNS, REQUEST_ROLLUP_DIRTY_KEY, REQUEST_ROLLUP_KEY)

HOUR_S, DAY_S = 3600, 86400
LEVELS_S = (HOUR_S, DAY_S)  # the rollup periods kept; a day is 24 whole hours, so both levels tile any window
# Histogram scale, shared by TTFT (ms) and decode speed (tokens/s): bin 0 holds values below HISTOGRAM_MIN,
# bin b >= 1 holds [MIN * GROWTH^(b-1), MIN * GROWTH^b); values past HISTOGRAM_MAX land in the last bin.
HISTOGRAM_MIN, HISTOGRAM_MAX, HISTOGRAM_GROWTH = 0.01, 1e7, 1.01
NUM_BINS = 1 + math.ceil(math.log(HISTOGRAM_MAX / HISTOGRAM_MIN) / math.log(HISTOGRAM_GROWTH))  # 2084
DENSE_MAX_CELLS = 1 << 22  # percentiles' dense path up to this many group x bin cells (32 MB of float64 counts)
# One histogram entry, stored base64 in a text column: 6 bytes -> exactly 8 characters (no padding), so the
# texts of many rows concatenate into one decodable string.
ENTRY = np.dtype([("bin", "<u2"), ("count", "<u4")])
ENTRY_CHARS = 8
TABLE, ROLLUP_KEY, COLUMNS = "request_rollups", REQUEST_ROLLUP_KEY, REQUEST_ROLLUP_COLUMNS  # migrations 0012, 0017
# A request row as the store writes it (fleet.store.request_row), and the fields a rollup takes from it (as SQL)
REQUEST_COLUMNS = (*KEY, "model", "version", *REQUEST_FIGURES_COLUMNS, "adapter")
ADAPTER_SQL = f"coalesce(adapter, '{NO_ADAPTER}')"
FIGURES = ("ts", "device_id", "model", "version", ADAPTER_SQL, "ttft_ms", "decode_tokens_per_s", "completion_tokens",
           "finish_reason")
_TS, _DEVICE, _MODEL, _VERSION, _ADAPTER = (REQUEST_COLUMNS.index(c)
                                            for c in ("ts", "device_id", "model", "version", "adapter"))
DIRTY, DIRTY_COLUMNS, DIRTY_KEY = "request_rollups_dirty", tuple(REQUEST_ROLLUP_DIRTY_COLUMNS), REQUEST_ROLLUP_DIRTY_KEY
BUCKET = ("start_ts", "device_id", "model", "version", "adapter")  # a mark's hour bucket: its key without `claimed`
# Per refresh transaction, at most this many hour buckets and, past the first bucket, raw rows: bounds how long a
# refresh holds the SQLite write lock (every replica's ingest commits wait for it), its memory, and each
# PostgreSQL transaction's work.
REFRESH_BATCH_BUCKETS, REFRESH_BATCH_ROWS = 200, 50_000  # an hour of 400,000 rows: 8 transactions of <= 0.2 s
# How often the consumer's writer runs a refresh pass (refresh_step, a batch between two commits until none is
# left; `edge-fleet serve --rollup-refresh`): the rollups of an ended hour trail its raw rows by about this plus one
# pass. Queries do not wait for it (stale hours are read raw); a shorter period re-rolls a late-written hour more often.
ROLLUP_REFRESH_EVERY_S = 5.0
CLAIM_LOCK_TIMEOUT_MS = 500  # PostgreSQL: a claim that cannot lock the marks by then tries again next pass
REFRESH_LOCK_KEY = 0x726F6C6C7570  # pg_advisory_xact_lock key of the refresh ("rollup"): one replica at a time


# ---- histograms -------------------------------------------------------------------------------------------
def bins_of(values: np.ndarray) -> np.ndarray:
    """values (any shape, float) -> their bins (int64)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        bins = np.floor(np.log(values / HISTOGRAM_MIN) / math.log(HISTOGRAM_GROWTH)) + 1
    return np.where(values < HISTOGRAM_MIN, 0, np.clip(np.nan_to_num(bins), 1, NUM_BINS - 1)).astype(np.int64)


def bin_values(bins: np.ndarray, fraction: np.ndarray) -> np.ndarray:
    """The value `fraction` (0-1) of the way through each bin, geometrically; bin 0's values are 0."""
    return np.where(bins == 0, 0.0, HISTOGRAM_MIN * HISTOGRAM_GROWTH ** (bins - 1 + fraction))


def encode(entries: np.ndarray) -> str:
    """ENTRY records (sorted by bin, each bin once) -> the stored text."""
    return base64.b64encode(entries.tobytes()).decode("ascii")


def decode(text: str) -> np.ndarray:
    """One histogram text, or several concatenated -> ENTRY records."""
    return np.frombuffer(base64.b64decode(text), ENTRY)


def merge(*texts: str) -> str:
    """The element-wise sum of histograms."""
    entries = decode("".join(texts))
    bins, inverse = np.unique(entries["bin"], return_inverse=True)
    merged = np.empty(len(bins), ENTRY)
    merged["bin"], merged["count"] = bins, np.bincount(inverse, weights=entries["count"])
    return encode(merged)


def histogram_texts(groups: np.ndarray, bins: np.ndarray, num_groups: int) -> list[str]:
    """One value per (group, bin) pair given -> each group's histogram text."""
    codes, counts = np.unique(groups * NUM_BINS + bins, return_counts=True)
    entries = np.empty(len(codes), ENTRY)
    entries["bin"], entries["count"] = codes % NUM_BINS, counts
    packed = entries.tobytes()
    bounds = np.searchsorted(codes // NUM_BINS, np.arange(num_groups + 1)) * ENTRY.itemsize
    return [base64.b64encode(packed[bounds[g]:bounds[g + 1]]).decode("ascii") for g in range(num_groups)]


def percentiles(groups: np.ndarray, bins: np.ndarray, counts: np.ndarray, num_groups: int,
                qs: Sequence[float]) -> np.ndarray:
    """Histogram entries (group, bin, count; any order, repeats summed) -> [num_groups, len(qs)] percentiles,
    NaN for a group without values. Ranks as numpy's linear interpolation counts them; a rank's value is
    placed evenly within its bin among the bin's ranks."""
    codes, counts = _summed_entries(groups.astype(np.int64) * NUM_BINS + bins, counts, num_groups)
    entry_bins, ends = codes % NUM_BINS, np.cumsum(counts)  # entries sorted by group, then bin
    totals = np.bincount(codes // NUM_BINS, weights=counts, minlength=num_groups).astype(np.int64)
    offsets = np.cumsum(totals) - totals  # each group's first rank in the global order
    out = np.full((num_groups, len(qs)), np.nan)
    present = totals > 0
    for i, q in enumerate(qs):
        pos = (totals[present] - 1) * q / 100
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, totals[present] - 1)
        v_lo, v_hi = (_rank_value(offsets[present] + r, entry_bins, counts, ends) for r in (lo, hi))
        out[present, i] = v_lo + (v_hi - v_lo) * (pos - lo)
    return out


def _summed_entries(codes: np.ndarray, counts: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(group * NUM_BINS + bin, count) entries with repeats -> each code once, ascending, with its summed count.
    Few groups: summed into a dense groups x bins array, linear in the entries (tps --by device over 90 days of
    500 devices: ~45,000 day rows' histograms); many (the report's per-device time buckets): sorted."""
    if num_groups * NUM_BINS <= DENSE_MAX_CELLS:
        dense = np.bincount(codes, weights=counts, minlength=num_groups * NUM_BINS)
        present = np.flatnonzero(dense)
        return present, dense[present].astype(np.int64)
    unique, inverse = np.unique(codes, return_inverse=True)
    return unique, np.bincount(inverse, weights=counts).astype(np.int64)


def _rank_value(ranks: np.ndarray, entry_bins: np.ndarray, counts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    entry = np.searchsorted(ends, ranks, side="right")
    within = ranks - (ends[entry] - counts[entry])
    return bin_values(entry_bins[entry], (within + 0.5) / counts[entry])


# ---- ingest: stale marks only ------------------------------------------------------------------------------
def mark(db: Database, request_rows: list[tuple], now: float) -> int:
    """Mark the hour buckets of request rows (fleet.store.request_row's, replays too: recomputing is idempotent)
    stale; the last statement of a commit (see `_claim`). Insert-or-ignore on the bucket's key: a commit reads
    no rollup row and locks none, and many rows of one hour cost one mark."""
    keys = sorted({(0, int(r[_TS] // HOUR_S) * HOUR_S, r[_DEVICE], r[_MODEL], r[_VERSION], r[_ADAPTER] or NO_ADAPTER)
                   for r in request_rows})
    # the claimed flag and the time as parameters: the statement keeps fleet.postgres' COPY-staged form
    return db.executemany(f"insert into {DIRTY} ({', '.join(DIRTY_COLUMNS)}) values ({_marks(DIRTY_COLUMNS)}) "
                          "on conflict do nothing", [(*k, now) for k in keys])


def _marks(columns: Sequence[str]) -> str:
    return ", ".join("?" * len(columns))


def rolled_up(figures: list[tuple], levels_s: Sequence[int] = LEVELS_S) -> dict[tuple, tuple]:
    """Rows of FIGURES -> rollup key (ROLLUP_KEY) -> (requests, errors, tokens_served, ttft_hist, decode_hist),
    at each level of levels_s."""
    ts, devices, models, versions, adapters, ttft, speed, completion, finish = zip(*figures)
    ts, completion = np.array(ts, np.float64), np.array(completion, np.int64)
    failed = np.array([f == "error" for f in finish], np.int64)
    names, who = np.unique(np.array(["\x1f".join(n) for n in zip(devices, models, versions, adapters)]),
                           return_inverse=True)
    ttft_bins, speed_bins = bins_of(np.array(ttft, np.float64)), bins_of(np.array(speed, np.float64))
    with_ttft, with_speed = has_ttft(completion), has_decode_speed(completion)
    out = {}
    for width_s in levels_s:
        starts, when = np.unique((ts // width_s).astype(np.int64) * width_s, return_inverse=True)
        keys, group = np.unique(who * len(starts) + when, return_inverse=True)
        requests = np.bincount(group, minlength=len(keys))
        errors, tokens = (np.bincount(group, weights=w, minlength=len(keys)) for w in (failed, completion))
        ttft_texts = histogram_texts(group[with_ttft], ttft_bins[with_ttft], len(keys))
        speed_texts = histogram_texts(group[with_speed], speed_bins[with_speed], len(keys))
        for g, key in enumerate(keys.tolist()):
            device_id, model, version, adapter = str(names[key // len(starts)]).split("\x1f")
            out[(width_s, int(starts[key % len(starts)]), device_id, model, version, adapter)] = (
                int(requests[g]), int(errors[g]), int(tokens[g]), ttft_texts[g], speed_texts[g])
    return out


def prune(db: Database, before_ts: float) -> int:
    """Delete the rollups of the periods that ended by `before_ts` (the requests table's retention): the raw
    rows of those periods are all older than it."""
    return db.execute(f"delete from {TABLE} where " + " or ".join(["(width_s = ? and start_ts < ?)"] * len(LEVELS_S)),
                      [v for width_s in LEVELS_S for v in (width_s, math.floor(before_ts / width_s) * width_s)]
                      ).rowcount


# ---- the background refresh ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backlog:
    """The refresh's backlog: closed hour buckets still marked stale, and how long the oldest has waited."""

    buckets: int
    lag_s: float  # now - when the oldest of them became refreshable (marked, or its hour ended if later); 0: none


def refresh_step(db: Database, now: float, max_buckets: int = REFRESH_BATCH_BUCKETS) -> int:
    """Re-roll up to max_buckets stale hour buckets whose hour has ended, and their days, from the raw rows;
    returns how many (0: nothing left for now). The open hour is left marked: queries read it raw anyway
    (`plan`'s last span), and re-reading a growing hour every pass would cost O(rows in it) each time."""
    if not _claimed(db, 1):
        _claim(db, now - HOUR_S, max_buckets)
    return _recompute(db, max_buckets)


def _claimed(db: Database, limit: int) -> list[tuple]:
    return db.execute(f"select {', '.join(BUCKET)} from {DIRTY} where claimed = 1 order by {', '.join(BUCKET)} "
                      "limit ?", [limit]).fetchall()


def _claim(db: Database, ended_before_ts: float, limit: int) -> int:
    """Move up to `limit` marks of hours started before ended_before_ts from ingest's (claimed 0) to the refresh's
    (1). A claimed bucket's raw rows are all committed: on SQLite the IMMEDIATE transaction is the only writer;
    on PostgreSQL the EXCLUSIVE table lock waits for every commit that has marked (marking is a commit's last
    statement, so those only have their COMMIT left) and holds off new marks until this one commits, after
    which a row for a claimed bucket marks it anew. Returns the buckets claimed; 0 if the lock was not had."""
    ready = f"from {DIRTY} where claimed = 0 and start_ts < ?"
    if not db.execute(f"select 1 {ready} limit 1", [ended_before_ts]).fetchone():
        return 0  # the usual pass within an hour: no lock taken, no commit held up
    try:
        with db.transaction(immediate=True):
            if db.dialect.name == "postgresql":
                db.execute(f"set local lock_timeout = {CLAIM_LOCK_TIMEOUT_MS}")
                db.execute(f"lock table {DIRTY} in exclusive mode")
            buckets = db.execute(f"select {', '.join(BUCKET)}, marked_at {ready} order by {', '.join(BUCKET)} "
                                 "limit ?", [ended_before_ts, limit]).fetchall()
            db.executemany(f"insert into {DIRTY} ({', '.join(DIRTY_COLUMNS)}) values (1, {_marks(DIRTY_COLUMNS[1:])}) "
                           "on conflict do nothing", buckets)
            db.executemany(f"delete from {DIRTY} where claimed = 0 and {_where(BUCKET)}",
                           [b[:len(BUCKET)] for b in buckets])
    except unavailable_errors():
        if db.dialect.name != "postgresql":
            raise
        return 0  # the lock timed out behind ingest (or the connection broke): next pass
    return len(buckets)


def _recompute(db: Database, limit: int) -> int:
    """One transaction: up to `limit` claimed buckets' hour rollups recomputed from their raw rows, then the
    days they fall in from their hours, then the claims cleared. Recomputed, not incremented: doing it twice
    (a replica dying before its commit, a replay) gives the same rows. On PostgreSQL one replica at a time
    (a transaction advisory lock; another finds it taken and skips the pass): two passes writing one day row
    from the hours each saw could leave the older view."""
    with db.transaction(immediate=True):
        if db.dialect.name == "postgresql" and not db.execute("select pg_try_advisory_xact_lock(?)",
                                                              [REFRESH_LOCK_KEY]).fetchone()[0]:
            return 0
        buckets = _write_hours(db, _claimed(db, limit))
        if not buckets:
            return 0
        _write_days(db, sorted({(start // DAY_S * DAY_S, *rest) for start, *rest in buckets}))
        db.executemany(f"delete from {DIRTY} where claimed = 1 and {_where(BUCKET)}", buckets)
    return len(buckets)


def _where(columns: Sequence[str]) -> str:
    return " and ".join(f"{c} = ?" for c in columns)


def _write_hours(db: Database, buckets: list[tuple]) -> list[tuple]:
    """The hour rollups of the first of `buckets` (up to REFRESH_BATCH_ROWS raw rows) from their raw rows;
    returns the buckets written."""
    figures, done, wanted = [], [], {}
    for start_ts, device_id, *group in buckets:  # sorted: a device-hour's buckets are neighbours
        wanted.setdefault((start_ts, device_id), set()).add(tuple(group))  # (model, version, adapter)
    for (start_ts, device_id), versions in wanted.items():
        if done and len(figures) >= REFRESH_BATCH_ROWS:
            break
        # by device and hour only, model and version kept here: with them in the condition, refreshing an hour of
        # 200 devices x 2,000 rows took 32 s on PostgreSQL (a plan on another index), 1.4 s this way
        rows = db.execute(f"select {', '.join(FIGURES)} from requests where device_id = ? and ts >= ? and ts < ?"
                          f"{partitions.from_ts(db.dialect, start_ts)}", [device_id, start_ts, start_ts + HOUR_S]
                          ).fetchall()
        figures += [r for r in rows if tuple(r[2:5]) in versions]
        done += [(start_ts, device_id, *group) for group in sorted(versions)]
    rows = sorted(rolled_up(figures, (HOUR_S,)).items()) if figures else []
    _replace(db, [(HOUR_S, *b) for b in done], [(*key, *value) for key, value in rows])
    return done


def _write_days(db: Database, days: list[tuple]) -> None:
    """Each day from its hour rows (the sums and merged histograms a roll-up of its raw rows gives)."""
    rows = []
    for day_ts, *group in days:  # group: (device_id, model, version, adapter)
        hours = db.execute(f"select requests, errors, tokens_served, ttft_hist, decode_hist from {TABLE} where "
                           f"width_s = ? and start_ts >= ? and start_ts < ? and {_where(BUCKET[1:])}",
                           [HOUR_S, day_ts, day_ts + DAY_S, *group]).fetchall()
        if hours:
            requests, errors, tokens, ttft, decode_ = zip(*hours)
            rows.append((DAY_S, day_ts, *group, sum(requests), sum(errors), sum(tokens), merge(*ttft), merge(*decode_)))
    _replace(db, [(DAY_S, *d) for d in days], rows)


def _replace(db: Database, keys: list[tuple], rows: list[tuple]) -> None:
    """The rollup rows of `keys` become `rows` (a key without a row: its rows are gone, so is its rollup)."""
    db.executemany(f"delete from {TABLE} where {_where(ROLLUP_KEY)}", keys)
    db.executemany(f"insert into {TABLE} ({', '.join(COLUMNS)}) values ({_marks(COLUMNS)})", rows)


def backlog(db: Database, now: float) -> Backlog:
    """The closed hour buckets still stale (claimed or not) and the lag of the oldest."""
    count, ready_ts = db.execute(
        f"select count(*), min({db.dialect.greatest('marked_at', f'start_ts + {HOUR_S}')}) from {DIRTY} "
        "where start_ts < ?", [now - HOUR_S]).fetchone()
    return Backlog(count, 0.0 if ready_ts is None else max(0.0, now - ready_ts))


def stale_hours(db: Database, since_ts: float) -> frozenset[int]:
    """The starts of the hours from since_ts on with a bucket still marked (of any device, model, version, adapter)."""
    return frozenset(r[0] for r in db.execute(f"select distinct start_ts from {DIRTY} where start_ts >= ?",
                                              [math.floor(since_ts / HOUR_S) * HOUR_S]))


# ---- the migration ----------------------------------------------------------------------------------------
def backfill(db: Database) -> int:
    """Roll up the request rows already stored into the empty rollup table, a day at a time (bounded memory);
    returns the rows read."""
    first, last = db.execute("select min(ts), max(ts) from requests").fetchone()
    if first is None:
        return 0
    read = 0
    for day in range(math.floor(first / DAY_S) * DAY_S, math.floor(last / DAY_S) * DAY_S + 1, DAY_S):
        # no partition bound: tables not partitioned yet are backfilled too (bench/fleet_queries.py, before 0015)
        rows = db.execute(f"select {', '.join(FIGURES)} from requests where ts >= ? and ts < ?",
                          [day, day + DAY_S]).fetchall()
        if rows:
            db.executemany(f"insert into {TABLE} ({', '.join(COLUMNS)}) values ({_marks(COLUMNS)})",
                           [(*key, *value) for key, value in sorted(rolled_up(rows).items())])
        read += len(rows)
    return read


# ---- queries ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    """[start_ts, end_ts) of a window, answered from rollups of width_s, or from raw rows (width_s 0)."""

    width_s: int
    start_ts: float
    end_ts: float


def plan(since_ts: float, now: float, coarsest_s: int = DAY_S, stale: frozenset[int] = frozenset()) -> list[Span]:
    """The window [since_ts, now] (and the rows stamped a little ahead of now) as raw edges, whole hours and,
    if coarsest_s allows, whole days; the hours in `stale` (their starts: marked, not yet refreshed) from raw
    rows, and a day holding one of them by its hours (its day row may predate that hour's rows)."""
    h0, h1 = math.ceil(since_ts / HOUR_S) * HOUR_S, math.floor(now / HOUR_S) * HOUR_S
    if h0 >= h1:
        return [Span(0, since_ts, math.inf)]
    spans, t = [Span(0, since_ts, h0)], h0
    while t < h1:
        if (coarsest_s >= DAY_S and t % DAY_S == 0 and t + DAY_S <= h1
                and not any(h in stale for h in range(t, t + DAY_S, HOUR_S))):
            spans.append(Span(DAY_S, t, t + DAY_S))
            t += DAY_S
        else:
            spans.append(Span(0 if t in stale else HOUR_S, t, t + HOUR_S))
            t += HOUR_S
    spans.append(Span(0, h1, math.inf))
    return _joined([s for s in spans if s.start_ts < s.end_ts])


def _joined(spans: list[Span]) -> list[Span]:
    """Neighbouring spans of one width as one (a range read each)."""
    out = spans[:1]
    for s in spans[1:]:
        if s.width_s == out[-1].width_s and s.start_ts == out[-1].end_ts:
            out[-1] = Span(s.width_s, out[-1].start_ts, s.end_ts)
        else:
            out.append(s)
    return out


# (ts or period start, device_id, model, version, adapter) -> group; adapter: NO_ADAPTER for the base alone
GroupKey = Callable[[float, str, str, str, str], Hashable]
GROUP_COLUMNS = ("start_ts", "device_id", "model", "version", "adapter")  # a rollup row's, in GroupKey's order


class Accumulator:
    """Groups' counts and histogram entries, gathered a span's rows at a time (rollup rows or raw rows) as
    arrays, merged at the end: per row only its group is looked up in Python."""

    def __init__(self):
        self.index: dict[Hashable, int] = {}
        self.count_parts: list[tuple[np.ndarray, ...]] = []  # (groups, requests, errors, tokens_served)
        self.texts: tuple[list[str], list[str]] = ([], [])  # ttft, decode: histogram texts
        self.text_groups: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])  # the group of each text's entries
        self.raw: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])  # ttft, decode: raw values
        self.raw_groups: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])

    def groups(self, keys: Iterable[Hashable]) -> np.ndarray:
        index = self.index
        return np.array([index.setdefault(k, len(index)) for k in keys], np.int64)

    def add_rollups(self, key: GroupKey, rows: list[tuple]) -> None:
        """rows: (start_ts, device_id, model, version, adapter, requests, errors, tokens_served, ttft_hist,
        decode_hist)."""
        if not rows:
            return
        starts, devices, models, versions, adapters, requests, errors, tokens, *texts = zip(*rows)
        groups = self.groups(map(key, starts, devices, models, versions, adapters))
        self.count_parts.append((groups, np.array(requests), np.array(errors), np.array(tokens)))
        for i, column in enumerate(texts):
            self.texts[i].extend(column)
            self.text_groups[i].append(np.repeat(groups, [len(t) // ENTRY_CHARS for t in column]))

    def add_raw(self, key: GroupKey, rows: list[tuple]) -> None:
        """rows: (ts, device_id, model, version, adapter, ttft_ms, decode_tokens_per_s, completion_tokens, failed)."""
        if not rows:
            return
        ts, devices, models, versions, adapters, ttft, speed, completion, failed = zip(*rows)
        groups = self.groups(map(key, ts, devices, models, versions, adapters))
        completion = np.array(completion, np.int64)
        self.count_parts.append((groups, np.ones(len(rows), np.int64), np.array(failed, np.int64), completion))
        for i, (values, counted) in enumerate(((ttft, has_ttft(completion)), (speed, has_decode_speed(completion)))):
            self.raw[i].append(np.array(values, np.float64)[counted])
            self.raw_groups[i].append(groups[counted])

    def summaries(self) -> dict[Hashable, dict]:
        """group -> requests, errors, tokens_served, ttft_p50_ms, ttft_p95_ms, decode_tps_p50, decode_tps_p95."""
        n = len(self.index)
        groups = np.concatenate([p[0] for p in self.count_parts] or [np.zeros(0, np.int64)])
        requests, errors, tokens = (np.bincount(groups, np.concatenate([p[c] for p in self.count_parts]),
                                                minlength=n).astype(np.int64).tolist() if n else [] for c in (1, 2, 3))
        ttft, speed = (self._percentiles(i) for i in (0, 1))
        return {key: {"requests": requests[g], "errors": errors[g], "tokens_served": tokens[g],
                      "ttft_p50_ms": _number(ttft[g, 0]), "ttft_p95_ms": _number(ttft[g, 1]),
                      "decode_tps_p50": _number(speed[g, 0]), "decode_tps_p95": _number(speed[g, 1])}
                for key, g in self.index.items()}

    def _percentiles(self, i: int) -> np.ndarray:
        entries = decode("".join(self.texts[i]))
        empty_i, empty_f = np.zeros(0, np.int64), np.zeros(0, np.float64)
        raw = np.concatenate(self.raw[i] or [empty_f])
        groups = np.concatenate([*self.text_groups[i], *self.raw_groups[i], empty_i])
        bins = np.concatenate([entries["bin"].astype(np.int64), bins_of(raw)])
        counts = np.concatenate([entries["count"].astype(np.int64), np.ones(len(raw), np.int64)])
        return percentiles(groups, bins, counts, len(self.index), (50, 95))


def _number(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def summaries(db: Database, since_ts: float, now: float, key: GroupKey, coarsest_s: int = DAY_S,
              where: str = "", params: tuple = (), reads: Sequence[str] = GROUP_COLUMNS) -> dict[Hashable, dict]:
    """Per group (key of each row's time, device, model, version, adapter): Accumulator.summaries over the requests
    stamped from since_ts on, as the raw rows stand now: hours still marked stale are read raw. where: a
    condition on model / version ('and ...'), for both tables. reads: the GROUP_COLUMNS key reads; it is given
    None for the others, whose rollup rows are summed in SQL (by version over 500 devices: a row per period and
    version, not per device and adapter)."""
    acc = Accumulator()
    for span in plan(since_ts, now, coarsest_s, stale_hours(db, since_ts)):
        if span.width_s:
            _read_rollups(db, span, key, acc, where, params, reads)
        else:
            _read_raw(db, span, key, acc, where, params)
    return acc.summaries()


def _read_rollups(db: Database, span: Span, key: GroupKey, acc: Accumulator, where: str, params: tuple,
                  reads: Sequence[str]) -> None:
    columns = ", ".join(c if c in reads else "null" for c in GROUP_COLUMNS)
    if set(reads) >= set(GROUP_COLUMNS):
        figures, grouped = "requests, errors, tokens_served, ttft_hist, decode_hist", ""
    else:  # histogram texts concatenate into one (ENTRY_CHARS a whole entry), repeated bins summed by percentiles
        concat = "string_agg({}, '')" if db.dialect.name == "postgresql" else "group_concat({}, '')"
        figures = ", ".join([*(f"cast(sum({c}) as bigint)" for c in ("requests", "errors", "tokens_served")),
                             *(f"coalesce({concat.format(c)}, '')" for c in ("ttft_hist", "decode_hist"))])
        grouped = f" group by {', '.join(reads)}" if reads else ""
    sql = (f"select {columns}, {figures} from {TABLE} where width_s = ? and start_ts >= ? and start_ts < ? "
           f"{where}{grouped}")
    acc.add_rollups(key, db.execute(sql, (span.width_s, int(span.start_ts), int(span.end_ts), *params)).fetchall())


def _read_raw(db: Database, span: Span, key: GroupKey, acc: Accumulator, where: str, params: tuple) -> None:
    sql = (f"select ts, device_id, model, version, {ADAPTER_SQL}, ttft_ms, decode_tokens_per_s, completion_tokens, "
           f"finish_reason = 'error' from requests where ts >= ? and ts < ?"
           f"{partitions.from_ts(db.dialect, span.start_ts)} {where}")
    acc.add_raw(key, db.execute(sql, (span.start_ts, span.end_ts, *params)).fetchall())
