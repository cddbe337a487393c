"""Helpers for the fleet tests: polling, and `edge-fleet serve` as a subprocess."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wait_until(condition, timeout_s: float = 20.0, interval_s: float = 0.05, message: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {message}")
        time.sleep(interval_s)


class ServeProcess:
    """`edge-fleet serve` in a subprocess (the real entry point, its own GIL)."""

    def __init__(self, url: str, db: Path, client_id: str, shared_group: str | None = None, log: Path | None = None,
                 extra_args: tuple = ()):
        args = [sys.executable, "-m", "fleet.cli", "serve", "--mqtt", url, "--db", str(db), "--client-id", client_id,
                *map(str, extra_args)]
        if shared_group:
            args += ["--shared-group", shared_group]
        self.log = log or db.with_name(f"{client_id}.log")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_connected(self, timeout_s: float = 20) -> None:
        wait_until(lambda: "connected to" in self.log.read_text() or self.proc.poll() is not None, timeout_s,
                   message="edge-fleet serve to connect")
        assert self.proc.poll() is None, self.log.read_text()

    def stop(self) -> str:
        """SIGTERM, then the summary line it prints."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, self.log.read_text()
        return out.strip()


def stop_all(devices, replicas: list[ServeProcess]) -> None:
    """A test's simulated devices disconnected and its `edge-fleet serve` processes killed, whatever state
    the test left them in."""
    for d in devices:
        d.client.disconnect()  # wakes paho's loop, so loop_stop() does not wait out a select timeout
        d.client.loop_stop()
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.kill()
