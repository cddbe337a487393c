"""The product as real processes, for end-to-end and reliability tests: `edge-agent serve` and
`edge-fleet serve` started from this virtualenv's scripts, their Unix-socket API, and polling helpers."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def client(sock: Path, timeout_s: float = 60) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://agent", timeout=timeout_s)


def health(sock: Path) -> dict | None:
    """/health's body when the agent is ready, else None (not listening, loading or draining)."""
    try:
        with client(sock, timeout_s=2) as c:
            r = c.get("/health")
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def wait(condition, what: str, timeout_s: float = 90, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(every_s)


def rows(db: Path, sql: str, params: tuple = ()) -> list[tuple]:
    conn = sqlite3.connect(db, timeout=10)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def integrity(db: Path) -> str:
    return rows(db, "PRAGMA integrity_check")[0][0]


class Agent:
    """One `edge-agent serve` process on its own socket and state directory; restartable."""

    def __init__(self, workdir: Path, *args, device_id: str = "dev-1"):
        self.workdir, self.args, self.device_id = Path(workdir), [str(a) for a in args], device_id
        self.sock = self.workdir / f"{device_id}.sock"
        self.state_dir = self.workdir / device_id
        self.log = self.workdir / f"{device_id}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, *extra, timeout_s: float = 90) -> dict:
        """Start it and wait until /health says ready; returns that body."""
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([BIN / "edge-agent", "serve", "--socket", self.sock, "--state-dir",
                                          self.state_dir, "--device-id", self.device_id, *self.args, *extra],
                                         stdout=log, stderr=subprocess.STDOUT)
        ready: dict = {}

        def is_ready() -> bool:
            assert self.proc.poll() is None, f"the agent exited:\n{self.log.read_text()[-3000:]}"
            ready.update(health(self.sock) or {})
            return bool(ready)
        wait(is_ready, "the agent ready", timeout_s)
        return ready

    @property
    def telemetry_db(self) -> Path:
        return self.state_dir / "telemetry.db"

    def status(self, field: str) -> int:
        """A kB figure from /proc/PID/status (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM and wait (SIGKILL after 60 s); the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class FleetServer:
    """`edge-fleet serve` ingesting from a broker into one database."""

    def __init__(self, workdir: Path, broker_url: str, *args):
        self.db = Path(workdir) / "fleet.db"
        self.log = Path(workdir) / "fleet.log"
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([BIN / "edge-fleet", "serve", "--mqtt", broker_url, "--db", self.db,
                                          *map(str, args)], stdout=log, stderr=subprocess.STDOUT)

    def stored(self, device_id: str) -> list[tuple]:
        """(boot_id, seq) of every request row the fleet holds for the device (duplicates included)."""
        if not self.db.exists():
            return []
        return rows(self.db, "SELECT boot_id, seq FROM requests WHERE device_id = ?", (device_id,))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def signing_fleet(workdir: Path, broker_url: str) -> tuple[FleetServer, Path]:
    """A fleet server that serves published artifacts over HTTP, and a fresh signing key for it to publish with
    (agents trust `KEY.pub`): (server, key)."""
    from broker import free_port

    key = Path(workdir) / "fleet.key"
    subprocess.run([BIN / "edge-fleet", "keygen", "--out", key], check=True, capture_output=True)
    return FleetServer(workdir, broker_url, "--artifacts-http", f"127.0.0.1:{free_port()}", "--artifacts-dir",
                       Path(workdir) / "artifacts"), key


def committed(agent_db: Path) -> list[tuple]:
    """(boot_id, seq) of every request record an agent committed."""
    return rows(agent_db, "SELECT boot_id, seq FROM records WHERE kind = 'request'")
