"""What PostgreSQL's day partitions of the telemetry tables (fleet.partitions, migration 0015) cost a commit: the
same batches (DEVICES devices x PER_DEVICE requests each, as the consumer commits them under load) committed
into two databases on one throwaway server, one migrated up to 0015 (unpartitioned) and one with it, alternating
between them batch by batch so that both see the same load on a shared machine; prints the median and quartiles.

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
        stores = {p: open_store(server.fresh_database(), p) for p in (False, True)}
        rng, now = random.Random(0), time.time()
        times: dict[bool, list[float]] = {False: [], True: []}
        for b in range(args.batches):
            ingest = Ingest()
            for d in range(args.devices):
                ingest.add_records(f"dev-{d:04d}", [request_record("boot", b * args.per_device + i, now - 60 + b * 0.1, rng)
                                                    for i in range(args.per_device)], now)
            for p in (False, True) if b % 2 else (True, False):  # each goes first in half the batches
                start = time.perf_counter()
                stores[p].commit(ingest)
                times[p].append(time.perf_counter() - start)
        rows = args.devices * args.per_device
        print(f"| tables | commit of {rows:,} requests, median (ms) | p25 (ms) | p75 (ms) |\n|---|--:|--:|--:|")
        for p in (False, True):
            q1, median, q3 = (x * 1000 for x in statistics.quantiles(times[p], n=4))
            print(f"| {'partitioned by day' if p else 'unpartitioned'} | {median:.1f} | {q1:.1f} | {q3:.1f} |")
        for store in stores.values():
            store.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
