"""A request's life in the local API across the engine's: loading, ready and draining, model switches under a
request, finished hooks, and a client that goes away cancelling its request."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from agent.api.app import EventBridge
from agent.api.backend import Backend
from agent.engine.engine import Engine
from agent.engine.request import Finished, RequestHandle, TextDelta
from agent.engine.sampler import make_rng
from agent.engine.sampling_params import SamplingParams
from agent.engine.sequence import Sequence
from agent.wire import Manifest, RequestFigures
from api_support import TINY_ENGINE, serving, wait_for


def test_a_request_tokenized_for_an_engine_that_a_model_switch_stopped_goes_to_the_new_one(tiny_bundle, caplog):
    """Found in review: swap_engine stopped the idle old engine while a request was being tokenized for it."""
    from agent.service.lifecycle import ModelLifecycle

    caplog.set_level("INFO", logger="agent.api.app")
    old = Engine(tiny_bundle, TINY_ENGINE)
    encode = old.tokenizer.encode
    tokenizing = threading.Event()
    # the request's tokenization ends only after the switch has stopped the old engine
    old.tokenizer.encode = lambda *a, **k: (tokenizing.set(), wait_for(lambda: not old.is_running), encode(*a, **k))[2]
    old.start()
    with serving(tiny_bundle, old) as s:
        answers = []
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
        client = threading.Thread(target=lambda: answers.append(s.http(timeout_s=20).post("/v1/completions", json=body)))
        client.start()
        assert tokenizing.wait(10)
        ModelLifecycle(s.server.backend, TINY_ENGINE).swap(tiny_bundle)  # the old engine is idle: stopped at once
        client.join(20)
        new = s.server.backend.engine
        assert new is not old and not old.is_running
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["usage"]["completion_tokens"] == 3
        assert "the engine stopped while a request was submitted to it" in caplog.text
        new.stop()


def test_a_request_outliving_the_event_loop_still_runs_its_finished_hooks(tiny_bundle):
    """A stream still running when the server stops (drain_timeout_s ran out): its thread must keep reading
    the request's events after the event loop has closed, so that the finished-request hooks (telemetry) run,
    and join_requests waits for them. The old thread returned at the first text event it could not deliver,
    and the request's row was never written."""
    handle = RequestHandle(Sequence([1, 2], SamplingParams(max_tokens=4), make_rng(0), 6))
    recorded: list[str] = []
    release = threading.Event()

    def slow_commit(fin: Finished) -> None:
        release.wait(10)
        recorded.append(fin.figures.finish_reason)

    backend = Backend(Manifest.read(tiny_bundle.path))
    loop = asyncio.new_event_loop()

    async def open_bridge() -> EventBridge:
        return EventBridge(handle, slow_commit, backend.track)
    bridge = loop.run_until_complete(open_bridge())
    loop.close()  # the server has stopped; the engine has not yet
    handle.events.put(TextDelta("a"))
    figures = RequestFigures(prompt_tokens=2, completion_tokens=1, queue_ms=0, ttft_ms=1, prefill_tokens_per_s=1,
                             decode_tokens_per_s=0, itl_p50_ms=0, itl_p95_ms=0, e2e_ms=1, kv_bytes=0,
                             finish_reason="cancelled")
    handle.events.put(Finished("a", [3], figures))
    try:
        assert not backend.join_requests(0.2)  # the hook is still committing
        release.set()
        assert backend.join_requests(10)
        assert recorded == ["cancelled"]
        assert handle.seq.cancelled  # nobody listens any more: the engine is told to stop generating
        assert not bridge.is_finished  # nothing was delivered to the closed loop
    finally:
        release.set()


def test_a_slow_finished_hook_holds_its_own_answer_and_not_the_server(tiny_bundle, tiny_engine):
    """Telemetry's commit is an fsync, which on an SD card can take a second: it must block only the request
    it records (whose answer waits for the commit, so a crash never loses a row a client saw end), never the
    event loop that streams everyone else's tokens."""
    entered, release = threading.Event(), threading.Event()

    def slow_commit(manifest, fin):
        entered.set()
        release.wait(10)

    with serving(tiny_bundle, tiny_engine) as s:
        s.server.backend.on_finished.append(slow_commit)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        first: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: first.append(s.http().post("/v1/completions", json=body)))
        waiting.start()
        try:
            assert entered.wait(10)
            s.server.backend.on_finished.remove(slow_commit)
            with s.http(timeout_s=3) as http:  # the old code: both time out, the loop sits in the hook
                assert http.get("/health").status_code == 200
                assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 2
            assert not first, "the answer went out before its telemetry was committed"
        finally:
            release.set()
            waiting.join(10)
        assert first[0].status_code == 200


def test_health_is_503_while_loading_and_draining(tiny_bundle, tiny_engine):
    loaded = threading.Event()
    with serving(tiny_bundle, None, load=lambda: (loaded.wait(10), tiny_engine)[1]) as s:
        http = s.http()
        r = http.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading", "model": "tiny",
                                                     "version": s.server.backend.manifest.version}
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 503
        loaded.set()
        wait_for(lambda: http.get("/health").status_code == 200)
        assert http.get("/health").json()["status"] == "ready"
        s.server.backend.mark_draining()
        assert http.get("/health").json()["status"] == "draining"
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 503


@pytest.mark.real_model
def test_disconnect_mid_stream_cancels_the_request(real):
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with real.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert real.engine.num_running == 1
    wait_for(lambda: real.engine.num_running == 0, timeout_s=3)  # 900 tokens would take the engine ~40 s
    wait_for(lambda: real.metrics().get('edge:request_success_total{finish_reason="cancelled"}') == 1, 3)
    with real.http(timeout_s=0.5) as http, pytest.raises(httpx.ReadTimeout):  # not streamed: same
        http.post("/v1/completions", json={**body, "stream": False})
    wait_for(lambda: real.metrics().get('edge:request_success_total{finish_reason="cancelled"}') == 2, 3)
    assert real.engine.num_running == 0


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_client_gone_before_the_first_chunk_still_cancels_the_request(spec_version):
    """Found in review: the request was cancelled by the body generator's `finally`, and a generator never
    started (the response's start message failed) runs none, so the request generated on to its limit."""
    from agent.api.app import RequestStream

    started, cancels = [], []

    class Events:  # the one method RequestStream uses of an EventBridge
        def cancel(self):
            cancels.append(1)

    async def body():
        started.append(1)
        yield b"data: x\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client closed the connection")

    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    with pytest.raises(Exception):
        asyncio.run(RequestStream(body(), Events())(scope, receive, send))
    assert cancels == [1] and not started


def test_a_request_tokenized_after_a_switch_closed_its_engine_goes_to_the_new_one(tiny_bundle, monkeypatch):
    """Found in review: the prompt's length limit was read from the engine in the tokenizing thread, and an
    engine a model switch had closed meanwhile answered 500 (the old code retried on the new engine)."""
    import agent.api.app
    from agent.service.lifecycle import ModelLifecycle

    to_thread = asyncio.to_thread

    async def late(fn, *a, **kw):  # queued behind other work in the executor
        await asyncio.sleep(0.5)
        return await to_thread(fn, *a, **kw)

    engine = Engine(tiny_bundle, TINY_ENGINE)
    engine.start()
    monkeypatch.setattr(agent.api.app.asyncio, "to_thread", late)
    with serving(tiny_bundle, engine) as s:
        answers = []
        ask = threading.Thread(target=lambda: answers.append(
            s.http().post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})))
        ask.start()
        time.sleep(0.2)  # it picked the old engine and waits for a thread
        ModelLifecycle(s.server.backend, TINY_ENGINE).swap(tiny_bundle)
        ask.join()
        s.server.backend.engine.stop()
        assert answers[0].status_code == 200, answers[0].text
