"""What PostgreSQL's day partitions of the telemetry tables (fleet.partitions, migration 0015) cost a commit: the
same batches (DEVICES devices x PER_DEVICE requests each, as the consumer commits them under load) committed
into three databases on one throwaway server, alternating between them batch by batch so that all see the same
load on a shared machine: one migrated up to 0015 (unpartitioned), one with it, and one unpartitioned with 0015's
key, sent_ts added, to tell the key's cost from the routing of rows to partitions. Prints medians and quartiles.

Run: .venv/bin/python bench/fleet_partitions.py [--batches 80] [--devices 200] [--per-device 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "fleet")]

import fleet.store  # noqa: E402
from fleet.db import POSTGRESQL  # noqa: E402
from fleet.store import FleetStore, Ingest  # noqa: E402


def open_store(url: str, partitioned: bool) -> FleetStore:
    """A store on url, migrated with or without 0015 (without: its writers told the tables are not partitioned)."""
    saved = fleet.store.MIGRATIONS
    if not partitioned:
        fleet.store.MIGRATIONS = tuple(m for m in saved if m[0] != "0015_telemetry_partitions")
    try:
        store = FleetStore(url)
    finally:
        fleet.store.MIGRATIONS = saved
    if not partitioned:
        store.db.dialect = dataclasses.replace(POSTGRESQL, partitioned=False)
    return store


def with_sent_ts_key(store: FleetStore) -> FleetStore:
    """An unpartitioned store's tables given 0015's key (device_id, boot_id, seq, sent_ts) and writers."""
    for table in fleet.store.TELEMETRY_TABLES:
        store.db.execute(f"alter table {table} add column sent_ts double precision not null default 0")
        store.db.execute(f"alter table {table} drop constraint {table}_pkey")
        store.db.execute(f"alter table {table} add primary key (device_id, boot_id, seq, sent_ts)")
    store.db.dialect = POSTGRESQL
    store.db._pks.clear()
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=80)
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--per-device", type=int, default=5)
    args = parser.parse_args()
    from postgres import Postgres
    from simdevice import request_record

    server = Postgres().start()
    try:
        stores = {"unpartitioned": open_store(server.fresh_database(), False),
                  "partitioned by day": open_store(server.fresh_database(), True),
                  "unpartitioned, sent_ts in the key": with_sent_ts_key(open_store(server.fresh_database(), False))}
        rng, now = random.Random(0), time.time()
        times: dict[str, list[float]] = {name: [] for name in stores}
        for b in range(args.batches):
            ingest = Ingest()
            for d in range(args.devices):
                ingest.add_records(f"dev-{d:04d}", [request_record("boot", b * args.per_device + i, now - 60 + b * 0.1, rng)
                                                    for i in range(args.per_device)], now)
            names = list(stores)
            for name in names[b % 3:] + names[:b % 3]:  # each goes first in a third of the batches
                start = time.perf_counter()
                stores[name].commit(ingest)
                times[name].append(time.perf_counter() - start)
        rows = args.devices * args.per_device
        print(f"| tables | commit of {rows:,} requests, median (ms) | p25 (ms) | p75 (ms) |\n|---|--:|--:|--:|")
        for name, seconds in times.items():
            q1, median, q3 = (x * 1000 for x in statistics.quantiles(seconds, n=4))
            print(f"| {name} | {median:.1f} | {q1:.1f} | {q3:.1f} |")
        for store in stores.values():
            store.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
