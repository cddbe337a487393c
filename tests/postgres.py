"""A real throwaway PostgreSQL server for tests: initdb'd into a directory of its own, started on a free loopback
port, handing out a fresh database per test, and able to make a streaming standby of itself for failover tests.

It never touches the packaged cluster (Debian's `main` on 5432): each server has its own data directory, port and
socket directory. Durability is off (fsync, synchronous_commit, full_page_writes): the crashes the tests cause
kill the postmaster, not the machine, and the WAL they need is still written.
As root, the server programs run as the `postgres` user (initdb refuses root), so every directory they use is
owned by it and every parent must be traversable by it.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from broker import free_port

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 30.0
# Data directories go in tmpfs when it has room: CREATE DATABASE took a median of ~81 ms in /tmp (ext4) and
# ~5 ms in /dev/shm on the 2-CPU dev box, fsync off in both. Each server needs ~40 MB plus its databases.
TMPFS_DIR = Path("/dev/shm")
TMPFS_MIN_FREE_BYTES = 1 << 30
# wal_level=replica and max_wal_senders are PostgreSQL 10+'s defaults, stated because standby() needs them
SERVER_OPTIONS = ("fsync=off", "synchronous_commit=off", "full_page_writes=off",
                  "wal_level=replica", "max_wal_senders=10", "listen_addresses=127.0.0.1")

_names = itertools.count()


def postgres_bin_dir() -> Path:
    """The newest installed major's binaries (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = [d for d in Path("/usr/lib/postgresql").glob("*/bin")
             if d.parent.name.isdigit() and (d / "postgres").exists()]
    if not found:
        raise RuntimeError("postgresql is not installed (run .ci/setup)")
    return max(found, key=lambda d: int(d.parent.name))


def database_name(url: str) -> str:
    """The database a URL names: postgresql://user@host:port/NAME[?params]."""
    return url.split("?", 1)[0].rsplit("/", 1)[1]


def scratch_root() -> str | None:
    """Where new server directories go: tmpfs if it has room, else tempfile's default (TMPDIR, /tmp)."""
    if not (TMPFS_DIR.is_dir() and os.access(TMPFS_DIR, os.W_OK)):
        return None
    return str(TMPFS_DIR) if shutil.disk_usage(TMPFS_DIR).free >= TMPFS_MIN_FREE_BYTES else None


def as_server_user(argv: list[str]) -> list[str]:
    """argv run as the user the server runs as: `postgres` when we are root, else ourselves."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def give_to_server_user(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def run_server_tool(cwd: Path, tool: str, *args: str) -> None:
    """One of the server's programs, run to completion; its output is in the error when it fails."""
    r = subprocess.run(as_server_user([str(postgres_bin_dir() / tool), *args]), cwd=cwd, capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{tool} failed ({r.returncode}): {r.stderr or r.stdout}")


class Postgres:
    """One server. workdir None: a new temporary directory, removed with the server; a given workdir is kept
    (with the log) and only its data directory is removed; as root it is handed to the postgres user (mode 0o755),
    so its parents must be traversable by that user."""

    def __init__(self, workdir: Path | None = None, port: int | None = None):
        self.owns_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="edge-llm-pg-", dir=scratch_root()))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(0o755)
        give_to_server_user(self.workdir)
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "postgres.log"
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._admin: psycopg.Connection | None = None

    @property
    def url(self) -> str:
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def start(self) -> "Postgres":
        if not (self.data_dir / "PG_VERSION").exists():
            self.initdb()
        # The socket goes in workdir, not /var/run/postgresql (root's) nor data_dir (a base backup would copy its lock)
        options = [*SERVER_OPTIONS, f"unix_socket_directories={self.workdir}"]
        argv = [str(postgres_bin_dir() / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(as_server_user(argv + [a for o in options for a in ("-c", o)]),
                                         cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_until_accepting()
        except RuntimeError:
            self.kill()
            raise
        return self

    def initdb(self) -> None:
        self.check_reachable()
        run_server_tool(self.workdir, "initdb", "-D", str(self.data_dir), "--auth=trust", "--no-sync", "-U",
                        "postgres", "--encoding=UTF8", "--locale=C")

    def check_reachable(self) -> None:
        if os.geteuid() != 0:
            return
        r = subprocess.run(as_server_user(["test", "-w", str(self.workdir)]), cwd="/")
        if r.returncode != 0:
            raise RuntimeError(f"the postgres user cannot write {self.workdir}: a parent directory is not "
                               "traversable (pytest's tmp_path is root's 0o700); pass workdir=None")

    def wait_until_accepting(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"postgres exited ({self.proc.returncode}): see {self.log_path}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not accept connections in {START_TIMEOUT_S} s: "
                                       f"see {self.log_path}") from None
                time.sleep(0.05)

    def admin(self) -> psycopg.Connection:
        """An autocommit connection to the `postgres` database (CREATE / DROP DATABASE cannot run in a
        transaction)."""
        if self._admin is None or self._admin.closed:
            self._admin = psycopg.connect(self.url, autocommit=True)
        return self._admin

    def fresh_database(self) -> str:
        """A new, empty, uniquely named database; its URL."""
        name = f"test_{os.getpid()}_{next(_names)}"
        # A prepared template or STRATEGY FILE_COPY measured no faster than template0 with PostgreSQL 15's default
        # (WAL_LOG) here; template0 needs no set-up and never holds a connection, which CREATE DATABASE refuses
        self.admin().execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drops it even with clients still connected (WITH (FORCE): PostgreSQL 13+)."""
        self.admin().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def standby(self, workdir: Path | None = None) -> "Postgres":
        """A started streaming replica of this server on its own port. pg_basebackup -R writes standby.signal
        and primary_conninfo; initdb --auth=trust also trusts `replication` from 127.0.0.1 (pg_hba.conf)."""
        replica = Postgres(workdir)
        try:
            replica.check_reachable()
            run_server_tool(replica.workdir, "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.port), "-U",
                            "postgres", "-D", str(replica.data_dir), "-R", "-X", "stream", "--no-sync",
                            "--checkpoint=fast")  # the default spread checkpoint waited ~90 s
            return replica.start()
        except RuntimeError:
            replica.kill()
            raise

    def promote(self) -> None:
        """Ends recovery: the standby becomes a primary that accepts writes (-w: returns once it does)."""
        run_server_tool(self.workdir, "pg_ctl", "promote", "-D", str(self.data_dir), "-w")

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crashed host would: no shutdown checkpoint, clients cut off. The data
        directory stays until stop()."""
        self.close_admin()
        self.signal_postmaster(signal.SIGKILL)

    def stop(self) -> None:
        """Fast shutdown, then the data directory is removed. SIGINT: roll back open transactions, disconnect
        clients, checkpoint (SIGTERM would wait for every client to leave)."""
        self.close_admin()
        self.signal_postmaster(signal.SIGINT)
        shutil.rmtree(self.workdir if self.owns_workdir else self.data_dir, ignore_errors=True)

    def signal_postmaster(self, sig: signal.Signals) -> None:
        """sig to the postmaster itself, then wait for it to exit. As root self.proc is runuser, which would pass
        on SIGTERM whatever it got; the postmaster's pid is postmaster.pid's first line."""
        if self.is_running():
            pid_file = self.data_dir / "postmaster.pid"
            if pid_file.exists():
                os.kill(int(pid_file.read_text().split()[0]), sig)
            else:  # still starting: it has not written its pid yet
                self.proc.send_signal(sig)
            self.proc.wait(STOP_TIMEOUT_S)
        self.proc = None

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None
