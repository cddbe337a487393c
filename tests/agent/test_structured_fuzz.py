"""Bad and odd JSON schemas against the real API: hypothesis generates small schemas (mostly ones a model can
satisfy in a few tokens, the rest invalid, unsupported or unsatisfiable) and sends them, eight at a time, as
`response_format` json_schema requests to a served SmolLM2 INT4 bundle. Every answer is a 200 whose output
validates with `jsonschema` (an output cut by max_tokens is counted as truncated, never as valid) or a 400
whose error names the field at fault; never a 500, never a hang; and a free request sent again and again
beside them keeps its greedy text.

Run: PYTHONPATH=$PWD python -m pytest -q tests/agent/test_structured_fuzz.py
"""
from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api_servers import http, serving

pytestmark = pytest.mark.real_model

PARAM = "response_format.json_schema.schema"
BATCH = 8  # requests sent at once: the engine decodes them as one batch
BATCHES = 64  # hypothesis examples: 512 schemas in all
MAX_TOKENS = 40  # the generated schemas' outputs close well within this (see MAX_TRUNCATED_SHARE)
MAX_TRUNCATED_SHARE = 0.1  # more would mean the generator makes schemas too big to test validity on
TIMEOUT_S = 120  # one request; a hang fails the test instead of stalling it

# ---- the schemas --------------------------------------------------------------------------------------
KEYS = st.sampled_from(["a", "id", "name", "ok", "x1", "tags"])
SHORT_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=5)


@st.composite
def integers(draw) -> dict:
    lo = draw(st.integers(-100, 100))
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 50))}


@st.composite
def numbers(draw) -> dict:
    lo = draw(st.integers(-10, 10))
    return {"type": "number", "minimum": lo, "maximum": lo + draw(st.integers(1, 20))}


@st.composite
def strings(draw) -> dict:
    most = draw(st.integers(0, 8))
    schema = {"type": "string", "maxLength": most}
    if draw(st.booleans()):
        schema["minLength"] = draw(st.integers(0, most))
    return schema


scalars = st.one_of(
    integers(), numbers(), strings(),
    st.fixed_dictionaries({"type": st.sampled_from(["boolean", "null"])}),
    st.builds(lambda v: {"enum": v}, st.lists(st.one_of(SHORT_TEXT, st.integers(-9, 99), st.booleans(), st.none()),
                                               min_size=1, max_size=4, unique_by=json.dumps)),
    st.builds(lambda v: {"const": v}, st.one_of(SHORT_TEXT, st.integers(-9, 99))),
    st.sampled_from([{"type": "string", "pattern": "^[a-z]{1,4}$"}, {"type": "string", "format": "date"},
                     {"type": "string", "enum": ["red", "green"]}, {"type": ["integer", "null"], "maximum": 9}]),
)


def compounds(inner):
    """Objects of 1-3 properties, arrays of at most 3 items, anyOf of 2: what nests a leaf."""
    objects = st.builds(
        lambda props, n_required: {"type": "object", "additionalProperties": False, "properties": props,
                                   "required": sorted(props)[:n_required]},
        st.dictionaries(KEYS, inner, min_size=1, max_size=3), st.integers(0, 3))
    arrays = st.integers(0, 2).flatmap(lambda lo: st.builds(
        lambda items, hi: {"type": "array", "items": items, "minItems": lo, "maxItems": hi},
        inner, st.integers(lo, 3)))
    any_of = st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner)
    return st.one_of(objects, arrays, any_of)


satisfiable = st.recursive(scalars, compounds, max_leaves=4)

# invalid (not a schema), unsupported by llguidance, or satisfiable by no JSON value
BAD_SCHEMAS = [
    {"type": "wat"}, {"type": 5}, {"properties": 5}, {"required": "a"}, {"minimum": "zero", "type": "integer"},
    {"type": "string", "pattern": "(unclosed"}, {"$ref": "#/$defs/missing"}, {"$ref": "https://example.com/s.json"},
    {"not": {"type": "string"}}, {"type": "array", "uniqueItems": True}, {"if": {"type": "string"}, "then": {}},
    {"type": "object", "propertyNames": {"maxLength": 2}}, {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "string", "minLength": 4, "maxLength": 2},
    {"type": "array", "minItems": 3, "maxItems": 1}, {"enum": []}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object", "required": ["a"], "properties": {}, "additionalProperties": False},
    {"type": "integer", "multipleOf": 0}, {"type": "string", "minLength": -1}, {"anyOf": []},
]


@st.composite
def broken(draw) -> dict:
    """A bad schema alone, or one in place of a leaf of a satisfiable one's property."""
    bad = draw(st.sampled_from(BAD_SCHEMAS))
    if draw(st.booleans()):
        return bad
    return {"type": "object", "properties": {draw(KEYS): bad}, "required": [], "additionalProperties": False}


schemas = st.one_of(satisfiable, satisfiable, satisfiable, broken())  # three satisfiable draws for one bad


# ---- the requests -------------------------------------------------------------------------------------
def ask(client: httpx.Client, schema: dict) -> httpx.Response:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": MAX_TOKENS, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "g", "schema": schema}}}
    return client.post("/v1/chat/completions", json=body)


def has_empty_any_of(schema) -> bool:
    if isinstance(schema, dict):
        return schema.get("anyOf") == [] or any(has_empty_any_of(v) for v in schema.values())
    return isinstance(schema, list) and any(has_empty_any_of(v) for v in schema)


def outcome(schema: dict, r: httpx.Response) -> str:
    """"valid", "truncated", "refused" or "lenient"; AssertionError for anything else (a 500, an invalid
    output, ...). "lenient": llguidance takes an optional property whose schema is an empty anyOf (which the
    JSON Schema metaschema forbids) as one no value matches, so the output leaves it out; jsonschema cannot
    check an output against an invalid schema, and no other invalid schema may pass."""
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["param"] == PARAM, (schema, r.text)
        return "refused"
    assert r.status_code == 200, (schema, r.status_code, r.text)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return "truncated"
    assert choice["finish_reason"] == "stop", (schema, r.text)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError:
        assert has_empty_any_of(schema), (schema, r.text)
        return "lenient"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return "valid"


class FreeTraffic:
    """A free greedy request sent over and over from its own thread while the schemas run; every answer
    must be the text it got alone before they started."""

    BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "Name three fruits."}], "max_tokens": 16,
            "temperature": 0}

    def __init__(self, client: httpx.Client):
        self.client, self.stop, self.answers = client, threading.Event(), []
        self.alone = self.text()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def text(self) -> str:
        r = self.client.post("/v1/chat/completions", json=self.BODY)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.answers.append(self.text())
            except Exception as e:  # noqa: BLE001 -- recorded, and the test fails on it
                self.answers.append(e)


@pytest.fixture(scope="module")
def socket_path(real_q4_bundle):
    with serving(real_q4_bundle) as path:
        yield path


def test_generated_schemas_get_a_valid_output_or_a_400_and_free_requests_are_unaffected(socket_path):
    client = http(socket_path, TIMEOUT_S)
    counts: Counter = Counter()
    free = FreeTraffic(http(socket_path, TIMEOUT_S))
    free.thread.start()

    @settings(max_examples=BATCHES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(batch=st.lists(schemas, min_size=BATCH, max_size=BATCH))
    def run(batch: list[dict]) -> None:
        with ThreadPoolExecutor(BATCH) as pool:
            responses = list(pool.map(lambda s: ask(client, s), batch))
        for schema, r in zip(batch, responses):
            counts[outcome(schema, r)] += 1

    try:
        run()
    finally:
        free.stop.set()
        free.thread.join(TIMEOUT_S)
    print(f"\nschemas: {sum(counts.values())} {dict(counts)}; free requests beside them: {len(free.answers)}")
    assert sum(counts.values()) >= 500 and counts["valid"] >= 250 and counts["refused"] >= 50, counts
    assert counts["truncated"] <= MAX_TRUNCATED_SHARE * sum(counts.values()), counts
    assert free.answers and all(a == free.alone for a in free.answers), (free.alone, free.answers[:5])
