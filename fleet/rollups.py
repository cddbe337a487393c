"""Request rollups: per (hour or day, device, model, version) the request, error and token counts and log-spaced
histograms of TTFT and decode speed, so that a 90-day question reads thousands of rollup rows, not millions of
requests (the continuous aggregates of time-series stores).

FleetStore.commit inserts request rows through `insert_requests` (which tells the rows new to the database from
replays) and adds the new ones to their rollups with `add`, in the same transaction, so a rollup always sums
exactly the raw rows stored. Migration 0012 builds the rollups of rows stored before it (`backfill`). Rollups
follow the requests table's retention: a commit deletes those whose whole period is older than it (`prune`).

Queries over a window take whole days and whole hours from the rollups and only the partial hours at the
window's edges from raw rows (`plan`, `summaries`). Percentiles come from the merged histograms: bins are
HISTOGRAM_GROWTH (1%) wide, and the value of a rank is placed inside its bin, so every percentile in
[HISTOGRAM_MIN, HISTOGRAM_MAX] is within 1% (relative) of numpy's linear-interpolated one over the raw rows
(the two ranks it interpolates between are each within their bin); values below HISTOGRAM_MIN count as 0.

    new_rows = insert_requests(db, insert_sql, rows); add(db, new_rows)
    by_version = summaries(db, since_ts, now, lambda t, device, model, version: f"{model}@{version}")
"""
from __future__ import annotations

import base64
import functools
import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

from agent.wire import has_decode_speed, has_ttft
from fleet.db import Database
from fleet.migrations import KEY, REQUEST_FIGURES_COLUMNS, REQUEST_ROLLUP_COLUMNS, REQUEST_ROLLUP_KEY

HOUR_S, DAY_S = 3600, 86400
LEVELS_S = (HOUR_S, DAY_S)  # the rollup periods kept; a day is 24 whole hours, so both levels tile any window
# Histogram scale, shared by TTFT (ms) and decode speed (tokens/s): bin 0 holds values below HISTOGRAM_MIN,
# bin b >= 1 holds [MIN * GROWTH^(b-1), MIN * GROWTH^b); values past HISTOGRAM_MAX land in the last bin.
HISTOGRAM_MIN, HISTOGRAM_MAX, HISTOGRAM_GROWTH = 0.01, 1e7, 1.01
NUM_BINS = 1 + math.ceil(math.log(HISTOGRAM_MAX / HISTOGRAM_MIN) / math.log(HISTOGRAM_GROWTH))  # 2084
# One histogram entry, stored base64 in a text column: 6 bytes -> exactly 8 characters (no padding), so the
# texts of many rows concatenate into one decodable string.
ENTRY = np.dtype([("bin", "<u2"), ("count", "<u4")])
ENTRY_CHARS = 8
TABLE, ROLLUP_KEY, COLUMNS = "request_rollups", REQUEST_ROLLUP_KEY, REQUEST_ROLLUP_COLUMNS  # migration 0012
# A request row as the store writes it (fleet.store.request_row), and the fields a rollup takes from it
REQUEST_COLUMNS = (*KEY, "model", "version", *REQUEST_FIGURES_COLUMNS)
FIGURES = ("ts", "device_id", "model", "version", "ttft_ms", "decode_tokens_per_s", "completion_tokens",
           "finish_reason")
_figures_of = itemgetter(*(REQUEST_COLUMNS.index(c) for c in FIGURES))
_key_of = itemgetter(*(REQUEST_COLUMNS.index(c) for c in ("device_id", "boot_id", "seq")))
MAX_KEYS_PER_SELECT = 1000


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
    codes, inverse = np.unique(groups.astype(np.int64) * NUM_BINS + bins, return_inverse=True)
    counts = np.bincount(inverse, weights=counts).astype(np.int64)
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


def _rank_value(ranks: np.ndarray, entry_bins: np.ndarray, counts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    entry = np.searchsorted(ends, ranks, side="right")
    within = ranks - (ends[entry] - counts[entry])
    return bin_values(entry_bins[entry], (within + 0.5) / counts[entry])


# ---- ingest: new rows only, added to their rollups ----------------------------------------------------------
def insert_requests(db: Database, insert_sql: str, rows: list[tuple]) -> list[tuple]:
    """Insert request rows (fleet.store.request_row's, in key order) with ON CONFLICT DO NOTHING; returns those
    new to the database, so that a replay is never counted twice. SQLite: one statement per row and its
    rowcount (the IMMEDIATE transaction is the only writer; rows added earlier in the batch count as there).
    PostgreSQL: one insert of the rows as arrays, RETURNING the keys inserted (not a concurrent replica's)."""
    if db.dialect.name == "sqlite":
        return [row for row in rows if db.execute(insert_sql, row).rowcount]
    inserted = set(db.execute(_unnest_sql(), [list(column) for column in zip(*rows)]))
    new = []
    for row in rows:  # the first of repeated keys within the batch is the one stored
        if (key := _key_of(row)) in inserted:
            inserted.discard(key)
            new.append(row)
    return new


@functools.cache
def _unnest_sql() -> str:
    """PostgreSQL: the request rows as one array a column, one statement whatever their number."""
    array_types = {str: "text[]", int: "bigint[]", float: "double precision[]"}
    columns = {**KEY, "model": str, "version": str, **REQUEST_FIGURES_COLUMNS}
    return (f"insert into requests ({', '.join(columns)}) select * from unnest("
            + ", ".join(f"?::{array_types[t]}" for t in columns.values())
            + ") on conflict do nothing returning device_id, boot_id, seq")


def rolled_up(figures: list[tuple]) -> dict[tuple, tuple]:
    """Rows of FIGURES -> rollup key (ROLLUP_KEY) -> (requests, errors, tokens_served, ttft_hist, decode_hist),
    at every level."""
    ts, devices, models, versions, ttft, speed, completion, finish = zip(*figures)
    ts, completion = np.array(ts, np.float64), np.array(completion, np.int64)
    failed = np.array([f == "error" for f in finish], np.int64)
    names, who = np.unique(np.array([f"{d}\x1f{m}\x1f{v}" for d, m, v in zip(devices, models, versions)]),
                           return_inverse=True)
    ttft_bins, speed_bins = bins_of(np.array(ttft, np.float64)), bins_of(np.array(speed, np.float64))
    with_ttft, with_speed = has_ttft(completion), has_decode_speed(completion)
    out = {}
    for width_s in LEVELS_S:
        starts, when = np.unique((ts // width_s).astype(np.int64) * width_s, return_inverse=True)
        keys, group = np.unique(who * len(starts) + when, return_inverse=True)
        requests = np.bincount(group, minlength=len(keys))
        errors, tokens = (np.bincount(group, weights=w, minlength=len(keys)) for w in (failed, completion))
        ttft_texts = histogram_texts(group[with_ttft], ttft_bins[with_ttft], len(keys))
        speed_texts = histogram_texts(group[with_speed], speed_bins[with_speed], len(keys))
        for g, key in enumerate(keys.tolist()):
            device_id, model, version = str(names[key // len(starts)]).split("\x1f")
            out[(width_s, int(starts[key % len(starts)]), device_id, model, version)] = (
                int(requests[g]), int(errors[g]), int(tokens[g]), ttft_texts[g], speed_texts[g])
    return out


def add(db: Database, request_rows: list[tuple]) -> None:
    """Add request rows (fleet.store.request_row's, new to the database) to their rollups. The rollup rows are
    created, then locked and updated in key order: two PostgreSQL replicas adding to the same row queue on
    its lock (never both reading it before either writes), and take their locks in one order."""
    by_key = rolled_up([_figures_of(r) for r in request_rows])
    keys = sorted(by_key)
    db.executemany(f"insert into {TABLE} ({', '.join(COLUMNS)}) values (?, ?, ?, ?, ?, 0, 0, 0, '', '') "
                   "on conflict do nothing", keys)
    updates = []
    for current in _locked_rows(db, keys):
        requests, errors, tokens_served, ttft_hist, decode_hist = by_key[tuple(current[:5])]
        updates.append((current[5] + requests, current[6] + errors, current[7] + tokens_served,
                        merge(current[8], ttft_hist), merge(current[9], decode_hist), *current[:5]))
    assert len(updates) == len(keys), "a rollup row created above is missing"
    db.executemany(f"update {TABLE} set requests = ?, errors = ?, tokens_served = ?, ttft_hist = ?, decode_hist = ? "
                   f"where {' and '.join(f'{c} = ?' for c in ROLLUP_KEY)}", updates)


def _locked_rows(db: Database, keys: list[tuple]) -> Iterable[tuple]:
    # 'for update of r': the rows of the table, not of the VALUES list (PostgreSQL); SQLite's transaction holds
    # the write lock already. A join on a VALUES list, not `in (values ...)`, which SQLite answers by a scan.
    lock = f"{db.dialect.lock_row} of r" if db.dialect.lock_row else ""
    columns = ", ".join(ROLLUP_KEY)
    for at in range(0, len(keys), MAX_KEYS_PER_SELECT):
        chunk = keys[at:at + MAX_KEYS_PER_SELECT]
        yield from db.execute(
            f"with k ({columns}) as (values {', '.join(['(?, ?, ?, ?, ?)'] * len(chunk))}) "
            f"select {', '.join(f'r.{c}' for c in ROLLUP_KEY)}, r.requests, r.errors, r.tokens_served, "
            f"r.ttft_hist, r.decode_hist from k join {TABLE} r on "
            + " and ".join(f"r.{c} = k.{c}" for c in ROLLUP_KEY)
            + f" order by {', '.join(f'r.{c}' for c in ROLLUP_KEY)}{lock}", [v for key in chunk for v in key]).fetchall()


def prune(db: Database, before_ts: float) -> int:
    """Delete the rollups of the periods that ended by `before_ts` (the requests table's retention): the raw
    rows of those periods are all older than it."""
    return db.execute(f"delete from {TABLE} where " + " or ".join(["(width_s = ? and start_ts < ?)"] * len(LEVELS_S)),
                      [v for width_s in LEVELS_S for v in (width_s, math.floor(before_ts / width_s) * width_s)]
                      ).rowcount


# ---- the migration ----------------------------------------------------------------------------------------
def backfill(db: Database) -> int:
    """Roll up the request rows already stored into the empty rollup table, a day at a time (bounded memory);
    returns the rows read."""
    first, last = db.execute("select min(ts), max(ts) from requests").fetchone()
    if first is None:
        return 0
    read = 0
    for day in range(math.floor(first / DAY_S) * DAY_S, math.floor(last / DAY_S) * DAY_S + 1, DAY_S):
        rows = db.execute(f"select {', '.join(FIGURES)} from requests where ts >= ? and ts < ?",
                          [day, day + DAY_S]).fetchall()
        if rows:
            db.executemany(f"insert into {TABLE} ({', '.join(COLUMNS)}) values ({', '.join('?' * len(COLUMNS))})",
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


def plan(since_ts: float, now: float, coarsest_s: int = DAY_S) -> list[Span]:
    """The window [since_ts, now] (and the rows stamped a little ahead of now) as raw edges, whole hours and,
    if coarsest_s allows, whole days."""
    h0, h1 = math.ceil(since_ts / HOUR_S) * HOUR_S, math.floor(now / HOUR_S) * HOUR_S
    if h0 >= h1:
        return [Span(0, since_ts, math.inf)]
    spans = [Span(0, since_ts, h0), Span(0, h1, math.inf)]
    d0, d1 = math.ceil(h0 / DAY_S) * DAY_S, math.floor(h1 / DAY_S) * DAY_S
    if coarsest_s >= DAY_S and d0 < d1:
        spans += [Span(HOUR_S, h0, d0), Span(DAY_S, d0, d1), Span(HOUR_S, d1, h1)]
    else:
        spans.append(Span(HOUR_S, h0, h1))
    return [s for s in spans if s.start_ts < s.end_ts]


GroupKey = Callable[[float, str, str, str], Hashable]  # (ts or period start, device_id, model, version) -> group


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
        """rows: (start_ts, device_id, model, version, requests, errors, tokens_served, ttft_hist, decode_hist)."""
        if not rows:
            return
        starts, devices, models, versions, requests, errors, tokens, *texts = zip(*rows)
        groups = self.groups(map(key, starts, devices, models, versions))
        self.count_parts.append((groups, np.array(requests), np.array(errors), np.array(tokens)))
        for i, column in enumerate(texts):
            self.texts[i].extend(column)
            self.text_groups[i].append(np.repeat(groups, [len(t) // ENTRY_CHARS for t in column]))

    def add_raw(self, key: GroupKey, rows: list[tuple]) -> None:
        """rows: (ts, device_id, model, version, ttft_ms, decode_tokens_per_s, completion_tokens, failed)."""
        if not rows:
            return
        ts, devices, models, versions, ttft, speed, completion, failed = zip(*rows)
        groups, completion = self.groups(map(key, ts, devices, models, versions)), np.array(completion, np.int64)
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
              where: str = "", params: tuple = ()) -> dict[Hashable, dict]:
    """Per group (key of each row's time, device, model, version): Accumulator.summaries over the requests
    stamped from since_ts on. where: a condition on model / version ('and ...'), for both tables."""
    acc = Accumulator()
    for span in plan(since_ts, now, coarsest_s):
        if span.width_s:
            _read_rollups(db, span, key, acc, where, params)
        else:
            _read_raw(db, span, key, acc, where, params)
    return acc.summaries()


def _read_rollups(db: Database, span: Span, key: GroupKey, acc: Accumulator, where: str, params: tuple) -> None:
    sql = (f"select start_ts, device_id, model, version, requests, errors, tokens_served, ttft_hist, decode_hist "
           f"from {TABLE} where width_s = ? and start_ts >= ? and start_ts < ? {where}")
    acc.add_rollups(key, db.execute(sql, (span.width_s, int(span.start_ts), int(span.end_ts), *params)).fetchall())


def _read_raw(db: Database, span: Span, key: GroupKey, acc: Accumulator, where: str, params: tuple) -> None:
    sql = ("select ts, device_id, model, version, ttft_ms, decode_tokens_per_s, completion_tokens, "
           f"finish_reason = 'error' from requests where ts >= ? and ts < ? {where}")
    acc.add_raw(key, db.execute(sql, (span.start_ts, span.end_ts, *params)).fetchall())
