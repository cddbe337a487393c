"""FleetStore: migrations, batched commits, replay dedupe, the device registry rules, rejected counts."""
from __future__ import annotations

import random
import threading

import pytest

from agent.wire import DeviceState, RequestFigures
from fleet.migrations import MIGRATIONS, REQUEST_FIGURES_COLUMNS, REQUEST_FIGURES_COLUMNS_0002
from fleet.db import database_errors, open_database
from fleet.store import FleetStore, Ingest, StoreError, is_newer_state
from simdevice import event_record, request_record, sample_record

RNG = random.Random(1)


def records(boot: str, seqs, ts: float = 1000.0):
    out = []
    for seq in seqs:
        if seq % 7 == 0:
            out.append(event_record(boot, seq, ts + seq, "model_change", to="x"))
        elif seq % 5 == 0:
            out.append(sample_record(boot, seq, ts + seq, RNG))
        else:
            out.append(request_record(boot, seq, ts + seq, RNG))
    return out


def ingest_of(device_id: str, recs, seen_at: float = 2000.0) -> Ingest:
    ingest = Ingest()
    ingest.add_records(device_id, recs, seen_at=seen_at)
    return ingest


def total_rows(store: FleetStore) -> int:
    return sum(store.db[t].count for t in ("requests", "samples", "events"))


def state(connection: int, status: str = "online", boot: str = "b1", ts: float = 100.0) -> DeviceState:
    return DeviceState(device_id="d1", status=status, connection=connection, boot_id=boot, ts=ts, model="m",
                       version="v1", precision="int4")


def test_migrations_run_once_in_order(fleet_target):
    store = FleetStore(fleet_target)
    assert store.applied_migrations() == [name for name, _ in MIGRATIONS]
    if store.db.dialect.name == "sqlite":
        assert store.db.utils.journal_mode == "wal"
    store.close()
    again = FleetStore(fleet_target)
    assert again.migrate() == []
    again.close()


def test_a_database_migrated_by_a_newer_fleet_is_refused_and_left_as_it_was(fleet_target):
    store = FleetStore(fleet_target)
    store.db["_migrations"].insert({"name": "9999_from_the_future", "applied_at": 0.0})
    store.close()
    with pytest.raises(StoreError, match="migrated by a newer edge-fleet \\(9999_from_the_future\\)"):
        FleetStore(fleet_target)
    with open_database(fleet_target) as db:
        assert db["_migrations"].count == len(MIGRATIONS) + 1


def test_replicas_starting_together_migrate_once(fleet_target):
    """Each migration runs under the migration lock: four stores opened at once on a new database all
    come up, and every migration is recorded once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: FleetStore(fleet_target), range(4)))
    assert sorted(stores[0].applied_migrations()) == sorted(name for name, _ in MIGRATIONS)
    for store in stores:
        store.close()


def test_every_request_figure_has_a_column():
    assert set(REQUEST_FIGURES_COLUMNS) == set(RequestFigures.model_fields)


def test_a_database_from_before_the_constraint_columns_gains_them_and_keeps_its_rows(fleet_target):
    old = open_database(fleet_target)  # as a fleet before 0010 left it, with one request stored
    old.create_table("_migrations", {"name": str, "applied_at": float}, "name")
    for name, step in MIGRATIONS[:9]:
        step(old)
        old["_migrations"].insert({"name": name, "applied_at": 0.0})
    figures = request_record("b", 1, 1000.0, RNG).request.figures.model_dump()
    old["requests"].insert({"device_id": "d1", "boot_id": "b", "seq": 1, "ts": 1000.0, "model": "m", "version": "v",
                            **{c: figures[c] for c in REQUEST_FIGURES_COLUMNS_0002}})
    old.close()
    store = FleetStore(fleet_target)
    assert "0010_request_constraint" in store.applied_migrations()
    record = request_record("b", 2, 1001.0, RNG)
    figures = record.request.figures.model_copy(update={"constrained": True, "constraint_ms": 12.5})
    record = record.model_copy(update={"request": record.request.model_copy(update={"figures": figures})})
    store.commit(ingest_of("d1", [record]))
    rows = store.db.execute("select seq, constrained, constraint_ms from requests order by seq").fetchall()
    assert rows == [(1, 0, 0.0), (2, 1, 12.5)]


def test_batch_is_stored_once_and_replays_are_dropped(fleet_target):
    store = FleetStore(fleet_target)
    recs = records("boot-a", range(1, 101))
    first = store.commit(ingest_of("d1", recs))
    assert (first.inserted, first.duplicates) == (100, 0)
    replay = store.commit(ingest_of("d1", recs[40:60] + records("boot-a", range(101, 111))))
    assert (replay.inserted, replay.duplicates) == (10, 20)
    assert total_rows(store) == 110
    other_device = store.commit(ingest_of("d2", recs[:10]))  # same boot id and seqs, another device: new rows
    assert other_device.inserted == 10
    row = store.db.execute("select ttft_ms, model, finish_reason from requests "
                           "where device_id = 'd1' and seq = 1").fetchone()
    assert row == (recs[0].request.figures.ttft_ms, "smollm2", recs[0].request.figures.finish_reason)
    assert store.db["devices"].get("d1")["last_seen"] == 2000.0


def test_large_batches_with_repeats_within_and_across_commits_are_stored_once(fleet_target):
    """Past fleet.postgres.COPY_MIN_ROWS rows of a table, PostgreSQL stages them by COPY and moves them with one
    INSERT ... SELECT: the same counts as row by row."""
    store = FleetStore(fleet_target)
    recs = records("boot-a", range(1, 1001))
    first = store.commit(ingest_of("d1", recs + recs[:300]))  # a batch holding its own repeats
    assert (first.inserted, first.duplicates) == (1000, 300)
    again = store.commit(ingest_of("d1", recs[500:] + records("boot-a", range(1001, 1201))))
    assert (again.inserted, again.duplicates) == (200, 500)
    assert total_rows(store) == 1200


def with_edges(record):
    """record with what a row's columns must carry through intact: a flag, an adapter or none, a 62-bit count."""
    if record.kind != "request" or record.seq % 3:
        return record
    figures = record.request.figures.model_copy(update={"constrained": True, "constraint_ms": 12.5,
                                                        "kv_bytes": 2**62 + record.seq})
    body = record.request.model_copy(update={"figures": figures, "adapter": f"lora-{record.seq}@r1"})
    return record.model_copy(update={"request": body})


def test_a_large_batch_stores_every_column_as_row_by_row_does(fleet_target):
    """PostgreSQL stages fleet.postgres.COPY_MIN_ROWS rows of a table or more by binary COPY, and inserts fewer
    row by row: both store every column alike, stamps to the microsecond."""
    store = FleetStore(fleet_target)
    recs = [with_edges(r) for r in records("b", range(1, 201), ts=1_760_000_000.123456)]
    store.commit(ingest_of("big", recs))
    for r in recs:
        store.commit(ingest_of("small", [r]))
    for table in ("requests", "samples", "events"):
        big, small = ([{k: v for k, v in row.items() if k != "device_id"} for row in store.db.query(
            f"select * from {table} where device_id = ? order by seq", [device])] for device in ("big", "small"))
        assert big == small and len(big) >= 20, table
    assert store.db.execute("select count(*) from requests where device_id = 'big' and constrained = 1 and "
                            "kv_bytes > ? and adapter like 'lora-%'", [2**62]).fetchone()[0] == \
        sum(r.kind == "request" and r.request.adapter is not None for r in recs) > 0


def test_a_store_whose_connection_was_cut_commits_on_a_new_one(postgres_url):
    store = FleetStore(postgres_url)
    store.commit(ingest_of("d1", records("b", range(1, 501))))  # its staging tables made in this session
    backend = store.db.execute("select pg_backend_pid()").fetchone()[0]
    with open_database(postgres_url) as admin:
        admin.execute("select pg_terminate_backend(?)", [backend])
    later = records("b", range(501, 1001))
    with pytest.raises(database_errors()):
        store.commit(ingest_of("d1", later))
    assert store.commit(ingest_of("d1", later)).inserted == 500
    assert total_rows(store) == 1000


def test_a_failing_commit_writes_nothing(tmp_path):
    store = FleetStore(tmp_path / "f.db")
    good = records("boot-a", range(1, 11))
    broken = good[0].model_copy(update={"seq": 99, "request": None})  # cannot become a row
    ingest = ingest_of("d1", good + [broken])
    ingest.reject("d1", "schema")
    with pytest.raises(AttributeError):
        store.commit(ingest)
    assert total_rows(store) == 0 and store.db["rejected"].count == 0 and store.db["devices"].count == 0


def test_rejections_are_counted_per_device_and_reason(tmp_path):
    store = FleetStore(tmp_path / "f.db")
    for _ in range(2):
        ingest = Ingest()
        ingest.reject("d1", "schema")
        ingest.reject("d1", "schema")
        ingest.reject("d2", "too_large")
        assert store.commit(ingest).rejected == 3
    counts = {(r["device_id"], r["reason"]): r["count"] for r in store.db["rejected"].rows}
    assert counts == {("d1", "schema"): 4, ("d2", "too_large"): 2}


@pytest.mark.parametrize("current, incoming, newer", [
    (None, state(1), True),
    (state(3), state(4), True),  # reconnect
    (state(3), state(3, "offline"), True),  # this connection's Will
    (state(3), state(3, "stopped"), True),  # clean stop
    (state(4), state(3, "offline"), False),  # a late Will from the previous connection
    (state(3, "offline"), state(3, "online"), False),  # a replayed birth cannot reopen an ended connection
    (state(9, ts=100), state(1, boot="b2", ts=200), True),  # re-imaged: counter reset, new boot, later
    (state(9, ts=300), state(1, boot="b0", ts=200), False),  # an old boot's late Will
])
def test_registry_rules(current, incoming, newer):
    row = None if current is None else {"status": current.status, "connection": current.connection,
                                        "boot_id": current.boot_id, "state_ts": current.ts}
    assert is_newer_state(row, incoming) is newer


def test_registry_keeps_the_newest_connection(tmp_path):
    store = FleetStore(tmp_path / "f.db")
    ingest = Ingest()
    for s in (state(1), state(2), state(1, "offline")):
        ingest.add_state(s, s.ts)
    assert store.commit(ingest).states_applied == 2
    device = store.db["devices"].get("d1")
    assert (device["status"], device["connection"], device["model"]) == ("online", 2, "m")


def test_two_writers_on_one_file(tmp_path):
    """Replicas share the database: concurrent commits wait for the lock and every row lands once."""
    stores = [FleetStore(tmp_path / "f.db") for _ in range(2)]
    recs = records("boot-a", range(1, 2001))

    def write(store, offset):
        for i in range(offset, 2000, 100):
            store.commit(ingest_of("d1", recs[max(0, i - 20):i + 50]))  # overlapping: both write the seams

    threads = [threading.Thread(target=write, args=(s, k * 50)) for k, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert total_rows(stores[0]) == 2000


def test_a_retained_state_of_an_earlier_boot_never_overrides_the_new_boot():
    """Found by the demo: the fleet got a new boot's birth (counter 1, its state directory was wiped) and
    then the previous boot's retained 'stopped' (counter 5, older): the device must stay online."""
    from agent.wire import DeviceState
    from fleet.store import is_newer_state

    online = DeviceState(device_id="d", status="online", connection=1, boot_id="boot-2", ts=2000.0)
    stale = DeviceState(device_id="d", status="stopped", connection=5, boot_id="boot-1", ts=1000.0)
    current = {"status": "online", "connection": 1, "boot_id": "boot-2", "state_ts": 2000.0}
    assert not is_newer_state(current, stale)
    assert is_newer_state({"status": "stopped", "connection": 5, "boot_id": "boot-1", "state_ts": 1000.0}, online)


def test_a_new_boot_whose_clock_is_behind_the_last_one_comes_online(tmp_path):
    """The previous boot's clock ran an hour ahead (set wrong, corrected by NTP later): its Will said offline
    at t=5000. The new boot's live birth at t=2000 must bring the device online; only a retained or
    replayed state of another boot is ordered by the clock."""
    store = FleetStore(tmp_path / "f.db")
    will = DeviceState(device_id="d", status="offline", connection=3, boot_id="boot-1", ts=5000.0)
    birth = DeviceState(device_id="d", status="online", connection=1, boot_id="boot-2", ts=2000.0)
    first = Ingest()
    first.add_state(will, will.ts)
    store.commit(first)
    retained = Ingest()
    retained.add_state(birth, birth.ts)  # the same birth, retained: not evidence the device is up now
    assert store.commit(retained).states_applied == 0
    live = Ingest()
    live.add_state(birth, 2001.0, live=True)
    assert store.commit(live).states_applied == 1
    assert store.db["devices"].get("d")["status"] == "online"
    online = {"status": "online", "connection": 1, "boot_id": "boot-2", "state_ts": 2000.0}
    old_birth = DeviceState(device_id="d", status="online", connection=3, boot_id="boot-1", ts=1500.0)
    assert not is_newer_state(online, old_birth, live=True)  # a late birth of an older boot: the clock decides


@pytest.mark.parametrize("bad", [
    {},
    {"seq": 2**63},  # found in review: OverflowError in the writer thread, which died for every device
    {"ts": float("nan")}, {"ts": float("inf")}, {"ts": 1e300},  # broke tps / devices / report for everyone
    {"request_figures": {"ttft_ms": float("nan")}}, {"request_figures": {"prompt_tokens": 2**70}},
])
def test_values_sqlite_or_the_queries_cannot_hold_are_rejected_at_ingest(bad):
    import json

    from fleet.consumer import Inbound, Rejected, add_message

    rec = request_record("boot-a", 1, 1000.0, RNG).model_dump(mode="json")
    rec.update({k: v for k, v in bad.items() if k != "request_figures"})
    rec["request"]["figures"].update(bad.get("request_figures", {}))
    payload = json.dumps({"device_id": "d1", "records": [rec]}).encode()  # json writes NaN / Infinity
    add = lambda: add_message(Ingest(), Inbound("edge/v1/d1/tele", payload, 1, 1, False, 0), "d1", 2000.0)  # noqa: E731
    if not bad:
        add()  # the same record unchanged is accepted
        return
    with pytest.raises(Rejected, match="schema"):
        add()


def test_prune_deletes_old_telemetry_in_batches_and_keeps_the_registry(tmp_path, monkeypatch):
    """Retention (found in review: nothing ever deleted telemetry, ~170 M rows a day at 200 devices)."""
    import fleet.store as store_module

    monkeypatch.setattr(store_module, "PRUNE_BATCH_ROWS", 4)  # several batches per table
    store = FleetStore(tmp_path / "f.db")
    store.commit(ingest_of("d1", records("old", range(1, 40), ts=1000.0)))
    store.commit(ingest_of("d1", records("new", range(1, 40), ts=9000.0), seen_at=9000.0))
    ingest = Ingest()
    ingest.add_state(state(1), 100.0)
    store.commit(ingest)
    before = total_rows(store)
    everything = dict.fromkeys(("requests", "samples", "events"), 5000.0)
    assert store.prune(everything) == 39 and total_rows(store) == before - 39
    for table in ("requests", "samples", "events"):
        assert store.db[table].count_where("boot_id = 'old'") == 0 and store.db[table].count_where("boot_id = 'new'")
    assert store.db["devices"].count == 1 and store.prune(everything) == 0
    store.close()


def test_samples_are_kept_for_less_time_than_requests_and_events(tmp_path):
    """Samples are ~8 rows in 10 of a fleet's database (83 GB for 500 devices over 90 days at the agents'
    default interval) and no query reads them: serve keeps them 14 days by default, the rest 90."""
    from fleet.cli import retention

    day = 86400.0
    assert retention("90d", "14d") == {"requests": 90 * day, "events": 90 * day, "samples": 14 * day}
    assert retention("7d", "14d")["samples"] == 7 * day  # never longer than everything else
    assert retention("forever", "14d") == {"samples": 14 * day}
    assert retention("forever", "forever") == {}
    store = FleetStore(tmp_path / "f.db")
    now = 1_764_000_000.0
    store.commit(ingest_of("d1", records("month-old", range(1, 8), ts=now - 30 * day), seen_at=now))
    store.commit(ingest_of("d1", records("new", range(1, 8), ts=now - day), seen_at=now))
    store.prune({table: now - keep_s for table, keep_s in retention("90d", "14d").items()})
    assert store.db["samples"].count_where("boot_id = 'month-old'") == 0
    for table in ("requests", "samples", "events"):
        assert store.db[table].count_where("boot_id = 'new'")
    for table in ("requests", "events"):
        assert store.db[table].count_where("boot_id = 'month-old'")
    with pytest.raises(ValueError, match="not a telemetry table"):
        store.prune({"devices": now})
    store.close()


def test_the_consumer_prunes_old_telemetry_when_it_starts(broker, consumers, fleet_db):
    import time

    from fleet.db import open_database
    from fleet_support import wait_until

    store = FleetStore(fleet_db)
    store.commit(ingest_of("d1", records("old", range(1, 10), ts=time.time() - 100 * 86400), time.time()))
    store.commit(ingest_of("d1", records("new", range(1, 10), ts=time.time() - 86400), time.time()))
    consumers(store=store, keep_s=dict.fromkeys(("requests", "samples", "events"), 90 * 86400.0))
    db = open_database(fleet_db)
    wait_until(lambda: sum(db[t].count for t in ("requests", "samples", "events")) == 9,
               message="the 100-day-old rows pruned")
    db.close()


def test_ingest_goes_on_while_a_long_prune_runs(broker, consumers, fleet_db, devices, monkeypatch):
    """Found in review (an 18 GB, 91-day database): the writer ran the whole prune in one call, so ingest
    stopped for 24 s on a day of expired rows (149 s at the agent's default sample rate). Retention now
    deletes one batch between two commits: a device's records are stored while the prune goes on."""
    import time

    import fleet.store as store_module
    from fleet.db import open_database
    from fleet_support import wait_until

    monkeypatch.setattr(store_module, "PRUNE_BATCH_ROWS", 2)
    store = FleetStore(fleet_db)
    store.commit(ingest_of("d1", records("old", range(1, 61), ts=time.time() - 100 * 86400), time.time()))
    steps: list[int] = []
    one_step = store.prune_step

    def slow_step(before: dict[str, float]) -> int:  # a batch of a large database takes ~0.1-0.7 s
        time.sleep(0.1)
        steps.append(n := one_step(before))
        return n
    store.prune_step = slow_step
    consumers(store=store, keep_s={"requests": 90 * 86400.0})
    wait_until(lambda: len(steps) >= 2, message="the prune under way")
    devices("dev-new").emit(5)
    db = open_database(fleet_db)
    wait_until(lambda: db["requests"].count_where("device_id = 'dev-new'") > 0, message="new records stored")
    assert len(steps) < 31, "the new records waited for the whole prune"  # 60 rows, 2 a batch, then a 0
    wait_until(lambda: steps[-1:] == [0], 20, message="the prune finished")
    assert db["requests"].count_where("device_id = 'd1'") == 0
    db.close()


def test_records_older_than_their_table_keeps_are_counted_not_stored(tmp_path):
    """Found in review: the backlog of a device offline for three weeks (20% of it samples older than the
    14 days they are kept) was stored, deleted by the next prune, and counted nowhere."""
    day, now = 86400.0, 1_800_000_000.0
    kept = {"requests": 90 * day, "samples": 14 * day, "events": 90 * day}
    old = [request_record("b", 1, now - 20 * day, RNG), sample_record("b", 2, now - 20 * day, RNG),
           sample_record("b", 3, now - day, RNG), event_record("b", 4, now - 91 * day, "start")]
    ingest = Ingest(kept_s=kept)
    ingest.add_records("d1", old, seen_at=now)
    assert [r.seq for _, r, _ in ingest.records] == [1, 3] and ingest.rejected == {("d1", "expired"): 2}
    store = FleetStore(tmp_path / "fleet.db")
    committed = store.commit(ingest)
    assert (committed.inserted, committed.rejected) == (2, 2)
    assert [(r["device_id"], r["reason"], r["count"]) for r in store.db["rejected"].rows] == [("d1", "expired", 2)]
    assert total_rows(store) == 2
    store.close()


def test_the_consumer_refuses_a_backlog_older_than_it_keeps(broker, consumers, fleet_db, devices):
    import time

    from fleet.db import open_database
    from fleet_support import wait_until

    consumers(keep_s={"requests": 14 * 86400.0})
    device = devices("dev-away")
    device.send(device.make_records(3, ts=time.time() - 20 * 86400) + device.make_records(2))
    db = open_database(fleet_db)
    wait_until(lambda: db["rejected"].count, message="the old records counted")
    assert db["requests"].count == 2
    [(reason, count)] = [(r["reason"], r["count"]) for r in db["rejected"].rows]
    assert reason == "expired" and count % 3 == 0  # 3 a delivery: at least once, so a batch may come twice
    db.close()
