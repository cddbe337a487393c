"""Request rollups (fleet/rollups.py): histogram percentiles within 1% of numpy's, windows tiled without gap or
overlap (stale hours raw), and on both backends rollup-answered queries that agree with raw-row percentiles per
group (adapters' too) across hour and day edges, with replays, before and after the background refresh, after a
backfill and after retention."""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.figures import percentile
from fleet import partitions, queries, rollups
from fleet.migrations import (MIGRATIONS, REQUEST_ROLLUP_COLUMNS_0012, REQUEST_ROLLUP_DIRTY_COLUMNS_0013,
                              REQUEST_ROLLUP_DIRTY_KEY_0013, REQUEST_ROLLUP_KEY_0012)
from fleet.store import FleetStore, Ingest
from test_queries import request

NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z
BOUND = 0.01  # relative: fleet.rollups' documented accuracy
ROUNDING = 0.05  # queries round percentiles to 0.1
REQUESTS = list(rollups.COLUMNS).index("requests")  # a rollup row's column


def close(got: float | None, want: float | None) -> bool:
    if want is None or got is None:
        return got is None and want is None
    return abs(got - want) <= BOUND * abs(want) + ROUNDING


# ---- pure -------------------------------------------------------------------------------------------------
values_in_range = st.lists(st.floats(rollups.HISTOGRAM_MIN, 1e6), min_size=1, max_size=300)


@given(st.lists(values_in_range, min_size=1, max_size=4), st.sampled_from([0, 1, 37.5, 50, 95, 99, 100]))
def test_histogram_percentiles_are_within_the_bound(groups, q):
    gids = np.concatenate([np.full(len(v), g) for g, v in enumerate(groups)])
    values = np.concatenate([np.array(v) for v in groups])
    got = rollups.percentiles(gids, rollups.bins_of(values), np.ones(len(values), np.int64), len(groups) + 1, [q])
    for g, v in enumerate(groups):
        want = np.percentile(v, q)
        assert abs(got[g, 0] - want) <= BOUND * want * (1 + 1e-9), (v, q)
    assert np.isnan(got[len(groups), 0])  # a group without values


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, rollups.NUM_BINS - 1), st.integers(1, 2**20)),
                min_size=1, max_size=200))
def test_percentiles_of_few_groups_summed_densely_equal_those_sorted(entries):
    """percentiles sums few groups' entries in a dense groups x bins array and many groups' by sorting: the
    same answer either way, repeated (group, bin) entries summed."""
    groups, bins, counts = (np.array(column, np.int64) for column in zip(*entries))
    dense = rollups.percentiles(groups, bins, counts, 11, (0, 50, 95, 100))
    saved = rollups.DENSE_MAX_CELLS
    rollups.DENSE_MAX_CELLS = 0
    try:
        sorted_ = rollups.percentiles(groups, bins, counts, 11, (0, 50, 95, 100))
    finally:
        rollups.DENSE_MAX_CELLS = saved
    assert np.array_equal(dense, sorted_, equal_nan=True)


@given(st.lists(st.dictionaries(st.integers(0, rollups.NUM_BINS - 1), st.integers(1, 2**20), max_size=50),
                max_size=4))
def test_histogram_texts_concatenate_and_merge_by_summing(histograms):
    def text(counts):
        entries = np.array(sorted(counts.items()), np.int64).reshape(-1, 2)
        packed = np.empty(len(entries), rollups.ENTRY)
        packed["bin"], packed["count"] = entries[:, 0], entries[:, 1]
        return rollups.encode(packed)

    texts = [text(h) for h in histograms]
    assert [len(t) for t in texts] == [rollups.ENTRY_CHARS * len(h) for h in histograms]
    total = {}
    for h in histograms:
        for b, c in h.items():
            total[b] = total.get(b, 0) + c
    merged = rollups.decode(rollups.merge(*texts))
    assert dict(zip(merged["bin"].tolist(), merged["count"].tolist())) == total


def test_values_below_the_scale_count_as_zero_and_above_it_as_its_top():
    bins = rollups.bins_of(np.array([0.0, 0.005, 0.01, 1e9]))
    assert bins.tolist() == [0, 0, 1, rollups.NUM_BINS - 1]


@settings(max_examples=300)
@given(st.floats(1.6e9, 1.8e9), st.floats(0, 200 * 86400), st.sampled_from([rollups.HOUR_S, rollups.DAY_S]))
def test_a_window_is_tiled_by_its_spans(now, since_s, coarsest_s):
    spans = sorted(rollups.plan(now - since_s, now, coarsest_s), key=lambda s: s.start_ts)
    assert spans[0].start_ts == now - since_s and spans[-1].end_ts == math.inf
    assert all(a.end_ts == b.start_ts for a, b in zip(spans, spans[1:]))  # no gap, no overlap
    for s in spans:
        assert s.width_s in (0, rollups.HOUR_S, coarsest_s)
        if s.width_s:
            assert s.start_ts % s.width_s == 0 and s.end_ts % s.width_s == 0 and s.end_ts <= now
    raw_s = sum(min(s.end_ts, now) - s.start_ts for s in spans if not s.width_s)
    assert raw_s <= 2 * rollups.HOUR_S  # raw rows: the partial hours at the edges only


@settings(max_examples=300)
@given(st.floats(1.6e9, 1.8e9), st.floats(0, 40 * 86400), st.sampled_from([rollups.HOUR_S, rollups.DAY_S]),
       st.lists(st.integers(-50, 40 * 24), max_size=30))
def test_stale_hours_are_read_raw_and_their_days_by_hours(now, since_s, coarsest_s, hours_ago):
    stale = frozenset(math.floor(now / 3600) * 3600 - h * 3600 for h in hours_ago)
    spans = sorted(rollups.plan(now - since_s, now, coarsest_s, stale), key=lambda s: s.start_ts)
    assert spans[0].start_ts == now - since_s and spans[-1].end_ts == math.inf
    assert all(a.end_ts == b.start_ts for a, b in zip(spans, spans[1:]))
    for s in spans:
        if s.width_s:
            assert s.start_ts % s.width_s == 0 and s.end_ts % s.width_s == 0 and s.end_ts <= now
            assert not any(s.start_ts <= h < s.end_ts for h in stale), (s, sorted(stale))
            if s.width_s == rollups.DAY_S:  # no day holds a stale hour
                assert not any(d <= h < d + rollups.DAY_S for d in range(int(s.start_ts), int(s.end_ts),
                                                                        rollups.DAY_S) for h in stale)
    raw_s = sum(min(s.end_ts, now) - s.start_ts for s in spans if not s.width_s)
    stale_in = {h for h in stale if now - since_s <= h and h + rollups.HOUR_S <= now}
    assert raw_s <= 2 * rollups.HOUR_S + len(stale_in) * rollups.HOUR_S  # and only those hours more


# ---- on each backend --------------------------------------------------------------------------------------
ADAPTERS = (None, None, "bot@r8-1", "doc@r4-2")  # None: the base model alone


def with_adapter(record, adapter: str | None):
    return record.model_copy(update={"request": record.request.model_copy(update={"adapter": adapter})})


def history(seed: int = 0, days: int = 10, devices: int = 4) -> list[tuple[str, list]]:
    """Requests every ~20 min over `days` up to NOW on each device, on two versions, some shed or 1-token, half
    of them with one of two LoRA adapters."""
    rng = np.random.default_rng(seed)
    out = []
    for d in range(devices):
        n = days * 72
        ts = np.sort(rng.uniform(NOW - days * 86400, NOW, n))
        records = []
        for i, t in enumerate(ts):
            version = "v1" if t < NOW - days * 43200 + d * 3600 else "v2"
            completion = int(rng.choice([0, 1, 50, 50, 50, 200]))
            adapter = ADAPTERS[int(rng.integers(len(ADAPTERS)))]
            speed = float(rng.lognormal(3 + d * 0.1 + (adapter is not None) * 0.3, 0.2))  # adapters: other figures
            records.append(with_adapter(request(i, float(t), "m", version, speed, float(rng.lognormal(5, 0.6)),
                                                completion=completion), adapter))
        out.append((f"dev-{d}", records))
    return out


def ingest_all(store: FleetStore, batches: list[tuple[str, list]], size: int = 50, refresh_every: int = 0) -> int:
    """Commit the batches; refresh_every: a refresh step after every that many commits, as the consumer
    interleaves them. Returns the buckets refreshed."""
    refreshed, commits = 0, 0
    for device_id, records in batches:
        for at in range(0, len(records), size):
            ingest = Ingest()
            ingest.add_records(device_id, records[at:at + size], NOW)
            store.commit(ingest)
            commits += 1
            if refresh_every and commits % refresh_every == 0:
                refreshed += store.refresh_rollups()
    return refreshed


def refresh_all(store: FleetStore) -> int:
    """The consumer's refresh pass: steps until none is left (every hour before 2023 has ended)."""
    refreshed = 0
    while n := store.refresh_rollups():
        refreshed += n
    assert store.rollup_backlog() == rollups.Backlog(0, 0.0)
    return refreshed


def exact_summaries(db, since_s: float, key) -> dict:
    """Raw rows -> figures.percentile's figures per group, as the pre-rollup queries computed them."""
    groups: dict = {}
    for ts, device_id, model, version, adapter, ttft, speed, completion, finish in db.execute(
            "select ts, device_id, model, version, adapter, ttft_ms, decode_tokens_per_s, completion_tokens, "
            "finish_reason from requests where ts >= ?", [NOW - since_s]):
        g = groups.setdefault(key(ts, device_id, model, version, adapter or ""),
                              {"n": 0, "e": 0, "tok": 0, "ttft": [], "spd": []})
        g["n"], g["e"], g["tok"] = g["n"] + 1, g["e"] + (finish == "error"), g["tok"] + completion
        if completion >= 1:
            g["ttft"].append(ttft)
        if completion >= 2:
            g["spd"].append(speed)
    return {k: {"requests": g["n"], "errors": g["e"], "tokens_served": g["tok"],
                "ttft_p50_ms": percentile(g["ttft"], 50), "ttft_p95_ms": percentile(g["ttft"], 95),
                "decode_tps_p50": percentile(g["spd"], 50), "decode_tps_p95": percentile(g["spd"], 95)}
            for k, g in groups.items()}


def assert_agree(rows: list[dict], exact: dict, by: str) -> None:
    assert [r[by] for r in rows] == sorted(exact)
    for r in rows:
        want = exact[r[by]]
        assert (r["requests"], r["errors"], r["tokens_served"]) == (want["requests"], want["errors"],
                                                                   want["tokens_served"])
        for column in ("ttft_p50_ms", "ttft_p95_ms", "decode_tps_p50", "decode_tps_p95"):
            assert close(r[column], want[column]), (by, r[by], column, r[column], want[column])


@pytest.fixture
def filled(fleet_target):
    """Ten days of four devices' requests, every batch delivered twice and a tenth of them a third time, the
    rollups refreshed between the deliveries and after them."""
    store = FleetStore(fleet_target)
    batches = history()
    ingest_all(store, batches)
    refresh_all(store)
    ingest_all(store, batches, size=37)  # replays, cut differently: no batch repeats a commit exactly
    ingest_all(store, [(d, records[::10]) for d, records in batches])
    refresh_all(store)
    yield store
    store.close()


def rollup_rows(db) -> list[tuple]:
    return [tuple(r) for r in db.execute(f"select * from {rollups.TABLE} order by {', '.join(rollups.ROLLUP_KEY)}")]


def test_replays_are_rolled_up_once(filled):
    """What the refresh maintained is what a backfill of the stored rows builds."""
    db = filled.db
    assert db["requests"].count == 4 * 720
    maintained = rollup_rows(db)
    assert sum(r[REQUESTS] for r in maintained if r[0] == rollups.DAY_S) == 4 * 720
    db.execute(f"delete from {rollups.TABLE}")
    assert rollups.backfill(db) == 4 * 720
    assert rollup_rows(db) == maintained


@pytest.mark.parametrize("since_s", [1.5 * 86400, 7 * 86400 + 1234.5, 30 * 86400])
@pytest.mark.parametrize("by", queries.GROUPINGS)
def test_tps_from_rollups_agrees_with_raw_rows(filled, since_s, by):
    db = filled.db
    rows = queries.tps(db, since_s, by, now=NOW)
    if by == "adapter":  # every adapter's own group (rollups keyed without it would merge them into one)
        assert [r["adapter"] for r in rows] == ["m", "m:bot@r8-1", "m:doc@r4-2"]
    assert_agree(rows, exact_summaries(db, since_s, queries._GROUP_KEY[by]), by)


def test_compare_and_timeseries_from_rollups_agree_with_raw_rows(filled):
    db = filled.db
    since_s = 7 * 86400
    exact = {m: exact_summaries(db, since_s, lambda t, d, model, version, adapter, m=m:
                                d if f"{model}@{version}" == m else None) for m in ("m@v1", "m@v2")}
    for row in queries.compare(db, ["m@v1", "m@v2"], since_s, now=NOW):
        for m in ("m@v1", "m@v2"):
            assert row[f"{m} requests"] == exact[m][row["device"]]["requests"]
            assert close(row[f"{m} decode_tps_p50"], exact[m][row["device"]]["decode_tps_p50"])
    bucket_s = 3 * 3600  # 7 days in 60 buckets: 2.8 h, aligned to whole hours
    exact = exact_summaries(db, since_s, lambda t, d, model, version, adapter: (f"{model}@{version}", d,
                                                                        int(t // bucket_s) * bucket_s))
    points = queries.timeseries(db, since_s, now=NOW)
    assert [(p["model"], p["device"], p["t"]) for p in points] == sorted(exact)
    for p in points:
        want = exact[(p["model"], p["device"], p["t"])]
        assert p["requests"] == want["requests"]
        assert close(p["decode_tps_p50"], want["decode_tps_p50"]) and close(p["ttft_p50_ms"], want["ttft_p50_ms"])


def test_a_fleet_upgraded_with_history_gets_its_rollups_keyed_by_adapter(fleet_target):
    """Migration 0017 rebuilds the rollups of a fleet from before it (keyed without the adapter, some marks still
    pending) from the requests stored, every row kept: long windows agree with the raw rows per adapter at once."""
    store = FleetStore(fleet_target)
    ingest_all(store, history(seed=1, days=3))
    refresh_all(store)
    maintained, requests = rollup_rows(store.db), store.db["requests"].count
    # the database as a fleet before 0017 left it: the same raw rows, rollups and a mark keyed without the adapter
    for table in (rollups.TABLE, rollups.DIRTY):
        store.db.execute(f"drop table {table}")
    store.db.create_table(rollups.TABLE, REQUEST_ROLLUP_COLUMNS_0012, REQUEST_ROLLUP_KEY_0012)
    store.db.create_table(rollups.DIRTY, REQUEST_ROLLUP_DIRTY_COLUMNS_0013, REQUEST_ROLLUP_DIRTY_KEY_0013)
    store.db.execute(f"insert into {rollups.TABLE} values (3600, 0, 'dev-0', 'm', 'v1', 1, 0, 1, '', '')")
    store.db.execute(f"insert into {rollups.DIRTY} values (0, 0, 'dev-0', 'm', 'v1', 0.0)")
    store.db.execute("delete from _migrations where name = '0017_request_rollup_adapter'")
    store.close()
    store = FleetStore(fleet_target)
    assert store.applied_migrations() == [name for name, _ in MIGRATIONS]  # 0017 again
    assert store.db["requests"].count == requests and store.rollup_backlog() == rollups.Backlog(0, 0.0)
    assert rollup_rows(store.db) == maintained
    for by in ("adapter", "device"):
        assert_agree(queries.tps(store.db, 2 * 86400, by, now=NOW),
                     exact_summaries(store.db, 2 * 86400, queries._GROUP_KEY[by]), by)
    store.close()


def test_rollups_follow_the_requests_retention_when_the_store_prunes(fleet_target):
    """A commit no longer deletes rollups (it writes only stale marks); the prune the consumer runs between
    commits deletes the periods that ended by the requests' cutoff, with their raw rows."""
    store = FleetStore(fleet_target)
    ingest_all(store, history(seed=2, days=5, devices=1))
    refresh_all(store)
    before = rollup_rows(store.db)
    ingest = Ingest(kept_s={"requests": 2 * 86400})
    ingest.add_records("dev-0", [request(10_000, NOW, "m", "v2", 10, 10)], NOW)
    store.commit(ingest)
    assert rollup_rows(store.db) == before
    cutoff = NOW - 2 * 86400
    store.prune({"requests": cutoff})
    starts = {(w, s) for w, s in store.db.execute(f"select width_s, start_ts from {rollups.TABLE}")}
    # the first period kept is the one still holding raw rows at or after the cutoff (PostgreSQL's partitioned
    # tables keep whole days: the cutoff's day start)
    kept_from = partitions.cutoff(store.db.dialect, cutoff)
    assert store.db.execute("select min(ts) from requests").fetchone()[0] >= kept_from > cutoff - 86400
    assert min(s for w, s in starts if w == rollups.HOUR_S) == math.floor(kept_from / 3600) * 3600
    assert min(s for w, s in starts if w == rollups.DAY_S) == math.floor(cutoff / 86400) * 86400
    store.close()


def test_a_query_right_after_ingest_equals_the_raw_rows_before_and_after_the_refresh(fleet_target):
    """Rollups lag ingest; a query does not: the hours still marked stale are read raw. Rows added to hours
    already rolled up (a late device's backlog) count at once too, and after their refresh."""
    store = FleetStore(fleet_target)
    batches = history(seed=4, days=6, devices=3)
    ingest_all(store, [(d, records[: len(records) // 2]) for d, records in batches])
    db, since_s, key = store.db, 5 * 86400, queries._GROUP_KEY["device"]
    assert store.db[rollups.TABLE].count == 0 and store.rollup_backlog(NOW + 86400).buckets > 0
    assert_agree(queries.tps(db, since_s, "device", now=NOW), exact_summaries(db, since_s, key), "device")
    refresh_all(store)
    rolled = rollup_rows(db)
    ingest_all(store, [(d, records[len(records) // 2:]) for d, records in batches])  # into rolled-up hours
    assert rollup_rows(db) == rolled  # not refreshed yet: what the query reads for those hours must be raw
    assert_agree(queries.tps(db, since_s, "device", now=NOW), exact_summaries(db, since_s, key), "device")
    refresh_all(store)
    assert rollup_rows(db) != rolled
    assert not rollups.stale_hours(db, NOW - since_s)  # the query below reads rollups for every whole hour
    assert_agree(queries.tps(db, since_s, "device", now=NOW), exact_summaries(db, since_s, key), "device")
    store.close()


def test_the_open_hour_waits_for_its_end_and_the_backlog_says_how_long(fleet_target, monkeypatch):
    store = FleetStore(fleet_target)
    hour = math.floor(NOW / 3600) * 3600
    ingest = Ingest()
    ingest.add_records("dev-0", [request(0, hour + 10, "m", "v1", 10, 10), request(1, hour - 10, "m", "v1", 10, 10)],
                       NOW)
    monkeypatch.setattr("fleet.store.time.time", lambda: hour + 30)  # the marks' clock
    store.commit(ingest)
    # at hour + 60 the earlier hour has ended and waited since it was marked; the open one is not counted
    assert store.rollup_backlog(hour + 60) == rollups.Backlog(1, 30.0)
    assert store.refresh_rollups(hour + 60) == 1 and store.refresh_rollups(hour + 60) == 0
    assert {s for (s,) in db_rows(store, "start_ts", rollups.DIRTY)} == {hour}
    assert store.rollup_backlog(hour + 60) == rollups.Backlog(0, 0.0)
    assert store.rollup_backlog(hour + 3600 + 5) == rollups.Backlog(1, 5.0)  # ended 5 s ago, marked before
    assert store.refresh_rollups(hour + 3600 + 5) == 1
    assert sum(r for (r,) in db_rows(store, "requests", rollups.TABLE, "width_s = 86400")) == 2
    store.close()


def db_rows(store: FleetStore, column: str, table: str, where: str = "1 = 1") -> list[tuple]:
    return store.db.execute(f"select {column} from {table} where {where}").fetchall()


def test_replicas_ingesting_and_refreshing_concurrently_count_each_row_once(fleet_target):
    """Two writers (PostgreSQL: two replicas' connections; SQLite: two connections to one file) commit the same
    batches at once, each refreshing between its commits as the consumer does, into hours being refreshed:
    once both are done and the marks refreshed, every rollup row is what a backfill of the stored rows builds."""
    batches = history(seed=3, days=2, devices=3)
    FleetStore(fleet_target).close()
    stores = [FleetStore(fleet_target) for _ in range(2)]
    errors, refreshed = [], []

    def run(store, seed):
        try:
            order = np.random.default_rng(seed).permutation(len(batches))
            refreshed.append(ingest_all(store, [batches[i] for i in order], size=20, refresh_every=3))
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s, i)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(refreshed) > 0  # the refresh ran while the other writer committed
    refresh_all(stores[0])
    db = stores[0].db
    maintained = rollup_rows(db)
    assert sum(r[REQUESTS] for r in maintained if r[0] == rollups.DAY_S) == db["requests"].count == 3 * 2 * 72
    db.execute(f"delete from {rollups.TABLE}")
    rollups.backfill(db)
    assert rollup_rows(db) == maintained
    for s in stores:
        s.close()


def test_a_refresh_step_stops_at_its_row_bound_and_the_next_goes_on(fleet_target, monkeypatch):
    """A transaction re-rolls buckets until REFRESH_BATCH_ROWS raw rows (at least one bucket); the rest stay
    claimed for the next step, and the pass ends with what a backfill builds."""
    monkeypatch.setattr(rollups, "REFRESH_BATCH_ROWS", 10)
    store = FleetStore(fleet_target)
    ingest_all(store, history(seed=5, days=2, devices=2))
    marks = store.rollup_backlog().buckets
    first = store.refresh_rollups()
    assert 1 <= first < marks and store.rollup_backlog().buckets == marks - first
    assert first + refresh_all(store) == marks
    maintained = rollup_rows(store.db)
    store.db.execute(f"delete from {rollups.TABLE}")
    rollups.backfill(store.db)
    assert rollup_rows(store.db) == maintained
    store.close()


def test_a_refresh_claiming_a_bucket_a_commit_in_flight_has_marked_waits_for_that_commit(fleet_target, monkeypatch):
    """A commit whose mark found its bucket's mark already there (insert-or-ignore) and which has not committed
    yet: a refresh claiming that mark then must see its rows (PostgreSQL: the claim's table lock waits for it;
    SQLite: the write lock does), or the rows would be left out with no mark left to bring them in."""
    hour = math.floor(NOW / 3600) * 3600 - 5 * 3600
    writer, refresher = FleetStore(fleet_target), FleetStore(fleet_target)
    first = Ingest()
    first.add_records("dev-0", [request(0, hour + 10, "m", "v1", 10, 10)], NOW)
    writer.commit(first)  # the bucket's mark, committed
    marked, mark = threading.Event(), rollups.mark

    def mark_then_linger(db, rows, now):
        n = mark(db, rows, now)  # ignored: the bucket is marked already
        marked.set()
        time.sleep(0.3)  # the refresh's claim comes now, before this commit ends
        return n

    monkeypatch.setattr(rollups, "mark", mark_then_linger)
    second = Ingest()
    second.add_records("dev-0", [request(1, hour + 20, "m", "v1", 10, 10)], NOW)
    in_flight = threading.Thread(target=writer.commit, args=(second,))
    in_flight.start()
    assert marked.wait(10)
    refresh_all(refresher)
    in_flight.join()
    refresh_all(refresher)
    rolled = sorted(db_rows(refresher, "width_s, requests", rollups.TABLE))
    assert rolled == [(rollups.HOUR_S, 2), (rollups.DAY_S, 2)]
    writer.close()
    refresher.close()
