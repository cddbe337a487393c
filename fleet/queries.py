"""Read-only questions about the fleet database; every function returns a list of plain row dicts.

The database is opened read-only (SQLite `mode=ro`, a PostgreSQL session with read-only transactions), so a
query can never change what the consumer wrote.
Percentiles over a window of at most ROLLUP_AFTER_S are computed here, over the raw per-request figures, with
linear interpolation between ranks; over a longer one they come from fleet.rollups' hourly and daily
histograms (raw rows only for the partial hours at its edges), within 1% of the raw rows' figures. Counts and
tokens are exact either way. TTFT percentiles leave out requests that produced no token, decode speed ones
those with fewer than 2 (agent.figures.ttft_samples / decode_speed_samples). Times are the devices' clocks.

    db = open_readonly("fleet.db"); rows = tps(db, since_s=24 * 3600, by="model")
"""
from __future__ import annotations

import functools
import json
import math
import re
import statistics
import time
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from agent.figures import has_decode_speed, has_ttft, percentile
from agent.wire import Manifest
from fleet import partitions, rollups
from fleet.db import Database, database_errors, is_url, open_database

GROUPINGS = ("device", "model", "version", "hour", "adapter")
_GROUP_SQL = {  # the SQL expression each --by groups on
    "device": lambda dialect: "device_id",
    # MODEL:NAME@VERSION, or MODEL for the base alone (|| with NULL is NULL in SQLite and PostgreSQL alike)
    "adapter": lambda dialect: "model || coalesce(':' || adapter, '')",
    "model": lambda dialect: "model",
    "version": lambda dialect: "model || '@' || version",
    "hour": lambda dialect: dialect.hour("ts"),
}
# (ts or a rollup's start, device_id, model, version, adapter) -> the group, as _GROUP_SQL's expressions name it
_GROUP_KEY: dict[str, rollups.GroupKey] = {
    "device": lambda t, device_id, model, version, adapter: device_id,
    "adapter": lambda t, device_id, model, version, adapter: f"{model}:{adapter}" if adapter else model,
    "model": lambda t, device_id, model, version, adapter: model,
    "version": lambda t, device_id, model, version, adapter: f"{model}@{version}",
    "hour": lambda t, device_id, model, version, adapter: _hour(int(t // 3600) * 3600),
}
# the rollup columns each _GROUP_KEY reads (fleet.rollups.summaries sums rollup rows over the others)
_GROUP_READS = {"device": ("device_id",), "adapter": ("model", "adapter"), "model": ("model",),
                "version": ("model", "version"), "hour": ("start_ts",)}
# Windows longer than this are answered from rollups: a day of raw rows is ~0.2 s at 10 M requests in 90
# days, and shorter windows (`devices`' hour, a day's report) keep exact percentiles.
ROLLUP_AFTER_S = 86400
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class QueryError(ValueError):
    """A question the database cannot answer as asked (a user error)."""


def existing_db(path: Path | str) -> Path:
    """path, if a fleet database is there: a mistyped --db must be an error, not a new empty fleet."""
    path = Path(path)
    if path.is_dir():
        raise QueryError(f"--db {path} is a directory: give the database file (e.g. {path / 'fleet.db'})")
    if not path.is_file():
        raise QueryError(f"no fleet database at {path} (start `edge-fleet serve --db {path}` first)")
    return path


def open_readonly(target: Path | str) -> Database:
    """A SQLite file (which must exist) or a postgresql:// URL, opened read-only."""
    db = open_database(target if is_url(target) else existing_db(target), readonly=True)
    try:  # sqlite's "file is not a database" and "no such table: requests" name no file: the error below does
        tables = set(db.table_names())
    except database_errors() as e:
        db.close()
        raise QueryError(f"{db.target} is not a fleet database ({e})") from None
    if "requests" not in tables:
        db.close()
        raise QueryError(f"{db.target} is not a fleet database (no requests table; `edge-fleet serve` creates one)")
    return db


MAX_DURATION_S = 100 * 365 * 86400


def parse_duration_s(text: str) -> float:
    """'90s', '30m', '24h', '7d', '2w' -> seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise QueryError(f"bad duration {text!r}: use a number and one of s, m, h, d, w (e.g. 24h)")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds > MAX_DURATION_S:  # past it, the arithmetic on times overflows
        raise QueryError(f"bad duration {text!r}: at most 100 years")
    return seconds


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


@functools.lru_cache(maxsize=4096)
def _hour(ts: int) -> str:
    """dialect.hour's text for an hour's start."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:00Z")


@dataclass
class Figures:
    """One group's requests, as the few numbers its summary needs: 16 bytes a request here, where a dict per
    row makes a 90-day window of a million requests take 385 MB and 4 s."""

    requests: int = 0
    # finished in error: shed or refused as overloaded (HTTP 429), or failed. They have no TTFT, so without
    # this count a device's TTFT percentiles would look better the more it shed.
    errors: int = 0
    tokens_served: int = 0
    ttfts: array = field(default_factory=lambda: array("d"))
    speeds: array = field(default_factory=lambda: array("d"))

    def add(self, ttft_ms: float, decode_tokens_per_s: float, completion_tokens: int, failed: int) -> None:
        self.requests += 1
        self.errors += failed
        self.tokens_served += completion_tokens
        if has_ttft(completion_tokens):
            self.ttfts.append(ttft_ms)
        if has_decode_speed(completion_tokens):
            self.speeds.append(decode_tokens_per_s)


def summarize(f: Figures) -> dict:
    """Counts, TTFT and decode percentiles, tokens served (completion tokens)."""
    ttft_p50, ttft_p95 = _p50_p95(f.ttfts)
    tps_p50, tps_p95 = _p50_p95(f.speeds)
    return _summary_row({"requests": f.requests, "errors": f.errors, "ttft_p50_ms": ttft_p50, "ttft_p95_ms": ttft_p95,
                         "decode_tps_p50": tps_p50, "decode_tps_p95": tps_p95, "tokens_served": f.tokens_served})


def _summary_row(s: dict) -> dict:
    """A summary (summarize's or fleet.rollups') in the columns' order, percentiles rounded."""
    return {"requests": s["requests"], "errors": s["errors"], "ttft_p50_ms": _round(s["ttft_p50_ms"]),
            "ttft_p95_ms": _round(s["ttft_p95_ms"]), "decode_tps_p50": _round(s["decode_tps_p50"]),
            "decode_tps_p95": _round(s["decode_tps_p95"]), "tokens_served": s["tokens_served"]}


def _summaries_since(db: Database, since_s: float, now: float, by: str, where: str = "",
                     params: tuple = ()) -> dict[str, dict]:
    """Group (as `by` names it) -> summary row, over the last since_s: from raw rows or, past
    ROLLUP_AFTER_S, from rollups (hourly ones only when grouping by hour)."""
    if since_s <= ROLLUP_AFTER_S:
        return {k: summarize(f) for k, f in _requests_since(db, now - since_s, _GROUP_SQL[by](db.dialect), where,
                                                            params).items()}
    coarsest_s = rollups.HOUR_S if by == "hour" else rollups.DAY_S
    return {k: _summary_row(s) for k, s in rollups.summaries(db, now - since_s, now, _GROUP_KEY[by], coarsest_s,
                                                             where, params, _GROUP_READS[by]).items()}


def _p50_p95(values: array) -> tuple[float | None, float | None]:
    """figures.percentile's figures (numpy's linear interpolation), in numpy: sorting 10 M floats in Python takes
    13.7 s of a 90-day `tps`."""
    if not values:
        return None, None
    p50, p95 = np.percentile(np.frombuffer(values, np.float64), [50, 95])
    return float(p50), float(p95)


def _requests_since(db: Database, since_ts: float, key_sql: str = "device_id", where: str = "",
                    params: tuple = ()) -> dict[str, Figures]:
    sql = (f"select {key_sql} as key, ttft_ms, decode_tokens_per_s, completion_tokens, finish_reason = 'error' "
           f"from requests where ts >= ?{partitions.from_ts(db.dialect, since_ts)} {where}")
    groups: dict[str, Figures] = defaultdict(Figures)
    for key, *figures in db.execute(sql, (since_ts, *params)):  # tuples: no dict per row
        groups[key].add(*figures)
    return groups


# ---- the questions ----------------------------------------------------------------------------------------
def devices(db: Database, now: float | None = None) -> list[dict]:
    """Every known device: status, last contact, what it runs, its requests over the last hour and the
    median decode speed of the model it runs now over that hour (not of the one it ran before a switch)."""
    now = time.time() if now is None else now
    last_hour = _requests_since(db, now - 3600)
    by_model = _requests_since(db, now - 3600, key_sql="device_id || '|' || model || '@' || version")
    rows = []
    for d in db.query("select * from devices order by id"):
        speeds = by_model.get(f"{d['id']}|{d['model']}@{d['version']}", Figures()).speeds
        rows.append({
            "id": d["id"], "online": d["status"] == "online", "status": d["status"] or "unknown",
            "last_seen": iso(d["last_seen"]),
            "model": f"{d['model']}@{d['version']}" if d["model"] else None, "precision": d["precision"],
            "decode_tps_p50_1h": _round(percentile(speeds, 50)), "requests_1h": last_hour.get(d["id"], Figures()).requests,
            "broker": d["broker"],  # the broker its newest state came through (several: docs/scaling.md)
        })
    return rows


def tps(db: Database, since_s: float, by: str = "model", now: float | None = None) -> list[dict]:
    """Throughput and latency per device, model, model@version, UTC hour or adapter (MODEL:ADAPTER@VERSION, MODEL
    for the base alone), over the last `since_s`."""
    if by not in GROUPINGS:
        raise QueryError(f"cannot group by {by!r}: choose one of {', '.join(GROUPINGS)}")
    now = time.time() if now is None else now
    return [{by: key, **s} for key, s in sorted(_summaries_since(db, since_s, now, by).items())]


def published_parameters(db: Database) -> dict[str, tuple[int, int]]:
    """model@version -> (total, active) parameters, from the published manifests that record them (a Mixture of
    Experts': a dense bundle's manifest has no counts, nor has a model seeded on a device and never published)."""
    counts = {}
    for r in db.query("select name, version, manifest from models"):
        try:
            p = Manifest.model_validate_json(r["manifest"]).parameters
        except ValidationError:  # a row written by hand or by an older fleet
            continue
        if p is not None:
            counts[f"{r['name']}@{r['version']}"] = (p.total, p.active)
    return counts


def with_parameters(db: Database, rows: list[dict]) -> list[dict]:
    """tps(by="version") rows with each version's total and active parameters after it (blank where no published
    manifest records them): a Mixture of Experts' decode speed follows the active ones, its memory the total."""
    counts = published_parameters(db)
    return [{"version": r["version"], "parameters_total": counts.get(r["version"], (None, None))[0],
             "parameters_active": counts.get(r["version"], (None, None))[1],
             **{k: v for k, v in r.items() if k != "version"}} for r in rows]


def events(db: Database, device_id: str, since_s: float | None = None, limit: int = 100,
           now: float | None = None) -> list[dict]:
    """A device's events, newest first."""
    if not db["devices"].count_where("id = ?", [device_id]):
        raise QueryError(f"unknown device {device_id!r} (see `edge-fleet devices`)")
    since_ts = 0.0 if since_s is None else (time.time() if now is None else now) - since_s
    rows = db.query(f"select ts, boot_id, seq, kind, detail from events where device_id = ? and ts >= ?"
                    f"{partitions.from_ts(db.dialect, since_ts)} order by ts desc, seq desc limit ?",
                    [device_id, since_ts, limit])
    return [{"ts": iso(r["ts"]), "boot_id": r["boot_id"], "seq": r["seq"], "kind": r["kind"],
             "detail": json.loads(r["detail"])} for r in rows]


def _model_filter(db: Database, spec: str) -> tuple[str, tuple]:
    """'name' or 'name@version' -> an SQL condition on requests."""
    name, _, version = spec.partition("@")
    # '+model': not the (model, version, ts) index, which a bare name cannot narrow by time and so read every
    # request of that model ever stored, but the ts index (0.67 s -> 0.04 s a day on 10 M rows)
    return (("and model = ? and version = ?", (name, version)) if version
            else (f"and {db.dialect.no_index('model')} = ?", (name,)))


def compare(db: Database, models: list[str], since_s: float, now: float | None = None) -> list[dict]:
    """Median decode speed and TTFT of two or more models side by side, on each device that ran all of them."""
    if len(models) < 2:
        raise QueryError("compare needs at least two --model (name or name@version)")
    now = time.time() if now is None else now
    per_model = {m: _summaries_since(db, since_s, now, "device", *_model_filter(db, m)) for m in models}
    missing = [m for m, groups in per_model.items() if not groups]
    if missing:
        known = [r["m"] for r in db.query("select distinct model || '@' || version as m from requests where ts >= ? "
                                          "order by m", [now - since_s])]  # the window's, not all history's
        raise QueryError(f"no requests for {', '.join(missing)} in that window; known: {', '.join(known) or 'none'}")
    common = sorted(set.intersection(*(set(groups) for groups in per_model.values())))
    return [_compare_row(device, {m: per_model[m][device] for m in models}) for device in common]


def _compare_row(device_id: str, summaries: dict[str, dict]) -> dict:
    row: dict = {"device": device_id}
    for m, s in summaries.items():
        row |= {f"{m} requests": s["requests"], f"{m} errors": s["errors"], f"{m} decode_tps_p50": s["decode_tps_p50"],
                f"{m} ttft_p50_ms": s["ttft_p50_ms"]}
    models = list(summaries)
    first, last = summaries[models[0]]["decode_tps_p50"], summaries[models[-1]]["decode_tps_p50"]
    row["decode_ratio"] = _round(last / first, 3) if first and last else None  # last model / first model
    return row


def timeseries(db: Database, since_s: float, buckets: int = 60, now: float | None = None) -> list[dict]:
    """Median decode speed and TTFT per (model@version, device, time bucket), for charts; t is the bucket's
    start in seconds since the epoch. Buckets of an hour or more are whole hours, answered from rollups."""
    now = time.time() if now is None else now
    if since_s > ROLLUP_AFTER_S and since_s / buckets > rollups.HOUR_S:
        return _rollup_timeseries(db, since_s, math.ceil(since_s / buckets / rollups.HOUR_S) * rollups.HOUR_S, now)
    bucket_s = max(60, math.ceil(since_s / buckets / 60) * 60)
    groups: dict[tuple, Figures] = defaultdict(Figures)
    for model, device_id, bucket, *figures in db.execute(
            f"select model || '@' || version, device_id, {db.dialect.bucket('ts')}, ttft_ms, decode_tokens_per_s, "
            "completion_tokens, finish_reason = 'error' from requests where ts >= ?"
            + partitions.from_ts(db.dialect, now - since_s), [bucket_s, now - since_s]):
        groups[(model, device_id, bucket * bucket_s)].add(*figures)
    return [{"model": model, "device": device_id, "t": t, **_series_point(f)}
            for (model, device_id, t), f in sorted(groups.items())]


def _rollup_timeseries(db: Database, since_s: float, bucket_s: int, now: float) -> list[dict]:
    def key(t: float, device_id: str, model: str, version: str, adapter: str) -> tuple:
        return f"{model}@{version}", device_id, int(t // bucket_s) * bucket_s

    points = rollups.summaries(db, now - since_s, now, key, coarsest_s=rollups.HOUR_S,
                               reads=("start_ts", "device_id", "model", "version"))
    return [{"model": model, "device": device_id, "t": t, "requests": s["requests"],
             "decode_tps_p50": _round(s["decode_tps_p50"]), "ttft_p50_ms": _round(s["ttft_p50_ms"])}
            for (model, device_id, t), s in sorted(points.items())]


def _series_point(f: Figures) -> dict:
    return {"requests": f.requests, "decode_tps_p50": _round(_median(f.speeds)),
            "ttft_p50_ms": _round(_median(f.ttfts))}


def _median(values: array) -> float | None:
    """The p50 of _p50_p95, cheaper for the report's many small groups: numpy's percentile costs ~100 us a
    call, 5.5 s of CPU for `report --since 7d` on 500 devices."""
    if len(values) > 1000:
        return _p50_p95(values)[0]
    return statistics.median(values) if values else None


def rejected(db: Database) -> list[dict]:
    """Bad messages per device and reason."""
    return [{"device": r["device_id"], "reason": r["reason"], "count": r["count"], "first": iso(r["first_ts"]),
             "last": iso(r["last_ts"])}
            for r in db.query("select * from rejected order by count desc, device_id, reason")]
