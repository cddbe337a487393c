"""The fleet database seam: one small interface over SQLite (the embedded default, a file path) and
PostgreSQL (a `postgresql://` URL, fleet.postgres), so that every module above writes its SQL once.

SQL is written with `?` placeholders in the dialect both databases share (ON CONFLICT upserts, row values,
CASE); what differs is a `Dialect` fragment (hour buckets, greatest-of-two, the physical row id, index hints).
Autocommit outside `transaction()`: each statement commits alone, as a PostgreSQL session does by default.
Schema changes go through create_table / create_index / add_column, which keep SQLite's schema exactly
what sqlite-utils made before this seam existed.

    db = open_database("fleet.db")            # or "postgresql://fleet@db.example/fleet"
    with db.transaction():
        db.execute("update jobs set state = ? where id = ?", ["FAILED", job_id])
"""
from __future__ import annotations

import sqlite3
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence
from urllib.parse import urlsplit

import sqlite_utils

BUSY_TIMEOUT_S = 30.0  # replicas sharing one SQLite file wait this long for the write lock
URL_SCHEMES = ("postgresql://", "postgres://")


class StoreError(ValueError):
    """The fleet database cannot be opened or is not one this code can use; the message names it."""


def is_url(target: str | Path) -> bool:
    return str(target).startswith(URL_SCHEMES)


def has_password(target: str | Path) -> bool:
    return is_url(target) and urlsplit(str(target)).password is not None


def describe(target: str | Path) -> str:
    """The target as a message may name it: a URL without its password."""
    text = str(target)
    if not is_url(text) or "@" not in text.split("/")[2]:
        return text
    scheme, rest = text.split("://", 1)
    userinfo, host = rest.split("@", 1)
    return f"{scheme}://{userinfo.split(':', 1)[0]}@{host}"


def database_errors() -> tuple[type[BaseException], ...]:
    """What a database call may raise for the database's sake (locked, gone, full, constraint): each driver's
    base error. psycopg's only once it is loaded: before that, nothing can have raised it."""
    psycopg = sys.modules.get("psycopg")
    return (sqlite3.Error,) + ((psycopg.Error,) if psycopg else ())


def unavailable_errors() -> tuple[type[BaseException], ...]:
    """The errors after which the same statement may succeed later: a lock, a full disk, a lost connection,
    a failover, a deadlock (psycopg's TransactionRollback is one of its OperationalErrors)."""
    psycopg = sys.modules.get("psycopg")
    return (sqlite3.OperationalError,) + ((psycopg.OperationalError,) if psycopg else ())


@dataclass(frozen=True)
class Dialect:
    name: str
    row_id: str  # the physical row id, for batched deletes
    hour: Callable[[str], str]  # epoch seconds -> 'YYYY-MM-DDTHH:00Z'
    day_time: Callable[[str], str]  # epoch seconds -> 'YYYY-MM-DD HH:MM:SS'
    bucket: Callable[[str], str]  # floor(epoch seconds / ?): the one parameter is the bucket's width
    greatest: Callable[[str, str], str]
    no_index: Callable[[str], str]  # a column the planner must not pick an index for
    lock_row: str  # appended to a select whose rows the transaction then updates
    partitioned: bool  # the telemetry tables are partitioned by day on sent_ts (fleet.partitions, migration 0015)


SQLITE = Dialect(
    name="sqlite", row_id="rowid",
    hour=lambda ts: f"strftime('%Y-%m-%dT%H:00Z', {ts}, 'unixepoch')",
    day_time=lambda ts: f"datetime({ts}, 'unixepoch')",
    bucket=lambda ts: f"cast({ts} / ? as integer)",  # ts >= 0: truncation is floor
    greatest=lambda a, b: f"max({a}, {b})",
    no_index=lambda column: f"+{column}",
    lock_row="",  # BEGIN IMMEDIATE has locked the whole file already
    partitioned=False,
)

POSTGRESQL = Dialect(
    name="postgresql", row_id="ctid",
    hour=lambda ts: f"to_char(to_timestamp({ts}) at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:00\"Z\"')",
    day_time=lambda ts: f"to_char(to_timestamp({ts}) at time zone 'UTC', 'YYYY-MM-DD HH24:MI:SS')",
    bucket=lambda ts: f"floor({ts} / ?)::bigint",  # a cast alone rounds
    greatest=lambda a, b: f"greatest({a}, {b})",
    no_index=lambda column: column,
    lock_row=" for update",
    partitioned=True,
)


class Table:
    """The few row operations the fleet uses on one table (sqlite-utils' names for them)."""

    def __init__(self, db: "Database", name: str):
        self.db, self.name = db, name

    def _pk(self) -> tuple[str, ...]:
        return self.db.primary_key(self.name)

    def get(self, key: Any) -> dict:
        """The row with this primary key (a tuple for a compound one); KeyError if there is none."""
        values = key if isinstance(key, (tuple, list)) else (key,)
        where = " and ".join(f"{c} = ?" for c in self._pk())
        row = next(self.rows_where(where, list(values)), None)
        if row is None:
            raise KeyError(f"no row {key!r} in {self.name}")
        return row

    def rows_where(self, where: str | None = None, params: Sequence = (), order_by: str | None = None) -> Iterator[dict]:
        sql = f"select * from {self.name}" + (f" where {where}" if where else "") + (
            f" order by {order_by}" if order_by else "")
        return self.db.query(sql, params)

    @property
    def rows(self) -> Iterator[dict]:
        return self.rows_where()

    def count_where(self, where: str, params: Sequence = ()) -> int:
        return self.db.execute(f"select count(*) from {self.name} where {where}", params).fetchone()[0]

    @property
    def count(self) -> int:
        return self.db.execute(f"select count(*) from {self.name}").fetchone()[0]

    def insert(self, row: dict) -> None:
        self.insert_all([row])

    def insert_all(self, rows: Iterable[dict]) -> None:
        rows = list(rows)
        if rows:
            columns = list(rows[0])
            self.db.executemany(f"insert into {self.name} ({', '.join(columns)}) values ({_marks(len(columns))})",
                                [[r[c] for c in columns] for r in rows])

    def upsert(self, row: dict, pk: str | tuple[str, ...]) -> None:
        """Insert the row, or update the columns it names where its primary key is already there."""
        keys = (pk,) if isinstance(pk, str) else tuple(pk)
        columns = list(row)
        updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in keys)
        self.db.execute(f"insert into {self.name} ({', '.join(columns)}) values ({_marks(len(columns))}) "
                        f"on conflict ({', '.join(keys)}) do " + (f"update set {updates}" if updates else "nothing"),
                        [row[c] for c in columns])

    def delete_where(self, where: str, params: Sequence = ()) -> int:
        return self.db.execute(f"delete from {self.name} where {where}", params).rowcount

    def delete(self, key: Any) -> None:
        values = key if isinstance(key, (tuple, list)) else (key,)
        self.delete_where(" and ".join(f"{c} = ?" for c in self._pk()), list(values))


def _marks(n: int) -> str:
    return ", ".join("?" * n)


class Database:
    """One connection, owned by one thread at a time. Subclasses: SqliteDatabase, fleet.postgres.PostgresDatabase."""

    dialect: Dialect
    target: str  # what it was opened from, as messages name it (no password)

    def execute(self, sql: str, params: Sequence = ()) -> Any:
        """A cursor: rowcount, fetchone(), and iteration over tuples."""
        raise NotImplementedError

    def executemany(self, sql: str, rows: Iterable[Sequence]) -> int:
        """Rows changed in all."""
        raise NotImplementedError

    def query(self, sql: str, params: Sequence = ()) -> Iterator[dict]:
        raise NotImplementedError

    @contextmanager
    def transaction(self, immediate: bool = False) -> Iterator[None]:
        """Everything inside commits together or not at all. immediate: take the write lock now (SQLite),
        so that two writers never deadlock upgrading a read lock; PostgreSQL locks rows as it goes."""
        raise NotImplementedError
        yield

    def close(self) -> None:
        raise NotImplementedError

    def table_names(self) -> list[str]:
        raise NotImplementedError

    def primary_key(self, table: str) -> tuple[str, ...]:
        raise NotImplementedError

    @contextmanager
    def migration_lock(self) -> Iterator[None]:
        """Held while migrations run: one replica migrates, the others wait and then find nothing to do."""
        yield

    # ---- schema (migrations only) ----
    def create_table(self, name: str, columns: dict[str, type], pk: str | tuple[str, ...]) -> None:
        raise NotImplementedError

    def create_index(self, table: str, columns: list[str], if_not_exists: bool = False) -> None:
        raise NotImplementedError

    def add_column(self, table: str, column: str, kind: type, not_null_default: Any = None) -> None:
        raise NotImplementedError

    def __getitem__(self, table: str) -> Table:
        return Table(self, table)

    def __enter__(self) -> "Database":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SqliteDatabase(Database):
    dialect = SQLITE

    def __init__(self, path: Path, readonly: bool = False, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path, self.target = Path(path), str(path)
        uri = self.path.resolve().as_uri() + ("?mode=ro" if readonly else "")
        # isolation_level=None: no implicit BEGIN; transaction() says where one starts and ends
        self.conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout_s, check_same_thread=False,
                                    isolation_level=None)
        self.utils = sqlite_utils.Database(self.conn)  # the schema operations, as before this seam

    def execute(self, sql: str, params: Sequence = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence]) -> int:
        return self.conn.executemany(sql, rows).rowcount

    def query(self, sql: str, params: Sequence = ()) -> Iterator[dict]:
        cursor = self.conn.execute(sql, params)
        names = [d[0] for d in cursor.description]
        for row in cursor:
            yield dict(zip(names, row))

    @contextmanager
    def transaction(self, immediate: bool = False) -> Iterator[None]:
        self.conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
        try:
            yield
        except BaseException:
            self.conn.rollback()
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    def table_names(self) -> list[str]:
        return self.utils.table_names()

    def primary_key(self, table: str) -> tuple[str, ...]:
        return tuple(self.utils[table].pks)

    def create_table(self, name: str, columns: dict[str, type], pk: str | tuple[str, ...]) -> None:
        self.utils[name].create(columns, pk=pk)

    def create_index(self, table: str, columns: list[str], if_not_exists: bool = False) -> None:
        self.utils[table].create_index(columns, if_not_exists=if_not_exists)

    def add_column(self, table: str, column: str, kind: type, not_null_default: Any = None) -> None:
        self.utils[table].add_column(column, kind, not_null_default=not_null_default)


def open_database(target: str | Path, readonly: bool = False, busy_timeout_s: float = BUSY_TIMEOUT_S,
                  pooled: bool = False) -> Database:
    """A path opens (or creates) a SQLite file; a postgresql:// URL connects (libpq's URL: several hosts and
    target_session_attrs=read-write for a failover pair; the password from ~/.pgpass, PGPASSFILE or
    PGPASSWORD, never a command line). pooled: a short-lived use, which on PostgreSQL borrows a connection from
    the process's pool and gives it back at close() (a SQLite file is opened as ever: it costs a file open)."""
    if is_url(target):
        from fleet.postgres import PostgresDatabase

        return PostgresDatabase(str(target), readonly=readonly, pooled=pooled)
    return SqliteDatabase(Path(target), readonly=readonly, busy_timeout_s=busy_timeout_s)
