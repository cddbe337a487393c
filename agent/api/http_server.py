"""The HTTP server plumbing under the local API: pre-bound Unix (and optional TCP) sockets, uvicorn under the
connection limits (agent.api.admission) with a deadline on each request head, log filters, and the drain on
SIGTERM / SIGINT.

The Unix socket is bound with its mode and group set before listen(), so no client can connect through
looser permissions. A socket file left by a crash is replaced only if it is a socket and nothing answers on
it; any other file at that path is an error. Each connection is seen as it opens: its peer (the uid behind a
Unix socket, SO_PEERCRED) is counted against the per-peer cap, and a request refused by the limits gets 503
in OpenAI's error shape with Retry-After. SIGTERM or Ctrl-C drains: /health turns 503, the listeners close,
in-flight requests get `drain_timeout_s` to finish, then the engine stops.

Example:
    server = ApiServer(Backend(manifest), [bind_unix(path, 0o660, None)], ApiConfig())
    server.load_in_background(load)   # a callable returning a started engine
    server.run()                      # until SIGTERM / SIGINT
"""
from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agent.api.admission import SLOW_HEAD_S, ConnectionLimits, Decision
from agent.api.app import create_app
from agent.api.backend import Backend, ServerState, too_many_connections
from agent.api.metrics import Metrics
from agent.config import ApiConfig
from agent.logs import Repeats as _Repeats

if TYPE_CHECKING:  # the server is handed a loader that returns a started engine
    from agent.engine.engine import Engine

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 128  # pending connections per listener; clients beyond it are refused by the kernel
PROBE_TIMEOUT_S = 1.0  # how long a stale-socket probe waits for a live server to accept


class ServeError(RuntimeError):
    """The server cannot start (or its model failed to load); the message says why."""


# ---- sockets ----------------------------------------------------------------------------------------
def clear_stale_socket(path: Path) -> None:
    """Make way for a new socket at path: remove a socket nobody answers on; refuse anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ServeError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # a socket file with no listener: left by a crash
        log.warning("removing stale socket %s", path)
        path.unlink()
        return
    except FileNotFoundError:  # removed meanwhile
        return
    except OSError as e:
        raise ServeError(f"{path}: cannot tell whether another server uses it ({e})") from e
    finally:
        probe.close()
    raise ServeError(f"{path}: another server is answering on this socket")


def bind_unix(path: Path, mode: int, group: str | None) -> socket.socket:
    """A listening Unix socket at path with the given permission bits and group."""
    path = Path(path)
    clear_stale_socket(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)  # before listen(): until then a connect() is refused, whatever the mode
        if group is not None:
            os.chown(path, -1, group_id(group))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        unlink_if_socket(path)
        raise
    return sock


def group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ServeError(f"socket_group {group!r} is not a group on this system") from None


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def unlink_if_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    except FileNotFoundError:
        pass


# ---- the server -------------------------------------------------------------------------------------
PEERCRED = "3i"  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}: SO_PEERCRED on Linux, unix(7)


def peer_of(transport: asyncio.Transport) -> str:
    """Who is at the other end, for the per-peer cap: a Unix socket's peer uid as it was at connect() (a client
    can fork pids, not uids), or a TCP peer's address."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        if not hasattr(socket, "SO_PEERCRED"):  # not Linux: every local client is one peer
            return "unix"
        try:
            _pid, uid, _gid = struct.unpack(PEERCRED, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                      struct.calcsize(PEERCRED)))
        except OSError:
            return "unix"
        return f"uid {uid}"
    peer = transport.get_extra_info("peername")
    return f"address {peer[0]}" if isinstance(peer, tuple) and peer else "unknown"


class _LimitedProtocol(H11Protocol):
    """uvicorn's h11 protocol under the connection limits (agent.api.admission), with a deadline for each
    request head. uvicorn's own limit_concurrency is not used: it counts connections still sending their head
    and answers every request past it, /health too, with a plain-text 503. Without the deadline a connection
    that opens and sends nothing, or half its headers, is held for good (uvicorn's keep-alive timer starts only
    after a response and stops at the first byte).

    The class attributes are set per server (ApiServer). Only the event loop's thread runs these methods.
    """

    head_timeout_s = 5.0
    retry_after_s = 1
    limits: ConnectionLimits
    metrics: Metrics

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._app, self.app = self.app, self._gate  # uvicorn runs self.app for each request
        self._refusal: str | None = None  # why the current request is refused, if it is
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        decision = self.limits.open(self, peer_of(transport), self.loop.time())
        self._carry_out(decision)
        if decision.refusal is not None:  # past every limit: its descriptor goes back at once, unanswered
            transport.close()
            return
        self._await_request()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: uvicorn made its cycle and a task to run it
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            decision = self.limits.admit(self, self.scope["path"], self.loop.time())
            self._carry_out(decision)
            self._refusal = decision.refusal

    async def _gate(self, scope, receive, send) -> None:
        # uvicorn runs one request at a time on a connection: _refusal is this request's
        if self._refusal is None:
            await self._app(scope, receive, send)
        else:
            await too_many_connections(self._refusal, self.retry_after_s)(scope, receive, send)

    def on_response_complete(self) -> None:
        self.limits.responded(self, self.loop.time())
        self._await_request()
        super().on_response_complete()  # may begin a pipelined request, in handle_events

    def connection_lost(self, exc) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self.limits.closed(self)
        super().connection_lost(exc)

    def _carry_out(self, decision: Decision) -> None:
        for slow in decision.evict:
            slow.transport.close()
        if decision.evict:
            log.warning("connection limits: closing connections that sent no request head within %.0f s, to "
                        "make room for those that did", SLOW_HEAD_S)
        if decision.refusal is not None:
            log.warning("connection limit %s reached: refusing connections", decision.limit)
            self.metrics.observe_error("too_many_connections")

    def _await_request(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._close_if_idle, self.cycle)

    def _close_if_idle(self, cycle_then) -> None:
        if self.cycle is cycle_then and not self.transport.is_closing():  # no new request began since
            self.transport.close()


class _CutOffRequests(logging.Filter):
    """Drops uvicorn's traceback for each request still running when drain_timeout_s ran out.

    uvicorn says once that it cancels them ("Cancel N running task(s), timeout graceful shutdown exceeded"),
    then logs every cancelled request as "Exception in ASGI application" with a traceback: 32 tracebacks in
    the journal for one ordinary stop. Their telemetry is still recorded (EventBridge).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


_CUT_OFF_REQUESTS = _CutOffRequests()


_REPEATS = _Repeats()  # uvicorn's warnings, each once a minute


# After drain_timeout_s the engine stops, and the streams it held get this long to send their error event and
# [DONE] before uvicorn cancels what is left.
CUT_OFF_GRACE_S = 5.0


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, backend: Backend, drain_timeout_s: float):
        super().__init__(config)
        self.backend, self.drain_timeout_s = backend, drain_timeout_s
        self._cut_off: threading.Timer | None = None
        for f in (_CUT_OFF_REQUESTS, _REPEATS):  # once each: the same filter is not added twice
            logging.getLogger("uvicorn.error").addFilter(f)
        log.addFilter(_REPEATS)  # the connection limits warn once per refused connection

    on_stopping: Callable[[], None] | None = None  # told as the drain begins (sd_notify STOPPING=1)

    def handle_exit(self, sig, frame) -> None:
        self.begin_drain()
        if self.on_stopping:
            self.on_stopping()
        super().handle_exit(sig, frame)

    def begin_drain(self) -> None:
        """/health answers 503 while in-flight requests finish; after drain_timeout_s the engine ends them."""
        self.backend.mark_draining()
        if self._cut_off is None:
            self._cut_off = threading.Timer(self.drain_timeout_s, self._stop_engine)
            self._cut_off.daemon = True
            self._cut_off.start()

    def end_drain(self) -> None:
        """The server has stopped: nothing is left for the timer to cut off (the caller stops the engine, so
        a cut-off already under way is waited for: two stops at once would end the held requests twice)."""
        if self._cut_off is not None:
            self._cut_off.cancel()
            if self._cut_off.is_alive():
                self._cut_off.join()

    def _stop_engine(self) -> None:
        """Every request still held ends with an "unavailable" error, which a stream sends as its last event
        before [DONE]: cancelled by uvicorn instead, each connection would close mid-body, which openai's
        clients raise as httpx's RemoteProtocolError rather than an APIError their callers catch."""
        engine = self.backend.engine
        if engine is not None and not engine.stopped:
            log.warning("drain_timeout_s (%.0f s) ran out: stopping the requests still running", self.drain_timeout_s)
            engine.stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version re-raises the signal after shutdown, killing the process before the engine
        # stops and the socket file is removed; here a drained shutdown simply returns (exit status 0).
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class ApiServer:
    """The API app on pre-bound sockets, with a loader thread that brings the engine up.

    run() serves in the calling thread (the main thread: SIGTERM / SIGINT drain); start() / stop() run it
    in a background thread (tests).
    """

    def __init__(self, backend: Backend, sockets: list[socket.socket], config: ApiConfig,
                 metrics: Metrics | None = None):
        self.backend, self.sockets = backend, sockets
        self.metrics = metrics or Metrics()
        app = create_app(backend, self.metrics, config)
        protocol = type("Protocol", (_LimitedProtocol,), {
            "head_timeout_s": config.head_deadline_s, "retry_after_s": config.retry_after_s, "metrics": self.metrics,
            "limits": ConnectionLimits(config.max_connections, config.connections_per_peer, config.status_places)})
        # ws="none": the API has no WebSocket endpoint, and an upgraded connection would leave the limits' books
        uv = uvicorn.Config(app, http=protocol, ws="none", loop="asyncio", lifespan="off", access_log=False,
                            log_config=None, timeout_graceful_shutdown=config.drain_timeout_s + CUT_OFF_GRACE_S)
        self.uvicorn = _Uvicorn(uv, backend, config.drain_timeout_s)
        self.load_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def load_in_background(self, load: Callable[[], Engine]) -> threading.Thread:
        """Call load() (which returns a started engine) in a thread; the backend turns ready or failed."""
        thread = threading.Thread(target=self._load, args=(load,), name="engine-loader", daemon=True)
        thread.start()
        return thread

    def _load(self, load: Callable[[], Engine]) -> None:
        try:
            engine = load()
        except Exception as e:
            log.error("the model failed to load: %s", e)
            self.load_error = e
            self.backend.mark_failed()
            self.uvicorn.should_exit = True  # a service without its model should exit, so systemd sees it
            return
        if self.backend.can_move(ServerState.READY):
            self.backend.mark_ready(engine)
        else:  # shutdown began while loading
            engine.stop()

    def run(self) -> None:
        try:
            self.uvicorn.run(sockets=self.sockets)
        finally:
            self.uvicorn.end_drain()

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread = threading.Thread(target=self.run, name="api-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise ServeError("the API server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.uvicorn.begin_drain()
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
