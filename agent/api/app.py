"""The local HTTP API: OpenAI-compatible endpoints served over the agent's Unix socket (the only Starlette import).

POST /v1/chat/completions and /v1/completions answer with one JSON object or, with "stream": true, a
server-sent-event stream ending in `data: [DONE]` (OpenAI API); GET /v1/models[/{id}], /health and /metrics
report the model, readiness and Prometheus metrics. This module translates between HTTP and the engine
and holds no engine logic: it validates a body (agent.api.openai_models), tokenizes it, submits it, and relays
the request's events. The engine thread fills one blocking queue per request; an `EventBridge` thread
hands each event to the event loop with call_soon_threadsafe, so the loop never blocks on the engine. A
client that goes away cancels its request at once. Every error has OpenAI's body
{"error": {"message", "type", "param", "code"}}; an unexpected exception is logged with its traceback
and answered with a bare 500.

Example:
    app = create_app(Backend(manifest), Metrics(), ApiConfig())   # then serve it (agent.service.serve)
    backend.mark_ready(engine)                                      # /health turns 200
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from agent.api import openai_models as om
from agent.api.backend import ApiError, Backend, EngineStopped, ServerState, invalid_request, overloaded, unavailable
from agent.config import ApiConfig
from agent.engine.request import Finished, RequestError, RequestHandle, TextDelta
from agent.engine.sampling_params import Structure
from agent.api.metrics import Metrics
from agent.api.replies import ChatReplies, Replies, Reply, TextReplies, sse_event
from agent.api.tool_calls import ToolPlan, tool_plan
from agent.engine.tokenizer import PromptTooLong
from agent.wire import Manifest

if TYPE_CHECKING:  # the API is handed engines to serve from; the service loads them
    from agent.engine.engine import Engine

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's end-of-stream sentinel
SWITCH_WAIT_S = 90.0  # how long a request waits for a model switch (the old model's drain, then the load)


# ---- engine events -> event loop ---------------------------------------------------------------------
class EventBridge:
    """One request's engine events, moved from its blocking queue to the event loop by a helper thread.

    A thread per request (not asyncio.to_thread per event) because the default executor has a handful of
    workers and 32 blocked streams would starve it. The thread ends with the request's Finished event,
    which the engine always sends (also after cancel()). on_finished runs on this thread before the event
    reaches the loop: telemetry's commit (an fsync, up to a second on an SD card) then holds only this
    request's answer, which goes out after its row is durable, and never the loop that streams the others.
    """

    def __init__(self, handle: RequestHandle, on_finished: Callable[[Finished], None],
                 track: Callable[[threading.Thread], None] = lambda thread: None):
        self.handle = handle
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._on_finished = on_finished
        self.is_finished = False
        thread = threading.Thread(target=self._pump, name=f"api-events-{handle.seq.seq_id}", daemon=True)
        thread.start()
        track(thread)  # so that shutdown can wait for on_finished (Backend.join_requests)

    def _pump(self) -> None:
        delivering = True
        for event in self.handle:  # blocks in the engine queue's get(), off the event loop
            if isinstance(event, Finished):
                self._on_finished(event)  # counted even when the client is gone and nobody reads it
            if not delivering:
                continue
            try:
                self._loop.call_soon_threadsafe(self._deliver, event)
            except RuntimeError:  # the loop is closed: the server has stopped and nobody is waiting.
                # Stop generating but wait for the Finished that follows: returning here, on a text event,
                # lost the request's telemetry (found with requests cut off by the drain timeout).
                delivering = False
                self.handle.cancel()

    def _deliver(self, event: TextDelta | Finished) -> None:
        if isinstance(event, Finished):
            self.is_finished = True
        self._queue.put_nowait(event)

    async def get(self) -> TextDelta | Finished:
        return await self._queue.get()

    def cancel(self) -> None:
        if not self.is_finished:
            self.handle.cancel()


class RequestStream(StreamingResponse):
    """A streamed answer that cancels its request however the response ends.

    The body generator's own `finally` is not enough: a client gone before the first chunk (the response's
    start message fails, or Starlette's disconnect watcher cancels it) leaves the generator never started,
    and a generator never started runs no `finally`, so the request went on generating to its limit.
    """

    def __init__(self, body: AsyncIterator[bytes], events: EventBridge, **kw):
        super().__init__(body, **kw)
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.events.cancel()  # a no-op once the request has finished


class ClientGone(Exception):
    """The client closed its connection before the response started."""


async def _wait_disconnect(request: Request) -> None:
    # Once the body is read, receive() returns only at http.disconnect (ASGI HTTP spec).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_or_gone(events: EventBridge, gone: asyncio.Task) -> TextDelta | Finished:
    """The next event, or ClientGone if the client disconnects first."""
    get = asyncio.ensure_future(events.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    raise ClientGone


# ---- the two completion endpoints ---------------------------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    """A request made ready for the engine: its prompt, the structure tools impose, and the tools' plan."""

    prompt_ids: list[int]
    structure: Structure | None = None
    tools: ToolPlan | None = None  # set when the reply may call tools


class ChatKind:
    path = "/v1/chat/completions"
    prompt_field = "messages"
    request_model = om.ChatCompletionRequest
    id_prefix = "chatcmpl-"

    @staticmethod
    def prepare(req: om.ChatCompletionRequest, engine: Engine) -> Prepared:
        plan = tool_plan(req, engine.tokenizer.chat_template_source, engine.tokenizer.added_token_id)
        messages = req.template_messages()
        try:
            ids = engine.tokenizer.encode_chat(plan.messages(messages) if plan else messages,
                                               max_tokens=engine.max_prompt_tokens,
                                               tools=plan.template_tools() if plan else None)
        except PromptTooLong:
            raise
        except ValueError as e:  # the template refused the conversation
            raise om.FieldError(str(e), "messages") from None
        structure = plan.structure() if plan else None
        return Prepared(ids, structure, plan if structure else None)

    @staticmethod
    def default_max_tokens(engine: Engine) -> int:
        # OpenAI: no limit but the context. We use the configured default (clamped to the context by the
        # engine), so that a generation that never ends does not hold a full-context slot until it does.
        return engine.config.default_max_tokens

    @staticmethod
    def replies(reply: Reply, req: om.ChatCompletionRequest, prepared: Prepared) -> ChatReplies:
        return ChatReplies(reply, prepared.tools.syntax if prepared.tools else None)


class TextKind:
    path = "/v1/completions"
    prompt_field = "prompt"
    request_model = om.CompletionRequest
    id_prefix = "cmpl-"

    @staticmethod
    def prepare(req: om.CompletionRequest, engine: Engine) -> Prepared:
        prompt = req.prompt_text_or_ids()
        if isinstance(prompt, str):
            return Prepared(engine.tokenizer.encode(prompt, max_tokens=engine.max_prompt_tokens))
        vocab_size = engine.bundle.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise om.FieldError(f"prompt: token id {bad} is outside this model's vocabulary [0, {vocab_size})",
                                "prompt")
        return Prepared(list(prompt))

    @staticmethod
    def default_max_tokens(engine: Engine) -> int:
        return om.COMPLETIONS_DEFAULT_MAX_TOKENS

    @staticmethod
    def replies(reply: Reply, req: om.CompletionRequest, prepared: Prepared) -> TextReplies:
        return TextReplies(reply)


Kind = type[ChatKind] | type[TextKind]


def finished_error(fin: Finished, retry_after_s: int) -> ApiError | None:
    """The API error for a request the engine ended without a normal finish, else None."""
    reason = fin.figures.finish_reason
    if reason == "error":
        message = fin.error or "the engine failed the request"
        if fin.error_code == "overloaded":
            return overloaded(message, retry_after_s)
        if fin.error_code == "unavailable":
            return unavailable(message, retry_after_s)
        if fin.error_code == "structured_output":  # the grammar the request gave reached a dead end
            return invalid_request(message, code="structured_output_failed")
        log.error("request failed in the engine: %s", message)
        return ApiError(500, "internal error", "server_error", "internal_error")
    if reason == "cancelled":  # not by this client (it would not be waiting): the engine is stopping
        return ApiError(503, "the request was cancelled: the server is shutting down", "server_error", "cancelled")
    return None


# ---- the application ---------------------------------------------------------------------------------
INTAKE_BODIES = 4  # bodies being read or tokenized hold at most this many max_body_bytes together...
INTAKE_SMALL_BYTES = 64 << 10  # ...except that a body up to this size is always read (256 connections: 16 MiB)


class Intake:
    """Bytes of request bodies read but not yet submitted, over all connections (on the event loop only).
    Past the limit a body is refused as overloaded: 200 connections sending 4 MiB bodies slowly held 1.35 GB
    of an agent whose budget was 350 MB, none of it counted anywhere. Small bodies, every
    ordinary request, are never refused: four slow uploads would otherwise lock every other client out."""

    def __init__(self, limit: int, retry_after_s: int):
        self.limit, self.retry_after_s, self.held = limit, retry_after_s, 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[Callable[[int], None]]:
        taken = 0

        def take(n: int) -> None:
            nonlocal taken
            if taken + n > INTAKE_SMALL_BYTES and self.held + n > self.limit:
                raise overloaded(f"the agent is reading {self.held} bytes of other requests; try again",
                                 self.retry_after_s)
            self.held, taken = self.held + n, taken + n

        try:
            yield take
        finally:
            self.held -= taken


class OpenAIServer:
    """The endpoints, bound to one backend, metrics and API configuration."""

    def __init__(self, backend: Backend, metrics: Metrics, config: ApiConfig):
        self.backend, self.metrics, self.config = backend, metrics, config
        self.intake = Intake(INTAKE_BODIES * config.max_body_bytes, config.retry_after_s)
        backend.on_ready(metrics.bind_engine)

    # -- plumbing --
    def endpoint(self, fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Wrap a handler: ApiError -> its response, anything unexpected -> logged, bare 500."""

        @functools.wraps(fn)
        async def run(request: Request) -> Response:
            try:
                return await fn(request)
            except ApiError as e:
                self.metrics.observe_error(e.code or e.type)
                return e.response()
            except (ClientDisconnect, ClientGone):
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            except Exception:
                log.exception("internal error serving %s %s", request.method, request.url.path)
                self.metrics.observe_error("internal_error")
                return ApiError(500, "internal error", "server_error", "internal_error").response()

        return run

    async def read_body(self, request: Request, take: Callable[[int], None] = lambda n: None) -> bytes:
        """The whole body, each part counted by take() (which may refuse it) as it arrives."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise invalid_request(f"the request body is {declared} bytes; at most {limit} are accepted",
                                  code="request_too_large", status=413)
        body = bytearray()

        async def read() -> None:
            async for part in request.stream():
                take(len(part))
                body.extend(part)
                if len(body) > limit:
                    raise invalid_request(f"the request body exceeds {limit} bytes", code="request_too_large",
                                          status=413)

        try:  # a client that stops mid-body held its connection (and a file descriptor) for good
            await asyncio.wait_for(read(), self.config.request_timeout_s)
        except TimeoutError:
            raise invalid_request(f"the request body did not arrive within {self.config.request_timeout_s:g} s",
                                  code="request_timeout", status=408) from None
        return bytes(body)

    def parse(self, body: bytes, model: type[om.SamplingRequest]) -> om.SamplingRequest:
        try:
            req = model.model_validate_json(body)
        except ValidationError as e:
            message, param = om.describe_validation_error(e, model)
            code = {"json_invalid": "invalid_json", "extra_forbidden": "unknown_parameter"}.get(e.errors()[0]["type"])
            raise invalid_request(message, param, code or "invalid_value") from None
        self.adapter_of(req.model)  # a 404 before the body is tokenized
        return req

    def adapter_of(self, model_id: str, engine: Engine | None = None) -> str | None:
        """The LoRA adapter a request's model names ("BASE:ADAPTER"; BASE by either of its names), None for the
        base; a 404 in OpenAI's shape for a model or adapter not served (by engine, when given, else the one
        serving now: an adapter is known once its engine has loaded)."""
        base, colon, adapter = model_id.partition(":")  # names hold no ':' (wire.MODEL_NAME_PATTERN)
        if base not in self.backend.model_ids or (colon and not adapter):
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{self.backend.manifest.name!r}", "invalid_request_error", "model_not_found", "model")
        engine = engine or self.backend.engine
        if adapter and engine is not None and adapter not in engine.adapters:
            served = ", ".join(f"{base}:{a}" for a in engine.adapters) or "none"
            raise ApiError(404, f"the adapter {adapter!r} of {base!r} does not exist; adapters served: {served}",
                           "invalid_request_error", "model_not_found", "model")
        return adapter or None

    async def submit(self, engine: Engine, prepared: Prepared, req: om.SamplingRequest, kind: Kind) -> RequestHandle:
        try:
            params = req.sampling_params(kind.default_max_tokens(engine), self.backend.sampling_defaults(),
                                         prepared.structure)
            # a grammar compiles in submit (up to ~1 s), the first logprobs request builds the token table: off the loop
            adapter = self.adapter_of(req.model, engine)
            if params.structure is not None or params.logprobs is not None:
                return await asyncio.to_thread(engine.submit, prepared.prompt_ids, params, req.priority, adapter)
            return engine.submit(prepared.prompt_ids, params, req.priority, adapter)
        except om.FieldError as e:
            raise invalid_request(str(e), e.param) from None
        except RequestError as e:
            if e.code == "overloaded":
                if e.refused is not None:  # recorded off the loop: telemetry commits to disk
                    await asyncio.to_thread(self._observe(engine.bundle.manifest, metrics=False), e.refused)
                raise overloaded(str(e), self.config.retry_after_s) from None
            if e.code == "engine_stopped":
                raise EngineStopped from None
            raise invalid_request(str(e), e.param or kind.prompt_field, e.code) from None

    # -- completions --
    async def complete(self, request: Request, kind: Kind) -> Response:
        with self.intake.hold() as take:  # until the prompt is tokenized and submitted, or refused
            req = self.parse(await self.read_body(request, take), kind.request_model)
            handle, engine, prepared = await self._submit_parsed(req, kind)
        events = EventBridge(handle, self._observe(engine.bundle.manifest), self.backend.track)
        reply = Reply(kind.id_prefix + secrets.token_hex(12), int(time.time()), req.model,
                      self.backend.manifest.version, req.include_usage)
        replies, stream = kind.replies(reply, req, prepared), req.stream
        del req  # not held while it runs: its fields can be megabytes
        return await self.relay(request, events, replies, stream)

    async def _submit_parsed(self, req: om.SamplingRequest, kind: Kind) -> tuple[RequestHandle, Engine, Prepared]:
        for _ in range(3):  # a model switch may stop the engine while the request is tokenized for it
            await self._wait_for_switch()
            engine = self.backend.require_engine()
            try:
                # Off the loop, so other streams keep flowing (a long text is encoded without the GIL).
                prepared = await asyncio.to_thread(kind.prepare, req, engine)
            except om.FieldError as e:
                raise invalid_request(str(e), e.param) from None
            except PromptTooLong as e:  # refused before a text of megabytes is encoded
                if engine.stopped:  # by the old model of a switch: the new one may hold it
                    continue
                raise invalid_request(str(e), kind.prompt_field, "context_length_exceeded") from None
            try:
                handle = await self.submit(engine, prepared, req, kind)
                break
            except EngineStopped:
                log.info("the engine stopped while a request was submitted to it: trying the current one")
        else:
            raise unavailable("the engine stopped while the request was submitted", self.config.retry_after_s)
        return handle, engine, prepared

    async def _wait_for_switch(self) -> None:
        """While a model switch drains the old model and loads the new one, wait (not 503) for a while."""
        deadline = time.monotonic() + SWITCH_WAIT_S
        while self.backend.switching.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _observe(self, manifest: Manifest, metrics: bool = True) -> Callable[[Finished], None]:
        """The finished-request hooks; metrics=False leaves out /metrics, which counts a request refused at
        submission as an error of its own (its zero queue time and uncomputed prompt would skew the rest)."""
        def observe(fin: Finished) -> None:  # on the request's EventBridge thread
            hooks = [lambda m, f: self.metrics.observe_finished(f.figures, f.token_times, f)] if metrics else []
            for hook in [*hooks, *self.backend.on_finished]:
                try:
                    hook(manifest, fin)
                except Exception:  # a failing observer must not keep the answer from its client
                    log.exception("a finished-request hook failed")
        return observe

    async def relay(self, request: Request, events: EventBridge, replies: Replies, stream: bool) -> Response:
        """Wait for the first event (or the whole answer) while watching for the client going away."""
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            event = await _next_or_gone(events, gone)
            while not stream and not isinstance(event, Finished):
                event = await _next_or_gone(events, gone)
        except BaseException:
            events.cancel()  # the client left (or we failed): free the slot now
            raise
        finally:
            gone.cancel()
        if isinstance(event, Finished) and (error := finished_error(event, self.config.retry_after_s)):
            raise error
        if not stream:
            return Response(replies.response(event).model_dump_json(), media_type="application/json")
        # Headers go out only now, so a request refused in the queue still gets its real status code.
        return RequestStream(self.stream(events, event, replies), events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    async def stream(self, events: EventBridge, event: TextDelta | Finished, replies: Replies) -> AsyncIterator[bytes]:
        """The SSE chunks from the first event on (RequestStream cancels the request if the client goes)."""
        usage = replies.reply.include_usage
        for chunk in replies.opening():
            yield sse_event(chunk, usage)
        while isinstance(event, TextDelta):
            for chunk in replies.delta(event):
                yield sse_event(chunk, usage)
            event = await events.get()
        yield self._stream_end(event, replies)

    def _stream_end(self, fin: Finished, replies: Replies) -> bytes:
        error = finished_error(fin, self.config.retry_after_s)
        if error is not None:  # mid-stream: the status is sent already, so the error is an event (as vLLM does)
            self.metrics.observe_error(error.code or error.type)
            body = om.ErrorResponse(error=om.ErrorDetail(message=error.message, type=error.type, code=error.code))
            return b"data: " + body.model_dump_json().encode() + b"\n\n" + SSE_DONE
        return b"".join(sse_event(chunk, replies.reply.include_usage) for chunk in replies.end(fin)) + SSE_DONE

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, ChatKind)

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, TextKind)

    # -- status --
    async def models(self, request: Request) -> Response:
        """The base model, then each adapter served with it (once its engine has loaded) as BASE:ADAPTER."""
        engine = self.backend.engine
        adapters = list(engine.adapters) if engine is not None else []
        cards = [self._card()] + [self._card(a, engine) for a in adapters]
        return Response(om.ModelList(data=cards).model_dump_json(), media_type="application/json")

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}, the OpenAI clients' models.retrieve: the served id by either of its names."""
        engine = self.backend.engine
        adapter = self.adapter_of(request.path_params["model_id"], engine)
        return Response(self._card(adapter, engine).model_dump_json(), media_type="application/json")

    def _card(self, adapter: str | None = None, engine: Engine | None = None) -> om.ModelCard:
        m = self.backend.manifest
        if adapter is None:
            return om.ModelCard(id=m.name, created=_unix_seconds(m.created_at), version=m.version, precision=m.precision)
        a = engine.adapters[adapter].manifest
        return om.ModelCard(id=f"{m.name}:{adapter}", created=_unix_seconds(a.created_at), version=a.version,
                            precision=m.precision, parent=m.name)

    async def health(self, request: Request) -> Response:
        state, m = self.backend.state, self.backend.manifest
        engine = self.backend.engine
        healthy = state is ServerState.READY and engine is not None and engine.is_running
        status = state.value if state is not ServerState.READY or healthy else "engine_stopped"
        body = om.Health(status=status, model=m.name, version=m.version).model_dump_json()
        return Response(body, 200 if healthy else 503, media_type="application/json")

    async def prometheus(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


def _unix_seconds(iso: str) -> int:
    try:
        return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0  # a manifest from an older quantizer with another date format: OpenAI's field is required


async def _http_error(request: Request, exc: HTTPException) -> Response:
    # Unknown paths and wrong methods, in OpenAI's error shape too.
    response = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error",
                        "not_found" if exc.status_code == 404 else "method_not_allowed").response()
    response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 requires it)
    return response


def create_app(backend: Backend, metrics: Metrics, config: ApiConfig = ApiConfig()) -> Starlette:
    server = OpenAIServer(backend, metrics, config)
    e = server.endpoint
    routes = [
        Route("/v1/chat/completions", e(server.chat_completions), methods=["POST"]),
        Route("/v1/completions", e(server.completions), methods=["POST"]),
        Route("/v1/models", e(server.models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", e(server.model), methods=["GET"]),
        Route("/health", e(server.health), methods=["GET"]),
        Route("/metrics", e(server.prometheus), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
