"""The fleet database on PostgreSQL (psycopg 3): fleet.db's interface for a `postgresql://` URL.

The only module that imports psycopg. Statements arrive with fleet.db's `?` placeholders and are sent with
server-side binding; executemany runs in libpq's pipeline mode (one round trip per batch, not per row), except
the telemetry inserts (`insert into T (...) values (...) on conflict do nothing` with COPY_MIN_ROWS rows or more),
which are staged by binary COPY in a temporary table and moved by one INSERT ... SELECT.
Autocommit outside transaction(), as fleet.db says. Types: str -> text, int -> bigint, float -> double
precision (epoch seconds keep their microseconds).

Connections: a long-lived database (the consumer's store, the leader's lock, a command-line query) holds its
own; a server's short-lived one (`pooled`: the rollout driver's report batches and passes) borrows one from the
process's psycopg-pool pool for its URL and mode, and close() gives it back, so a busy replica does not pay a
connection (a backend process, authentication, on a remote server TLS) for every batch. While the server is
unreachable a borrower waits up to CONNECT_TIMEOUT_S and the pool's own log names each failed attempt.
"""
from __future__ import annotations

import atexit
import functools
import re
import threading
import zlib
from contextlib import contextmanager, nullcontext
from typing import Any, Iterable, Iterator, Sequence

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from fleet.db import POSTGRESQL, Database, StoreError, describe

CONNECT_TIMEOUT_S = 10
MIGRATION_LOCK_KEY = 0x666C656574  # pg_advisory_lock key of the migrations ("fleet")
_TYPES = {str: "text", int: "bigint", float: "double precision"}
_PLACEHOLDER = re.compile(r"%|\?")
# The store's telemetry insert (fleet.store._insert_sql): table, columns. A rewrite of it must keep this form.
_INSERT_IGNORING = re.compile(r"insert into (\w+) \(([\w, ]+)\) values \([?, ]+\) on conflict do nothing")
# From this many rows on, COPY + INSERT ... SELECT beats the pipeline's INSERT per row: at 500 rows (a 50 ms
# commit at 10,000 records/s) ~30% less CPU in this process and ~25% less in the server, which on a host
# shared by consumers, server and broker is ingest rate. Even at ~32 rows; below that the pipeline is cheaper.
COPY_MIN_ROWS = 48
# COPY's binary format, not text: no number formatted as text here nor parsed back in the server. Commits of
# 10,000 of fleet_ingest's records cost 4.9 us of this process' CPU a record against 9.0 in text, and 9.3 us of
# the server's against 10.1.
# A replica's borrowers at once: the rollout pass, the artifact server's and the report's request threads. More
# would wait (up to CONNECT_TIMEOUT_S) rather than open backends without bound; idle ones close after POOL_IDLE_S.
POOL_MAX_CONNECTIONS = 8
POOL_IDLE_S = 60.0
_CONNECT_ARGS = dict(autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, application_name="edge-fleet",
                     # keepalives: a server gone without a FIN (a host lost, a failover) is noticed in ~30 s
                     keepalives_idle=10, keepalives_interval=5, keepalives_count=3)
MAX_POOLS = 4  # a process serves one database (two pools: read-write and read-only); more are closed oldest first
_pools: dict[tuple[str, bool], ConnectionPool] = {}  # (url, readonly) -> this process's pool, oldest first
_pools_lock = threading.Lock()


@functools.lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """'?' -> '%s' and a literal '%' -> '%%': no statement of ours has a '?' inside a string literal."""
    return _PLACEHOLDER.sub(lambda m: "%s" if m.group() == "?" else "%%", sql)


class PostgresDatabase(Database):
    dialect = POSTGRESQL

    def __init__(self, url: str, readonly: bool = False, pooled: bool = False):
        self.url, self.target, self.readonly = url, describe(url), readonly
        self._pool = _pool(url, readonly) if pooled else None
        self._returned = False
        try:
            self._conn = self._connect()
        except (psycopg.Error, PoolTimeout) as e:
            raise StoreError(f"fleet database {self.target}: {str(e).strip()}") from None
        self._pks: dict[str, tuple[str, ...]] = {}
        # (table, columns) -> its temporary staging table and that table's column types
        self._staging: dict[tuple[str, str], tuple[str, list[str]]] = {}

    def _connect(self) -> psycopg.Connection:
        if self._pool is not None:
            return self._pool.getconn(timeout=CONNECT_TIMEOUT_S)
        conn = psycopg.connect(self.url, **_CONNECT_ARGS)
        _configure(conn, self.readonly)
        return conn

    @property
    def conn(self) -> psycopg.Connection:
        """The connection, made anew if the last one broke (a restart, a failover: with a multi-host URL and
        target_session_attrs=read-write, libpq finds the new primary). Never inside a transaction: a broken
        one fails as a whole, and its caller retries it."""
        if self._conn.closed:
            if self._pool is not None:
                self._pool.putconn(self._conn)  # a broken connection is discarded by the pool
            self._conn = self._connect()
            self._staging.clear()  # temporary tables are the old session's
        return self._conn

    def execute(self, sql: str, params: Sequence = ()) -> psycopg.Cursor:
        return self.conn.execute(_pg_sql(sql), tuple(params))  # () too: '%%' is unescaped only with params

    def executemany(self, sql: str, rows: Iterable[Sequence]) -> int:
        rows = rows if isinstance(rows, list) else list(rows)
        insert = _INSERT_IGNORING.fullmatch(sql) if len(rows) >= COPY_MIN_ROWS else None
        if insert:
            return self._insert_staged(insert.group(1), insert.group(2), rows)
        with self.conn.cursor() as cursor:
            cursor.executemany(_pg_sql(sql), rows)
            return cursor.rowcount  # psycopg >= 3.1: the sum over every row's statement

    def _insert_staged(self, table: str, columns: str, rows: list[Sequence]) -> int:
        """COPY the rows into a temporary table, then one INSERT ... SELECT ... ON CONFLICT DO NOTHING, in
        primary-key order (replicas inserting the same replayed keys lock them in one order, as the store's
        sorted rows did); its rowcount is the rows new to `table`. The staging table is emptied by the same
        statement (a second call in one transaction sees only its own rows) and truncated at commit (temporary
        tables are never autovacuumed: deleted rows would pile up)."""
        staging, types = self._staging_table(table, columns)
        named = {c.strip() for c in columns.split(",")}
        order = ", ".join(c for c in self.primary_key(table) if c in named) or "1"
        in_transaction = self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
        with (nullcontext() if in_transaction else self.conn.transaction()), self.conn.cursor() as cursor:
            with cursor.copy(f"copy {staging} ({columns}) from stdin (format binary)") as copy:
                copy.set_types(types)  # binary: each value dumped as its column's type (an int into a float column)
                for row in rows:
                    copy.write_row(row)
            cursor.execute(f"with staged as (delete from {staging} returning {columns}) insert into {table} "
                           f"({columns}) select {columns} from staged order by {order} on conflict do nothing")
            return cursor.rowcount

    def _staging_table(self, table: str, columns: str) -> tuple[str, list[str]]:
        """The temporary table staging `columns` of `table`, made if missing, and its column types in that order."""
        key = (table, columns)
        if key not in self._staging:
            name = f"_staged_{table}_{zlib.crc32(columns.encode()):08x}"  # the same after a rollback's clear()
            self.conn.execute(f"create temporary table if not exists {name} on commit delete rows as "
                              f"select {columns} from {table} with no data")
            types = [r[0] for r in self.conn.execute(
                "select format_type(atttypid, atttypmod) from pg_attribute where attrelid = %s::regclass and "
                "attnum > 0 and not attisdropped order by attnum", [name])]
            self._staging[key] = (name, types)
        return self._staging[key]

    def query(self, sql: str, params: Sequence = ()) -> Iterator[dict]:
        with self.conn.cursor(row_factory=dict_row) as cursor:
            cursor.execute(_pg_sql(sql), tuple(params))
            yield from cursor

    @contextmanager
    def transaction(self, immediate: bool = False) -> Iterator[None]:
        try:
            with self.conn.transaction():
                yield
        except BaseException:
            self._staging.clear()  # a staging table made in this transaction went with it (made again if missing)
            raise

    def close(self) -> None:
        if self._pool is None:
            self._conn.close()
        elif not self._returned:  # given back once (the pool rolls back a transaction left open)
            self._returned = True
            self._pool.putconn(self._conn)

    def table_names(self) -> list[str]:
        return [r[0] for r in self.conn.execute(
            "select tablename from pg_tables where schemaname = current_schema() order by tablename")]

    def primary_key(self, table: str) -> tuple[str, ...]:
        if table not in self._pks:
            self._pks[table] = tuple(r[0] for r in self.conn.execute(
                "select a.attname from pg_index i join pg_attribute a on a.attrelid = i.indrelid and "
                "a.attnum = any(i.indkey) where i.indrelid = %s::regclass and i.indisprimary "
                "order by array_position(i.indkey, a.attnum)", [table]))
        return self._pks[table]

    @contextmanager
    def migration_lock(self) -> Iterator[None]:
        # a session lock on this connection: a replica that dies mid-migration releases it with its connection
        self.conn.execute("select pg_advisory_lock(%s)", [MIGRATION_LOCK_KEY])
        try:
            yield
        finally:
            self.conn.execute("select pg_advisory_unlock(%s)", [MIGRATION_LOCK_KEY])

    def create_table(self, name: str, columns: dict[str, type], pk: str | tuple[str, ...]) -> None:
        keys = (pk,) if isinstance(pk, str) else tuple(pk)
        body = ", ".join(f"{c} {_TYPES[t]}" + (" not null" if c in keys else "") for c, t in columns.items())
        self.conn.execute(f"create table {name} ({body}, primary key ({', '.join(keys)}))")

    def create_index(self, table: str, columns: list[str], if_not_exists: bool = False) -> None:
        name = f"idx_{table}_{'_'.join(columns)}"  # sqlite-utils' name for it
        self.conn.execute(f"create index {'if not exists ' if if_not_exists else ''}{name} on {table} "
                          f"({', '.join(columns)})")

    def add_column(self, table: str, column: str, kind: type, not_null_default: Any = None) -> None:
        default = "" if not_null_default is None else f" not null default {_literal(not_null_default)}"
        self.conn.execute(f"alter table {table} add column {column} {_TYPES[kind]}{default}")


def _literal(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    raise ValueError(f"a column default must be a number here, got {value!r}")


def _configure(conn: psycopg.Connection, readonly: bool) -> None:
    if readonly:
        conn.execute("set default_transaction_read_only = on")


def _pool(url: str, readonly: bool) -> ConnectionPool:
    """This process's pool for url in that mode, opened at first use (no connection until one is borrowed)."""
    with _pools_lock:
        if (url, readonly) not in _pools:
            _pools[(url, readonly)] = ConnectionPool(
                url, min_size=0, max_size=POOL_MAX_CONNECTIONS, max_idle=POOL_IDLE_S, kwargs=_CONNECT_ARGS,
                configure=functools.partial(_configure, readonly=readonly), name="edge-fleet", num_workers=1,
                open=True)
        retired = [_pools.pop(key) for key in list(_pools)[:-MAX_POOLS]]
        pool = _pools[(url, readonly)]
    for old in retired:  # its borrowed connections are closed when given back (the pool is closed by then)
        old.close(timeout=0)
    return pool


@atexit.register
def close_pools() -> None:
    """Close every pool's connections (its worker threads would otherwise hold the interpreter's exit)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()
