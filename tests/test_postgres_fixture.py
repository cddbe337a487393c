"""The PostgreSQL test fixtures (tests/postgres.py; conftest's postgres_server and postgres_url) against real
servers: fresh databases and their isolation, a streaming standby, failover by promotion, and a libpq multi-host
URL that follows the primary.

Run: .venv/bin/python -m pytest -q tests/test_postgres_fixture.py
"""
from __future__ import annotations

import statistics
import time

import psycopg
import pytest

from postgres import Postgres, database_name

REPLICATION_TIMEOUT_S = 10.0
FRESH_DATABASE_RUNS = 10
# ~13 ms median on PostgreSQL 15 here; the bound only catches a regression by an order of magnitude
FRESH_DATABASE_MAX_MEDIAN_MS = 250.0


@pytest.fixture
def primary():
    server = Postgres().start()
    yield server
    server.stop()


@pytest.fixture
def standby(primary):
    server = primary.standby()
    yield server
    server.stop()


def wait_for_rows(url: str, query: str) -> list[tuple]:
    """query's rows once the standby has replayed them: the database and table may not be there yet."""
    deadline = time.monotonic() + REPLICATION_TIMEOUT_S
    while True:
        try:
            with psycopg.connect(url) as conn:
                rows = conn.execute(query).fetchall()
            if rows:
                return rows
        except (psycopg.OperationalError, psycopg.errors.UndefinedTable):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no rows for {query!r} at {url} within {REPLICATION_TIMEOUT_S} s")
        time.sleep(0.05)


def server_port(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT inet_server_port()").fetchone()[0]


def test_fresh_database_takes_a_table(postgres_url):
    with psycopg.connect(postgres_url) as conn:
        conn.execute("CREATE TABLE t (id integer PRIMARY KEY, name text)")
        conn.execute("INSERT INTO t VALUES (1, 'one')")
        assert conn.execute("SELECT id, name FROM t").fetchall() == [(1, "one")]


def test_fresh_databases_are_isolated(postgres_server, postgres_url):
    other = postgres_server.fresh_database()
    with psycopg.connect(postgres_url) as conn:
        conn.execute("CREATE TABLE only_here (x integer)")
    with psycopg.connect(other) as conn:
        assert conn.execute("SELECT to_regclass('only_here')").fetchone() == (None,)
    postgres_server.drop_database(database_name(other))


def test_drop_database_cuts_off_connections_left_open(postgres_server):
    url = postgres_server.fresh_database()
    left_open = psycopg.connect(url)
    postgres_server.drop_database(database_name(url))
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url).close()
    left_open.close()


def test_fresh_database_takes_tens_of_ms(postgres_server, figures):
    times_ms = []
    for _ in range(FRESH_DATABASE_RUNS):
        start = time.perf_counter()
        url = postgres_server.fresh_database()
        times_ms.append((time.perf_counter() - start) * 1000)
        postgres_server.drop_database(database_name(url))
    median_ms = statistics.median(times_ms)
    line = (f"postgres: fresh_database() median {median_ms:.1f} ms of {FRESH_DATABASE_RUNS} "
            f"(min {min(times_ms):.1f}, max {max(times_ms):.1f})")
    figures.append(line)
    print(line)
    assert median_ms < FRESH_DATABASE_MAX_MEDIAN_MS, line


def test_stop_removes_the_data_directory():
    server = Postgres().start()
    assert (server.data_dir / "PG_VERSION").exists()
    server.stop()
    assert not server.workdir.exists()


def test_standby_follows_the_primary_and_takes_writes_once_promoted(primary, standby):
    name = database_name(primary.fresh_database())
    with psycopg.connect(primary.database_url(name), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id integer)")
        conn.execute("INSERT INTO t VALUES (1)")
    assert wait_for_rows(standby.database_url(name), "SELECT id FROM t") == [(1,)]
    with psycopg.connect(standby.database_url(name)) as conn, pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        conn.execute("INSERT INTO t VALUES (2)")

    primary.kill()
    standby.promote()
    with psycopg.connect(standby.database_url(name), autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (2)")
        assert conn.execute("SELECT id FROM t ORDER BY id").fetchall() == [(1,), (2,)]


def test_multi_host_url_reaches_whichever_is_the_primary(primary, standby):
    name = database_name(primary.fresh_database())
    wait_for_rows(standby.database_url(name), "SELECT 1")  # the database has reached the standby
    hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
    url = f"postgresql://postgres@{hosts}/{name}?target_session_attrs=read-write"
    reversed_url = f"postgresql://postgres@127.0.0.1:{standby.port},127.0.0.1:{primary.port}/{name}" \
                   "?target_session_attrs=read-write"
    assert server_port(url) == primary.port
    assert server_port(reversed_url) == primary.port  # the standby answers first and is passed over

    primary.kill()
    standby.promote()
    assert server_port(url) == standby.port
