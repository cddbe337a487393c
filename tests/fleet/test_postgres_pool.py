"""The rollout driver's short-lived PostgreSQL connections come from a pool: reused, replaced when broken,
read-only where asked, and given back once."""
from __future__ import annotations

import pytest

from fleet.db import database_errors, open_database
from fleet.postgres import POOL_MAX_CONNECTIONS


def backend_pid(db) -> int:
    return db.execute("select pg_backend_pid()").fetchone()[0]


def test_pooled_opens_reuse_one_connection(postgres_url):
    pids = set()
    for _ in range(20):
        with open_database(postgres_url, pooled=True) as db:
            pids.add(backend_pid(db))
    assert len(pids) == 1
    with open_database(postgres_url) as direct:  # unpooled: a connection of its own, closed at close()
        assert backend_pid(direct) not in pids


def test_pooled_opens_at_once_get_their_own_connections_up_to_the_pool_size(postgres_url):
    held = [open_database(postgres_url, pooled=True) for _ in range(3)]
    assert len({backend_pid(db) for db in held}) == 3
    for db in held:
        db.close()
        db.close()  # given back once: a second close is a no-op, not a second copy in the pool
    with open_database(postgres_url) as admin:
        backends = admin.execute("select count(*) from pg_stat_activity where application_name = 'edge-fleet' "
                                 "and datname = current_database() and pid <> pg_backend_pid()").fetchone()[0]
    assert backends == 3 <= POOL_MAX_CONNECTIONS  # idle in the pool, ready for the next borrowers


def test_a_pooled_connection_cut_by_the_server_is_replaced(postgres_url):
    with open_database(postgres_url, pooled=True) as db:
        first = backend_pid(db)
    with open_database(postgres_url) as admin:
        admin.execute("select pg_terminate_backend(?)", [first])
    with open_database(postgres_url, pooled=True) as db:
        try:
            pid = backend_pid(db)
        except database_errors():  # the pool handed out the dead one: the next statement reconnects
            pid = backend_pid(db)
        assert pid != first


def test_a_readonly_pool_refuses_writes_and_the_writable_one_takes_them(postgres_url):
    with open_database(postgres_url, pooled=True) as db:
        db.execute("create table t (a bigint)")
    with open_database(postgres_url, readonly=True, pooled=True) as ro:
        with pytest.raises(database_errors(), match="read-only"):
            ro.execute("insert into t values (1)")
    with open_database(postgres_url, pooled=True) as db:
        db.execute("insert into t values (1)")
        assert db.execute("select count(*) from t").fetchone()[0] == 1
