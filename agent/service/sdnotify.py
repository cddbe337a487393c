"""systemd's sd_notify protocol, spoken directly: one datagram per state change to $NOTIFY_SOCKET.

READY=1 after the model is verified and loaded and the socket listens; STATUS=... lines; WATCHDOG=1 from
the engine loop's own heartbeat (a stuck loop stops the pings and systemd restarts the service);
STOPPING=1 at shutdown. Without a NOTIFY_SOCKET (not under systemd) every call is a no-op.
See sd_notify(3) for the protocol; an '@' prefix means the abstract socket namespace.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from agent.process import periodically


class Notifier:
    def __init__(self, notify_socket: str | None, watchdog_usec: int | None = None):
        self.address = None
        if notify_socket:
            self.address = "\0" + notify_socket[1:] if notify_socket.startswith("@") else notify_socket
        # ping at half the watchdog interval, as sd_watchdog_enabled(3) recommends
        self.watchdog_interval_s = watchdog_usec / 2e6 if watchdog_usec else None
        self._last_ping = 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls, environ: dict) -> "Notifier":
        usec = environ.get("WATCHDOG_USEC")
        return cls(environ.get("NOTIFY_SOCKET"), int(usec) if usec and usec.isdigit() else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> None:
        if self.address is None:
            return
        with self._lock, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto("\n".join(fields).encode(), self.address)
            except OSError:
                pass  # systemd went away; nothing useful to do from here

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    def heartbeat(self) -> None:
        """Called from the engine loop every iteration; sends WATCHDOG=1 at most every interval."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_s:
            self._last_ping = now
            self.send("WATCHDOG=1")

    @contextlib.contextmanager
    def keepalive(self, max_s: float) -> Iterator[None]:
        """Ping the watchdog from a helper thread while the block runs, for at most max_s. A model switch stops
        the engine loop that feeds it: the old engine drains and stops, the new one is health-checked and
        loaded (4.6 s without a ping for SmolLM2 on x86, longer than WatchdogSec=30 for a larger model on a
        small box). A switch stuck past max_s stops the pings, and systemd restarts us."""
        if self.watchdog_interval_s is None:
            yield
            return
        deadline = time.monotonic() + max_s
        self.send("WATCHDOG=1")  # now: the engine's last ping may be nearly an interval old already

        def ping() -> bool:
            if time.monotonic() >= deadline:
                return False
            self.send("WATCHDOG=1")
            return True

        with periodically(self.watchdog_interval_s, ping, "watchdog-keepalive"):
            yield
