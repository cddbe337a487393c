"""The local API over a real Unix socket with real engines: the official openai client against the tiny and the
real model, 32 concurrent streams, a fuzz of odd bodies, /metrics, OpenAI-shaped errors, loading and draining,
a client that disconnects cancelling its request, socket safety, and `edge-agent serve` as a process."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from agent.api.app import EventBridge
from agent.api.backend import Backend
from agent.config import ApiConfig, EngineConfig
from agent.engine.engine import Engine
from agent.engine.request import Finished, RequestHandle, TextDelta
from agent.api.openai_models import ChatMessage
from agent.api.http_server import ApiServer, ServeError, bind_unix, clear_stale_socket
from agent.service.serve import load_agent_config
from agent.engine.sampler import make_rng
from agent.engine.sampling_params import SamplingParams
from agent.engine.sequence import Sequence
from agent.wire import Manifest, RequestFigures
from quantize.package import build_bundle
from quantize.precision import QuantSpec
from api_servers import agent_process

TINY_ENGINE = EngineConfig(threads=2, memory_budget_mb=2048, min_context=64, prefill_chunk_tokens=64)
USER_HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("api") / "fp32", name="tiny",
                        progress=lambda s: None)


@pytest.fixture(scope="module")
def tiny_engine(tiny_bundle):
    engine = Engine(tiny_bundle, TINY_ENGINE)
    engine.start()
    yield engine
    engine.stop()


@dataclass
class Served:
    server: ApiServer
    path: Path
    engine: Engine | None

    def http(self, timeout_s: float = 30.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.path)), base_url="http://localhost",
                            timeout=timeout_s)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0,
                             http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(self.path))))

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v"}': value}."""
        text = self.http().get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out


@contextmanager
def serving(bundle, engine: Engine | None, load=None, **config):
    """A real server on a fresh Unix socket (AF_UNIX paths are short: not under pytest's tmp_path)."""
    folder = Path(tempfile.mkdtemp(prefix="edge-api-", dir="/tmp"))
    path = folder / "api.sock"
    config = ApiConfig(**{"socket": path, "drain_timeout_s": 2, **config})
    server = ApiServer(Backend(Manifest.read(bundle.path)), [bind_unix(path, config.socket_mode, None)], config)
    server.start()
    server.load_in_background(load or (lambda: engine))
    try:
        if load is None:
            wait_for(lambda: server.backend.state.value == "ready")
        yield Served(server, path, engine)
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def tiny(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine) as served:
        yield served


def sse_events(raw: str) -> list[dict]:
    """The JSON events of a well-formed SSE body; asserts the framing and the closing [DONE]."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]" and "data: [DONE]" not in blocks[:-1]
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


# ---- the openai client, tiny and real model ------------------------------------------------------------
def check_chat_and_stream(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> str:
    args = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.model == model and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.model_extra["timings"]["ttft_ms"] > 0
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason and "timings" in chunks[-2].model_extra
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == choice.message.content
    return choice.message.content


def test_openai_client_chat_and_stream_on_tiny_model(tiny):
    client = tiny.openai()
    check_chat_and_stream(client, "tiny", USER_HI, 12)
    forced = client.chat.completions.create(model="tiny", messages=USER_HI, max_completion_tokens=9,
                                            extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05, "priority": 3})
    assert forced.usage.completion_tokens == 9 and forced.choices[0].finish_reason == "length"


def test_text_completions_with_text_and_token_id_prompts(tiny):
    client = tiny.openai()
    by_text = client.completions.create(model="tiny", prompt="the answer", temperature=0,
                                        extra_body={"ignore_eos": True})
    assert by_text.object == "text_completion" and by_text.usage.completion_tokens == 16  # OpenAI's default
    by_ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(by_ids)
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
    assert client.models.list().data[0].id == "tiny"
    # a batch of one token list, as OpenAI accepts it (found in review: refused)
    batch = client.completions.create(model="tiny", prompt=[[5, 6, 7, 8]], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert batch.usage.prompt_tokens == 4 and batch.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model="tiny", prompt=[[5, 6], [7, 8]], max_tokens=4)


@pytest.fixture(scope="module")
def real(real_fp32_bundle):
    engine = Engine(real_fp32_bundle, EngineConfig(threads=2, memory_budget_mb=2048, max_context=1024))
    engine.start()
    with serving(real_fp32_bundle, engine) as served:
        yield served
    engine.stop()


@pytest.mark.real_model
def test_openai_client_chat_and_stream_on_real_model(real):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    text = check_chat_and_stream(real.openai(), "smollm2", question, 12)
    assert "Paris" in text


QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.mark.real_model
def test_openai_client_chat_and_stream_on_qwen_int4(real_arch_bundle, tmp_path):
    """The second chat model: Qwen2.5-Coder's INT4 bundle answers a coding question, whole and streamed."""
    with agent_process(real_arch_bundle(QWEN, "int4"), tmp_path) as client:
        question = [{"role": "user", "content": "Write a Python function add(a, b) that returns a + b."}]
        text = check_chat_and_stream(client, QWEN, question, 48)
    assert "def add" in text


@pytest.mark.real_model
def test_gemma_base_completes_text_and_refuses_chat_with_a_clear_error(real_arch_bundle, tmp_path):
    """Gemma 3 270M is a base model with no chat template: completions work, chat is a 400 naming why."""
    with agent_process(real_arch_bundle("gemma3-270m", "int8"), tmp_path) as client:
        done = client.completions.create(model="gemma3-270m", prompt="Monday, Tuesday, Wednesday,", max_tokens=4,
                                         temperature=0)
        assert done.usage.completion_tokens > 0 and "Thursday" in done.choices[0].text, done.choices[0].text
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="gemma3-270m", messages=USER_HI, max_tokens=4)


# ---- load: 32 concurrent streams -------------------------------------------------------------------------
async def one_stream(client: httpx.AsyncClient, i: int) -> list[dict]:
    body = dict(model="tiny", messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=16, stream=True,
                temperature=0.8, seed=i, ignore_eos=True, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events((await r.aread()).decode())


def test_32_concurrent_streams_all_finish_well_formed(tiny):
    async def run():
        transport = httpx.AsyncHTTPTransport(uds=str(tiny.path))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as client:
            return await asyncio.gather(*(one_stream(client, i) for i in range(32)))

    for events in asyncio.run(run()):
        assert len({e["id"] for e in events}) == 1
        assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 16
        assert all(e["usage"] is None for e in events[:-1])


# ---- fuzz: odd bodies never give a 500 or a hang ------------------------------------------------------------
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


# ---- metrics ------------------------------------------------------------------------------------------------
def test_metrics_parse_and_count_what_was_served(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine) as s:
        before = s.metrics()
        s.openai().chat.completions.create(model="tiny", messages=USER_HI, max_tokens=5,
                                           extra_body={"ignore_eos": True})
        s.http().post("/v1/completions", json={"model": "tiny", "prompt": "x", "bogus": 1})
        after = s.metrics()
    length = 'edge:request_success_total{finish_reason="length"}'
    assert length not in before and after[length] == 1
    assert after["edge:generation_tokens_total"] - before["edge:generation_tokens_total"] == 5
    assert after["edge:prompt_tokens_total"] > before["edge:prompt_tokens_total"]
    assert after["edge:time_to_first_token_seconds_count"] == 1 and after["edge:e2e_request_latency_seconds_count"] == 1
    assert after["edge:inter_token_latency_seconds_count"] == 4
    assert after['edge:request_errors_total{code="unknown_parameter"}'] == 1
    for gauge in ("edge:num_requests_running", "edge:num_requests_waiting", "edge:kv_cache_usage_perc",
                  "edge:prefix_cache_hit_rate"):
        assert 0 <= after[gauge] <= 1, gauge


# ---- errors in OpenAI's shape --------------------------------------------------------------------------------
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


def test_the_fleets_sampling_defaults_fill_what_a_request_leaves_out(tiny):
    """Found in review: set_config sampling answered "applied" and changed nothing."""
    backend = tiny.server.backend
    backend.sampling_defaults = lambda: {"max_tokens": 2, "temperature": 0.0}
    try:
        http = tiny.http()
        body = {"model": "tiny", "prompt": "hello", "ignore_eos": True}
        assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 2
        assert http.post("/v1/completions", json=body | {"max_tokens": 3}).json()["usage"]["completion_tokens"] == 3
    finally:
        backend.sampling_defaults = dict


def test_what_openai_and_vllm_clients_legally_send_is_understood(tiny):
    """Found in review: null n / stream (documented as nullable) and vLLM's top_k=-1 ("off") were refused, and a
    non-text content part got an error naming a union branch ("messages.0.content.str")."""
    http = tiny.http()
    for extra in ({"n": None, "stream": None}, {"top_k": -1}):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER_HI, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    image = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": image}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.content", r.text
    assert err["message"] == ("messages.0.content: only text content parts are supported by this text model "
                              "(got 'image_url')")
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and "content is required" in r.json()["error"]["message"]


def test_openai_parameters_we_do_not_implement_are_accepted_when_off_and_refused_by_name_otherwise(tiny):
    """Found in review: LangChain's OpenAI LLM sends "logit_bias": {} and "logprobs": null on every call (others
    send store / response_format / parallel_tool_calls at their defaults) and got 400 "unknown field"."""
    http = tiny.http()
    body = {"model": "tiny", "prompt": ["hello"], "max_tokens": 2, "logit_bias": {}, "logprobs": None, "seed": None,
            "echo": False, "suffix": None, "best_of": 1}
    assert http.post("/v1/completions", json=body).status_code == 200
    chat = {"model": "tiny", "messages": USER_HI, "max_tokens": 2, "logprobs": False, "top_logprobs": None,
            "store": False, "response_format": {"type": "text"}, "parallel_tool_calls": False, "tools": []}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    r = http.post("/v1/chat/completions", json=chat | {"store": True})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "store"
    assert err["message"] == "store: true is not supported by this server (only null or false)"
    # logprobs is implemented (tests/agent/test_logprobs.py); top_logprobs without it is refused by name
    r = http.post("/v1/chat/completions", json=chat | {"top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert http.post("/v1/completions", json=body | {"logit_bias": {"5": 100}}).status_code == 200  # implemented
    for bias, needle in (({"999999": 1}, "outside this model's vocabulary"), ({"abc": 1}, "must be token ids"),
                         ({"5": 101}, "in [-100, 100]"), ({"\u00b2": 1}, "must be token ids")):  # "²": was a 500
        r = http.post("/v1/completions", json=body | {"logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert needle in r.json()["error"]["message"]


def test_a_reply_appended_to_the_history_as_the_sdks_return_it_is_accepted(tiny):
    """Found in review: openai's `message.model_dump()` (`refusal`, `tool_calls`, ... as null) and litellm's
    message (`provider_specific_fields`) appended to the history got 400 "unknown field": every multi-turn chat
    through them failed. A message's unknown keys are ignored, as vLLM does; what needs tools is still refused."""
    client = tiny.openai()
    history = [*USER_HI]
    for _ in range(2):
        reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=3).choices[0].message
        history += [reply.model_dump(), {"role": "user", "content": "and then?"}]
    assert history[1]["refusal"] is None and "tool_calls" in history[1]
    litellm_style = {"role": "assistant", "content": "hi", "provider_specific_fields": None, "function_call": None}
    assert client.chat.completions.create(model="tiny", messages=[*USER_HI, litellm_style], max_tokens=2).choices
    refused = {"role": "assistant", "content": None, "refusal": "I can't help with that."}  # as OpenAI returns it
    assert ChatMessage.model_validate(refused).as_template_message()["content"] == "I can't help with that."
    for extension in ({"images": ["aGk="]}, {"prefix": True}):  # Ollama's, vLLM's: lost if ignored
        with pytest.raises(ValidationError):
            ChatMessage.model_validate({"role": "user", "content": "what is this?", **extension})
    http = tiny.http()
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]  # a tools loop's
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        *USER_HI, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]})
    assert r.status_code == 200, r.text
    # what SDKs send at the top level when the feature is off, and tags for stored completions
    off = {"functions": [], "function_call": "none", "modalities": ["text"], "prediction": None, "audio": None,
           "metadata": {"app": "notes"}}
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER_HI, "max_tokens": 2, **off})
    assert r.status_code == 200, r.text
    for field, value in (("n", 2), ("stream_options", {"include_usage": True}), ("max_completion_tokens", 3)):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER_HI, "max_tokens": 2,
                                                     field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text  # it was null


def test_models_retrieve_answers_for_the_served_model_and_404_otherwise(tiny):
    """Found in review: GET /v1/models/{id} (the clients' models.retrieve) was a 404 even for the served model."""
    client = tiny.openai()
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_text_parts_of_a_message_are_joined_by_a_newline_as_vllm_does():
    """Found in review: parts were joined with nothing between them, running the last word of one into the next."""
    msg = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "Summarize:"},
                                                                  {"type": "text", "text": "the cat sat."}]})
    assert msg.as_template_message() == {"role": "user", "content": "Summarize:\nthe cat sat."}


def test_a_message_name_reaches_the_template_only_when_given():
    """Found in review: `name` was dropped, so a template that prints it (as transformers passes it) lost it."""
    named = ChatMessage.model_validate({"role": "user", "content": "hi", "name": "ann"})
    assert named.as_template_message() == {"role": "user", "content": "hi", "name": "ann"}
    assert ChatMessage.model_validate({"role": "user", "content": "hi"}).as_template_message() == {
        "role": "user", "content": "hi"}


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


def test_internal_error_is_a_bare_500_and_logged(tiny, tiny_engine, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("secret detail")

    monkeypatch.setattr(tiny_engine, "submit", broken)
    r = tiny.http().post("/v1/completions", json={"model": "tiny", "prompt": "hello"})
    assert r.status_code == 500 and r.json()["error"] == {"message": "internal error", "type": "server_error",
                                                          "param": None, "code": "internal_error"}
    assert "secret" not in r.text and "ZeroDivisionError" in caplog.text

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



# ---- lifecycle: loading, ready, draining ----------------------------------------------------------------------
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


# ---- a client that goes away cancels its request ---------------------------------------------------------------
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


# ---- sockets and config ----------------------------------------------------------------------------------------
def test_socket_mode_and_stale_socket_handling():
    folder = Path(tempfile.mkdtemp(prefix="edge-sock-", dir="/tmp"))
    path = folder / "a.sock"
    try:
        live = bind_unix(path, 0o660, None)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        with pytest.raises(ServeError, match="another server"):
            clear_stale_socket(path)
        live.close()  # a crash: the file stays, nothing listens
        bind_unix(path, 0o600, None).close()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        (folder / "file").write_text("not a socket")
        with pytest.raises(ServeError, match="not a socket"):
            bind_unix(folder / "file", 0o660, None)
        assert (folder / "file").read_text() == "not a socket"
    finally:
        shutil.rmtree(folder)


def test_config_file_with_flags_over_it(tmp_path):
    toml = tmp_path / "agent.toml"
    toml.write_text('model = "/m"\n[engine]\nthreads = 3\n[api]\nsocket_mode = "0600"\ntcp = "127.0.0.1:9000"\n')
    c = load_agent_config(toml, threads=1, socket=Path("/tmp/x.sock"), model=None, memory_budget_mb=None, tcp=None)
    assert (c.model, c.engine.threads, c.api.socket, c.api.socket_mode) == (Path("/m"), 1, Path("/tmp/x.sock"), 0o600)
    assert c.api.tcp_address == ("127.0.0.1", 9000)
    with pytest.raises(ValueError, match="not loopback"):
        load_agent_config(toml, tcp="0.0.0.0:9000")


@pytest.mark.parametrize("text, flags, where", [
    ('api = "x"\n', {"socket": Path("/tmp/x.sock")}, "api must be a table"),
    ("telemetry = 5\n", {"state_dir": Path("/tmp/s")}, "telemetry must be a table"),
    ('[telemetry]\nmqtt = "m"\n', {"mqtt": "mqtt://127.0.0.1"}, "telemetry.mqtt must be a table"),
])
def test_a_config_section_that_is_not_a_table_is_named_even_with_flags(text, flags, where, tmp_path):
    """Found in review: with the flags the unit passes, these were an internal TypeError naming no key."""
    toml = tmp_path / "agent.toml"
    toml.write_text(text)
    with pytest.raises(ServeError, match=where):
        load_agent_config(toml, **flags)


def test_serve_command_runs_in_the_foreground_and_drains_on_sigterm(tiny_bundle):
    folder = Path(tempfile.mkdtemp(prefix="edge-cli-", dir="/tmp"))
    path = folder / "api.sock"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = folder / "agent.toml"
    config.write_text("[engine]\nmin_context = 64\n[api]\nsocket_mode = 0o600\n")
    cmd = [sys.executable, "-m", "agent.service.cli", "serve", "--model", str(tiny_bundle.path), "--socket", str(path),
           "--config", str(config), "--memory-budget-mb", "2048", "--threads", "1", "--tcp", f"127.0.0.1:{port}",
               "--state-dir", str(folder / "state")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        wait_for(path.exists, timeout_s=20)
        served = Served(None, path, None)
        wait_for(lambda: served.http().get("/health").status_code == 200, timeout_s=30)
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["model"] == "tiny"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # Found in review: a second agent on another socket and the same state directory ran beside it
        second = subprocess.run([*cmd[:cmd.index("--socket") + 1], str(folder / "b.sock"),
                                 *cmd[cmd.index("--socket") + 2:cmd.index("--tcp")], *cmd[cmd.index("--tcp") + 2:]],
                                capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert f"another edge-agent (pid {proc.pid}) is using the state directory" in second.stderr, second.stderr
        assert not (folder / "b.sock").exists() and served.http().get("/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
        assert not path.exists()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_serve_that_cannot_bind_changes_nothing(tiny, tiny_bundle, tiny_checkpoint, tmp_path):
    """Found in review: a second `serve --model OTHER` on a live agent's socket failed but had already made
    OTHER the store's current model, so the next restart would boot it."""
    from agent.service.serve import boot_model, serve_forever
    from agent.updates.model_store import ModelStore

    state = tmp_path / "state"
    store = ModelStore(state)
    boot_model(store, tiny_bundle.path)
    before = store.link("current")
    other = build_bundle(tiny_checkpoint, QuantSpec(precision="int8"), tmp_path / "int8", name="tiny",
                         progress=lambda s: None)
    config = load_agent_config(None, model=other.path, socket=tiny.path, tcp=None, threads=1, memory_budget_mb=2048,
                               state_dir=state)
    with pytest.raises(ServeError, match="another server is answering"):
        serve_forever(config)
    assert store.link("current") == before and store.link("previous") is None
    assert tiny.http().get("/health").status_code == 200  # the live one still serves on its socket


def test_speculative_extension_field_and_its_metrics(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine) as s:
        prompt = "ab ab ab ab ab ab ab ab ab ab"
        r = s.http().post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True, "speculative": "ngram"})
        assert r.status_code == 200, r.text
        bad = s.http().post("/v1/completions", json={"model": "tiny", "prompt": "x", "speculative": "magic"})
        assert bad.status_code == 400
        no_draft = s.http().post("/v1/completions", json={"model": "tiny", "prompt": "x", "speculative": "draft"})
        assert no_draft.status_code == 400 and no_draft.json()["error"]["param"] == "speculative", no_draft.text
        m = s.metrics()
    assert "edge:spec_decode_num_draft_tokens_total" in m and "edge:spec_decode_num_accepted_tokens_total" in m


# ---- found in review (2026-12-04): connections that hold a file descriptor for good -----------------------
def raw_connection(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.connect(str(path))
    return conn


def closed_by_server(conn: socket.socket) -> bytes:
    """What the server sent before closing (b"" if nothing); fails if it keeps the connection open."""
    received = b""
    while chunk := conn.recv(4096):
        received += chunk
    return received


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\n"])
def test_a_connection_that_never_completes_a_request_head_is_closed(sent, tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine, request_timeout_s=0.5) as s:
        conn = raw_connection(s.path)
        conn.sendall(sent)
        t0 = time.monotonic()
        assert closed_by_server(conn) == b"" and time.monotonic() - t0 < 4
        with s.http() as http:  # the server still serves
            assert http.get("/health").status_code == 200


def test_a_body_that_stops_arriving_gets_408(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine, request_timeout_s=0.5) as s:
        conn = raw_connection(s.path)
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        answer = b""
        while b"request_timeout" not in answer and (chunk := conn.recv(4096)):  # head and body may come apart
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        conn.close()


def test_connections_past_the_limit_get_503_not_a_descriptor_each(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine, max_connections=2) as s:
        idle = [raw_connection(s.path) for _ in range(2)]
        conn = raw_connection(s.path)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: agent\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 503")
        for c in (*idle, conn):
            c.close()


def test_a_serve_that_fails_to_start_lets_go_of_the_state_directory(tmp_path, tiny_bundle):
    """Found in review: the state directory's lock was taken outside the try, so a serve that failed early
    (here: models/ is a file) kept it, and the next serve in the same process was refused as 'another agent'."""
    from agent.service.preflight import lock_state_dir
    from agent.service.serve import serve_forever

    state = tmp_path / "state"
    state.mkdir()
    (state / "models").write_text("not a directory")
    config = load_agent_config(None, model=tiny_bundle.path, socket=tmp_path / "a.sock", tcp=None, threads=1,
                               memory_budget_mb=2048, state_dir=state)
    with pytest.raises(OSError):
        serve_forever(config)
    os.close(lock_state_dir(state))  # free again


def test_bodies_held_while_being_read_are_bounded_and_refused_as_overloaded(tiny_bundle, tiny_engine):
    """Found in review: 200 connections each sending a 4 MiB body and holding back its last byte made the
    agent hold 1.35 GB (budget 350 MB) before any queue limit applied. Bodies being read or tokenized now take
    at most INTAKE_BODIES x max_body_bytes together; past that a large body is refused 429 with a
    Retry-After, while small ones (every ordinary request) are still served: a first version locked everyone
    out with four slow uploads (found in review of the fix)."""
    from agent.api.app import INTAKE_BODIES, INTAKE_SMALL_BYTES

    limit = 2 * INTAKE_SMALL_BYTES
    with serving(tiny_bundle, tiny_engine, max_body_bytes=limit, request_timeout_s=5) as s:
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode().ljust(limit - 1024)
        held = []
        for _ in range(INTAKE_BODIES):  # each sends all but its last byte, and waits
            conn = raw_connection(s.path)
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:-1])
            held.append(conn)
        time.sleep(0.3)  # read by the server
        refused = s.http().post("/v1/completions", content=body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded", refused.text
        assert "retry-after" in refused.headers
        small = s.http().post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert small.status_code == 200, small.text
        for conn in held:  # they complete, and the room is free again
            conn.sendall(body[-1:])
            answer = b""
            while b"\r\n\r\n" not in answer and (chunk := conn.recv(4096)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            conn.close()
        assert s.http().post("/v1/completions", content=body).status_code == 200


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


def test_a_client_sending_garbage_is_logged_once_a_minute_not_once_a_connection(tiny, caplog):
    """Found in review: uvicorn logged "Invalid HTTP request received." for every bad connection, 4,200 lines a
    second into the journal from one local client. Each warning now goes through once a minute with a count."""
    import socket as socket_module

    from agent.api.http_server import _Repeats

    caplog.set_level(logging.WARNING, logger="uvicorn.error")
    for _ in range(50):
        with socket_module.socket(socket_module.AF_UNIX) as s:
            s.connect(str(tiny.path))
            s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
            s.recv(1024)
    assert tiny.http().get("/health").status_code == 200
    lines = [r for r in caplog.records if "Invalid HTTP request" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]
    now = [0.0]
    repeats = _Repeats(60.0, clock=lambda: now[0])
    record = lambda: logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, "Invalid HTTP request", (), None)  # noqa: E731
    assert [repeats.filter(record()) for _ in range(4)] == [True, False, False, False]
    now[0] = 61.0
    again = record()
    assert repeats.filter(again) and again.getMessage() == "Invalid HTTP request (3 more in the last 60 s)"
    try:  # a crash is news every time, whatever its message (uvicorn's is always the same)
        raise KeyError("x")
    except KeyError:
        crash = logging.LogRecord("uvicorn.error", logging.ERROR, "", 0, "Exception in ASGI application", (),
                                  sys.exc_info())
    assert all(repeats.filter(crash) for _ in range(3))


def test_a_read_only_state_directory_still_serves_with_telemetry_in_memory(tmp_path, monkeypatch, caplog):
    """Found in review (an SD card that ext4 remounted read-only after an I/O error): every start failed at the
    state directory's lock file, so the box served nothing though its model was readable. The lock is on the
    directory, telemetry goes to memory (and says so), and a second agent is still refused, by a message
    that does not name a dead run's pid."""
    import errno

    import agent.link.store
    from agent.service.preflight import lock_state_dir
    from agent.link.store import TelemetryStore
    from agent.wire import EventRecord

    state = tmp_path / "state"
    os.close(lock_state_dir(state))  # as a run before the card failed left it
    TelemetryStore(state / "telemetry.db", "dev-1").close()
    (state / "agent.lock").write_text("999999999\n")  # a dead run's pid, which a read-only disk keeps
    real_write_text = Path.write_text

    def read_only(self, *args, **kwargs):
        if self.parent == state:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    monkeypatch.setattr(agent.link.store, "writable_dir", lambda d: Path(d) != state)
    fd = lock_state_dir(state)
    try:
        assert "read-only file system" in caplog.text
        with pytest.raises(ServeError, match=r"another edge-agent is using the state directory"):
            lock_state_dir(state)
        store = TelemetryStore(state / "telemetry.db", "dev-1")
        assert "read-only" in store.in_memory_because
        store.append(EventRecord(kind="tick"))
        assert store.count_unsent() == 1
        store.close()
    finally:
        os.close(fd)
    monkeypatch.undo()  # writable again: the next agent takes the same lock, on the directory
    fd = lock_state_dir(state)
    try:
        with pytest.raises(ServeError, match=f"another edge-agent \\(pid {os.getpid()}\\)"):
            lock_state_dir(state)
    finally:
        os.close(fd)


def test_a_budget_above_the_services_memory_limit_is_lowered_to_fit_and_said(tmp_path, monkeypatch, caplog):
    """Found in review: nothing compared memory_budget_mb with systemd's MemoryMax= (cgroup memory.max) or the
    RAM, so a budget above them ended with the kernel killing the agent under load, where the budget would
    have refused requests. It is lowered to fit, at ERROR; a tighter parent cgroup counts, "max" does not."""
    import agent.process
    from agent.config import AgentConfig
    from agent.service.preflight import fitted_budget

    root = tmp_path / "cg"
    (root / "system.slice").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "system.slice" / "memory.max").write_text(f"{1000 * 2**20}\n")  # a slice of 1000 MB
    monkeypatch.setattr(agent.process, "cgroup_values", lambda name: [  # a v2 system: no v1 files
        (root / "system.slice" / name).read_text().strip(), (root / name).read_text().strip()]
        if name == "memory.max" else [])
    config = AgentConfig.model_validate({"engine": {"memory_budget_mb": 1024}})
    fitted = fitted_budget(config)
    assert fitted.engine.memory_budget_mb == 800 and config.engine.memory_budget_mb == 1024
    assert "memory_budget_mb = 1024 is above 80% of the 1000 MB" in caplog.text and "using 800 MB" in caplog.text
    small = AgentConfig.model_validate({"engine": {"memory_budget_mb": 512}})
    assert fitted_budget(small) is small  # within the limit: as configured
    (root / "system.slice" / "memory.max").write_text("max\n")
    monkeypatch.setattr(agent.process, "memory_limit_bytes", lambda: None)  # unknown: as configured
    monkeypatch.setattr("agent.service.preflight.memory_limit_bytes", lambda: None)
    assert fitted_budget(config) is config


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
