"""The consumer's background refresh of request rollups (fleet.consumer, fleet.rollups.refresh_step), on both
backends against a real Mosquitto: rows of an ended hour reach their rollups within the refresh period, and the
consumer's counters report the backlog it leaves."""
from __future__ import annotations

import math
import time

from fleet import rollups
from fleet.consumer import ROLLUP_REFRESH_EVERY_S
from fleet.db import open_database
from fleet.store import FleetStore, Ingest
from fleet_support import wait_until

SLACK_S = 3.0  # one refresh pass and the test's polling, on a shared 2-core box


def rolled_up_requests(target) -> tuple[int, int, int]:
    """(raw request rows, requests in hour rollups, requests in day rollups)."""
    db = open_database(target)
    try:
        raw = db.execute("select count(*) from requests").fetchone()[0]
        hours, days = (db.execute(f"select coalesce(sum(requests), 0) from {rollups.TABLE} where width_s = ?",
                                  [w]).fetchone()[0] for w in (rollups.HOUR_S, rollups.DAY_S))
        return raw, hours, days
    finally:
        db.close()


def test_rows_of_an_ended_hour_are_rolled_up_within_the_refresh_period(consumers, devices, fleet_target):
    consumer = consumers(store=FleetStore(fleet_target))  # the default period, ROLLUP_REFRESH_EVERY_S
    device = devices("dev-late")
    ended = (math.floor(time.time() / 3600) - 2) * 3600  # two hours ago: ended, so the refresh takes it
    device.send(device.make_records(200, ts=ended + 60))
    device.send(device.make_records(100, ts=ended + 3000))
    requests = sum(r.kind == "request" for r in device.produced)
    wait_until(lambda: rolled_up_requests(fleet_target)[0] == requests, message="the requests stored")
    stored_at = time.monotonic()
    wait_until(lambda: rolled_up_requests(fleet_target) == (requests, requests, requests),
               ROLLUP_REFRESH_EVERY_S + SLACK_S, interval_s=0.1, message="the rollups refreshed")
    lag_s = time.monotonic() - stored_at
    print(f"rows stored -> rolled up: {lag_s:.2f} s (refresh every {ROLLUP_REFRESH_EVERY_S:g} s)")
    # >= 1: a commit landing after a pass re-marks the bucket, and the next pass refreshes it again
    wait_until(lambda: consumer.stats.rollup_buckets_refreshed >= 1, message="the counters")
    assert (consumer.stats.rollup_backlog_buckets, consumer.stats.rollup_lag_s) == (0, 0.0)


def test_a_replica_finding_another_refreshing_skips_and_reports_its_backlog(consumers, devices, postgres_url):
    """PostgreSQL: one replica recomputes at a time (a transaction advisory lock). While another holds it, this
    one's passes recompute nothing and its counters report the ended buckets still stale and their lag; once
    it is released, the next pass rolls them up."""
    other = open_database(postgres_url)
    consumer = consumers(store=FleetStore(postgres_url), refresh_every_s=0.2)
    device = devices("dev-late")
    ended = (math.floor(time.time() / 3600) - 3) * 3600
    with other.transaction():
        other.execute("select pg_advisory_xact_lock(?)", [rollups.REFRESH_LOCK_KEY])
        for h in range(2):  # two ended hours: two buckets
            device.send(device.make_records(20, ts=ended + h * 3600 + 10))
        requests = sum(r.kind == "request" for r in device.produced)
        wait_until(lambda: rolled_up_requests(postgres_url)[0] == requests, message="the requests stored")
        wait_until(lambda: consumer.stats.rollup_backlog_buckets == 2 and consumer.stats.rollup_lag_s > 0.3,
                   message="the backlog reported")
        assert rolled_up_requests(postgres_url)[1:] == (0, 0) and consumer.stats.rollup_buckets_refreshed == 0
    wait_until(lambda: rolled_up_requests(postgres_url) == (requests, requests, requests), message="the refresh")
    wait_until(lambda: consumer.stats.rollup_backlog_buckets == 0, message="the backlog cleared")
    assert consumer.stats.rollup_buckets_refreshed == 2
    other.close()


def test_serve_says_its_rollup_backlog_at_start_and_refreshes_every_rollup_refresh(broker, fleet_db,
                                                                                   serve_processes):
    """`edge-fleet serve --rollup-refresh 0.5`: the start-up lines name the stale hour buckets found and the period;
    a bucket marked while it runs is refreshed within a few periods, well before the default period has passed."""
    from test_queries import request

    def commit_ended_hour(seq: int) -> None:
        ingest = Ingest()
        ingest.add_records("dev-1", [request(seq, time.time() - 2 * 3600, "m", "v1", 20, 100)], time.time())
        store = FleetStore(fleet_db)
        store.commit(ingest)
        store.close()

    commit_ended_hour(1)
    serve = serve_processes(broker.url, fleet_db, "fleet-a", extra_args=("--rollup-refresh", "0.5"))
    log = serve.log.read_text()
    assert "request rollups: 1 ended hour buckets to refresh" in log and "refreshed every 0.5 s" in log, log
    wait_until(lambda: rolled_up_requests(fleet_db)[1] == 1, message="the first pass")
    commit_ended_hour(2)
    started = time.monotonic()
    wait_until(lambda: rolled_up_requests(fleet_db)[1] == 2, ROLLUP_REFRESH_EVERY_S, message="the next pass")
    assert time.monotonic() - started < ROLLUP_REFRESH_EVERY_S - 1, "refreshed at the default period"
    serve.stop()
