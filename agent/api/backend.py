"""What the local API is serving: the model's identity, its engine once loaded, and the server state that gates
every endpoint; plus the API's errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}.

The loader calls mark_ready / mark_failed, the server's shutdown mark_draining, and only the model lifecycle
(agent.service.lifecycle) swaps the engine; request handlers read `engine` once per request.

Example:
    backend = Backend(manifest)          # LOADING: /health answers 503
    backend.mark_ready(engine)           # READY
    engine = backend.require_engine()    # in a handler: the engine, or an ApiError to answer with
"""
from __future__ import annotations

import enum
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.responses import Response

from agent.api import openai_models as om
from agent.engine.request import Finished
from agent.wire import Manifest

if TYPE_CHECKING:  # the API is handed engines to serve from; the service loads them
    from agent.engine.engine import Engine


# ---- errors -----------------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered in OpenAI's shape; `retry_after_s` adds a Retry-After header (429, 503)."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_s = retry_after_s

    def response(self) -> Response:
        body = om.ErrorResponse(error=om.ErrorDetail(message=self.message, type=self.type, param=self.param,
                                                     code=self.code))
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return Response(body.model_dump_json(), self.status, headers, media_type="application/json")


class EngineStopped(Exception):
    """The engine a request was tokenized for stopped before taking it (a model switch): try the current one."""


def invalid_request(message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
    return ApiError(status, message, "invalid_request_error", code, param)


def overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, "rate_limit_error", "overloaded", retry_after_s=retry_after_s)


def unavailable(message: str, retry_after_s: int) -> ApiError:
    return ApiError(503, message, "server_error", "unavailable", retry_after_s=retry_after_s)


def too_many_connections(message: str, retry_after_s: int) -> Response:
    """The answer to a request refused by the connection limits (agent.api.admission); the connection closes
    after it, so that the refused client does not keep holding a file descriptor."""
    response = ApiError(503, message, "server_error", "too_many_connections", retry_after_s=retry_after_s).response()
    response.headers["Connection"] = "close"
    return response


# ---- what is being served ---------------------------------------------------------------------------
class ServerState(enum.Enum):
    LOADING = "loading"  # the socket answers; the model is being verified and loaded
    READY = "ready"
    DRAINING = "draining"  # shutting down: in-flight requests finish, new ones are refused
    FAILED = "failed"  # the model could not be loaded


_TRANSITIONS = {
    ServerState.LOADING: {ServerState.READY, ServerState.DRAINING, ServerState.FAILED},
    ServerState.READY: {ServerState.DRAINING},
    ServerState.DRAINING: set(),
    ServerState.FAILED: {ServerState.DRAINING},
}


class Backend:
    """The model this server answers for and, once loaded, its engine; the state gates every endpoint.

    The loader thread calls mark_ready / mark_failed, the server's shutdown calls mark_draining.
    """

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.engine: Engine | None = None
        self.state = ServerState.LOADING
        self._lock = threading.Lock()
        self._on_ready: list[Callable[[Engine], None]] = []
        # called with (the manifest that served it, Finished) for every request that ends, on that request's
        # own thread (EventBridge) before its client hears the end: telemetry
        self.on_finished: list[Callable[[Manifest, Finished], None]] = []
        # sampling defaults for what a request leaves out, as the fleet last set them (set_config)
        self.sampling_defaults: Callable[[], dict] = dict
        self.switching = threading.Event()  # a model switch is under way: requests wait for it (agent.api.app's SWITCH_WAIT_S)
        self._request_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # EventBridge threads

    @property
    def model_ids(self) -> tuple[str, str]:
        """The names a request's `model` may use: the bare name, or name@version."""
        return self.manifest.name, f"{self.manifest.name}@{self.manifest.version}"

    def can_move(self, to: ServerState) -> bool:
        return to in _TRANSITIONS[self.state]

    def _move(self, to: ServerState) -> bool:
        with self._lock:
            if not self.can_move(to):
                return False
            self.state = to
            return True

    def on_ready(self, callback: Callable[[Engine], None]) -> None:
        self._on_ready.append(callback)

    def mark_ready(self, engine: Engine) -> None:
        self.engine = engine  # set before the state, so a READY backend always has its engine
        for callback in self._on_ready:
            callback(engine)
        if not self._move(ServerState.READY):
            raise RuntimeError(f"cannot become ready from {self.state.value}")

    def swap(self, engine: Engine) -> Engine | None:
        """Serve new requests from `engine` (a model update); returns the old engine, which finishes what it
        already holds. Attribute assignment is atomic, so a request sees one engine or the other."""
        old, self.engine = self.engine, engine
        self.manifest = engine.bundle.manifest
        for callback in self._on_ready:
            callback(engine)
        return old

    def mark_failed(self) -> None:
        self._move(ServerState.FAILED)

    def mark_draining(self) -> None:
        self._move(ServerState.DRAINING)

    def track(self, thread: threading.Thread) -> None:
        with self._lock:
            self._request_threads.add(thread)

    def join_requests(self, timeout_s: float) -> bool:
        """After the engine has stopped: wait until every request's thread has run its finished-request hooks.

        The engine ends what it still holds as it stops, but the hooks (telemetry's commit) run on each
        request's own thread afterwards; a shutdown that closed telemetry without waiting lost those rows.
        Returns whether all of them finished in time.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._request_threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def require_engine(self) -> Engine:
        if self.state is ServerState.READY:
            if not self.engine.is_running:
                raise unavailable("the engine has stopped", retry_after_s=1)
            return self.engine
        what = {ServerState.LOADING: "the model is still loading", ServerState.DRAINING: "the server is shutting down",
                ServerState.FAILED: "the model failed to load"}[self.state]
        raise ApiError(503, f"not ready: {what}", "server_error", self.state.value, retry_after_s=1)

