"""Structured output on the real SmolLM2 INT4 bundle: every output of a schema suite (nested objects, arrays with
item bounds, enums, anyOf, $ref, string formats, additionalProperties false, bounded numbers) validates with
`jsonschema`, greedy and sampled, alone and in a batch of 8 beside free requests whose greedy text it leaves
unchanged; regex, choice and Lark grammars match; the openai SDK's `parse` helper returns a parsed object over
the socket; bad structures are a 400 naming the field; a grammar's dead end fails its own request only.

Run: PYTHONPATH=$PWD python -m pytest -q tests/agent/test_structured.py
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agent.engine.constraint import ConstraintError
from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams, Structure
from api_servers import engine_config, http, serving

pytestmark = pytest.mark.real_model


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"], "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email", "maxLength": 40}}}
SCHEMAS = {
    "nested": ({"type": "object", "additionalProperties": False, "required": ["city", "location"], "properties": {
        "city": {"type": "string", "maxLength": 30},
        "location": {"type": "object", "additionalProperties": False, "required": ["lat", "lon"], "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}}}}},
        "Describe Paris as JSON with its city name and location."),
    "array": ({"type": "object", "additionalProperties": False, "required": ["colors"], "properties": {
        "colors": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}},
        "List some colors of the rainbow as JSON."),
    "enum": ({"type": "object", "additionalProperties": False, "required": ["mood", "score"], "properties": {
        "mood": {"enum": ["happy", "sad", "neutral"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}}},
        "How does a sunny day make people feel? Answer as JSON."),
    "anyof": ({"type": "object", "additionalProperties": False, "required": ["value"], "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 20}]}}},
        "Give me a value as JSON."),
    "ref": ({"$defs": {"person": PERSON}, "type": "object", "additionalProperties": False, "required": ["people"],
             "properties": {"people": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/$defs/person"}}}},
        "Invent one or two people with a name, an age and an email address, as JSON."),
    "formats": ({"type": "object", "additionalProperties": False, "required": ["day", "id", "ip"], "properties": {
        "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"},
        "ip": {"type": "string", "format": "ipv4"}}},
        "Give a date, a UUID and an IPv4 address as JSON."),
    "bounds": ({"type": "object", "additionalProperties": False, "required": ["temperature", "humidity"],
                "properties": {"temperature": {"type": "number", "minimum": -40, "maximum": 50},
                               "humidity": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100}}},
        "What is the weather in the kitchen? Answer as JSON."),
    "person": (PERSON, "Who wrote Hamlet? Answer as JSON."),
}
FREE_PROMPTS = ["What is the capital of France?", "Name three fruits.", "Say hello in Spanish.",
                "Count from one to five."]


@pytest.fixture(scope="module")
def engine(real_q4_bundle):
    """Driven step by step in the test's thread (its batches are exactly what a test submits together)."""
    return Engine(real_q4_bundle, engine_config())


def chat_ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def schema_structure(schema: dict) -> Structure:
    return Structure(kind="json_schema", text=json.dumps(schema), param="response_format.json_schema.schema")


def run_together(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Submit all at once, step until every one finishes: one batch."""
    handles = [engine.submit(ids, params) for ids, params in requests]
    while any(not h.seq.is_finished for h in handles):
        engine.step()
    return [h.result() for h in handles]


def check_valid(name: str, fin) -> None:
    schema = SCHEMAS[name][0]
    assert fin.figures.finish_reason == "stop", (name, fin.text, fin.error)
    jsonschema.validate(json.loads(fin.text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def schema_requests(engine: Engine, sampled: bool) -> list[tuple[str, list[int], SamplingParams]]:
    knobs = dict(temperature=0.9, top_p=0.95, seed=7) if sampled else dict(temperature=0.0)
    return [(name, chat_ids(engine, prompt), SamplingParams(max_tokens=160, structure=schema_structure(schema), **knobs))
            for name, (schema, prompt) in SCHEMAS.items()]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_schema_output_validates_alone(engine, sampled):
    for name, ids, params in schema_requests(engine, sampled):
        check_valid(name, run_together(engine, [(ids, params)])[0])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_schema_output_validates_in_a_batch_of_8_with_free_requests(engine, sampled):
    constrained = schema_requests(engine, sampled)
    free = [(chat_ids(engine, p), SamplingParams(max_tokens=24, temperature=0.0)) for p in FREE_PROMPTS]
    for half in (constrained[:4], constrained[4:]):  # 4 constrained + 4 free in each step's batch
        results = run_together(engine, [(ids, params) for _, ids, params in half] + free)
        for (name, _, _), fin in zip(half, results):
            check_valid(name, fin)
        assert all(f.figures.finish_reason in ("stop", "length") and f.text for f in results[4:])


def test_a_constrained_request_leaves_the_free_ones_greedy_output_unchanged(engine):
    free = [(chat_ids(engine, p), SamplingParams(max_tokens=24, temperature=0.0)) for p in FREE_PROMPTS]
    alone = run_together(engine, free)
    name = "person"
    beside = run_together(engine, free[:2] + [schema_requests(engine, False)[-1][1:]] + free[2:])
    check_valid(name, beside[2])
    assert [f.token_ids for f in alone] == [f.token_ids for f in beside[:2] + beside[3:]]


def test_regex_choice_and_grammar_outputs_match(engine):
    ids = chat_ids(engine, "Give me a phone number, and tell me if the sky is blue.")
    cases = [("regex", r"[0-9]{3}-[0-9]{4}", re.compile(r"[0-9]{3}-[0-9]{4}")),
             ("choice", json.dumps(["yes", "no", "maybe"]), re.compile(r"yes|no|maybe")),
             ("grammar", 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"', re.compile(r"The answer is (yes|no)\."))]
    for sampled in (False, True):
        knobs = dict(temperature=1.0, seed=3) if sampled else dict(temperature=0.0)
        requests = [(ids, SamplingParams(max_tokens=40, structure=Structure(kind=k, text=t, param=k), **knobs))
                    for k, t, _ in cases]
        for (kind, _, pattern), fin in zip(cases, run_together(engine, requests)):
            assert fin.figures.finish_reason == "stop" and pattern.fullmatch(fin.text), (kind, fin.text)
            assert fin.constrained and fin.constraint_s > 0
            assert fin.figures.constrained and fin.figures.constraint_ms == pytest.approx(1000 * fin.constraint_s)


class DeadEnd:
    """A constraint (Constraint's interface) that refuses every token and finds none legal."""

    time_s, num_masks = 0.0, 0

    def allows(self, token: int) -> bool:
        return False

    def legal_mask(self) -> np.ndarray:
        raise ConstraintError("structured output failed: the grammar allows no next token (a dead end)")

    def accept(self, token: int) -> None:
        raise AssertionError("never reached")


def test_a_dead_end_fails_its_own_request_and_not_the_batch(engine):
    free = [(chat_ids(engine, p), SamplingParams(max_tokens=12, temperature=0.0)) for p in FREE_PROMPTS[:2]]
    alone = run_together(engine, free)
    handles = [engine.submit(ids, params) for ids, params in free]
    doomed = engine.submit(chat_ids(engine, "Hi"), SamplingParams(max_tokens=12, structure=schema_structure(PERSON)))
    doomed.seq.constraint = DeadEnd()  # before the step takes it in: this thread drives the engine
    while any(not h.seq.is_finished for h in [*handles, doomed]):
        engine.step()
    fin = doomed.result()
    assert (fin.figures.finish_reason, fin.error_code) == ("error", "structured_output")
    assert "dead end" in fin.error
    assert [h.result().token_ids for h in handles] == [f.token_ids for f in alone]


# ---- over the socket -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def socket_path(real_q4_bundle):
    with serving(real_q4_bundle) as path:
        yield path


class Capital(BaseModel):
    city: str
    country: str
    population_millions: float


def test_the_openai_sdk_parse_helper_returns_a_parsed_object(socket_path):
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path))))
    completion = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France? Answer as JSON."}],
        response_format=Capital, max_tokens=80, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.city, completion
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=40, stream=True,
        response_format={"type": "json_object"}, temperature=0)  # sampled, 1 in 30 ran past max_tokens
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict), text


def test_structured_outputs_on_both_endpoints(socket_path):
    client = http(socket_path)
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Is water wet?"}], "max_tokens": 20,
            "temperature": 0}
    r = client.post("/v1/chat/completions", json=chat | {"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    text = {"model": "smollm2", "prompt": "My phone number is", "max_tokens": 20, "temperature": 0}
    r = client.post("/v1/completions", json=text | {"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert r.status_code == 200 and re.fullmatch(r" [0-9]{3}-[0-9]{4}", r.json()["choices"][0]["text"]), r.text
    r = client.post("/v1/completions", json=text | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
                                 "additionalProperties": False}}}})
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["text"])["n"], int), r.text
    metrics = client.get("/metrics").text
    assert re.search(r"^edge:structured_requests_total [1-9]", metrics, re.M), metrics
    assert re.search(r"^edge:structured_mask_seconds_total [0-9.e-]+$", metrics, re.M)


BIG = "start: " + " | ".join(f'"w{i}"' for i in range(30_000))  # over MAX_STRUCTURE_CHARS
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema", "Unimplemented keys: [\"not\"]"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}},
     "response_format.json_schema.schema", "does not exist"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"grammar": BIG}}, "structured_outputs.grammar", "characters long; at most"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, None, "ignore_eos cannot be combined"),
]


@pytest.mark.parametrize("extra,param,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_structure_is_a_400_naming_the_field(socket_path, extra, param, needle):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5} | extra
    r = http(socket_path).post("/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert (r.status_code, err["type"], err["param"]) == (400, "invalid_request_error", param), r.text
    assert needle in err["message"], err["message"]


# ---- the sampler's constrained draw (pure) -------------------------------------------------------------
class Allowed:
    """A constraint (Constraint's interface) allowing a fixed set of ids."""

    def __init__(self, legal: np.ndarray):
        self.legal, self.num_masks = legal, 0

    def allows(self, token: int) -> bool:
        return bool(self.legal[token])

    def legal_mask(self) -> np.ndarray:
        self.num_masks += 1
        return self.legal


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8)],
                         ids=["plain", "top_k", "top_p"])
def test_the_constrained_draw_is_the_filtered_distribution_conditioned_on_legality(knobs):
    from agent.engine.sampler import filtered, make_rng, sample_constrained

    logits = np.log(np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02], np.float32))
    legal = np.array([False, True, False, True, True, False, True, True])
    params = SamplingParams(**knobs)
    ids, probs = filtered(logits, params)
    want = np.zeros(len(logits))
    want[ids] = probs
    want = np.where(legal, want, 0) / np.where(legal, want, 0).sum()
    rng, constraint, n = make_rng(5), Allowed(legal), 40_000
    counts = np.bincount([sample_constrained(logits, params, [], [], rng, constraint) for _ in range(n)],
                         minlength=len(logits))
    assert counts[~legal].sum() == 0 and 0 < constraint.num_masks < n
    np.testing.assert_allclose(counts / n, want, atol=0.01)
    greedy = sample_constrained(logits, SamplingParams(temperature=0), [], [], rng, constraint)
    assert greedy == 1  # the most probable legal token


# ---- generated schemas: a 200 with valid output or a 400 naming the field, never a 500 ----------------------
KEYWORDS = ["type", "properties", "required", "items", "enum", "anyOf", "oneOf", "allOf", "minimum", "maximum",
            "minLength", "maxLength", "pattern", "format", "additionalProperties", "minItems", "maxItems", "const",
            "$ref", "not", "uniqueItems", "prefixItems", "if", "exclusiveMinimum", "multipleOf", "default"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "wat"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 50), st.floats(-10, 10, allow_nan=False),
                    st.sampled_from(TYPES), st.text(max_size=6))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=8)
schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(TYPES)}),
    lambda inner: st.dictionaries(st.sampled_from(KEYWORDS), st.one_of(
        inner, json_values, st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
        max_size=4),
    max_leaves=10)
GENERATED_SCHEMAS = 120


@settings(max_examples=GENERATED_SCHEMAS, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(schema=schemas)
def test_generated_schemas_get_valid_output_or_a_400_naming_the_field(socket_path, schema):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 24,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "g", "schema": schema}}}
    r = http(socket_path).post("/v1/chat/completions", json=body)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
        return
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        except jsonschema.SchemaError:  # a schema llguidance takes but jsonschema's metaschema refuses
            pass
