"""What the device's and the fleet's MQTT links share, without paho: link states, reconnect backoff, broker URLs.

Both links (agent.link.mqtt on the device, fleet.mqtt on the server) are state machines over one `LinkState`
enum and transition table, retry a lost broker after a capped, jittered exponential backoff that only a
connection that lasted starts over, read their broker from an mqtt:// or mqtts:// URL, and present a user
name, password and TLS files to it. Each link keeps its own paho client, callbacks and policies; paho stays
imported by those two modules only, so this one loads wherever `agent.config` does.

Example:
    endpoint = parse_url("mqtts://broker.lan")  # Endpoint(host="broker.lan", port=8883, tls=True)
    backoff = Backoff(min_s=1.0, max_s=120.0, rng=random.Random())
    delay_s = backoff.next_delay_s(lasted_s=3.0)  # a short connection: the next delay doubles
"""
from __future__ import annotations

import enum
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

KEEPALIVE_S = 30  # MQTT keep alive (v5 §3.1.2.10): the broker drops us, and we notice a dead broker, after 1.5x this
STABLE_CONNECTION_S = 60.0  # a connection that lasted this long resets the backoff; a shorter one does not


class LinkError(ValueError):
    """A bad broker URL or link setting (a user error)."""


# ---- states -----------------------------------------------------------------------------------------------
class LinkState(enum.Enum):
    IDLE = "idle"  # not started
    CONNECTING = "connecting"  # TCP connect sent, waiting for CONNACK
    CONNECTED = "connected"  # CONNACK accepted; subscriptions (re)sent
    BACKOFF = "backoff"  # waiting before the next attempt
    STOPPING = "stopping"  # stop() began: no new connection, the current one is closed cleanly
    STOPPED = "stopped"  # stop() ended; never leaves this state


TRANSITIONS: dict[LinkState, set[LinkState]] = {
    LinkState.IDLE: {LinkState.CONNECTING, LinkState.STOPPING},
    LinkState.CONNECTING: {LinkState.CONNECTED, LinkState.BACKOFF, LinkState.STOPPING},
    LinkState.CONNECTED: {LinkState.BACKOFF, LinkState.STOPPING},
    LinkState.BACKOFF: {LinkState.CONNECTING, LinkState.STOPPING},
    LinkState.STOPPING: {LinkState.STOPPED},
    LinkState.STOPPED: set(),
}


class LinkStateMachine:
    """A link's state, changed only along TRANSITIONS: `can_move` says whether a move is allowed now, `_move`
    makes it (False, and no change, if it is not). Thread-safe: the link's thread, paho's network thread and
    stop() all move it."""

    def __init__(self) -> None:
        self._state = LinkState.IDLE
        self._state_lock = threading.Lock()

    @property
    def state(self) -> LinkState:
        return self._state

    @property
    def is_connected(self) -> bool:
        return self._state is LinkState.CONNECTED

    def can_move(self, to: LinkState) -> bool:
        return to in TRANSITIONS[self._state]

    def _move(self, to: LinkState) -> bool:
        """Check and change under one lock: a stop() racing a reconnect cannot both be let through."""
        with self._state_lock:
            if to in TRANSITIONS[self._state]:
                self._state = to
                return True
        return False


# ---- reconnect backoff ------------------------------------------------------------------------------------
def backoff_delay_s(attempt: int, min_s: float, max_s: float, rng: random.Random) -> float:
    """Delay before reconnect attempt `attempt` (0-based): "equal jitter", uniform in [cap/2, cap] with
    cap = min(max_s, min_s * 2**attempt). Half the delay is fixed (no thundering retries), half spread
    (a fleet that lost its broker together does not come back together)."""
    cap = min(max_s, min_s * 2 ** min(attempt, 32))  # the exponent bounded: 2.0**1024 overflows a float
    return rng.uniform(cap / 2, cap)


class Backoff:
    """The reconnect attempts of one link: each delay doubles (backoff_delay_s) until a connection lasts
    STABLE_CONNECTION_S. A connection the broker accepts and drops at once (a session taken over by another
    client with our id, a packet over its limit) backs off too, or the two clients flap twice a second for
    good. `first_attempt` is where the count starts before any connection has lasted."""

    def __init__(self, min_s: float, max_s: float, rng: random.Random, first_attempt: int = 0):
        self.min_s, self.max_s, self.rng = min_s, max_s, rng
        self.attempt = first_attempt

    def next_delay_s(self, lasted_s: float) -> float:
        """The wait before the next attempt, after a connection that lasted lasted_s (0: none was made)."""
        if lasted_s >= STABLE_CONNECTION_S:
            self.attempt = 0
        delay_s = backoff_delay_s(self.attempt, self.min_s, self.max_s, self.rng)
        self.attempt += 1
        return delay_s


# ---- the broker: where, and who we are to it ---------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    tls: bool = False


def parse_url(url: str) -> Endpoint:
    """mqtt://HOST[:PORT] (1883) or mqtts://HOST[:PORT] (TLS, 8883) -> Endpoint; LinkError naming the form."""
    expected = "expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT]"
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname or parts.path or parts.query:
        raise LinkError(f"bad broker URL {url!r}: {expected}")
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port
    except ValueError as e:  # not a number, or outside 0-65535
        raise LinkError(f"bad broker URL {url!r}: {e}") from e
    if port == 0:
        raise LinkError(f"bad broker URL {url!r}: port 0; {expected}")
    return Endpoint(parts.hostname, port or (8883 if tls else 1883), tls)


@dataclass(frozen=True)
class Credentials:
    """Who we are to the broker: a user name and password, and for mqtts the CA that signed the broker's
    certificate (None: the system's) and a client certificate with its key (mutual TLS)."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @classmethod
    def from_files(cls, username: str | None, password_file: Path | None, ca_file: Path | None) -> "Credentials":
        """The password comes from a file, never the command line (where `ps` would show it)."""
        if password_file is not None and username is None:
            raise LinkError("a password file needs a user name")
        password = password_file.read_text().rstrip("\n") if password_file is not None else None
        return cls(username, password, ca_file)

    def apply(self, client, tls: bool) -> None:
        """Set these on a paho client before it connects; with tls, paho verifies the broker's certificate
        and host name."""
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if tls:
            client.tls_set(ca_certs=_str(self.ca_file), certfile=_str(self.cert_file), keyfile=_str(self.key_file))


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)
