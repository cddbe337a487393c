"""Tool calling through the socket API with the official openai client: tool_choice "required" and a named function
always yield a valid call (its arguments validate against the tool's schema), streamed as OpenAI's fragments; a
round trip (call, `role: tool` result, answer) works streamed and unstreamed; bad tools are a 400 naming the
field. On SmolLM2 (a template without tools: the generic JSON envelope) and Qwen2.5-Coder (its own <tool_call>
syntax). The readers of both syntaxes are checked on their own, prefixes included.

Run: PYTHONPATH=$PWD python -m pytest -q tests/agent/test_tools.py
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agent.api import openai_models as om
from agent.api.tool_calls import ToolCallStream, parse_reply, tool_plan
from api_servers import agent_process, serving

QWEN = "qwen2.5-coder-0.5b-instruct"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
LIGHTS = {"type": "function", "function": {
    "name": "lights_off", "description": "Turn the lights off in a room",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["room"], "properties": {
        "room": {"type": "string", "maxLength": 40}}}}}
TOOLS = [WEATHER, LIGHTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- the readers -----------------------------------------------------------------------------------------
HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "lights_off", "arguments": {"room": "{kitchen}"}}\n</tool_call>\n')
GENERIC = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "unit": "celsius"}}, '
           '{"name": "lights_off", "arguments": {"room": "{kitchen}"}}]}')
CALLS = [("get_weather", {"city": 'Pa"ris', "unit": "celsius"}), ("lights_off", {"room": "{kitchen}"})]


@pytest.mark.parametrize("syntax, text", [("hermes", HERMES), ("generic", GENERIC)])
def test_a_whole_reply_reads_as_its_calls(syntax, text):
    view = parse_reply(text, syntax)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in view.calls] == [(n, a, True) for n, a in CALLS]
    assert view.content == ""


@pytest.mark.parametrize("syntax, text", [("hermes", HERMES), ("generic", GENERIC)])
@given(cuts=st.lists(st.integers(1, 200), max_size=12))
def test_streamed_fragments_rebuild_the_calls_however_the_text_is_cut(syntax, text, cuts):
    stream, pos, calls = ToolCallStream(syntax), 0, {}
    for size in [*cuts, len(text)]:
        content, deltas = stream.push(text[pos:pos + size])
        pos += size
        assert content == ""
        for d in deltas:
            if d.id is not None:  # a call's first fragment: id, type and name, once
                assert d.index == len(calls) and d.function.name and d.type == "function"
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == CALLS


@pytest.mark.parametrize("syntax, text, content", [
    ("hermes", "Paris is sunny <tool_call>", "Paris is sunny <tool_call>"),
    ("generic", '{"response": "Caf\\u00e9 \\ud83d\\ude00 \\\\o/ \\"hi\\""}', 'Café 😀 \\o/ "hi"'),
])
def test_text_replies_read_as_content_and_stream_whole_characters(syntax, text, content):
    assert parse_reply(text, syntax).content == content and not parse_reply(text, syntax).calls
    stream, streamed = ToolCallStream(syntax), ""
    for ch in text:  # one character at a time: escapes and surrogate pairs arrive in pieces
        piece, deltas = stream.push(ch)
        assert not deltas
        piece.encode()  # never half of a surrogate pair
        streamed += piece
    assert streamed == content


def test_an_undecided_prefix_reads_as_nothing_yet():
    for syntax, heads in (("hermes", ["", "<tool", "<tool_call>\n"]), ("generic", ["", '{"to', '{"response": "'])):
        for head in heads:
            view = parse_reply(head, syntax)
            assert view.content == "" and view.calls == [], (syntax, head)


def request(**fields) -> om.ChatCompletionRequest:
    return om.ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **fields})


@pytest.mark.parametrize("fields, param, needle", [
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice", "'fly'"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), "tools", "cannot be combined"),
])
def test_a_tool_plan_that_cannot_be_served_names_the_field(fields, param, needle):
    with pytest.raises(om.FieldError, match=needle) as e:
        tool_plan(request(**fields), "")
    assert e.value.param == param


def test_the_generic_syntax_lists_the_tools_and_renders_calls_and_results_as_json():
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    req = request(messages=history, tools=TOOLS, tool_choice="auto")
    plan = tool_plan(req, "{{ messages }}")
    messages = plan.messages(req.template_messages())
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert '{"response"' in messages[0]["content"] and plan.template_tools() is None
    assert json.loads(messages[2]["content"]) == {"tool_call": {"name": "get_weather",
                                                                "arguments": {"city": "Paris", "unit": "celsius"}}}
    assert (messages[3]["role"], json.loads(messages[3]["content"])) == (
        "user", {"tool_response": {"name": "get_weather", "content": "18 C"}})
    required = tool_plan(request(tools=TOOLS, tool_choice="required"), "")
    assert '"response"' not in required.structure().text and '"response"' not in required.messages(ASK)[0]["content"]


@pytest.mark.parametrize("message, needle", [
    ({"role": "tool", "content": "18 C"}, "needs the tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "c1"}, "only a tool message"),
    ({"role": "assistant", "content": None}, "content is required"),
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
     "belong to assistant messages"),
])
def test_malformed_tool_messages_are_refused_by_name(message, needle):
    with pytest.raises(ValidationError, match=needle) as e:
        request(messages=[*ASK, message])
    assert e.value.errors()[0]["loc"][:2] == ("messages", 1)


def test_arguments_in_the_history_that_are_not_json_are_refused_by_name():
    bad = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{city: Paris"}}]}
    with pytest.raises(om.FieldError, match="not valid JSON") as e:
        request(messages=[*ASK, bad]).template_messages()
    assert e.value.param == "messages.1.tool_calls"


# ---- over the socket -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def socket_path(real_q4_bundle):
    with serving(real_q4_bundle) as path:
        yield path


@pytest.fixture(scope="module")
def client(socket_path):
    return openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), timeout=120))


def check_calls(calls, names=SCHEMAS) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, model: str, **kw) -> tuple[str, dict, str]:
    """(content, {index: [id, name, arguments]}, finish_reason) of a streamed chat, from its fragments."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def check_tool_calling(client, model: str) -> None:
    for choice, names in (("required", SCHEMAS), ({"type": "function", "function": {"name": "lights_off"}},
                                                  ["lights_off"])):
        for temperature in (0.0, 1.0):
            r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                               max_tokens=80, temperature=temperature, seed=5)
            assert r.choices[0].finish_reason == "tool_calls", r
            check_calls(r.choices[0].message.tool_calls, names)
        content, calls, finish = streamed(client, model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                          temperature=0)
        assert finish == "tool_calls" and calls and not content
        for _, name, arguments in calls.values():
            assert name in names
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def check_round_trip(client, model: str) -> None:
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=40, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    content, calls, finish = streamed(client, model, messages=history, tools=TOOLS, max_tokens=60, temperature=0)
    if calls:  # "auto": another call is a valid answer too, and then it is a whole, valid one
        assert finish == "tool_calls"
        check_calls([openai.types.chat.ChatCompletionMessageToolCall(
            id=i, type="function", function={"name": n, "arguments": a}) for i, n, a in calls.values()])
    else:
        assert content and finish in ("stop", "length")


@pytest.mark.real_model
def test_required_and_named_tool_choices_always_yield_valid_calls_on_smollm2(client):
    check_tool_calling(client, "smollm2")


@pytest.mark.real_model
def test_a_tool_round_trip_on_smollm2(client):
    check_round_trip(client, "smollm2")


@pytest.mark.real_model
def test_auto_answers_with_text_or_a_valid_call(client):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
                                       tools=TOOLS, max_tokens=40, temperature=0)
    message = r.choices[0].message
    if message.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(message.tool_calls)
    else:
        assert message.content and not message.content.startswith('{"response"'), message


@pytest.mark.real_model
@pytest.mark.parametrize("fields, param", [
    (dict(tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools.0.function.name"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}}}}]), "tools"),
])
def test_bad_tools_are_a_400_naming_the_field(client, fields, param):
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=8, **body)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.real_model
def test_qwen_calls_tools_in_its_own_syntax(real_arch_bundle, tmp_path):
    """Qwen2.5-Coder's template lists the tools and shows calls in <tool_call> tags: the reply is held to that."""
    with agent_process(real_arch_bundle(QWEN, "int4"), tmp_path) as qwen:
        check_tool_calling(qwen, QWEN)
        check_round_trip(qwen, QWEN)


# ---- generated tool lists ----------------------------------------------------------------------------------
GOOD_LEAVES = [{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0, "maximum": 99},
               {"type": "boolean"}, {"enum": ["on", "off"]}, {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
               {"type": "string", "format": "date"}, {"type": "number", "minimum": -1, "maximum": 1}]
# refused or unsatisfiable: a 400 naming the field, or (unsatisfiable) a failed request, never a 500
BAD_LEAVES = [{"type": "strin"}, {"type": "string", "pattern": "(?<=a)b"}, {"type": "integer", "minimum": 5, "maximum": 1}]


def rarely(good, bad, one_in: int):
    """good, but bad once in one_in draws: a list with a bad item is refused whole, so bad items stay rare."""
    return st.integers(1, one_in).flatmap(lambda i: bad if i == 1 else good)


LEAF = rarely(st.sampled_from(GOOD_LEAVES), st.sampled_from(BAD_LEAVES), 12)
NAMES = rarely(st.from_regex(r"[a-z_]{1,10}", fullmatch=True), st.sampled_from(["bad name", "", "x" * 65]), 12)
PARAMETERS = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), LEAF, max_size=3).map(
    lambda props: {"type": "object", "additionalProperties": False, "properties": props, "required": sorted(props)})
TOOL = st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                 NAMES, st.none() | PARAMETERS)
CHOICE = st.sampled_from(["auto", "required", "none", None, "named", "named", "unknown"])


def tool_request(tools: list[dict], choice: str | None) -> dict:
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 64, "temperature": 0, "tools": tools}
    if choice in ("named", "unknown"):
        name = tools[0]["function"]["name"] if tools and choice == "named" else "nowhere"
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif choice is not None:
        body["tool_choice"] = choice
    return body


def check_tool_answer(body: dict, response: httpx.Response) -> str:
    """'valid', 'length' or 'refused'; fails on anything else (a 500, an invalid call, a 400 naming no field)."""
    if response.status_code == 400:
        param = response.json()["error"]["param"] or ""
        assert param.startswith(("tools", "tool_choice")), (body, response.json())
        return "refused"
    assert response.status_code == 200, (body, response.text)
    choice = response.json()["choices"][0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] or {} for t in body["tools"]}
    for call in choice["message"].get("tool_calls") or []:
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] in schemas, (body, choice)
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    if choice["finish_reason"] == "length":
        return "length"
    assert choice["message"].get("tool_calls") or choice["message"]["content"] is not None, (body, choice)
    return "valid"


@pytest.mark.real_model
def test_generated_tool_lists_get_valid_calls_or_a_400_naming_the_field(socket_path, figures):
    """32 examples of 8 concurrent requests (one batch): 256 tool lists, each a 200 whose calls validate or a 400
    naming tools / tool_choice, never a 500 or a hang; a free request beside them keeps its greedy text."""
    free = {"model": "smollm2", "messages": [{"role": "user", "content": "Name three fruits."}], "max_tokens": 16,
            "temperature": 0}
    outcomes: dict[str, int] = {}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://localhost",
                      timeout=120) as client:
        alone = client.post("/v1/chat/completions", json=free).json()["choices"][0]["message"]["content"]

        @settings(max_examples=32, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(st.lists(st.tuples(st.lists(TOOL, max_size=3), CHOICE), min_size=8, max_size=8))
        def batch(cases):
            bodies = [tool_request(tools, choice) for tools, choice in cases]
            with ThreadPoolExecutor(9) as pool:
                beside = pool.submit(client.post, "/v1/chat/completions", json=free)
                answers = list(pool.map(lambda b: client.post("/v1/chat/completions", json=b), bodies))
                assert beside.result().json()["choices"][0]["message"]["content"] == alone
            for body, response in zip(bodies, answers):
                kind = check_tool_answer(body, response)
                outcomes[kind] = outcomes.get(kind, 0) + 1

        batch()
    figures.append(f"tool calling: 256 generated tool lists: {outcomes}")
    assert sum(outcomes.values()) == 256 and outcomes.get("valid", 0) >= 25 and outcomes.get("refused", 0) >= 25
