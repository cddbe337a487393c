"""Which `edge-fleet serve` replica drives rollouts: exactly one at a time, the holder of a lock that dies
with its holder.

PostgreSQL: a session advisory lock (pg_try_advisory_lock) on a connection of the leader's own, which the
leader also runs its passes on. A leader that dies, or loses that connection, loses the lock with it, and
its half-done pass rolls back with the connection; another replica takes the lock at its next try (every
RETRY_S) and resumes each job where the database says it stands. SQLite: an exclusive flock on a file beside
the database (one machine), released when its process ends.

    leadership = Leadership("postgresql://...")
    if leadership.acquire():             # cheap while held: one round trip checks the lock's connection
        with leadership.database() as db: ...
"""
from __future__ import annotations

import fcntl
import logging
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import ContextManager, Iterator

from fleet.db import Database, database_errors, describe, is_url, open_database

log = logging.getLogger(__name__)

ROLLOUT_LOCK_KEY = 0x726F6C6C6F7574  # pg_advisory_lock key of the rollout leader ("rollout")
RETRY_S = 2.0  # a follower tries for the lock this often: a dead leader's jobs resume within about this


class Leadership:
    """Owned by the driver's thread."""

    def __init__(self, target: Path | str, busy_timeout_s: float = 10.0):
        self.target, self.busy_timeout_s = target, busy_timeout_s
        self._conn: Database | None = None  # PostgreSQL: the lock's connection, while we lead
        self._backend = 0  # its server process: the lock is that session's
        self._lock_file: int | None = None  # SQLite: the flocked file, while we lead

    @property
    def leading(self) -> bool:
        return self._conn is not None or self._lock_file is not None

    def acquire(self) -> bool:
        """Whether this replica leads now: keeps the lock it holds (checking it is still held), or tries to
        take it. Says so in the log when that changes."""
        was = self.leading
        try:
            now = self._hold_postgres() if is_url(self.target) else self._hold_file()
        except database_errors() + (OSError,) as e:
            self._drop()
            if was:
                log.warning("rollouts: lost the leader lock (%s); another replica takes over", str(e).strip())
            return False
        if now and not was:
            log.info("rollouts: this replica leads rollouts now (%s)", describe(self.target))
        return now

    def database(self) -> ContextManager[Database]:
        """The connection a pass runs on: the lock's own on PostgreSQL (a pass cannot outlive the lock), a
        short-lived one on SQLite (WAL: the consumer writes through its own)."""
        if self._conn is not None:
            return nullcontext(self._conn)
        return _closing(open_database(self.target, busy_timeout_s=self.busy_timeout_s))

    def release(self) -> None:
        self._drop()

    def _hold_postgres(self) -> bool:
        if self._conn is not None:
            # raises if the connection is gone; another backend is a connection made anew, without the lock
            if self._conn.execute("select pg_backend_pid()").fetchone()[0] == self._backend:
                return True
            raise OSError("the lock's connection was made anew")
        conn = open_database(self.target)
        if conn.execute("select pg_try_advisory_lock(?)", [ROLLOUT_LOCK_KEY]).fetchone()[0]:
            self._conn, self._backend = conn, conn.execute("select pg_backend_pid()").fetchone()[0]
            return True
        conn.close()
        return False

    def _hold_file(self) -> bool:
        if self._lock_file is not None:
            return True
        fd = os.open(f"{self.target}-rollouts.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_file = fd
        return True

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except database_errors():
                pass  # already broken: closing it is all that was left to do
            self._conn = None
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases the flock
            self._lock_file = None


@contextmanager
def _closing(db: Database) -> Iterator[Database]:
    try:
        yield db
    finally:
        db.close()
