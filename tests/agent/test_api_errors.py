"""The local API's refusals in OpenAI's shape: a fuzz of odd bodies that never gives a 500 or a hang,
400/404/429/500/503 with their bodies, and limits on what a request may hold."""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.engine.engine import Engine
from api_support import TINY_ENGINE, USER_HI, serving, sse_events, wait_for


# A valid request of either endpoint, then up to three fields replaced by odd values or removed, sent as JSON,
# truncated JSON, or to the other endpoint; plus arbitrary JSON and bytes.
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


ODD = st.one_of(JSON, st.sampled_from([0, -1, 0.5, 1e308, -1e-9, float("nan"), float("inf"), 10**30, -(2**70), "1",
                                       True, "", "\x00", "\ud7ff\U0001f600" * 50, [], {}, [1, "a"], {"text": 1}]))


TEXT = st.text(max_size=40)


PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": TEXT | st.lists(PART, max_size=2)})


SAMPLING = dict(temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(0, 300),
                min_p=st.floats(0, 1), repetition_penalty=st.floats(0.5, 2), presence_penalty=st.floats(-2, 2),
                frequency_penalty=st.floats(-2, 2), seed=st.integers(-(2**63), 2**64 - 1),
                stop=st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=4),
                stream=st.booleans(), ignore_eos=st.booleans(), priority=st.integers(-5, 5), n=st.just(1),
                user=TEXT)


CHAT = st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(MESSAGE, min_size=1, max_size=3),
                              "max_tokens": st.integers(1, 4)}, optional=SAMPLING)


TEXT_REQUEST = st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": st.integers(1, 4),
                                      "prompt": TEXT | st.lists(st.integers(0, 268), max_size=8)}, optional=SAMPLING)


FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream_options", "logprobs",
          "unknown", *SAMPLING]


@st.composite
def odd_request(draw) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body = draw(CHAT if chat else TEXT_REQUEST)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(ODD | st.just({"include_usage": True}) | st.integers(-2, 5))
    raw = json.dumps(body).encode()
    shape = draw(st.sampled_from(["json"] * 6 + ["truncated", "other endpoint", "any json", "bytes"]))
    raw = {"truncated": raw[:draw(st.integers(0, len(raw) - 1))], "any json": json.dumps(draw(JSON)).encode(),
           "bytes": draw(st.binary(max_size=40))}.get(shape, raw)
    return ("/v1/chat/completions" if chat != (shape == "other endpoint") else "/v1/completions"), raw


@pytest.fixture(scope="module")
def fuzz_client(tiny):
    with tiny.http(timeout_s=20) as client:
        yield client


FUZZ_CASES = 1000


FUZZ_COUNT = {"bodies": 0}  # a @given test cannot report its examples itself: test_report_fuzz_count does


@settings(max_examples=FUZZ_CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])
@given(request=odd_request())
def test_fuzzed_bodies_get_a_clean_answer(fuzz_client, request):
    path, body = request
    FUZZ_COUNT["bodies"] += 1
    r = fuzz_client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
    elif r.headers["content-type"].startswith("text/event-stream"):
        sse_events(r.text)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_report_fuzz_count(figures):
    figures.append(f"HTTP API: {FUZZ_COUNT['bodies']} fuzzed request bodies, each a 200 or an OpenAI-shaped 400/404, "
                   "no 500, no hang")
    assert FUZZ_COUNT["bodies"] >= FUZZ_CASES


def test_tiny_temperature_does_not_stop_the_engine(tiny_bundle):
    """Found by the fuzz run: temperature 1e-232 with min_p used to raise in the sampler and kill the loop."""
    engine = Engine(tiny_bundle, TINY_ENGINE)
    engine.start()
    with serving(tiny_bundle, engine) as s, s.http(timeout_s=3) as http:
        for temperature in (1e-232, 0.7):
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                   "temperature": temperature, "min_p": 0.1})
            assert r.status_code == 200
    engine.stop()


def test_errors_have_openai_status_and_body(tiny):
    client = tiny.openai()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=USER_HI)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="the " * 300)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    http = tiny.http()
    cases = [(b'{"model": "tiny", "messages": [', "invalid_json"), (b'{"model":"tiny","prompt":"x","logprob":1}',
                                                                    "unknown_parameter"),
             (b'{"model":"tiny","prompt":"x","n":2}', "invalid_value"),
             (b'{"model":"tiny","prompt":"x","temperature":"hot"}', "invalid_value")]
    for body, code in cases:
        r = http.post("/v1/completions", content=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert "logprob" in http.post("/v1/completions", content=cases[1][0]).json()["error"]["message"]
    assert http.post("/v1/completions", content=b"x" * (5 << 20)).status_code == 413
    assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"
    wrong_method = http.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"


def test_overloaded_engine_answers_429_with_retry_after_and_records_the_refusal(tiny_bundle):
    """Found in review: a request refused at submission left no telemetry row (one shed from the queue later
    did), so the fleet saw an overloaded device with a clean record."""
    engine = Engine(tiny_bundle, TINY_ENGINE.model_copy(update={"max_queue": 0}))  # every submit is 'overloaded'
    engine.start()
    with serving(tiny_bundle, engine) as s:
        recorded = []
        s.server.backend.on_finished.append(lambda manifest, fin: recorded.append((manifest.name, fin)))
        r = s.http().post("/v1/completions", json={"model": "tiny", "prompt": "hello"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        with pytest.raises(openai.RateLimitError):
            s.openai().completions.create(model="tiny", prompt="hello", stream=True)
        assert len(recorded) == 2 and all(name == "tiny" for name, _ in recorded)
        for _, fin in recorded:
            f = fin.figures
            assert (f.finish_reason, f.completion_tokens, fin.error_code) == ("error", 0, "overloaded")
            assert f.prompt_tokens > 0 and 0 <= f.queue_ms < 1000
        metrics = s.http().get("/metrics").text  # counted once, as errors (found in review: twice)
        assert 'edge:request_errors_total{code="overloaded"} 2.0' in metrics
        assert 'finish_reason="error"' not in metrics and "edge:prompt_tokens_total 0.0" in metrics
    engine.stop()


def test_a_stopped_engine_answers_503_and_ends_what_it_held(tiny_bundle):
    """Found in review: after engine.stop() a request hung until the client gave up, in flight or new."""
    engine = Engine(tiny_bundle, TINY_ENGINE)
    forward = engine.runner.forward
    engine.runner.forward = lambda *a, **k: (time.sleep(0.02), forward(*a, **k))[1]  # slow enough to stop mid-way
    engine.start()
    with serving(tiny_bundle, engine) as s:
        answers = []
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 500, "ignore_eos": True}
        client = threading.Thread(target=lambda: answers.append(s.http(timeout_s=20).post("/v1/completions", json=body)))
        client.start()
        wait_for(lambda: engine.num_running == 1)
        engine.stop()
        client.join(20)
        assert answers[0].status_code == 503 and answers[0].headers["retry-after"] == "1", answers[0].text
        assert answers[0].json()["error"]["code"] == "unavailable"
        r = s.http(timeout_s=5).post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert engine.num_running == 0 and engine.num_waiting == 0 and not engine.streams


def test_internal_error_is_a_bare_500_and_logged(tiny, tiny_engine, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("secret detail")

    monkeypatch.setattr(tiny_engine, "submit", broken)
    r = tiny.http().post("/v1/completions", json={"model": "tiny", "prompt": "hello"})
    assert r.status_code == 500 and r.json()["error"] == {"message": "internal error", "type": "server_error",
                                                          "param": None, "code": "internal_error"}
    assert "secret" not in r.text and "ZeroDivisionError" in caplog.text


def test_a_prompt_far_over_the_context_is_refused_before_it_is_tokenized(tiny, monkeypatch):
    """Found in review: a 4 MB prompt was tokenized in full (~500 bytes a token inside `tokenizers`, 919 MB
    of RSS at a 350 MB budget) before the length check refused it."""
    import agent.engine.tokenizer

    http = tiny.http()
    prompt = "the " * 400_000  # 1.6 MB
    encoded = []
    monkeypatch.setattr(agent.engine.tokenizer.Tokenizer, "encode", lambda *a, **kw: encoded.append(1))
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": prompt}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": prompt}]})):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "at least" in r.json()["error"]["message"]
    assert encoded == []


def test_fields_kept_for_the_whole_request_have_a_length_limit(tiny):
    """Found in review: a 3.9 MB `user` and 1 MB stop strings were accepted and kept while the request
    waited and ran (the queue counts requests, not bytes), and 123,000 one-letter messages were parsed and
    rendered (778 MB at a 350 MB budget) before the prompt was refused as too long."""
    from agent.api.openai_models import MAX_MESSAGES

    http = tiny.http()
    for extra, param in (({"user": "u" * 257}, "user"), ({"stop": ["s" * 1001]}, "stop")):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": "u" * 256,
                                            "stop": ["s" * 1000]})
    assert ok.status_code == 200, ok.text
    many = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "a"}]
                                                   * (MAX_MESSAGES + 1)})
    assert many.status_code == 400 and many.json()["error"]["param"] == "messages", many.text
    assert many.json()["error"]["code"] == "invalid_value"  # refused as parsed, not after rendering and encoding


def test_an_unsupported_value_is_named_by_its_type_not_cut_mid_json(tiny):
    """Found by an outside probe: refused values were cut at 60 characters with no ellipsis, so LangChain's
    structured output read '… {"name": "r", "strict is not supported' and its user blamed `strict`."""
    http = tiny.http()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    cases = [  # tools are chat's: /v1/completions refuses them
        ({"tools": [tool]}, "tools", "tools of type 'function' is not supported by this server (only null or [])"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
         "tool_choice type 'function' is not supported by this server (only null or \"none\")"),
        ({"prediction": {"type": "content", "content": "x" * 100}}, "prediction",
         "prediction type 'content' is not supported by this server (only null)"),
    ]
    for extra, param, message in cases:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2} | extra)
        err = r.json()["error"]
        assert (r.status_code, err["param"], err["message"]) == (400, param, message), r.text
    audio = {"voice": "alloy", "format": "wav", "note": "x" * 100}  # no "type" to name it by: shown, cut
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER_HI, "audio": audio})
    message = r.json()["error"]["message"]
    shown = json.dumps(audio)[:59] + "…"  # 60 characters with the ellipsis
    assert message == f"audio: {shown} is not supported by this server (only null)", message
