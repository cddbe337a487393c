"""The fleet database on PostgreSQL (psycopg 3): fleet.db's interface for a `postgresql://` URL.

The only module that imports psycopg. Statements arrive with fleet.db's `?` placeholders and are sent with
server-side binding; executemany runs in libpq's pipeline mode (one round trip per batch, not per row).
Autocommit outside transaction(), as fleet.db says. Types: str -> text, int -> bigint, float -> double
precision (epoch seconds keep their microseconds).
"""
from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

import psycopg
from psycopg.rows import dict_row

from fleet.db import POSTGRESQL, Database, StoreError, describe

CONNECT_TIMEOUT_S = 10
MIGRATION_LOCK_KEY = 0x666C656574  # pg_advisory_lock key of the migrations ("fleet")
_TYPES = {str: "text", int: "bigint", float: "double precision"}
_PLACEHOLDER = re.compile(r"%|\?")


@functools.lru_cache(maxsize=512)
def _pg_sql(sql: str) -> str:
    """'?' -> '%s' and a literal '%' -> '%%': no statement of ours has a '?' inside a string literal."""
    return _PLACEHOLDER.sub(lambda m: "%s" if m.group() == "?" else "%%", sql)


class PostgresDatabase(Database):
    dialect = POSTGRESQL

    def __init__(self, url: str, readonly: bool = False):
        self.url, self.target, self.readonly = url, describe(url), readonly
        try:
            self._conn = self._connect()
        except psycopg.Error as e:
            raise StoreError(f"fleet database {self.target}: {str(e).strip()}") from None
        self._pks: dict[str, tuple[str, ...]] = {}

    def _connect(self) -> psycopg.Connection:
        # keepalives: a server gone without a FIN (a host lost, a failover) is noticed in ~30 s, not hours
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                               application_name="edge-fleet", keepalives_idle=10, keepalives_interval=5,
                               keepalives_count=3)
        if self.readonly:
            conn.execute("set default_transaction_read_only = on")
        return conn

    @property
    def conn(self) -> psycopg.Connection:
        """The connection, made anew if the last one broke (a restart, a failover: with a multi-host URL and
        target_session_attrs=read-write, libpq finds the new primary). Never inside a transaction: a broken
        one fails as a whole, and its caller retries it."""
        if self._conn.closed:
            self._conn = self._connect()
        return self._conn

    def execute(self, sql: str, params: Sequence = ()) -> psycopg.Cursor:
        return self.conn.execute(_pg_sql(sql), tuple(params))  # () too: '%%' is unescaped only with params

    def executemany(self, sql: str, rows: Iterable[Sequence]) -> int:
        with self.conn.cursor() as cursor:
            cursor.executemany(_pg_sql(sql), rows)
            return cursor.rowcount  # psycopg >= 3.1: the sum over every row's statement

    def query(self, sql: str, params: Sequence = ()) -> Iterator[dict]:
        with self.conn.cursor(row_factory=dict_row) as cursor:
            cursor.execute(_pg_sql(sql), tuple(params))
            yield from cursor

    @contextmanager
    def transaction(self, immediate: bool = False) -> Iterator[None]:
        with self.conn.transaction():
            yield

    def close(self) -> None:
        self._conn.close()

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
