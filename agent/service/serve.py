"""Wiring for `edge-agent serve`: config, sockets, the engine loader and uvicorn, run in the foreground.

The Unix socket is bound first (its mode and group set before listen(), so no client can connect
through looser permissions), then the model loads in a thread while /health answers 503 "loading". A
socket file left by a crash is replaced only if it is a socket and nothing answers on it; any other file
at that path is an error. SIGTERM or Ctrl-C drains: /health turns 503, the listeners close, in-flight
requests get `drain_timeout_s` to finish, then the engine stops and the socket file is removed.

Run: edge-agent serve --model BUNDLE --socket /run/edge-agent/agent.sock [--config agent.toml] [--tcp 127.0.0.1:8080]
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import grp
import logging
import os
import secrets
import signal
import socket
import stat
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from pydantic import ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

from agent.api.app import Backend, ServerState, create_app
from agent.engine.bundle import open_bundle
from agent.link.commands import CommandError
from agent.service.sdnotify import Notifier
from agent.config import AgentConfig, ApiConfig, EngineConfig, describe_errors
from agent.engine.engine import Engine
from agent.engine.memory import MB, kv_bytes_per_token
from agent.api.metrics import Metrics
from agent.process import memory_limit_bytes, trim_heap
from agent.link.telemetry import Telemetry
from agent.engine.golden import measure_golden
from agent.updates.trust import load_trusted_keys
from agent.updates.jobs import UpdateContext
from agent.updates.model_store import ModelStore
from agent.updates.service import UpdateService
from agent.wire import JobDocument, Manifest, ModelConfig

AGENT_VERSION = "0.1.0"

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 128  # pending connections per listener; clients beyond it are refused by the kernel
PROBE_TIMEOUT_S = 1.0  # how long a stale-socket probe waits for a live server to accept
LOADING_WAIT_S = 300.0  # a model switch waits this long for the first model to finish loading (TimeoutStartSec=)
# at shutdown, after the engine stops: how long requests it cut off get to write their telemetry (an fsync
# each, up to a second on a slow SD card, several at once)
REQUEST_HOOKS_WAIT_S = 10.0
DRAIN_BEFORE_SWITCH_S = 60.0  # a switch lets the old model's requests finish this long, then stops them
SWITCH_KEEPALIVE_S = 300.0  # a switch's health check and load may take this long before the watchdog restarts us


class ServeError(RuntimeError):
    """The server cannot start (or its model failed to load); the message says why."""


# ---- configuration ----------------------------------------------------------------------------------
def load_agent_config(path: Path | None = None, **flags) -> AgentConfig:
    """The TOML config file (if any) with command-line flags laid over it (flags win), validated once.

    flags: model, socket, tcp (top level / [api]), threads, memory_budget_mb ([engine]), state_dir,
    device_id, mqtt ([telemetry]), trusted_keys ([updates]); None = not given.
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8")) if path else {}
    except UnicodeDecodeError as e:  # TOML is UTF-8; the codec's message named no file
        raise ServeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    tele = {k: flags.pop(k) for k in ("state_dir", "device_id") if flags.get(k) is not None}
    if flags.get("mqtt") is not None:
        tele["mqtt"] = {**_table(_table(data, "telemetry"), "mqtt", "telemetry."), "url": flags.pop("mqtt")}
    flags.pop("mqtt", None)
    if tele:
        data["telemetry"] = {**_table(data, "telemetry"), **tele}
    if flags.get("trusted_keys"):
        data["updates"] = {**_table(data, "updates"), "trusted_keys": [str(p) for p in flags.pop("trusted_keys")]}
    flags.pop("trusted_keys", None)
    engine_flags = {k: flags.pop(k) for k in ("threads", "memory_budget_mb") if flags.get(k) is not None}
    api_flags = {k: flags.pop(k) for k in ("socket", "tcp") if flags.get(k) is not None}
    if flags.get("model") is not None:
        data["model"] = flags["model"]
    if engine_flags:
        data["engine"] = {**_table(data, "engine"), **engine_flags}
    if api_flags:
        data["api"] = {**_table(data, "api"), **api_flags}
    return AgentConfig.model_validate(data)


def _table(data: dict, key: str, within: str = "") -> dict:
    """data[key] as a table to lay flags over; `api = "x"` beside --socket was an internal TypeError."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ServeError(f"config: {within}{key} must be a table ([{within}{key}]), not {type(value).__name__}")
    return value


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
            os.chown(path, -1, _group_id(group))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        _unlink_if_socket(path)
        raise
    return sock


def _group_id(group: str) -> int:
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


def _unlink_if_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    except FileNotFoundError:
        pass


# ---- the server -------------------------------------------------------------------------------------
class _DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request head: a connection that opens and sends
    nothing, or half its headers, was held for good (uvicorn's keep-alive timer starts only after a response
    and stops at the first byte), and enough of them took every file descriptor."""

    request_timeout_s = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_request()

    def connection_lost(self, exc) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)

    def _await_request(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.request_timeout_s, self._close_if_idle, self.cycle)

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


class _Repeats(logging.Filter):
    """Lets each warning through once a minute, with the count of those held back since. uvicorn logs one per
    bad connection ("Invalid HTTP request received.", "Exceeded concurrency limit."): a local client sending
    garbage wrote 4,200 lines a second to the journal (found in review)."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self._seen: dict[str, tuple[float, int]] = {}  # message -> (when last let through, held back since)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.exc_info:  # errors and tracebacks: each is news
            return True
        message, now = record.getMessage(), self.clock()
        with self._lock:
            if len(self._seen) > 1000:  # messages with varying text: forget, rather than grow
                self._seen.clear()
            last, held = self._seen.get(message, (-float("inf"), 0))
            if now - last < self.window_s:
                self._seen[message] = (last, held + 1)
                return False
            self._seen[message] = (now, 0)
        if held:
            record.msg, record.args = f"{message} ({held} more in the last {self.window_s:.0f} s)", ()
        return True


_REPEATS = _Repeats()


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

    notifier: Notifier | None = None

    def handle_exit(self, sig, frame) -> None:
        self.begin_drain()
        if self.notifier:
            self.notifier.stopping()
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
        before [DONE]. Found in review: uvicorn cancelled them instead, closing each connection mid-body, which
        openai's clients raise as httpx's RemoteProtocolError rather than an APIError their callers catch."""
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
        protocol = type("Protocol", (_DeadlineProtocol,), {"request_timeout_s": config.request_timeout_s})
        uv = uvicorn.Config(app, http=protocol, loop="asyncio", lifespan="off", access_log=False, log_config=None,
                            timeout_graceful_shutdown=config.drain_timeout_s + CUT_OFF_GRACE_S,
                            limit_concurrency=config.max_connections)
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


def load_engine(model: Path, config: EngineConfig, notifier: Notifier | None = None) -> Engine:
    """Verify and load the bundle, start the engine loop; its heartbeat feeds the systemd watchdog."""
    ping_s = notifier.watchdog_interval_s if notifier and notifier.watchdog_interval_s else 0.5
    engine = Engine(open_bundle(model), config, heartbeat=notifier.heartbeat if notifier else None,
                    idle_wait_s=min(0.5, ping_s / 2))  # an idle loop still beats often enough for the watchdog
    engine.start()
    if notifier:  # READY only now: the model is verified and loaded and the socket already listens
        m = engine.bundle.manifest
        notifier.ready(f"serving {m.name}@{m.version} ({m.precision})")
    return engine


LIVE_ENGINE_FIELDS = ("max_queue", "max_queue_wait_s", "default_max_tokens", "speculative", "speculative_max_batch")


def reload_live(backend: Backend, new: AgentConfig) -> list[str]:
    """SIGHUP: apply the settings that can change while serving; name the ones that need a restart."""
    with backend.reload_lock:  # a switch hands over between two SIGHUPs, never inside one
        engine = backend.engine
        if engine is None:
            return []
        changed = {f: getattr(new.engine, f) for f in LIVE_ENGINE_FIELDS
                   if getattr(new.engine, f) != getattr(engine.config, f)}
        if changed.get("speculative") == "draft" and engine.draft is None:  # it would quietly run prompt lookup
            log.error("SIGHUP: speculative = 'draft' needs a draft model, which this agent has none of: not applied")
            del changed["speculative"]
        _apply_live(engine, changed)
        restart = [f for f in type(new.engine).model_fields
                   if f not in LIVE_ENGINE_FIELDS and getattr(new.engine, f) != getattr(engine.config, f)]
    log.info("SIGHUP: applied %s%s", changed or "nothing new",
             f"; needs a restart: {', '.join(restart)}" if restart else "")
    return restart


def _apply_live(engine: Engine, changed: dict) -> None:
    engine.config = engine.config.model_copy(update=changed)  # replaced, not mutated: readers see old or new
    engine.scheduler.max_queue_wait_s = engine.config.max_queue_wait_s


def _hand_over(backend: Backend, engine: Engine) -> None:
    """Serve from engine, with the live settings the outgoing engine had by now. Found in review: a switch
    loaded the new model with the config it read before draining the old one, so a SIGHUP during the switch
    (applied to the outgoing engine, and logged as applied) was silently undone."""
    with backend.reload_lock:
        outgoing = backend.engine
        if outgoing is not None:
            live = {f: getattr(outgoing.config, f) for f in LIVE_ENGINE_FIELDS}
            if live["speculative"] == "draft" and engine.draft is None:
                del live["speculative"]
            _apply_live(engine, live)
        backend.swap(engine)


def restart_keys(started: AgentConfig, new: AgentConfig) -> list[str]:
    """Keys outside [engine] (which reload_live handles) that changed since the start: they need a restart.
    Found in review: a SIGHUP after editing [api], [telemetry], [updates] (a trusted key rotated) or `model`
    logged nothing about them, as if applied."""
    old, now = started.model_dump(exclude={"engine"}), new.model_dump(exclude={"engine"})

    def walk(a, b, prefix: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [k for key in sorted(a.keys() | b.keys()) for k in walk(a.get(key), b.get(key), prefix + key + ".")]
        return [] if a == b else [prefix.rstrip(".")]
    return walk(old, now, "")


def _install_sighup(backend: Backend, reload_config: Callable[[], AgentConfig] | None, started: AgentConfig) -> None:
    if reload_config is None or threading.current_thread() is not threading.main_thread():
        return

    def on_hup(signum, frame) -> None:
        try:
            new = fitted_budget(reload_config())  # as at the start, or the lowered budget read as a change
        except ValidationError as e:  # a bad edit of the file must not take the service down
            log.error("SIGHUP: config not reloaded: %s", describe_errors(e).replace("\n", "; "))
            return
        except Exception as e:
            log.error("SIGHUP: config not reloaded: %s", str(e).splitlines()[0])
            return
        if backend.engine is None:
            log.warning("SIGHUP while the model loads: nothing applied; send it again once the agent is ready")
            return
        others = restart_keys(started, new)
        if others:
            log.warning("SIGHUP: needs a restart, not applied: %s", ", ".join(others))
        try:
            reload_live(backend, new)
        except Exception as e:
            log.error("SIGHUP: config not applied: %s", str(e).splitlines()[0])

    signal.signal(signal.SIGHUP, on_hup)


def serve_forever(config: AgentConfig, announce: Callable[[str], None] = log.info,
                  notifier: Notifier | None = None, reload_config: Callable[[], AgentConfig] | None = None) -> None:
    """Serve the current model on the configured socket(s) until SIGTERM / SIGINT, then drain and stop.

    Wiring, in order: the state directory is locked (one agent each); the model store picks a verified
    model; the sockets bind; the updater settles the last job; telemetry (SQLite, and MQTT when configured)
    starts; the engine loads in the background (READY after it);
    at shutdown in-flight requests drain, the engine stops, telemetry is flushed and MQTT says "stopped".
    """
    config = fitted_budget(config)
    lock = lock_state_dir(Path(config.telemetry.state_dir))
    try:
        _serve(config, announce, notifier, reload_config)
    finally:
        os.close(lock)  # however serve ended: a later serve in this process (tests) must get it


def _serve(config: AgentConfig, announce: Callable[[str], None], notifier: Notifier | None,
           reload_config: Callable[[], AgentConfig] | None) -> None:
    store = ModelStore(config.telemetry.state_dir)
    api = config.api
    # The socket first: a second agent started on a live one fails here, before it changes the store.
    sockets = [bind_unix(api.socket, api.socket_mode, api.socket_group)]
    server = telemetry = updates = None
    try:
        if api.tcp_address is not None:
            sockets.append(bind_tcp(*api.tcp_address))
        model_dir = boot_model(store, config.model)
        manifest = Manifest.read(model_dir)  # identity for /health and /v1/models while the bundle loads
        server = ApiServer(Backend(manifest), sockets, api)
        server.uvicorn.notifier = notifier
        telemetry, updates = _start_services(config, store, server, notifier, reload_config)
        _install_sighup(server.backend, reload_config, config)
        server.load_in_background(lambda: load_engine(store.bootable().path, config.engine, notifier))
        announce(f"serving {manifest.name}@{manifest.version} on unix:{api.socket}"
                 + (f" and http://{api.tcp}" if api.tcp else "") + " (loading the model)")
        server.run()
    finally:
        if server is None:  # failed before serving: the sockets are still only ours
            for sock in sockets:
                sock.close()
        _unlink_if_socket(Path(api.socket))
        if server is not None and server.backend.engine is not None:
            server.backend.engine.stop()
            if not server.backend.join_requests(REQUEST_HOOKS_WAIT_S):
                log.warning("some requests' telemetry was still being written at shutdown; it may be lost")
        if updates is not None:
            updates.stop()
        if telemetry is not None:
            telemetry.stop()  # every finished request is already in SQLite; MQTT publishes "stopped" and leaves
    if server.load_error is not None:
        raise ServeError(f"the model failed to load: {server.load_error}") from server.load_error


def lock_state_dir(state_dir: Path) -> int:
    """Hold the state directory for this agent (an open descriptor: close it to let go).

    Two agents on one state directory (another socket, the same --state-dir) shared its telemetry
    database, models, links and update journal, and took the device's MQTT session from each other.
    An flock, so the kernel lets go when the process ends however it ends: no stale lock after a SIGKILL.
    It is taken on the directory itself, which a read-only file system (an SD card ext4 remounted after an
    I/O error) lets us open too: found in review, every start failed there on creating a lock file, and a
    lock on a file that may or may not exist let two agents in. agent.lock names the holder, when it can.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _lock_holder(state_dir / "agent.lock")
        raise ServeError(f"another edge-agent{f' (pid {holder})' if holder else ''} is using the state "
                         f"directory {state_dir}") from None
    try:
        (state_dir / "agent.lock").write_text(f"{os.getpid()}\n")
    except OSError as e:
        if e.errno != errno.EROFS:
            os.close(fd)
            raise
        log.error("the state directory %s is on a read-only file system: serving, with telemetry kept in "
                  "memory, and updates fail, until the agent starts on it writable again", state_dir)
    return fd


def _lock_holder(pid_file: Path) -> int | None:
    """The pid agent.lock names, if that process is alive (on a read-only disk the file can be a dead run's)."""
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def names_store_current(model: Path, state_dir: Path) -> bool:
    """Whether `model` is the store's own `current` link (as the shipped agent.toml names it), whose
    fall-back to `previous` the store decides."""
    return Path(model).absolute() == (Path(state_dir) / "current").absolute()


def environment_problems(config: AgentConfig) -> list[str]:
    """What `serve` would refuse at start on this machine, found without starting anything (check-config).
    Found in review: check-config said ok for a model path that was not there and a socket group that did
    not exist, and serve then failed at once."""
    problems = []
    state = config.telemetry.state_dir
    if config.model is not None:
        candidates = [Path(config.model)]
        if names_store_current(config.model, state):  # serve falls back to previous
            candidates.append(state / "previous")
        errors, readable, manifest = [], None, None
        for path in candidates:
            try:
                manifest = Manifest.read(path)
                readable = path
                break
            except (OSError, ValueError) as e:
                errors.append(f"{path}: {str(e).splitlines()[0]}")
        else:
            problems.append(f"model: not a readable bundle ({'; '.join(errors)})")
        if config.engine.kv_dtype == "int8" and readable:
            try:  # found in review: serve then refused to start, leaving the device off the network
                open_bundle(readable, verify_files=False).graph("int8")
            except (OSError, ValueError) as e:
                problems.append(f"engine.kv_dtype: \"int8\" needs the bundle's int8 KV cache graph: {e}")
        if readable and (problem := _budget_below_weights(config, readable, manifest)):
            problems.append(problem)
    elif not ((state / "current").exists() or (state / "previous").exists()):
        problems.append(f"model: none set and no installed model in {state}")
    if config.engine.speculative == "draft":  # found in review: check-config said ok, and serve refused it
        problems.append('engine.speculative: "draft" needs a draft model, which only `edge-agent generate '
                        '--draft-model` loads; serve offers "ngram" (prompt lookup) or "off"')
    if config.api.socket_group is not None:
        try:
            _group_id(config.api.socket_group)
        except ServeError as e:
            problems.append(f"api.{e}")
    loaded = {}
    for key in ("trusted_keys", "job_keys"):
        try:
            loaded[key] = load_trusted_keys(list(getattr(config.updates, key)))
        except (OSError, ValueError) as e:
            problems.append(f"updates.{key}: {str(e).splitlines()[0]}")
    if both := set(loaded.get("trusted_keys", {})) & set(loaded.get("job_keys", {})):
        problems.append(f"updates.job_keys: key {sorted(both)[0]} is also a manifest key (trusted_keys): the job key "
                        "lives on the fleet server, so the manifest key would no longer be offline; use two keys")
    for key, directory in (("telemetry.state_dir", state), ("api.socket", Path(config.api.socket).parent)):
        if problem := _not_writable(directory):  # found in review: said ok, and serve then failed "Read-only
            problems.append(f"{key}: {problem}")  # file system" (the socket's without naming a path)
    return problems


def _budget_below_weights(config: AgentConfig, bundle: Path, manifest: Manifest) -> str | None:
    """A budget that cannot hold even the weights' file and one min_context sequence of KV. Serve measures
    the exact need when it loads the model (the weights as ONNX Runtime holds them plus the runtime, ~200 MB
    more for SmolLM2); this is only a floor that needs no loading (found in review: check-config said ok to
    a 64 MB budget)."""
    try:
        model = ModelConfig.read(bundle)
    except (OSError, ValueError):  # serve's own load names what is wrong with the bundle
        return None
    weights = sum(f.size_bytes for name, f in manifest.files.items() if name.endswith(".data"))
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim,
                                   1 if config.engine.kv_dtype == "int8" else 4)
    tokens = config.engine.min_kv_tokens(model.context_length)
    floor = weights + tokens * per_token
    if config.engine.memory_budget_mb * MB >= floor:
        return None
    return (f"engine.memory_budget_mb: {config.engine.memory_budget_mb} MB cannot hold the model's weights "
            f"({weights / MB:.0f} MB) and one {tokens}-token sequence, let alone the runtime; "
            "serve names the exact need when it starts")


# Of the memory a process may have (the RAM, or its cgroup's memory.max) the budget may take at most this: the
# rest is for the page cache of the model files and the kernel, which the cgroup counts too (the shipped unit:
# a 1024 MB budget under MemoryMax=1280M)
BUDGET_OF_LIMIT = 0.8


def fitted_budget(config: AgentConfig) -> AgentConfig:
    """config with memory_budget_mb lowered to fit what this process may use, said at ERROR. Found in review:
    nothing compared them, and above the service's MemoryMax= (or the RAM) the kernel kills the agent under
    load where the budget would have refused requests. Lowered rather than refused: an agent that does not
    start is off the network too, with nobody there to edit its config."""
    limit = memory_limit_bytes()
    if limit is None or config.engine.memory_budget_mb * MB <= limit * BUDGET_OF_LIMIT:
        return config
    fitted = int(limit * BUDGET_OF_LIMIT) // MB
    log.error("engine.memory_budget_mb = %d is above %.0f%% of the %d MB this process may use (the machine's "
              "memory, or its cgroup's memory limit: systemd's MemoryMax=): using %d MB; set it so in the config",
              config.engine.memory_budget_mb, BUDGET_OF_LIMIT * 100, limit // MB, fitted)
    return config.model_copy(update={"engine": config.engine.model_copy(update={"memory_budget_mb": fitted})})


def _not_writable(directory: Path) -> str | None:
    """Why this process could not create files in directory (creating it and its parents first), if so."""
    existing = Path(directory).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only mount too, even for root
        return f"{existing} is not writable by this user"
    return None


def boot_model(store: ModelStore, model: Path | None) -> Path:
    """The bundle to serve. A model named on the command line or in the config becomes `current` (linked
    into the store, not copied); without one, or when it names the store's `current` itself (the shipped
    agent.toml does), the store's verified `current`, else `previous` (what updates installed). Found in
    review: the shipped config's `model = .../current` was opened directly, so a damaged `current` stopped
    the agent (a restart loop) instead of falling back to `previous`."""
    if model is not None and names_store_current(model, store.root):
        model = None
    if model is not None:
        bundle = open_bundle(model)  # verified before anything points at it
        if store.link("current") != Path(model).resolve():
            seeded = store.models / f"{bundle.manifest.name}@{bundle.manifest.version}"
            if not seeded.exists():
                seeded.symlink_to(Path(model).resolve(), target_is_directory=True)
            if seeded.resolve() != store.link("current"):
                store.activate(seeded)
    elif store.link("current") is None:
        raise ServeError("no model: pass --model or set `model` in the config file")
    return store.bootable().path


def _start_services(config: AgentConfig, store: ModelStore, server: ApiServer, notifier: Notifier | None,
                    reload_config: Callable[[], AgentConfig] | None = None):
    """Telemetry for every finished request, and the updater when a broker is configured."""
    backend = server.backend
    updates: UpdateService | None = None

    def rollback() -> dict:
        # refusals are errors, so `edge-fleet cmd` exits non-zero (found in review: answered ok with "queued":
        # false, it exited 0, and a device without a previous model failed the job only later, in its events)
        if updates is None:
            raise CommandError("updates need a broker connection")
        if config.updates.job_keys:  # the command is not signed, and a rollback is a job like any other
            raise CommandError("this device takes rollbacks only as signed jobs ([updates] job_keys): "
                               "edge-fleet rollback DEVICE")
        if store.link("previous") is None:
            raise CommandError("no previous model to roll back to")
        job_id = f"rollback-{int(time.time())}-{secrets.token_hex(3)}"  # two in one second are two jobs
        updates.offer(JobDocument(job_id=job_id, operation="rollback").model_dump_json().encode())
        return {"queued": True, "job_id": job_id}

    telemetry = Telemetry.open(config, describe=lambda: describe_device(backend), rollback=rollback)
    if store.fallback is not None:  # a damaged current at boot: the fleet hears why it runs an older model
        telemetry.record_event("model_fallback", store.fallback)
    server.metrics.bind_telemetry(lambda: telemetry.store.dropped_total)
    backend.on_finished.append(lambda m, fin: telemetry.record_request(m.name, m.version, fin.figures))
    backend.on_ready(telemetry.bind_engine)
    backend.sampling_defaults = lambda: telemetry.settings.sampling.given()  # set_config applies at once
    if telemetry.link is not None:
        ctx = UpdateContext(
            device_id=telemetry.link.device_id, store=store,
            trusted_keys=load_trusted_keys(list(config.updates.trusted_keys)),
            memory_budget_mb=config.engine.memory_budget_mb,
            current=lambda: backend.engine.bundle if backend.engine else store.bootable(),
            report=lambda u: _report_job(telemetry, u),
            replay=lambda u: telemetry.link.publish_job_status(u.model_dump_json(), u.job_id),
            swap=lambda bundle, check=None: swap_engine(backend, bundle, config.engine, notifier, check),
            measure=lambda b, n: measure_golden(b, config.engine.threads, n),
            kv_dtypes=lambda: _kv_dtypes(backend, config, reload_config),
            health_check_tokens=config.updates.health_check_tokens, allow_downgrade=config.updates.allow_downgrade,
            artifacts_url=config.updates.artifacts_url, min_tokens_per_s=config.updates.min_tokens_per_s,
            job_keys=load_trusted_keys(list(config.updates.job_keys)))
        updates = UpdateService(ctx)
        telemetry.link.on_job = updates.offer
        # settled before the link connects (statuses wait for it): a job the broker redelivered at once was
        # offered before recover() had run, which then reported it FAILED while it went on to run
        updates.start()
    telemetry.start()
    return telemetry, updates


def _kv_dtypes(backend: Backend, started: AgentConfig,
               reload_config: Callable[[], AgentConfig] | None) -> tuple[str, ...]:
    """The KV cache types a new model would run with: the engine's, and the config file's, which the next start
    applies."""
    running = (backend.engine.config if backend.engine else started.engine).kv_dtype
    try:
        configured = reload_config().engine.kv_dtype if reload_config else running
    except Exception:  # an edit that does not load: the next start refuses it, and says why
        configured = running
    return tuple(dict.fromkeys((running, configured)))


def _report_job(telemetry: Telemetry, update) -> None:
    if update.state.value in ("SUCCEEDED", "FAILED"):  # the model may have changed: the fleet's registry
        telemetry.link.publish_state()  # first, so that it names the new model by the time the job has ended
    telemetry.link.publish_job_status(update.model_dump_json(), update.job_id)
    if update.state.value in ("SUCCEEDED", "FAILED", "REJECTED"):
        telemetry.record_event("model_change" if update.state.value == "SUCCEEDED" else "error",
                               {"job_id": update.job_id, "state": update.state.value, "reason": update.reason})


def describe_device(backend: Backend) -> dict:
    """DeviceState's optional fields: what this device runs and on what."""
    import platform

    from agent.process import usable_cores

    m = backend.manifest
    mem_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:")), 0)
    return {"model": m.name, "version": m.version, "precision": m.precision, "agent_version": AGENT_VERSION,
            "hardware": {"cpu": platform.processor() or platform.machine(), "cores": usable_cores(),
                         "memory_mb": mem_kb // 1024, "arch": platform.machine()}}


def swap_engine(backend: Backend, bundle, config: EngineConfig, notifier: Notifier | None,
                check: Callable[[object], None] | None = None) -> None:
    """Activate a new model: the old one finishes what it holds, stops and lets go of its memory, then the new
    one is measured and loaded with the whole budget; requests arriving meanwhile wait for it (api
    SWITCH_WAIT_S). Found in review: loaded beside a busy old model, the new one's budget counted only what
    the old held at that moment, so the old one's requests went on filling its KV cache past
    memory_budget_mb, and the new model kept a KV cache sized around the old one until a restart. If the
    new model fails to load, the caller rolls back (the same way). check(bundle), an update's health check, runs
    between the two, alone in the budget; if it raises, the old model loads again and the exception propagates."""
    # A job can arrive while the first model still loads (a rollback queued for an offline device): swapped in
    # then, the loader's mark_ready() replaced it, and it ran on unused beside the one served.
    deadline = time.monotonic() + LOADING_WAIT_S
    while backend.state is ServerState.LOADING:
        if time.monotonic() > deadline:
            raise ServeError(f"the first model is still loading after {LOADING_WAIT_S:.0f} s: not switching now")
        time.sleep(0.1)
    if backend.engine is not None:  # its config carries what SIGHUP changed since the start: kept, not reverted
        config = backend.engine.config
    keepalive = notifier.keepalive(SWITCH_KEEPALIVE_S) if notifier else contextlib.nullcontext()
    backend.switching.set()
    try:
        old = backend.engine
        serving = old.bundle if old is not None else None
        if old is not None:
            _drain(old, timeout_s=DRAIN_BEFORE_SWITCH_S)
        with keepalive:  # from here no engine loop feeds the watchdog until the new one runs
            if old is not None:
                old.stop()
                old.close()  # stopped alone, it kept its session and KV cache (the API still references it)
                del old
                trim_heap()
            if check is not None:
                try:
                    check(bundle)
                except BaseException:
                    trim_heap()
                    if serving is not None:
                        try:
                            _hand_over(backend, load_engine(serving.path, config, notifier))
                        except Exception:  # the check's reason is the news; the watchdog restarts us
                            log.exception("the model that served before the check failed to load again: "
                                          "nothing is served until the agent restarts")
                    raise
                trim_heap()  # the check's sessions, before the next load measures its baseline
            _hand_over(backend, load_engine(bundle.path, config, notifier))
    finally:
        backend.switching.clear()


def _drain(engine: Engine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
