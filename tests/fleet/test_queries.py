"""Read-only queries over a database with known figures: percentiles, groupings, comparisons, time series."""
from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.figures import percentile
from agent.wire import DeviceState, Golden, Manifest, Parameters, RequestFigures, RequestRecord, TelemetryRecord
from fleet import queries
from fleet.db import database_errors
from fleet.queries import QueryError
from fleet.store import FleetStore, Ingest
from simdevice import event_record

NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def request(seq: int, ts: float, model: str, version: str, decode: float, ttft: float, completion: int = 50):
    figures = RequestFigures(prompt_tokens=10, completion_tokens=completion, queue_ms=1, ttft_ms=ttft,
                             prefill_tokens_per_s=500, decode_tokens_per_s=decode if completion >= 2 else 0.0,
                             itl_p50_ms=1, itl_p95_ms=2, e2e_ms=100, kv_bytes=1, finish_reason="stop")
    return TelemetryRecord(boot_id="b", seq=seq, ts=ts, kind="request",
                           request=RequestRecord(model=model, version=version, figures=figures))


@pytest.fixture
def db(fleet_target):
    """dev-1 ran m@v1 (decode 10..19 tok/s) and m@v2 (20..29); dev-2 ran only m@v1; dev-3 is offline. On each
    backend."""
    store = FleetStore(fleet_target)
    ingest = Ingest()
    recs1 = [request(i, NOW - 600 + i, "m", "v1", 10 + i, 100 + 10 * i) for i in range(10)]
    recs1 += [request(10 + i, NOW - 300 + i, "m", "v2", 20 + i, 50 + 5 * i) for i in range(10)]
    recs1 += [request(20, NOW - 200, "m", "v2", 999, 1, completion=1)]  # 1 token: no decode speed
    recs1 += [request(21, NOW - 2 * 86400, "m", "v1", 1, 1)]  # outside 24 h
    recs1 += [event_record("b", 30, NOW - 100, "model_change", to="m@v2")]
    ingest.add_records("dev-1", recs1, NOW)
    ingest.add_records("dev-2", [request(i, NOW - 600 + i, "m", "v1", 30, 40) for i in range(4)], NOW - 5)
    for device_id, status in (("dev-1", "online"), ("dev-2", "online"), ("dev-3", "offline")):
        ingest.add_state(DeviceState(device_id=device_id, status=status, connection=1, boot_id="b", ts=NOW - 900,
                                     model="m", version="v2", precision="int4"), NOW - 900,
                         broker="mqtt://shard-b:1883" if device_id == "dev-2" else None)
    ingest.reject("dev-9", "schema")
    store.commit(ingest)
    store.close()
    db = queries.open_readonly(fleet_target)
    yield db
    db.close()


def test_the_database_is_opened_read_only(db):
    with pytest.raises(database_errors(), match="readonly|read-only"):
        db.execute("delete from requests")


def test_missing_database_is_a_user_error(tmp_path):
    with pytest.raises(QueryError, match="no fleet database"):
        queries.open_readonly(tmp_path / "nope.db")


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(values, p):
    assert percentile(values, p) == pytest.approx(np.percentile(values, p), rel=1e-9, abs=1e-6)


@given(st.lists(st.floats(-1e6, 1e6), max_size=50))
def test_the_summaries_percentiles_are_the_wire_ones(values):
    """summarize() takes them in numpy (10 M requests in a 90-day window); the agent's are figures.percentile."""
    f = queries.Figures(ttfts=array("d", values))
    got = queries.summarize(f)
    for q in (50, 95):
        want = percentile(values, q)
        # rounded to 0.1 ms: within 0.05 of the exact figure (numpy's and ours differ in the last bit, so
        # at a tie such as 0.85 the two round apart; hypothesis found [0, 0, 0, 1])
        assert got[f"ttft_p{q}_ms"] == (None if want is None else pytest.approx(want, abs=0.0501))


def test_a_long_history_does_not_slow_a_short_window(db):
    """Found in review (10 M rows, 91 days): comparing a bare model name read every request of that model
    ever stored through the (model, version, ts) index, and the error path listed every model@version in
    history. Both now go by the ts index, and the error lists what the window holds."""
    where, params = queries._model_filter(db, "m")
    if db.dialect.name == "sqlite":  # PostgreSQL's planner goes by statistics, not by hints
        plan = " ".join(str(r) for r in db.execute(
            f"explain query plan select device_id from requests where ts >= ? {where}", (NOW - 86400, *params)))
        assert "idx_requests_ts" in plan, plan
    with pytest.raises(QueryError, match="known: m@v2$"):  # m@v1's requests in the last 4 minutes: none
        queries.compare(db, ["m@v1", "m@v9"], 240, now=NOW)


def test_the_fleet_database_caps_its_wal(tmp_path):
    store = FleetStore(tmp_path / "f.db")
    assert store.db.execute("pragma journal_size_limit").fetchone()[0] == 64 << 20
    store.close()


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("24h", 86400), ("7d", 604800),
                                           ("1.5h", 5400), ("2w", 1209600)])
def test_durations(text, seconds):
    assert queries.parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "-1h", "1y", "one day"])
def test_bad_durations(text):
    with pytest.raises(QueryError, match="bad duration"):
        queries.parse_duration_s(text)


def test_devices(db):
    rows = {r["id"]: r for r in queries.devices(db, now=NOW)}
    assert rows["dev-1"]["online"] and not rows["dev-3"]["online"]
    assert rows["dev-1"]["model"] == "m@v2" and rows["dev-1"]["precision"] == "int4"
    assert rows["dev-1"]["requests_1h"] == 21
    # of the model it runs now: found in review, m@v2 was shown with the median of m@v1's requests too
    assert rows["dev-1"]["decode_tps_p50_1h"] == pytest.approx(np.median(list(range(20, 30))))
    assert rows["dev-2"]["requests_1h"] == 4 and rows["dev-2"]["decode_tps_p50_1h"] is None  # all on m@v1
    assert rows["dev-2"]["last_seen"] == queries.iso(NOW - 5)
    assert rows["dev-3"]["decode_tps_p50_1h"] is None
    assert (rows["dev-1"]["broker"], rows["dev-2"]["broker"]) == (None, "mqtt://shard-b:1883")


def test_tps_by_version(db):
    rows = {r["version"]: r for r in queries.tps(db, 86400, "version", now=NOW)}
    v1, v2 = rows["m@v1"], rows["m@v2"]
    assert v1["requests"] == 14 and v2["requests"] == 11  # the 2-day-old request is outside the window
    v1_speeds = [10 + i for i in range(10)] + [30] * 4
    assert v1["decode_tps_p50"] == pytest.approx(np.percentile(v1_speeds, 50), abs=0.05)
    assert v1["decode_tps_p95"] == pytest.approx(np.percentile(v1_speeds, 95), abs=0.05)
    assert v2["decode_tps_p50"] == pytest.approx(24.5)  # the 1-token request does not count
    assert v2["ttft_p50_ms"] == pytest.approx(np.percentile([50 + 5 * i for i in range(10)] + [1], 50), abs=0.05)
    assert v2["tokens_served"] == 10 * 50 + 1


def test_requests_shed_as_overloaded_are_counted_as_errors_beside_the_percentiles(tmp_path):
    """Found in review: refused or shed requests have no TTFT, so they left the percentiles and nothing showed
    them: the more a device shed, the better its TTFT p95 looked."""
    store = FleetStore(tmp_path / "f.db")
    ingest = Ingest()
    served = [request(i, NOW - 60 + i, "m", "v1", 20, 100) for i in range(3)]
    shed = [request(10 + i, NOW - 30 + i, "m", "v1", 0, 0, completion=0) for i in range(5)]
    shed = [r.model_copy(update={"request": r.request.model_copy(update={
        "figures": r.request.figures.model_copy(update={"finish_reason": "error", "queue_ms": 1000.0})})})
        for r in shed]
    ingest.add_records("dev-1", served + shed, NOW)
    ingest.add_records("dev-2", [request(i, NOW - 60 + i, "m", "v2", 30, 90) for i in range(2)], NOW)
    store.commit(ingest)
    store.close()
    db = queries.open_readonly(tmp_path / "f.db")
    (row,) = queries.tps(db, 3600, "device", now=NOW)[:1]
    assert (row["requests"], row["errors"], row["ttft_p95_ms"]) == (8, 5, 100.0)
    assert [r["errors"] for r in queries.tps(db, 3600, "version", now=NOW)] == [5, 0]
    assert [p["requests"] for p in queries.timeseries(db, 3600, now=NOW)] == [8, 2]


def test_tps_groupings(db):
    assert [r["device"] for r in queries.tps(db, 86400, "device", now=NOW)] == ["dev-1", "dev-2"]
    assert [r["model"] for r in queries.tps(db, 86400, "model", now=NOW)] == ["m"]
    hours = queries.tps(db, 86400, "hour", now=NOW)
    assert [r["hour"] for r in hours] == ["2023-11-14T22:00Z"]  # NOW - 600 s is 22:03 UTC
    assert sum(r["requests"] for r in hours) == 25
    assert len(queries.tps(db, 7 * 86400, "device", now=NOW)) == 2
    with pytest.raises(QueryError, match="cannot group by"):
        queries.tps(db, 86400, "colour")


def test_compare_lists_devices_that_ran_both(db):
    rows = queries.compare(db, ["m@v1", "m@v2"], 86400, now=NOW)
    assert [r["device"] for r in rows] == ["dev-1"]
    row = rows[0]
    assert row["m@v1 decode_tps_p50"] == pytest.approx(14.5) and row["m@v2 decode_tps_p50"] == pytest.approx(24.5)
    assert row["m@v1 ttft_p50_ms"] == pytest.approx(145.0)
    assert row["decode_ratio"] == pytest.approx(24.5 / 14.5, abs=1e-3)
    with pytest.raises(QueryError, match="no requests for m@v9.*known: m@v1, m@v2"):
        queries.compare(db, ["m@v1", "m@v9"], 86400, now=NOW)
    with pytest.raises(QueryError, match="at least two"):
        queries.compare(db, ["m@v1"], 86400, now=NOW)


def test_events(db):
    rows = queries.events(db, "dev-1", now=NOW)
    assert rows == [{"ts": queries.iso(NOW - 100), "boot_id": "b", "seq": 30, "kind": "model_change",
                     "detail": {"to": "m@v2"}}]
    assert queries.events(db, "dev-2") == []
    with pytest.raises(QueryError, match="unknown device 'dev-404'"):
        queries.events(db, "dev-404")


def test_timeseries_buckets(db):
    rows = queries.timeseries(db, 3600, buckets=60, now=NOW)
    assert {(r["model"], r["device"]) for r in rows} == {("m@v1", "dev-1"), ("m@v2", "dev-1"), ("m@v1", "dev-2")}
    assert all(r["t"] % 60 == 0 for r in rows)
    assert sum(r["requests"] for r in rows) == 25


@given(st.lists(st.floats(0, 1e4, allow_nan=False), max_size=1100))
def test_the_series_median_is_the_percentile_of_every_other_query(values):
    """The report's cheaper median (found in review: numpy per group cost 5.5 s of CPU on 500 devices) must give
    what figures.percentile gives everywhere else, on both sides of its size switch."""
    got = queries._median(array("d", values))
    assert got is None if not values else got == pytest.approx(percentile(sorted(values), 50), rel=1e-12, abs=1e-9)
    large = np.random.default_rng(len(values)).uniform(0, 1e4, 1001 + len(values))  # the numpy side
    assert queries._median(array("d", large)) == pytest.approx(percentile(large.tolist(), 50), rel=1e-12)


def test_rejected(db):
    assert [(r["device"], r["reason"], r["count"]) for r in queries.rejected(db)] == [("dev-9", "schema", 1)]


def test_requests_that_produced_no_token_have_no_ttft(tmp_path):
    """Found in review: a shed request (no token, ttft_ms 0) counted as a 0 ms TTFT, so the more a device refused
    the better its TTFT p50 looked (0 ms once it shed half)."""
    store = FleetStore(tmp_path / "f.db")
    ingest = Ingest()
    served = [request(i, NOW - 100 + i, "m", "v1", 10, 2000 + i) for i in range(4)]
    shed = [request(10 + i, NOW - 50 + i, "m", "v1", 0, 0, completion=0) for i in range(6)]
    ingest.add_records("dev-1", served + shed, NOW)
    store.commit(ingest)
    store.close()
    row, = queries.tps(queries.open_readonly(tmp_path / "f.db"), since_s=3600, by="version", now=NOW)
    assert row["requests"] == 10 and row["ttft_p50_ms"] == 2001.5 and row["decode_tps_p50"] == 10


def test_a_device_clock_far_ahead_or_never_set_is_stamped_with_arrival(tmp_path):
    """Found in review: a device 180 days ahead put its whole history into `tps --since 1h` and escaped
    retention. A stamp more than CLOCK_SLACK_S ahead of the fleet's clock becomes the arrival time."""
    store = FleetStore(tmp_path / "f.db")
    ingest = Ingest()
    ahead = [request(i, NOW + 180 * 86400 - 3600 * i, "m", "v1", 10, 100) for i in range(30)]
    ingest.add_records("dev-skew", ahead, NOW)
    ingest.add_records("dev-ok", [request(0, NOW - 10, "m", "v1", 10, 100), request(1, NOW + 60, "m", "v1", 10, 100)],
                       NOW)
    # and a clock never set (no RTC, booted in 1970, its rows sent before NTP set it): pruned on arrival before
    ingest.add_records("dev-1970", [request(i, 30.0 + i, "m", "v1", 10, 100) for i in range(3)], NOW)
    store.commit(ingest)
    assert sorted({ts for (ts,) in store.db.execute("select ts from requests where device_id = 'dev-skew'")}) == [NOW]
    assert [ts for (ts,) in store.db.execute("select ts from requests where device_id = 'dev-1970'")] == [NOW] * 3
    store.prune({"requests": NOW - 90 * 86400})
    assert store.db["requests"].count_where("device_id = 'dev-1970'") == 3
    assert sorted(ts for (ts,) in store.db.execute("select ts from requests where device_id = 'dev-ok'")) == [
        NOW - 10, NOW + 60]  # a minute ahead is within the slack: kept as sent
    store.close()


def test_windows_past_a_day_are_answered_from_rollups_with_the_same_counts(db, fleet_target):
    """tps over 7 days reads the 2-day-old request from the rollups (once the background refresh made them),
    the last 10 minutes from raw rows; the percentiles are within the rollups' 1% (fleet.rollups), the counts
    exact; the report's buckets are whole hours."""
    assert queries.ROLLUP_AFTER_S < 7 * 86400
    store = FleetStore(fleet_target)
    while store.refresh_rollups(now=NOW):
        pass
    assert store.rollup_backlog(now=NOW).buckets == 0  # every ended hour rolled up (the open one stays marked)
    assert store.db.execute("select count(*) from request_rollups").fetchone()[0] > 0
    store.close()
    rows = {r["version"]: r for r in queries.tps(db, 7 * 86400, "version", now=NOW)}
    assert (rows["m@v1"]["requests"], rows["m@v2"]["requests"]) == (15, 11)
    v1_speeds = [1] + [10 + i for i in range(10)] + [30] * 4
    assert rows["m@v1"]["decode_tps_p50"] == pytest.approx(np.percentile(v1_speeds, 50), rel=0.01, abs=0.05)
    assert rows["m@v2"]["decode_tps_p50"] == pytest.approx(24.5, rel=0.01)
    points = queries.timeseries(db, 7 * 86400, now=NOW)
    assert sum(p["requests"] for p in points) == 26 and all(p["t"] % (3 * 3600) == 0 for p in points)


def publish(fleet_target, version: str, parameters: Parameters | None) -> None:
    """A models row as edge-fleet publish writes it, for m@version."""
    m = Manifest(name="m", version=version, precision="int4", quant={}, source_sha256="0" * 64, source_name="m.gguf",
                 created_at="2026-01-01T00:00:00+00:00", files={}, parameters=parameters,
                 golden=Golden(prompt="p", prompt_ids=[1], continuation_ids=[2]))
    store = FleetStore(fleet_target)
    store.db["models"].upsert({"name": m.name, "version": m.version, "manifest": m.model_dump_json(),
                               "signature": "s", "key_id": "k", "published_at": NOW}, pk=("name", "version"))
    store.close()


def test_the_reports_summary_gives_each_versions_published_parameters(db, fleet_target):
    """A Mixture of Experts' manifest records total and active parameters; a dense one's records none (blank)."""
    publish(fleet_target, "v1", Parameters(total=1000, active=250))
    publish(fleet_target, "v2", None)
    rows = queries.with_parameters(db, queries.tps(db, 86400, "version", now=NOW))
    assert [(r["version"], r["parameters_total"], r["parameters_active"]) for r in rows] == [
        ("m@v1", 1000, 250), ("m@v2", None, None)]
    assert list(rows[0])[:4] == ["version", "parameters_total", "parameters_active", "requests"]
    assert rows[0]["requests"] == 14


def test_requests_are_grouped_by_adapter_and_rows_from_before_adapters_are_the_base(fleet_target):
    """A request's adapter is stored with it (migration 0014); `tps --by adapter` gives MODEL:ADAPTER@VERSION, and
    MODEL for the base alone, for any window (past a day from rollups keyed by adapter, migration 0017)."""
    store = FleetStore(fleet_target)
    ingest = Ingest()
    adapted = [request(i, NOW - 600 + i, "m", "v1", 10.0, 50) for i in range(6)]
    adapted = [r.model_copy(update={"request": r.request.model_copy(
        update={"adapter": "bot@r8-1" if i < 4 else "doc@r4-2"})}) for i, r in enumerate(adapted)]
    ingest.add_records("dev-1", adapted + [request(10 + i, NOW - 300 + i, "m", "v1", 30.0, 40) for i in range(3)], NOW)
    store.commit(ingest)
    store.close()
    db = queries.open_readonly(fleet_target)
    try:
        assert next(db.query("select count(*) as n from requests where adapter is null"))["n"] == 3
        for window_s in (86400, 7 * 86400):
            rows = {r["adapter"]: r["requests"] for r in queries.tps(db, window_s, "adapter", now=NOW)}
            assert rows == {"m": 3, "m:bot@r8-1": 4, "m:doc@r4-2": 2}
        assert [r["model"] for r in queries.tps(db, 86400, "model", now=NOW)] == ["m"]  # other groupings unchanged
    finally:
        db.close()
