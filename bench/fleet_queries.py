"""Fleet query latency over a large telemetry history, from raw rows (before rollups) and from rollups.

Fills a fresh fleet database with N synthetic request rows spread over DAYS days and DEVICES devices (two
models, a new version every 30 days, 3% of requests failed, a quarter of them with one of two LoRA adapters): raw
rows bulk-inserted by SQL (PostgreSQL: COPY), then fleet.rollups.backfill, which is what migration 0017 runs on
an upgraded fleet; on PostgreSQL the rows go in before migration 0015 and the bench times it partitioning them by
day (fleet.partitions), as on an upgraded fleet. Then times `tps --by version --since 7d`, `tps --by device
--since 90d`, `tps --by adapter --since 7d`, `devices`, the report's `timeseries` over 7d and the whole report,
each answered from raw rows (queries.ROLLUP_AFTER_S set past every window, as before rollups) and from
rollups, and the largest percentile difference between the two. Last, the cost of maintaining rollups on
ingest: FleetStore.commit of 100-record batches with and without it.
PostgreSQL runs on a throwaway server (tests/postgres.py), as the tests' does.

Run: .venv/bin/python bench/fleet_queries.py [--sqlite-rows 1000000] [--postgresql-rows 10000000]
     [--devices 500] [--days 90] [--backends sqlite,postgresql] [--write-docs]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "fleet"), str(REPO / "bench")]

from fleet import queries, rollups  # noqa: E402
from fleet.migrations import KEY, REQUEST_FIGURES_COLUMNS  # noqa: E402
from fleet.store import FleetStore, Ingest  # noqa: E402

NOW = 1_760_000_000.0  # 2025-10-09T08:53:20Z: not on an hour, so every window has raw edges
CHUNK_ROWS = 500_000
COLUMNS = (*KEY, "model", "version", *REQUEST_FIGURES_COLUMNS, "adapter")
ADAPTERS = np.array([None, None, None, None, None, None, "support@r8-1", "sql@r4-2"], dtype=object)
PERCENTILES = ("ttft_p50_ms", "ttft_p95_ms", "decode_tps_p50", "decode_tps_p95")


def synthetic_chunk(rng: np.random.Generator, n: int, first_seq: int, devices: int, days: int) -> list[tuple]:
    """n request rows: per device a base decode speed and TTFT, per request lognormal spread around them."""
    device = rng.integers(0, devices, n)
    ts = NOW - rng.uniform(0, days * 86400, n)
    day = (NOW - ts) // 86400
    completion = np.where(rng.random(n) < 0.03, 0, rng.integers(1, 400, n))
    decode = np.where(completion >= 2, np.exp(rng.normal(np.log(20 + device % 17), 0.08)), 0.0)
    ttft = np.exp(rng.normal(np.log(150 + 7 * (device % 23)), 0.5))
    models = np.where(device % 3 == 0, "qwen2.5-0.5b", "smollm2-135m")
    versions = np.char.add("int4-r", (3 - np.minimum(day // 30, 2)).astype(int).astype(str))
    adapters = ADAPTERS[rng.integers(0, len(ADAPTERS), n)].tolist()
    rows = []
    for i, (d, t, c, dec, tt, m, v) in enumerate(zip(device.tolist(), ts.tolist(), completion.tolist(),
                                                     decode.tolist(), ttft.tolist(), models.tolist(), versions.tolist())):
        rows.append((f"dev-{d:04d}", "boot", first_seq + i, t, m, v, 100, c, 0, 2.0, tt, 800.0, dec, 40.0, 60.0,
                     tt + c * 40.0, 1 << 20, "error" if c == 0 else "stop", 0, 0, 0, 0, 0.0, adapters[i]))
    return rows


def fill(store: FleetStore, rows: int, devices: int, days: int) -> tuple[float, float]:
    """Raw rows, then their rollups; (insert s, backfill s)."""
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for at in range(0, rows, CHUNK_ROWS):
        chunk = synthetic_chunk(rng, min(CHUNK_ROWS, rows - at), at, devices, days)
        if store.db.dialect.name == "postgresql":
            with store.db.conn.cursor().copy(f"copy requests ({', '.join(COLUMNS)}) from stdin") as copy:
                for row in chunk:
                    copy.write_row(row)
        else:
            with store.db.transaction():
                store.db.executemany(f"insert into requests ({', '.join(COLUMNS)}) values "
                                     f"({', '.join('?' * len(COLUMNS))})", chunk)
        print(f"  {at + len(chunk):,} rows", file=sys.stderr, flush=True)
    store.db.executemany("insert into devices (id, status, connection, state_ts, first_seen, last_seen, boot_id, "
                         "model, version, precision) values (?, 'online', 1, ?, ?, ?, 'boot', ?, 'int4-r3', 'int4')",
                         [(f"dev-{d:04d}", NOW, NOW - days * 86400, NOW,
                           "qwen2.5-0.5b" if d % 3 == 0 else "smollm2-135m") for d in range(devices)])
    if store.db.dialect.name == "postgresql":
        store.db.execute("analyze requests")  # what autovacuum does after a bulk load
    inserted = time.perf_counter()
    with store.db.transaction():
        rollups.backfill(store.db)
    if store.db.dialect.name == "postgresql":
        store.db.execute(f"analyze {rollups.TABLE}")
    return inserted - start, time.perf_counter() - inserted


QUESTIONS: dict[str, Callable] = {
    "tps --by version --since 7d": lambda db: queries.tps(db, 7 * 86400, "version", now=NOW),
    "tps --by device --since 90d": lambda db: queries.tps(db, 90 * 86400, "device", now=NOW),
    "tps --by adapter --since 7d": lambda db: queries.tps(db, 7 * 86400, "adapter", now=NOW),
    "devices": lambda db: queries.devices(db, now=NOW),
    "report timeseries --since 7d": lambda db: queries.timeseries(db, 7 * 86400, now=NOW),
    "report --since 7d (the HTML)": lambda db: report_page(db, 7 * 86400),
}


def report_page(db, since_s: float) -> list[dict]:
    """What `edge-fleet report` reads and renders (fleet.cli.report), short of writing the file: one row, its size."""
    from fleet.report import render_report

    html = render_report(queries.with_parameters(db, queries.tps(db, since_s, "version", now=NOW)),
                         queries.timeseries(db, since_s, now=NOW), title="bench",
                         adapters=queries.tps(db, since_s, "adapter", now=NOW))
    return [{"t": NOW, "html_chars": len(html)}]


def timed(fn: Callable, db, runs: int) -> tuple[float, list[dict]]:
    best, rows = math.inf, []
    for _ in range(runs):
        start = time.perf_counter()
        rows = fn(db)
        best = min(best, time.perf_counter() - start)
    return best, rows


def worst_difference(raw: list[dict], rolled: list[dict]) -> float | None:
    """The largest relative difference of a percentile between the two answers (rows matched by position
    where both have the same groups; the timeseries' buckets differ in width, so it is not compared)."""
    if len(raw) != len(rolled) or not raw or "t" in raw[0]:
        return None
    worst = 0.0
    for a, b in zip(raw, rolled):
        for column in PERCENTILES:
            if a.get(column) and b.get(column) is not None:
                worst = max(worst, abs(b[column] - a[column]) / a[column])
    return worst


def measure_queries(target, runs: int) -> list[tuple]:
    db = queries.open_readonly(target)
    results = []
    try:
        for name, fn in QUESTIONS.items():
            saved = queries.ROLLUP_AFTER_S
            queries.ROLLUP_AFTER_S = math.inf  # every window from raw rows, as before rollups
            try:
                raw_s, raw_rows = timed(fn, db, 1)
            finally:
                queries.ROLLUP_AFTER_S = saved
            rolled_s, rolled_rows = timed(fn, db, runs)
            results.append((name, raw_s, rolled_s, len(rolled_rows), worst_difference(raw_rows, rolled_rows)))
    finally:
        db.close()
    return results


def ingest_cost(fresh_target: Callable[[], str | Path], batches: int = 200, per_batch: int = 100,
                devices: int = 20) -> tuple[float, float]:
    """ms per 100-record commit on a fresh store: without rollup maintenance (the commit before rollups), with."""
    from simdevice import request_record

    rng = random.Random(0)
    records = [[request_record("boot", b * per_batch + i, NOW - 3600 + b, rng) for i in range(per_batch)]
               for b in range(batches)]
    costs = []
    for maintain in (False, True):
        saved = rollups.mark
        if not maintain:
            rollups.mark = lambda db, rows, now: 0  # the commit without its rollups' share
        store = FleetStore(fresh_target())
        store.prepare_partitions(NOW)  # PostgreSQL: the bench's days have their partitions, as today's would
        try:
            start = time.perf_counter()
            for b, batch in enumerate(records):
                ingest = Ingest()
                ingest.add_records(f"dev-{b % devices:04d}", batch, NOW)
                store.commit(ingest)
            costs.append((time.perf_counter() - start) / batches * 1000)
        finally:
            rollups.mark = saved
            store.close()
    return costs[0], costs[1]


def before_partitions(target) -> FleetStore:
    """A store migrated up to, not including, 0015 (the telemetry tables unpartitioned), as a fleet before it."""
    import fleet.store

    saved = fleet.store.MIGRATIONS
    fleet.store.MIGRATIONS = tuple(m for m in saved if m[0] != "0015_telemetry_partitions")
    try:
        return FleetStore(target)
    finally:
        fleet.store.MIGRATIONS = saved


def partition_layout(db) -> str:
    """Where migration 0015 put the rows: day partitions holding rows, rows in the default partition, rows whose
    sent_ts is not their ts (every bench row's clock is set, so 0); '' when the tables are not partitioned."""
    if not db.dialect.partitioned:
        return ""
    days, in_default, restamped = db.execute(
        "select count(distinct tableoid), count(*) filter (where tableoid = 'requests_default'::regclass), "
        "count(*) filter (where sent_ts is distinct from ts) from requests").fetchone()
    assert in_default == 0 and restamped == 0, f"{in_default} rows in the default partition, {restamped} restamped"
    return f"{days} day partitions"


def run_backend(backend: str, rows: int, args, workdir: Path) -> dict:
    server = None
    if backend == "postgresql":
        from postgres import Postgres

        server = Postgres().start()
        fresh_target: Callable = server.fresh_database
    else:
        names = iter(range(1_000_000))
        fresh_target = lambda: workdir / f"fleet-{next(names)}.db"  # noqa: E731
    try:
        target = fresh_target()
        store = before_partitions(target)
        insert_s, backfill_s = fill(store, rows, args.devices, args.days)
        store.close()
        start = time.perf_counter()
        store = FleetStore(target)  # migration 0015: PostgreSQL's tables partitioned by day
        partition_s = time.perf_counter() - start
        rollup_rows = store.db[rollups.TABLE].count
        layout = partition_layout(store.db)
        store.close()
        return {"backend": backend, "rows": rows, "insert_s": insert_s, "backfill_s": backfill_s,
                "partition_s": partition_s, "rollup_rows": rollup_rows, "layout": layout,
                "queries": measure_queries(target, args.runs),
                "ingest_ms": ingest_cost(fresh_target)}
    finally:
        if server is not None:
            server.stop()


def table(results: list[dict], args) -> str:
    lines = [f"{args.devices} devices, {args.days} days of requests; best of {args.runs} runs from rollups, one "
             "from raw rows; max diff: the largest relative difference of a p50/p95 between the two answers.\n",
             "| backend | rows | question | raw rows (s) | rollups (s) | groups | max diff |",
             "|---|--:|---|--:|--:|--:|--:|"]
    for r in results:
        for name, raw_s, rolled_s, groups, diff in r["queries"]:
            lines.append(f"| {r['backend']} | {r['rows']:,} | `{name}` | {raw_s:.2f} | {rolled_s:.3f} | {groups} | "
                         + ("" if diff is None else f"{diff:.2%}") + " |")
    lines += ["", "| backend | rows | bulk insert (s) | rollup backfill (s) | migration 0015 (s) | layout | rollup rows "
              "| commit of 100 requests, before / with rollups (ms) |", "|---|--:|--:|--:|--:|---|--:|--:|"]
    for r in results:
        before_ms, after_ms = r["ingest_ms"]
        lines.append(f"| {r['backend']} | {r['rows']:,} | {r['insert_s']:.0f} | {r['backfill_s']:.0f} | "
                     f"{r['partition_s']:.1f} | {r['layout']} | {r['rollup_rows']:,} | {before_ms:.1f} / {after_ms:.1f} |")
    return "\n".join(lines)


NOTES = ("`devices` is the last hour, answered from raw rows both times (as every window of a day or less); "
         "the report's 7-day timeseries has 168-minute buckets from raw rows and 3-hour ones from rollups, so "
         "its figures are not compared (tests/fleet/test_rollups.py compares them per bucket); `report --since 7d "
         "(the HTML)` is what `edge-fleet report` does short of writing the file (that timeseries, `tps` by version "
         "and by adapter, the rendering). The commit "
         "column is one 100-request batch from one device into a fresh store, the rollups' added cost of "
         "ingest (the hour buckets marked stale; the refresh runs outside the commit). A 2-core box "
         "shared with other work: timings vary by up to 2x between runs.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqlite-rows", type=int, default=1_000_000)
    parser.add_argument("--postgresql-rows", type=int, default=10_000_000)
    parser.add_argument("--devices", type=int, default=500)
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--write-docs", action="store_true", help="replace docs/benchmarks.md's section")
    args = parser.parse_args()
    results, load_before, started = [], os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="fleet-queries-") as tmp:
        for backend in args.backends.split(","):
            rows = args.sqlite_rows if backend == "sqlite" else args.postgresql_rows
            results.append(run_backend(backend, rows, args, Path(tmp)))
            print(table(results[-1:], args), flush=True)
    text = table(results, args)
    run = f"{started}, load average {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end"
    print(f"\n{run}\n{text}")
    if args.write_docs:
        from benchdocs import replace_section

        title = "## Fleet queries (bench/fleet_queries.py)"
        replace_section(title, f"{title}\n\n`.venv/bin/python bench/fleet_queries.py --write-docs` ({run}): {text}\n\n{NOTES}\n")


if __name__ == "__main__":
    main()
