"""Which connections the local API serves when many are open: the places of `max_connections`, a cap per peer,
the last few places kept for /health and /metrics, and, under pressure, connections that are slow to send a
request head closed to make room for ones that have sent theirs.

Pure bookkeeping, no I/O: agent.api.http_server calls it from uvicorn's protocol on the event loop's thread (so
it takes no lock) and closes what it is told to. A connection holds a place while it waits for its request
head and while its request runs. One opened when its peer or the server had no place left waits in overflow,
holding none; when its head arrives it gets a place if one is free or can be made by closing a connection that
has waited SLOW_HEAD_S or more without sending a head (its peer's own first when the peer is at its cap), and
is refused otherwise. A connection that sends its head at once therefore wins over any number that dribble
theirs, whoever opened first.

    WAITING --head--> IN_REQUEST --response sent--> WAITING (or OVERFLOW, if the places are taken meanwhile)
    OVERFLOW --head, a place free or made--> IN_REQUEST
    OVERFLOW --head, no place--> REFUSED (answered 503, then closed)
    any --closed, or closed to make room--> forgotten

Example:
    limits = ConnectionLimits(max_connections=256, per_peer=128, status_reserve=4)
    limits.open(conn, "uid 1000", now_s)                  # Decision: what to close to make room, or refuse
    decision = limits.admit(conn, "/v1/completions", now_s)   # at its request head
    limits.responded(conn, now_s); limits.closed(conn)
"""
from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

# Any HTTP client writes its request head at once; one that has not completed a head this long after its
# connection opened (or after its last response) is slow, and is closed when a place is needed.
SLOW_HEAD_S = 1.0
STATUS_PATHS = frozenset({"/health", "/metrics"})  # may take the reserved places


class ConnState(enum.Enum):
    WAITING = "waiting"  # holds a place while it waits for (or receives) a request head
    OVERFLOW = "overflow"  # opened with no place free: holds none until its head arrives
    IN_REQUEST = "in_request"  # holds a place from its request head to the end of its response
    REFUSED = "refused"  # answered 503; holds no place and closes after the answer


_TRANSITIONS = {
    ConnState.WAITING: {ConnState.IN_REQUEST},
    ConnState.OVERFLOW: {ConnState.IN_REQUEST, ConnState.REFUSED},
    ConnState.IN_REQUEST: {ConnState.WAITING, ConnState.OVERFLOW},
    ConnState.REFUSED: set(),
}
_HOLDS_PLACE = {ConnState.WAITING, ConnState.IN_REQUEST}


@dataclass
class _Conn:
    peer: str
    state: ConnState
    since_s: float  # when it began waiting for a request head: opened, or its last response ended


@dataclass(frozen=True)
class Decision:
    """What the caller does: close `evict` (slow connections, already forgotten here) and, when `refusal` is
    set, refuse this connection: with a 503 saying so (admit), or by closing it at once (open)."""

    evict: tuple[Hashable, ...] = ()
    refusal: str | None = None
    limit: str | None = None  # the setting that refused it, for the log


class ConnectionLimits:
    """The places of one server's connections (agent.config.ApiConfig: max_connections, the per-peer cap,
    status_reserve). Peers are opaque strings ("uid 1000", "address 127.0.0.1")."""

    def __init__(self, max_connections: int, per_peer: int, status_reserve: int):
        assert 1 <= per_peer <= max_connections and 0 <= 2 * status_reserve <= max_connections
        self.max_connections, self.per_peer, self.status_reserve = max_connections, per_peer, status_reserve
        self._conns: dict[Hashable, _Conn] = {}
        self._places: Counter[str] = Counter()  # peer -> places it holds
        self.num_places = 0
        self.num_overflow = 0

    def state(self, key: Hashable) -> ConnState | None:
        conn = self._conns.get(key)
        return conn.state if conn else None

    # -- transitions -----------------------------------------------------------------------------------
    def open(self, key: Hashable, peer: str, now_s: float) -> Decision:
        """A new connection: a place if one is free for requests, else overflow. Overflow holds at most
        max_connections connections (each a file descriptor): past that the one waiting longest is closed
        if it is slow, else this one is refused."""
        assert key not in self._conns
        if self._has_free_place(peer):
            self._set(key, _Conn(peer, ConnState.WAITING, now_s))
            return Decision()
        evict = ()
        if self.num_overflow >= self.max_connections:
            victim = self._slowest(now_s, ConnState.OVERFLOW)
            if victim is None:
                return Decision(refusal=f"{self.num_overflow} connections are waiting for a place",
                                limit="max_connections")
            evict = (self._forget(victim),)
        self._set(key, _Conn(peer, ConnState.OVERFLOW, now_s))
        return Decision(evict=evict)

    def admit(self, key: Hashable, path: str, now_s: float) -> Decision:
        """A request head arrived on this connection: serve it (IN_REQUEST) or refuse it (REFUSED)."""
        conn = self._conns.get(key)
        if conn is None or not self.can_move(key, ConnState.IN_REQUEST):  # closed to make room meanwhile
            return Decision(refusal="the connection was closed to make room", limit="max_connections")
        if conn.state is ConnState.WAITING:  # it holds a place already
            self._move(key, ConnState.IN_REQUEST)
            return Decision()
        evict = []
        if self._places[conn.peer] >= self.per_peer:
            evict += self._make_room(now_s, peer=conn.peer)
            if self._places[conn.peer] >= self.per_peer:
                return self._refuse(key, evict, "max_connections_per_peer",
                                    f"this client ({conn.peer}) holds {self._places[conn.peer]} connections; at "
                                    f"most {self.per_peer} are served per client")
        limit = self.max_connections if path in STATUS_PATHS else self.max_connections - self.status_reserve
        if self.num_places >= limit:
            evict += self._make_room(now_s)
            if self.num_places >= limit:
                reserved = f" (the other {self.status_reserve} are kept for /health and /metrics)" \
                    if limit < self.max_connections else ""
                return self._refuse(key, evict, "max_connections",
                                    f"{self.num_places} connections are being served, at most {limit}{reserved}")
        self._move(key, ConnState.IN_REQUEST)
        return Decision(evict=tuple(evict))

    def responded(self, key: Hashable, now_s: float) -> None:
        """The response went out: the connection waits for its next head, in a place if one is free (a place
        taken from the reserve for /health goes back to it)."""
        conn = self._conns.get(key)
        if conn is None or conn.state is not ConnState.IN_REQUEST:  # forgotten, or refused and closing
            return
        self._release(conn)
        conn.state = ConnState.WAITING if self._has_free_place(conn.peer) else ConnState.OVERFLOW
        conn.since_s = now_s
        self._hold(conn)

    def closed(self, key: Hashable) -> None:
        if key in self._conns:
            self._forget(key)

    def can_move(self, key: Hashable, to: ConnState) -> bool:
        return to in _TRANSITIONS[self._conns[key].state]

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _has_free_place(self, peer: str) -> bool:
        return self._places[peer] < self.per_peer and self.num_places < self.max_connections - self.status_reserve

    def _refuse(self, key: Hashable, evict: list, limit: str, message: str) -> Decision:
        self._move(key, ConnState.REFUSED)
        return Decision(evict=tuple(evict), refusal=message, limit=limit)

    def _make_room(self, now_s: float, peer: str | None = None) -> list[Hashable]:
        """Close the connection (of `peer`, if given) that has waited longest for its head, if it is slow."""
        victim = self._slowest(now_s, ConnState.WAITING, peer)
        return [] if victim is None else [self._forget(victim)]

    def _slowest(self, now_s: float, state: ConnState, peer: str | None = None) -> Hashable | None:
        candidates = [(c.since_s, k) for k, c in self._conns.items() if c.state is state
                      and (peer is None or c.peer == peer) and now_s - c.since_s >= SLOW_HEAD_S]
        return min(candidates, key=lambda pair: pair[0])[1] if candidates else None

    def _set(self, key: Hashable, conn: _Conn) -> None:
        self._conns[key] = conn
        self._hold(conn)

    def _move(self, key: Hashable, to: ConnState) -> None:
        conn = self._conns[key]
        assert self.can_move(key, to), (conn.state, to)
        self._release(conn)
        conn.state = to
        self._hold(conn)

    def _forget(self, key: Hashable) -> Hashable:
        self._release(self._conns.pop(key))
        return key

    def _hold(self, conn: _Conn) -> None:
        if conn.state in _HOLDS_PLACE:
            self._places[conn.peer] += 1
            self.num_places += 1
        elif conn.state is ConnState.OVERFLOW:
            self.num_overflow += 1

    def _release(self, conn: _Conn) -> None:
        if conn.state in _HOLDS_PLACE:
            self._places[conn.peer] -= 1
            if not self._places[conn.peer]:
                del self._places[conn.peer]
            self.num_places -= 1
        elif conn.state is ConnState.OVERFLOW:
            self.num_overflow -= 1
