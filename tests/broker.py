"""A real Mosquitto broker for tests: started on a free loopback port, stoppable and restartable.

Persistence is on (a data directory per broker), so QoS 1 sessions and retained messages survive a
restart as they would in production.
"""
from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from pathlib import Path


def mosquitto_binary() -> str:
    path = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(path).exists():
        raise RuntimeError("mosquitto is not installed (run .ci/setup)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    def __init__(self, workdir: Path, port: int | None = None, extra_config: str = ""):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config = self.workdir / "mosquitto.conf"
        self.config.write_text(
            # as root, mosquitto drops to the `mosquitto` user, which could not write this directory: stay us
            f"user {getpass.getuser()}\n"
            f"listener {self.port} 127.0.0.1\n"
            "set_tcp_nodelay true\n"  # without it a command round trip took ~87 ms instead of ~1 ms
            f"persistence true\npersistence_location {self.workdir}/\n"
            "autosave_interval 1\n"
            f"log_dest file {self.workdir}/mosquitto.log\n"
            + (extra_config or "allow_anonymous true\n"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> "Broker":
        self.proc = subprocess.Popen([mosquitto_binary(), "-c", str(self.config)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mosquitto exited: see {self.workdir}/mosquitto.log")
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start listening")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()
