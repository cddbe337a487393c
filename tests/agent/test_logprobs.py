"""OpenAI logprobs / top_logprobs end to end: the values are a numpy log-softmax of the processed logits (bias,
penalties, temperature, grammar mask; temperature 1 for greedy), also from speculative verify rows; asking for
them leaves the tokens drawn unchanged; token bytes for byte-level BPE and SentencePiece; one entry per token but
the EOS, streamed with its text; the official openai SDK parses chat logprobs (whole and streamed) and the legacy
completions' shape over the real socket on the real SmolLM2 INT4 bundle; out-of-range values are a 400 naming
the field; requests without logprobs carry `"logprobs": null` as before.

Run: PYTHONPATH=$PWD python -m pytest -q tests/agent/test_logprobs.py
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.logprobs import (MIN_LOGPROB, LogprobEntry, TokenLogprobs, token_byte_table, token_logprobs,
                                   with_bytes)
from agent.engine.runner import open_runner
from agent.engine.sampler import apply_penalties, make_rng, sample, sample_with_logprobs
from agent.engine.sampling_params import SamplingParams
from agent.engine.tokenizer import TextTokenizer
from agent.wire import Manifest
from quantize.package import build_bundle
from quantize.precision import QuantSpec
from quantize.spm_tokenizer import spm_document
from api_servers import serving


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


# ---- the values, without a model ----------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_are_a_log_softmax_of_the_logits_after_bias_penalties_and_temperature(temperature):
    logits = np.random.default_rng(0).normal(0, 3, 5000).astype(np.float32)
    params = SamplingParams(temperature=temperature, logprobs=20, logit_bias={7: 5.0, 9: -100.0},
                            presence_penalty=0.5, repetition_penalty=1.2)
    prompt, output = [1, 2, 3], [7, 7, 4]
    x = apply_penalties(logits, params, prompt, output)
    ref = log_softmax(x / (temperature or 1.0))  # greedy: the distribution at temperature 1
    lp = token_logprobs(x, 42, params)
    assert lp.logprob == pytest.approx(ref[42], abs=1e-4)
    assert list(lp.top_ids) == np.argsort(-ref, kind="stable")[:20].tolist()
    np.testing.assert_allclose(lp.top_logprobs, np.sort(ref)[::-1][:20], atol=1e-4)
    assert 9 not in lp.top_ids  # its -100 bias applies


def test_a_grammar_mask_gives_illegal_tokens_probability_0_and_unlikely_ones_minus_9999():
    logits = np.random.default_rng(1).normal(0, 3, 300).astype(np.float32)
    legal = np.zeros(300, bool)
    legal[[5, 50, 250]] = True
    lp = token_logprobs(logits, 50, SamplingParams(temperature=1.0, logprobs=5), legal)
    ref = log_softmax(np.where(legal, logits, -np.inf))
    assert lp.logprob == pytest.approx(ref[50], abs=1e-5)
    assert set(lp.top_ids[:3]) == {5, 50, 250} and lp.top_logprobs[3:] == (MIN_LOGPROB, MIN_LOGPROB)
    assert math.fsum(math.exp(v) for v in lp.top_logprobs[:3]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("knobs", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=3),
                                   dict(temperature=1.2, top_k=40, min_p=0.05, seed=4)])
def test_asking_for_logprobs_draws_the_same_tokens(knobs):
    rows = np.random.default_rng(2).normal(0, 2, (40, 2000)).astype(np.float32)
    plain, asked = SamplingParams(**knobs), SamplingParams(**knobs, logprobs=20)
    rng_a, rng_b = make_rng(knobs.get("seed")), make_rng(knobs.get("seed"))
    a = [sample(r, plain, [1], [], rng_a) for r in rows]
    b = [sample_with_logprobs(r, asked, [1], [], rng_b) for r in rows]
    assert a == [t for t, _ in b] and all(lp.token_id == t for t, lp in b)
    if knobs["temperature"] == 0:
        assert all(t == lp.top_ids[0] for t, lp in b)  # greedy: the top-1


def test_sentencepiece_tokens_are_their_piece_with_spaces_and_byte_fallback_tokens_their_byte():
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "\u2581", "\u2581a", "b", "\u2581ab"]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(pieces[:3])]
    doc = spm_document(pieces, [0.0] * len(pieces), added, add_space_prefix=True, unk_token="<unk>")
    table = token_byte_table(Tokenizer.from_str(json.dumps(doc)))
    assert table[:3] == [b"<unk>", b"<s>", b"</s>"]
    assert table[3 + 0xE2] == b"\xe2" and table[3 + ord("A")] == b"A"
    assert table[259:] == [b" ", b" a", b"b", b" ab"]


@pytest.mark.real_model
def test_byte_level_tokens_bytes_join_to_the_text_they_encode(real_q4_bundle):
    tok = TextTokenizer(real_q4_bundle.tokenizer_json(), real_q4_bundle.config)
    text = "Héllo wörld — 你好 😊\n\tdone <|im_end|>"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes[i] for i in ids) == text.encode()
    assert any(len(tok.token_bytes[i].decode(errors="replace")) != len(tok.token_bytes[i].decode(errors="ignore"))
               for i in ids)  # some token holds part of a character: its bytes, not U+FFFD's


def test_ids_past_the_tokenizers_vocabulary_have_no_bytes():
    """A model whose logits are wider than its vocabulary (padded rows) may list those ids under a grammar."""
    entry = with_bytes(TokenLogprobs(1, -0.1, (1, 7), (-0.1, MIN_LOGPROB)), [b"a", b"b"])
    assert entry == LogprobEntry(b"b", -0.1, ((b"b", -0.1), (b"", MIN_LOGPROB)))


# ---- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bundle(tiny_varied_checkpoint, tmp_path_factory):
    return build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path_factory.mktemp("lp") / "fp32", name="tiny",
                        progress=lambda s: None)


def reference_logprobs(bundle, ids: list[int], n_prompt: int) -> np.ndarray:
    """Log-softmax of the model's logits at each generated position [len(ids) - n_prompt, V], from one forward
    pass over the whole sequence."""
    runner = open_runner(bundle, 2)
    n = len(ids)
    logits = runner.forward(np.array([ids]), np.array([n - 1]), np.array([n]), np.arange(n)[None],
                            runner.new_cache(1, n + 1))[0, n_prompt - 1:n - 1]
    return np.stack([log_softmax(row) for row in logits])


def check_against_reference(bundle, prompt: list[int], params: SamplingParams):
    """Generate greedily with logprobs, compare each entry with a numpy log-softmax of the model's logits."""
    engine = Engine(bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    out = engine.generate(prompt, params)
    ref = reference_logprobs(bundle, prompt + out.token_ids, len(prompt))
    assert len(out.logprobs) == len(out.token_ids) == params.max_tokens
    for entry, row, token in zip(out.logprobs, ref, out.token_ids):
        assert entry.logprob == pytest.approx(row[token], abs=2e-3)
        assert [v for _, v in entry.top] == pytest.approx(np.sort(row)[::-1][:params.logprobs].tolist(), abs=2e-3)
        assert entry.top[0] == (entry.token, entry.logprob)  # greedy: the chosen token is the most probable
        assert entry.token == engine.tokenizer.token_bytes[token]
    return out


def test_greedy_logprobs_equal_a_numpy_log_softmax_of_the_models_logits(tiny_bundle):
    check_against_reference(tiny_bundle, [5, 9, 17, 30, 41, 2, 77],
                            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=4))


def test_speculative_verify_rows_give_the_same_logprobs(tiny_fp32_bundle):
    """On the tiny model whose greedy text repeats one token, so that prompt lookup's drafts are accepted."""
    out = check_against_reference(tiny_fp32_bundle, [5, 9, 17, 5, 9, 17, 5, 9, 17],
                                  SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3,
                                                 speculative="ngram"))
    assert out.figures.accepted_tokens > 0


def test_entries_travel_with_their_text_and_none_is_given_for_the_eos(tiny_bundle):
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    eos = engine.bundle.config.eos_token_ids[0]
    # the EOS all but forced after a few tokens: the output ends on it
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, logit_bias={eos: 30.0})
    handle = engine.submit([5, 9, 17, 30], params)
    while not handle.seq.is_finished:
        engine.step()
    events = list(handle)
    fin = events[-1]
    assert fin.token_ids[-1] == eos and fin.figures.finish_reason == "stop"
    assert len(fin.logprobs) == len(fin.token_ids) - 1
    assert [e for ev in events[:-1] for e in ev.logprobs] == fin.logprobs
    assert all(ev.logprobs for ev in events[:-1] if ev.text)  # text never goes out without its tokens


def test_a_request_without_logprobs_has_none(tiny_bundle):
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    handle = engine.submit([5, 9, 17], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while not handle.seq.is_finished:
        engine.step()
    events = list(handle)
    assert events[-1].logprobs is None and all(ev.logprobs == () for ev in events[:-1])


# ---- the API on the real model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(real_q4_bundle):
    with serving(real_q4_bundle) as sock:
        yield sock, Manifest.read(real_q4_bundle.path).name


def sdk(sock: Path) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))))


def http(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://localhost", timeout=60)


CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.mark.real_model
def test_the_sdk_parses_chat_logprobs_whole_and_streamed(served):
    sock, model = served
    client = sdk(sock)
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert r.choices[0].logprobs.refusal is None
    # one entry per token but the EOS
    eos = 1 if r.choices[0].finish_reason == "stop" else 0
    assert len(content) == r.usage.completion_tokens - eos > 5
    assert "".join(t.token for t in content) == r.choices[0].message.content  # ASCII: whole characters
    for t in content:
        assert bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 5
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)  # greedy: top-1
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert math.fsum(math.exp(x.logprob) for x in t.top_logprobs) <= 1 + 1e-6
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True)
    chunks = [c for c in stream if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    for c in chunks:  # each chunk's entries are its own text's
        if c.choices[0].delta.content and c.choices[0].logprobs:
            assert "".join(t.token for t in c.choices[0].logprobs.content) == c.choices[0].delta.content


@pytest.mark.real_model
def test_completions_logprobs_have_the_legacy_shape_whole_and_streamed(served):
    sock, model = served
    body = {"model": model, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0,
            "logprobs": 3}
    with http(sock) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        n = r.json()["usage"]["completion_tokens"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert 1 <= len(top) <= 4 and top[token] == value == max(top.values())  # greedy: the top-1
        events = [json.loads(line[6:]) for line in client.post("/v1/completions", json=body | {"stream": True}
                                                                ).text.splitlines() if line.startswith("data: {")]
        parts = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
        assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
        assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]
        # SDK: the same response parsed
        parsed = sdk(sock).completions.create(**body)
        assert parsed.choices[0].logprobs.tokens == lp["tokens"]


@pytest.mark.real_model
def test_a_stop_strings_tokens_have_entries_though_its_text_is_cut(served):
    sock, model = served
    body = {"model": model, "prompt": "One, two, three, four, five,", "max_tokens": 20, "temperature": 0,
            "logprobs": 0, "stop": [" seven"]}
    with http(sock) as client:
        r = client.post("/v1/completions", json=body).json()
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["finish_reason"] == "stop" and "seven" not in r["choices"][0]["text"]
    assert len(lp["tokens"]) == r["usage"]["completion_tokens"]  # the stop string's token too
    assert "".join(lp["tokens"]).startswith(r["choices"][0]["text"])
    assert all(len(top) == 1 for top in lp["top_logprobs"])  # logprobs 0: the chosen token only


@pytest.mark.real_model
def test_a_constrained_request_gets_logprobs_under_its_grammar(served):
    sock, model = served
    body = {"model": model, "messages": CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "structured_outputs": {"choice": ["Paris", "Lyon"]}}
    with http(sock) as client:
        r = client.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert r["choices"][0]["message"]["content"] in ("Paris", "Lyon")
    assert "".join(t["token"] for t in content) == r["choices"][0]["message"]["content"]
    # the grammar's mask is part of the distribution: illegal tokens are -9999
    assert all(x["logprob"] == MIN_LOGPROB or x["token"] in "ParisLyon" for t in content for x in t["top_logprobs"])


@pytest.mark.real_model
@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_out_of_range_logprobs_are_a_400_naming_the_field(served, path, extra, param):
    sock, model = served
    body = {"model": model, "max_tokens": 2} | ({"messages": CHAT} if "chat" in path else {"prompt": "Hi"})
    with http(sock) as client:
        r = client.post(path, json=body | extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.real_model
def test_requests_without_logprobs_carry_null_as_before(served):
    sock, model = served
    with http(sock) as client:
        chat = client.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 3,
                                                         "logprobs": False, "top_logprobs": 0}).json()
        text = client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3,
                                                    "logprobs": None}).json()
        stream = client.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 3,
                                                           "stream": True}).text
    assert chat["choices"][0]["logprobs"] is None and text["choices"][0]["logprobs"] is None
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert events and all(e["choices"][0]["logprobs"] is None for e in events)
