"""PostgreSQL's day partitions of the telemetry tables (fleet.partitions, migration 0015): exactly-once under replay
whatever the restamping, retention by dropping partitions, the default partition, upkeep, and the migration of a
populated database; on SQLite, 0015 changes nothing."""
from __future__ import annotations

import random
import threading
import time

import psycopg
import pytest

from fleet import partitions, queries
from fleet.db import open_database
from fleet.migrations import MIGRATIONS, TELEMETRY_TABLES
from fleet.partitions import PARTITION_S as DAY
from fleet.partitions import day_of, partition_name
from fleet.store import ROW_WRITERS, FleetStore, Ingest
from simdevice import event_record, request_record, sample_record
from fleet_support import wait_until
from test_queries import request

RNG = random.Random(3)
T0 = day_of(time.time()) - 20 * DAY  # a day 20 days back: its partitions are made by the test, not the migration


def commit(store: FleetStore, records, seen_at: float, device_id: str = "d1"):
    ingest = Ingest()
    ingest.add_records(device_id, records, seen_at)
    return store.commit(ingest)


def rows_by_partition(db, table: str = "requests") -> dict[str, int]:
    return dict(db.execute(f"select tableoid::regclass::text, count(*) from {table} group by 1").fetchall())


def exists(db, name: str) -> bool:
    return db.execute("select to_regclass(?)", [name]).fetchone()[0] is not None


def test_a_replay_is_stored_once_across_a_day_boundary_however_its_rows_are_restamped(fleet_target):
    """The key holds the stamp the device sent, not the stored one: a record restamped with its arrival time (a
    clock never set, a clock ahead) arrives on either side of midnight in its two deliveries and is stored once."""
    store = FleetStore(fleet_target)
    store.prepare_partitions(T0)
    midnight = T0 + DAY
    recs = [request_record("b", i, midnight - 30 + i, RNG) for i in range(60)]  # 30 either side of midnight
    recs += [request_record("b", 100, 1000.0, RNG),  # a clock never set: stored at its arrival
             request_record("b", 101, midnight + 3 * 3600, RNG)]  # a clock 3 h ahead: stored at its arrival
    first = commit(store, recs, seen_at=midnight - 60)
    replay = commit(store, recs, seen_at=midnight + 60)  # the broker's redelivery, two minutes later
    assert (first.inserted, replay.inserted, replay.duplicates) == (62, 0, 62)
    assert store.db["requests"].count == 62
    restamped = store.db.execute("select seq, ts from requests where seq >= 100 order by seq").fetchall()
    assert restamped == [(100, midnight - 60), (101, midnight - 60)]  # the first delivery's stamps stay
    if store.db.dialect.partitioned:
        assert rows_by_partition(store.db) == {partition_name("requests", T0): 30,
                                               partition_name("requests", midnight): 31, "requests_default": 1}
    store.close()


def test_a_batch_sent_twice_through_the_broker_is_stored_once_with_its_restamped_rows(fleet_target, consumers,
                                                                                       devices):
    """The whole path (device, Mosquitto, consumer, store): a device resends a batch it saw no acknowledgement
    for; its rows of a clock never set and of a clock ahead are restamped with each arrival."""
    consumer = consumers(store=FleetStore(fleet_target))
    device = devices("dev-1")
    recs = device.make_records(20) + [request_record(device.boot_id, 1000, 1000.0, RNG),
                                      request_record(device.boot_id, 1001, time.time() + 3 * 3600, RNG)]
    device.send(recs)
    wait_until(lambda: consumer.stats.inserted == 22, message="the first delivery stored")
    time.sleep(1.1)  # the second arrival is a second later: its restamps differ
    device.send(recs)
    wait_until(lambda: consumer.stats.duplicates == 22, message="the second delivery dropped")
    with open_database(fleet_target) as db:
        assert sum(db[t].count for t in TELEMETRY_TABLES) == 22 and consumer.stats.inserted == 22
        first, second = db.execute("select ts from requests where seq >= 1000 order by seq").fetchall()
        assert first == second and abs(first[0] - time.time()) < 30  # both restamped, at the first arrival


def _with_days(postgres_url):
    """A store with 10 requests in each of the days T0 and T0 + 1, and one in the default partition stamped in
    T0 (a clock never set), and a log of every row DELETE on requests."""
    store = FleetStore(postgres_url)
    store.prepare_partitions(T0)
    for day in (T0, T0 + DAY):
        commit(store, [request_record(f"b{day}", i, day + 600 * i, RNG) for i in range(10)], seen_at=day + 6000)
    commit(store, [request_record("unset", 1, 1000.0, RNG)], seen_at=T0 + 3600)
    store.db.execute("create table deleted (seq bigint)")
    store.db.execute("create function log_delete() returns trigger language plpgsql as "
                     "$$ begin insert into deleted values (old.seq); return old; end $$")
    store.db.execute("create trigger log_delete after delete on requests for each row execute function log_delete()")
    return store


def test_retention_drops_the_partitions_of_expired_days_and_deletes_only_the_rows_outside_them(postgres_url):
    store = _with_days(postgres_url)
    expired = partition_name("requests", T0)
    assert rows_by_partition(store.db)[expired] == 10
    # the horizon an hour into T0 + 1: T0 goes whole, T0 + 1 stays whole (its first rows are before the horizon)
    assert store.prune({"requests": T0 + DAY + 3600}) == 11
    assert not exists(store.db, expired)
    assert expired not in {p for p, _, _ in partitions.ranges(store.db, "requests")}  # pg_inherits
    assert rows_by_partition(store.db) == {partition_name("requests", T0 + DAY): 10}
    # DROP TABLE deletes no row: the one DELETE was of the default partition's row
    assert store.db.execute("select seq from deleted").fetchall() == [(1,)]
    assert store.prune({"requests": T0 + DAY + 3600}) == 0
    store.close()


def test_a_drop_waits_for_readers_only_so_long_and_then_leaves_the_day_for_the_next_pass(postgres_url):
    """A long query holds the table: the drop gives up after LOCK_TIMEOUT_MS (commits queue behind a waiting DROP)
    and the day's rows stay, not deleted one by one meanwhile; the next pass drops it."""
    store = _with_days(postgres_url)
    expired = partition_name("requests", T0)
    with psycopg.connect(postgres_url) as reader:
        reader.execute("select count(*) from requests")  # a transaction open: its lock held until it ends
        started = time.monotonic()
        assert store.prune({"requests": T0 + DAY + 3600}) == 1  # the default partition's row
        assert time.monotonic() - started < 5
        assert rows_by_partition(store.db)[expired] == 10
    assert store.prune({"requests": T0 + DAY + 3600}) == 10 and not exists(store.db, expired)
    assert store.db.execute("select count(*) from deleted").fetchone()[0] == 1
    store.close()


def test_a_row_no_partition_covers_lands_in_the_default_one_is_queried_and_moves_to_its_day_later(postgres_url):
    store = FleetStore(postgres_url)
    now = time.time()
    month_ago = day_of(now) - 30 * DAY + 3600
    commit(store, [request(1, month_ago, "m", "v1", 20, 100), request(2, 1000.0, "m", "v1", 20, 100),  # 2: unset
                   event_record("b", 3, month_ago, "model_change", to="m@v1")], seen_at=now)
    assert rows_by_partition(store.db) == {"requests_default": 2}
    assert rows_by_partition(store.db, "events") == {"events_default": 1}

    def answers():
        db = queries.open_readonly(postgres_url)
        try:
            return ([r["requests"] for r in queries.tps(db, 31 * DAY, "device", now=now)],
                    [d["requests_1h"] for d in queries.devices(db, now=now)],
                    [e["seq"] for e in queries.events(db, "d1", since_s=31 * DAY, now=now)])
        finally:
            db.close()

    assert answers() == ([2], [1], [3])  # the restamped one in the last hour, by the stamp stored
    assert store.prepare_partitions(month_ago) == 4 * len(TELEMETRY_TABLES)  # that day and the 3 after it
    assert rows_by_partition(store.db) == {partition_name("requests", month_ago): 1, "requests_default": 1}
    assert rows_by_partition(store.db, "events") == {partition_name("events", month_ago): 1}
    assert answers() == ([2], [1], [3])
    store.close()


def test_a_query_over_the_last_hour_reads_no_partition_of_an_earlier_day(postgres_url):
    store = FleetStore(postgres_url)
    store.prepare_partitions(T0)
    now = time.time()
    plan = "\n".join(r[0] for r in store.db.execute(
        "explain select count(*) from requests where ts >= ?" + partitions.from_ts(store.db.dialect, now - 3600),
        [now - 3600]))
    assert partition_name("requests", day_of(now)) in plan and "requests_default" in plan
    assert partition_name("requests", T0) not in plan and partition_name("requests", day_of(now) - DAY) not in plan
    store.close()


def test_the_consumer_makes_the_days_ahead_one_replica_at_a_time(postgres_url, consumers):
    store = FleetStore(postgres_url)
    ahead = partition_name("samples", day_of(time.time()) + partitions.AHEAD_DAYS * DAY)
    store.db.execute(f"drop table {ahead}")
    with psycopg.connect(postgres_url) as other, other.transaction():  # another replica's upkeep under way
        other.execute("select pg_advisory_xact_lock(%s)", [partitions.UPKEEP_LOCK_KEY])
        assert store.prepare_partitions() == 0 and not exists(store.db, ahead)
    consumers(store=FleetStore(postgres_url))
    deadline = time.monotonic() + 10
    while not exists(store.db, ahead) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert exists(store.db, ahead)
    store.close()


def _old_database(target):
    """A fleet database as one before 0015 left it, with rows of two days, one of them restamped."""
    db = open_database(target)
    db.create_table("_migrations", {"name": str, "applied_at": float}, "name")
    for name, step in MIGRATIONS:
        if name != "0015_telemetry_partitions":
            step(db)
            db["_migrations"].insert({"name": name, "applied_at": 0.0})
    ingest = Ingest()
    for day in (T0, T0 + DAY):
        ingest.add_records("d1", [request_record(f"b{day}", 1, day + 60, RNG), sample_record(f"b{day}", 2, day + 70, RNG),
                                  event_record(f"b{day}", 3, day + 80, "model_change", to="x")], seen_at=day + 100)
    ingest.add_records("d2", [request_record("unset", 1, 1000.0, RNG)], seen_at=T0 + 200)
    for device_id, record, sent_ts in ingest.records:  # the writers of an unpartitioned table
        sql, row = ROW_WRITERS[record.kind]
        db.execute(sql, row(device_id, record, sent_ts))
    return db, ingest


def _contents(db) -> dict[str, list[tuple]]:
    return {t: db.execute(f"select {', '.join(_columns(db, t))} from {t} order by device_id, boot_id, seq").fetchall()
            for t in TELEMETRY_TABLES}


def _columns(db, table: str) -> list[str]:
    if db.dialect.name == "sqlite":
        return [r[1] for r in db.execute(f"pragma table_info({table})")]
    return [r[0] for r in db.execute("select column_name from information_schema.columns where table_name = ? "
                                     "and column_name != 'sent_ts' order by ordinal_position", [table])]


def _schema(db) -> list:
    if db.dialect.name == "sqlite":
        return db.execute("select type, name, tbl_name, sql from sqlite_master order by name").fetchall()
    return db.execute("select tablename, indexname from pg_indexes where schemaname = current_schema() and "
                      "tablename in ('requests', 'samples', 'events') order by indexname").fetchall()


def test_the_migration_partitions_a_populated_database_by_its_days_and_keeps_every_row(fleet_target):
    """On SQLite 0015 changes nothing; on PostgreSQL every row stays, with the stamp stored as its sent one, in
    the partition of its day (the restamped 1970 one by the stamp stored), under the same index names."""
    old, ingest = _old_database(fleet_target)
    before, schema = _contents(old), _schema(old)
    old.close()
    store = FleetStore(fleet_target)
    assert store.applied_migrations() == [name for name, _ in MIGRATIONS]
    assert _contents(store.db) == before and sum(map(len, before.values())) == 7
    if store.db.dialect.partitioned:
        assert [n for _, n in _schema(store.db)] == sorted([n for _, n in schema])
        assert store.db.execute("select count(*) from requests where sent_ts != ts").fetchone()[0] == 0
        assert rows_by_partition(store.db) == {partition_name("requests", T0): 2,  # the restamped one too
                                               partition_name("requests", T0 + DAY): 1}
        days = [start for _, start, _ in partitions.ranges(store.db, "events")]
        assert days == [T0, T0 + DAY, *range(day_of(time.time()), day_of(time.time()) + 4 * DAY, DAY)]
    else:
        assert _schema(store.db) == schema
    # stored before the upgrade, replayed after it: dropped, except on PostgreSQL the one restamped before it,
    # whose stamp as sent no row kept (fleet.partitions says so)
    replay = store.commit(ingest)
    assert (replay.inserted, replay.duplicates) == ((1, 6) if store.db.dialect.partitioned else (0, 7))
    store.close()


def test_two_stores_making_partitions_at_once_make_each_once(postgres_url):
    stores = [FleetStore(postgres_url) for _ in range(2)]
    made = []
    threads = [threading.Thread(target=lambda s=s: made.append(s.prepare_partitions(T0))) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(made) == 4 * len(TELEMETRY_TABLES)
    assert len(partitions.ranges(stores[0].db, "requests")) == 8  # T0's four, today's four
    for s in stores:
        s.close()


@pytest.mark.parametrize("since_ts", [0.0, 1_577_836_799.0, 1_800_000_000.5])
def test_the_pruning_condition_is_a_literal_float(since_ts):
    from fleet.db import POSTGRESQL, SQLITE

    assert partitions.from_ts(SQLITE, since_ts) == ""
    assert partitions.from_ts(POSTGRESQL, since_ts) == (f" and (sent_ts >= {since_ts!r} or "
                                                        "sent_ts < 1577836800.0)")


def test_making_a_partition_behind_a_long_lock_gives_up_with_an_error_and_makes_it_later(postgres_url):
    """Attaching locks the default partition: behind a reader holding it, upkeep waits LOCK_TIMEOUT_MS, not for
    the reader, and raises (the consumer logs it and tries again in PARTITIONS_RETRY_S)."""
    store = FleetStore(postgres_url)
    store.prepare_partitions(T0)
    day = T0 + partitions.AHEAD_DAYS * DAY + DAY  # the first day not made yet
    raised = []

    def attempt():
        try:
            store.prepare_partitions(day)
        except psycopg.errors.LockNotAvailable as e:
            raised.append(e)

    with psycopg.connect(postgres_url) as reader:
        reader.execute("select count(*) from requests_default")
        upkeep = threading.Thread(target=attempt)
        upkeep.start()
        upkeep.join(10)
        assert not upkeep.is_alive(), "upkeep waited for the reader"
    upkeep.join()
    assert raised and not exists(store.db, partition_name("requests", day))
    assert store.prepare_partitions(day) == 4 * len(TELEMETRY_TABLES)  # the first failed: none made before
    store.close()
