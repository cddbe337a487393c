"""Constrained requests in multi-token steps, on the real SmolLM2 fp32 bundle: tokens the grammar forces (key names,
closing brackets) go through the model together, and speculative drafts are cut at their first illegal token and
verified under the grammar. Greedy output is exactly what one-token constrained decoding gives (fp32: a
several-row step rounds like a one-row step to the last bits), in fewer steps.

Run: PYTHONPATH=$PWD python -m pytest -q tests/agent/test_constrained_steps.py
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from api_servers import engine_config

from agent.engine.constraint import Constraint
from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams, Structure

pytestmark = pytest.mark.real_model

ADDRESS = {"type": "object", "additionalProperties": False, "required": ["street", "city", "country", "zip_code"],
           "properties": {"street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20},
                          "country": {"enum": ["France", "Germany", "Italy"]},
                          "zip_code": {"type": "string", "pattern": "^[0-9]{5}$"}}}
TEAM = {"type": "object", "additionalProperties": False, "required": ["team", "members"], "properties": {
    "team": {"type": "string", "maxLength": 20},
    "members": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["first_name", "last_name", "is_manager"],
        "properties": {"first_name": {"type": "string", "maxLength": 12}, "last_name": {"type": "string", "maxLength": 12},
                       "is_manager": {"type": "boolean"}}}}}}
CASES = [(ADDRESS, "Give the address of the Louvre as JSON."), (TEAM, "Describe a small football team as JSON."),
         (TEAM, "Who works in a bakery? Answer as JSON.")]


@pytest.fixture(scope="module")
def engine(real_fp32_bundle):
    return Engine(real_fp32_bundle, engine_config())


def run(engine: Engine, prompt: str, schema: dict, **knobs) -> tuple:
    """(finished, steps taken) for one request run alone."""
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=250, temperature=0.0, seed=1, **knobs,
                            structure=Structure(kind="json_schema", text=json.dumps(schema), param="schema"))
    handle, steps = engine.submit(ids, params), 0
    while not handle.seq.is_finished:
        engine.step()
        steps += 1
    fin = handle.result()
    assert fin.figures.finish_reason == "stop", fin.text
    jsonschema.validate(json.loads(fin.text), schema)
    return fin, steps


def test_forced_tokens_and_constrained_drafts_keep_greedy_output_in_fewer_steps(engine, monkeypatch, figures):
    with monkeypatch.context() as m:  # one token a step: the reference
        m.setattr(Constraint, "forced_tokens", lambda self, limit: [])
        plain = [run(engine, prompt, schema) for schema, prompt in CASES]
    forced = [run(engine, prompt, schema) for schema, prompt in CASES]
    drafted = [run(engine, prompt, schema, speculative="ngram") for schema, prompt in CASES]
    for (p, p_steps), (f, f_steps), (d, d_steps) in zip(plain, forced, drafted):
        assert f.token_ids == p.token_ids == d.token_ids
        assert f.constraint_forced > 0 and f_steps < p_steps and d_steps <= f_steps
        assert p.constraint_forced == 0 and p.figures.drafted_tokens == f.figures.drafted_tokens == 0
    tokens = sum(len(p.token_ids) for p, _ in plain)
    figures.append(f"structured output: {tokens} tokens of 3 schemas in {sum(s for _, s in plain)} steps one token "
                   f"a step, {sum(s for _, s in forced)} with forced tokens run together "
                   f"({sum(f.constraint_forced for f, _ in forced)} forced), "
                   f"{sum(s for _, s in drafted)} with prompt-lookup drafts as well")


def test_a_free_request_beside_one_with_forced_tokens_keeps_its_greedy_output(engine):
    """Two in the batch (forced tokens run only in batches small enough for drafts): the free row is padded to the
    constrained one's width and still gives its own greedy text."""
    free_ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Name three fruits."}])
    free = SamplingParams(max_tokens=24, temperature=0.0)
    schema, prompt = CASES[1]
    alone_constrained = run(engine, prompt, schema)[0]
    alone_free = engine.submit(free_ids, free)
    while not alone_free.seq.is_finished:
        engine.step()
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    handles = [engine.submit(free_ids, free), engine.submit(ids, SamplingParams(
        max_tokens=250, temperature=0.0, structure=Structure(kind="json_schema", text=json.dumps(schema), param="s")))]
    while any(not h.seq.is_finished for h in handles):
        engine.step()
    together = [h.result() for h in handles]
    assert together[1].constraint_forced > 0
    assert [r.token_ids for r in together] == [alone_free.result().token_ids, alone_constrained.token_ids]
