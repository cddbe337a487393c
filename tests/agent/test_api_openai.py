"""The local API as OpenAI and vLLM clients use it, over a real Unix socket with real engines: the official openai
client against the tiny and real models, 32 concurrent streams, the request fields clients legally send, /metrics
and the speculative extension field."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from pydantic import ValidationError

from agent.api.openai_models import ChatMessage
from api_servers import agent_process
from api_support import USER_HI, serving, sse_events


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
