"""Speculative decoding keeps the output: greedy equals plain greedy token for token, and speculative
sampling keeps the target's distribution."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine import speculative
from agent.engine.sampling_params import SamplingParams
from agent.engine.sequence import Sequence
from agent.engine.sampler import filtered
from agent.engine.speculative import (DraftLength, LookupLength, learned_backoff, next_draft_length, ngram_draft,
                                      Speculation, sampled_chooser, verify)
from batching import GREEDY, run_together
from quantize.package import build_bundle
from quantize.precision import QuantSpec


def test_ngram_draft_follows_the_latest_match():
    assert ngram_draft([1, 2, 3, 4, 5, 9, 9, 2, 3, 4], 3) == [5, 9, 9]
    assert ngram_draft([1, 2, 3], 2) == []
    assert ngram_draft([7, 1, 2, 8, 1, 2, 9, 1, 2], 2) == [9, 1]  # the most recent occurrence wins


def test_draft_length_grows_with_acceptance_and_pauses_when_drafts_are_rejected():
    dl = DraftLength(pause_steps=0, spec_steps=4)
    for _ in range(10):
        dl.update(4, 4)
    assert dl.current() == dl.k_max
    for _ in range(6):
        dl.update(4, 0)
    assert dl.current() == 0 and dl.pause_steps > 0  # paused


def test_draft_length_is_short_when_extra_rows_and_draft_tokens_cost():
    """p = 0.85: with free rows and drafts the longest draft is best; at Qwen 1.5B/0.5B's measured costs on
    this box (a row ~0.2 of a step, a draft token ~0.3) two tokens are."""
    cheap = DraftLength(hits=8.5, misses=1.5, draft_cost=0.02, row_cost=0.02, pause_steps=0)
    assert cheap.current() == cheap.k_max
    costly = DraftLength(hits=8.5, misses=1.5, draft_cost=0.3, row_cost=0.2, pause_steps=0)
    assert costly.current() == 2
    hopeless = DraftLength(hits=8.5, misses=1.5, draft_cost=0.6, row_cost=0.4, pause_steps=0, spec_steps=4)
    assert hopeless.current() == 0 and hopeless.pause_steps == 15  # this step is the pause's first of 16


def test_draft_length_measures_its_costs():
    dl = DraftLength()
    plain_steps(dl, 3, 0.010)
    for _ in range(30):
        k = dl.current()
        dl.observe_draft(0.002 * k, k)  # a draft token: 0.2 of a plain step
        dl.update(k, k, 0.002 * k + 0.010 + 0.001 * k)  # an extra verify row: 0.1
    assert dl.draft_cost == pytest.approx(0.2, abs=0.01) and dl.row_cost == pytest.approx(0.1, abs=0.01)


def plain_steps(dl: DraftLength, n: int, seconds: float) -> None:
    for _ in range(n):
        assert dl.current() == 0
        dl.observe_plain(seconds)


def test_the_first_steps_run_plain_to_measure_the_yardstick():
    dl = DraftLength()
    plain_steps(dl, 3, 0.010)
    assert dl.current() > 0 and dl.plain_cost == pytest.approx(0.010)


def probe_until_paused(dl: DraftLength, seconds: float, plain_s: float) -> int:
    """Speculate with k - 1 of k tokens accepted, each step taking `seconds`, until dl pauses; its pause length
    (then the pause's plain steps are run)."""
    for _ in range(100):
        k = dl.current()
        if k == 0:
            break
        dl.update(k, k - 1, seconds)
    pause = dl.pause_steps + 1  # current() took the first step of it
    plain_steps(dl, dl.pause_steps, plain_s)
    return pause


def test_speculation_pauses_when_it_is_slower_even_if_mostly_accepted():
    """A draft model nearly as slow as the target: most tokens accepted, but 5 plain steps' time per step."""
    dl = DraftLength()
    plain_steps(dl, 3, 0.010)
    assert [probe_until_paused(dl, 0.050, 0.010) for _ in range(3)] == [16, 32, 64]  # each rests twice as long


def test_speculation_that_pays_keeps_going():
    dl = DraftLength()
    plain_steps(dl, 3, 0.010)
    for _ in range(50):
        k = dl.current()
        assert k > 0
        dl.update(k, k, 0.010 + 0.001 * k)  # whole drafts accepted, an extra row 0.1 of a step
    assert dl.current() == dl.k_max


def test_a_new_sequence_starts_from_what_the_last_one_learned():
    failed = DraftLength()
    plain_steps(failed, 3, 0.010)
    for _ in range(2):  # two failed probes: paused 16, then 32 steps; the next pause would be 64
        probe_until_paused(failed, 0.050, 0.010)
    assert learned_backoff(failed, drafted=True) == 64
    nxt = next_draft_length("draft", 64)
    plain_steps(nxt, 32, 0.010)  # starts paused for half as long
    assert nxt.current() > 0
    # a sequence that ended inside its pause, never drafting, hands on half its backoff: probes come back
    assert learned_backoff(next_draft_length("draft", 64), drafted=False) == 32
    assert learned_backoff(next_draft_length("draft", 32), drafted=False) == 16
    assert next_draft_length("draft", 16).pause_steps == DraftLength().pause_steps == 3


def test_a_new_sequence_starts_with_the_costs_the_engine_measured():
    """A finished request that drafted hands on its measured plain step, draft token and verify row: the next
    starts drafting at once from them instead of spending its first steps on plain decoding to learn them again,
    unless speculation was failing (then it starts paused, as before)."""
    spec = Speculation(EngineConfig(speculative="draft"))

    def sequence() -> Sequence:
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=8, **GREEDY), np.random.default_rng(0), 64)
        spec.start(seq)
        return seq

    done = sequence()
    done.draft_length = DraftLength(plain_cost=0.05, draft_cost=0.3, row_cost=0.2, pause_steps=0)
    done.num_computed, done.drafted_tokens = 10, 4
    spec.finished(done)
    nxt = sequence().draft_length
    assert (nxt.pause_steps, nxt.plain_cost, nxt.draft_cost, nxt.row_cost) == (0, 0.05, 0.3, 0.2)
    failing = sequence()
    failing.draft_length = DraftLength(plain_cost=0.05, draft_cost=0.9, row_cost=0.5, backoff=64, pause_steps=0)
    failing.num_computed, failing.drafted_tokens = 10, 4
    spec.finished(failing)
    after = sequence().draft_length
    assert after.pause_steps == 32 and after.draft_cost == 0.9


class RefusingDraft:
    """A draft model that must not be asked."""

    catch_up_s = 0.0

    def propose_many(self, wants):
        raise AssertionError(f"drafted for {list(wants)}")

    propose = propose_many


def test_a_sequence_that_decoded_in_a_batch_too_large_to_draft_stays_plain():
    """Its draft cache fell behind by everything it decoded meanwhile: catching up is a prefill of its whole
    context, which the tail of a batch does not repay."""
    spec = Speculation(EngineConfig(speculative="draft", speculative_max_batch=2), draft=RefusingDraft())
    seqs = []
    for _ in range(3):
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=32, **GREEDY), np.random.default_rng(0), 64)
        spec.start(seq)
        seq.draft_length.pause_steps = 0
        seqs.append(seq)
    spec.prepare(seqs, 64)  # three decode together: none drafts, and all fall behind
    assert all(s.draft_behind for s in seqs)
    spec.prepare(seqs[:1], 64)  # alone now: still plain
    assert spec.propose(seqs[0], 1, 64) == []


def test_lookup_drafts_as_long_as_the_acceptance_pays_for_the_extra_rows():
    lk = LookupLength()
    for _ in range(10):
        lk.update(5, 5)  # whole drafts accepted: a quote
    assert lk.best_k() == lk.k_max
    ks = []
    for _ in range(10):  # the output leaves its source: drafts shrink to one token, then stop
        ks.append(lk.best_k())
        lk.update(ks[-1], 0)  # (nothing to observe once it stops: no lookup was checked here)
    assert ks[0] == lk.k_max and ks[2] <= 3 and ks[-1] == 0
    costly = LookupLength(hits=6, misses=4)  # p = 0.6
    assert costly.best_k() > 0
    costly.observe_plain(0.010)
    for _ in range(10):
        costly.update(1, 1, 0.020)  # an extra row costs a whole plain step: 2 tokens for 2 steps' time
    assert costly.row_cost == pytest.approx(1.0, abs=0.05) and costly.best_k() == 0


def test_lookup_resumes_as_soon_as_the_output_quotes_its_source_again():
    """Checked for free while it does not draft: DraftLength paused prompt lookup for 16, 32, then 64 steps
    of a quote after each reworded sentence (bench/speculative.py's repeat-heavy workload, INT4: 1.21x, now 1.57x)."""
    source = list(range(100, 140))
    lk = LookupLength()
    for _ in range(4):
        lk.update(3, 0)
    ids = source + [7, 8] + source[:2]  # the answer picks the quote up again
    steps = 0
    while not lk.propose(ids, room=10):
        assert lk.shadow == source[len(ids) - len(source) - 2]
        lk.observe_plain(0.010, ids.append(lk.shadow) or ids[-1])  # the model produced the looked-up token
        steps += 1
    assert steps <= 3


@pytest.fixture(scope="module")
def tiny_bundle(tiny_varied_checkpoint, tmp_path_factory):
    return build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path_factory.mktemp("spec") / "fp32", name="tiny",
                        progress=lambda s: None)


def repetitive_prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 260, 6).tolist()
        out.append(phrase * 4 + rng.integers(3, 260, 3).tolist() + phrase[:3])
    return out


@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_greedy_equals_plain_greedy_tiny(tiny_bundle, batch):
    ps = repetitive_prompts(batch)
    cfg = dict(threads=2, memory_budget_mb=16000, min_context=64, speculative_max_batch=4)
    plain = Engine(tiny_bundle, EngineConfig(**cfg))
    spec = Engine(tiny_bundle, EngineConfig(speculative="ngram", **cfg))
    want = [plain.generate(p, SamplingParams(max_tokens=40, **GREEDY)).token_ids for p in ps]
    results = run_together(spec, ps, 40)
    assert [r.token_ids for r in results] == want
    assert sum(r.figures.drafted_tokens for r in results) > 0


def test_tokens_accepted_together_make_one_inter_token_gap(tiny_fp32_bundle):
    """A verify step that accepts drafts delivers its tokens at once: they share the step's time, and the
    ITL figures and /metrics histogram count one gap per step, not a ~0 gap per extra token (which would
    read an ITL p50 of 0.01 ms while the client waits 16-20 ms between bursts). On the tiny model whose greedy
    text repeats one token, so that drafts are accepted (the varied one rarely repeats what it has seen)."""
    from agent.api.metrics import Metrics
    from agent.engine.sequence import delivery_gaps_s
    spec = Engine(tiny_fp32_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, speculative="ngram"))
    r, = run_together(spec, repetitive_prompts(1), 200)
    times = r.token_times
    assert r.figures.accepted_tokens > 0 and len(set(times)) < len(times)
    gaps = delivery_gaps_s(times)
    assert len(gaps) == len(set(times)) - 1 and gaps.min() > 0
    assert r.figures.itl_p50_ms == pytest.approx(float(np.percentile(gaps, 50)) * 1000)
    metrics = Metrics()
    metrics.observe_finished(r.figures, times)
    count, = [s.value for s in metrics.itl.collect()[0].samples if s.name.endswith("_count")]
    assert count == len(gaps)


@pytest.mark.real_model
@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_greedy_equals_plain_greedy_real(real_fp32_bundle, batch):
    cfg = dict(threads=2, memory_budget_mb=16000, max_context=1024, speculative_max_batch=4)
    plain = Engine(real_fp32_bundle, EngineConfig(**cfg))
    spec = Engine(real_fp32_bundle, EngineConfig(speculative="ngram", **cfg))
    tok = plain.tokenizer
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and "
               "wrote the weather in a leather book. ")
    questions = ["Repeat the passage exactly.", "Quote the first sentence.", "What did the keeper write?",
                 "Copy the text word for word."][:batch]
    ps = [tok.encode(tok.render_chat([{"role": "user", "content": passage + q}])) for q in questions]
    want = [plain.generate(p, SamplingParams(max_tokens=32, **GREEDY)).token_ids for p in ps]
    results = run_together(spec, ps, 32)
    assert [r.token_ids for r in results] == want
    print("accepted/drafted", sum(r.figures.accepted_tokens for r in results),
          sum(r.figures.drafted_tokens for r in results))


def test_speculative_sampling_keeps_the_target_distribution():
    """Chi-square test: tokens from verify() over a fixed draft follow the target distribution, even though
    the draft always proposes token 1 (p = 0.4)."""
    rng = np.random.default_rng(1234)
    logits = np.log(np.array([0.05, 0.4, 0.25, 0.2, 0.1], np.float32))
    params = SamplingParams(temperature=1.0, seed=1)
    n = 20000
    first = np.array([verify([1], np.stack([logits, logits]), params, [], [], rng)[0] for _ in range(n)])
    counts = np.bincount(first, minlength=5)
    p = np.exp(logits) / np.exp(logits).sum()
    expected = p * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 18.47, (counts, expected)  # chi-square, 4 degrees of freedom, p = 0.001


def chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells expected at least 5 times, the rest pooled into one."""
    big = expected >= 5
    cells_c = np.append(counts[big], counts[~big].sum())
    cells_e = np.append(expected[big], expected[~big].sum())
    keep = cells_e > 0
    return float(((cells_c[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum()), int(keep.sum()) - 1


def chi2_999(dof: int) -> float:
    """chi-square's 0.999 quantile (a correct rule fails one run in a thousand), by Wilson and Hilferty's cube
    approximation: within 2% of the table from 3 degrees of freedom up (18.72 for 4, table 18.47)."""
    return dof * (1 - 2 / (9 * dof) + 3.0902 * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=0.8, top_k=6),
                                     dict(temperature=1.2, top_p=0.9)], ids=["plain", "top-k", "top-p"])
def test_the_p_over_q_rule_keeps_the_target_distribution_whatever_the_draft_draws_from(filters):
    """A sampled draft drawn from q, verified by accept-with-min(1, p/q)-else-residual: the first emitted token
    follows p's first row, and after an accepted first draft token the second follows p's second row. q is
    made far from p (another random distribution, part of it where p is filtered out), so a rule that kept the
    draft too often (or resampled from p rather than the residual) would follow q instead."""
    rng, v, n = np.random.default_rng(7), 12, 20000
    logits = rng.normal(0, 1.5, (2, v)).astype(np.float32)
    draft_logits = rng.normal(0, 1.5, (2, v)).astype(np.float32)
    params = SamplingParams(seed=3, **filters)
    p_rows = []
    for row in logits:
        ids, probs = filtered(row, params)
        dense = np.zeros(v)
        dense[ids] = probs / probs.sum()
        p_rows.append(dense)
    draft_rng = np.random.default_rng(11)
    first, second, accepted = np.zeros(v), np.zeros(v), 0
    for _ in range(n):
        q = []
        choose = sampled_chooser(params, draft_rng, q)
        draft = [choose(draft_logits[0]), choose(draft_logits[1])]
        out = verify(draft, np.concatenate([logits, logits[1:]]), params, [], [], rng, q=q)
        first[out[0]] += 1
        if out[0] == draft[0]:
            accepted += 1
            second[out[1]] += 1
    assert 0.05 * n < accepted < 0.95 * n  # both acceptance and the residual were exercised
    for counts, p in ((first, p_rows[0]), (second, p_rows[1])):
        stat, dof = chi_square(counts, p * counts.sum())
        assert stat < chi2_999(dof), (counts, p * counts.sum())


def test_a_greedy_request_ignores_q_and_keeps_the_argmax():
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], np.float32))
    q = [(np.array([2]), np.array([1.0], np.float32))]
    assert verify([2], logits, SamplingParams(**GREEDY), [], [], np.random.default_rng(0), q=q) == [1]
    assert verify([1], logits, SamplingParams(**GREEDY), [], [], np.random.default_rng(0), q=q) == [1, 0]


@pytest.fixture(scope="module")
def tiny_noisy_bundle(tiny_varied_checkpoint, tmp_path_factory):
    """The target with noise on its output head: a draft whose q is near the target's p but plainly not it, so
    that both acceptances and residual draws are frequent."""
    rng = np.random.default_rng(5)
    weights = dict(tiny_varied_checkpoint.weights)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = head + rng.normal(0, 0.6 * head.std(), head.shape).astype(np.float32)
    ckpt = dataclasses.replace(tiny_varied_checkpoint, weights=weights)
    return build_bundle(ckpt, QuantSpec(), tmp_path_factory.mktemp("spec-noisy") / "fp32", name="tiny",
                        progress=lambda s: None)


def test_sampled_requests_with_a_draft_model_follow_plain_sampling(tiny_bundle, tiny_noisy_bundle, monkeypatch):
    """Two-sample chi-square over the first two generated tokens: the second is the first a verify step emits
    (the controller drafts from the first decode step here), whether it kept the draft's token or drew from the
    residual; the pair's distribution is the one plain sampling gives."""
    monkeypatch.setattr(speculative, "next_draft_length", lambda mode, backoff: DraftLength(pause_steps=0))
    prompt = repetitive_prompts(1)[0][:12]
    cfg = dict(threads=1, memory_budget_mb=16000, min_context=64, speculative_max_batch=4)
    n = 1500
    plain = Engine(tiny_bundle, EngineConfig(**cfg))
    spec = Engine(tiny_bundle, EngineConfig(speculative="draft", **cfg), draft=tiny_noisy_bundle)

    def pairs(engine: Engine, seed: int) -> tuple[list[tuple[int, int]], int, int]:
        out, drafted, accepted = [], 0, 0
        for i in range(n):
            r = engine.generate(prompt, SamplingParams(max_tokens=3, temperature=1.2, top_k=3, seed=seed + i))
            out.append(tuple(r.token_ids[:2]))
            drafted, accepted = drafted + r.figures.drafted_tokens, accepted + r.figures.accepted_tokens
        return out, drafted, accepted

    want, _, _ = pairs(plain, 0)
    got, drafted, accepted = pairs(spec, 10_000)
    assert drafted == n and 0.1 * n < accepted < 0.9 * n  # one draft token a request; both ways exercised
    cells = sorted(set(want) | set(got))
    a = np.array([want.count(c) for c in cells], float)
    b = np.array([got.count(c) for c in cells], float)
    big = (a + b) >= 10
    a, b = np.append(a[big], a[~big].sum()), np.append(b[big], b[~big].sum())
    a, b = a[(a + b) > 0], b[(a + b) > 0]
    stat = float((((a - b) ** 2) / (a + b)).sum())  # two equal-size samples: sum (a - b)^2 / (a + b)
    assert stat < chi2_999(len(a) - 1), (cells, a, b)


def test_a_seeded_sampled_request_gives_the_same_text_with_speculation_alone_or_in_a_batch(tiny_bundle):
    """Verification draws from the request's generator once per emitted token, as plain decoding does, so a
    seeded request's text does not change with speculation or with the batch it runs in."""
    ps = repetitive_prompts(4)
    cfg = dict(threads=2, memory_budget_mb=16000, min_context=64, speculative_max_batch=4)
    # temperature 3: flat enough on the tiny model that drafts are often rejected (at 0.9 all were accepted)
    seeded = [SamplingParams(max_tokens=40, temperature=3.0, seed=1234 + i) for i in range(4)]
    plain = Engine(tiny_bundle, EngineConfig(**cfg))
    want = [plain.generate(p, s).token_ids for p, s in zip(ps, seeded)]
    spec = Engine(tiny_bundle, EngineConfig(speculative="ngram", **cfg))
    assert spec.generate(ps[0], seeded[0]).token_ids == want[0]  # alone
    handles = [spec.submit(p, s) for p, s in zip(ps, seeded)]  # together
    while any(not h.seq.is_finished for h in handles):
        spec.step()
    results = [h.result() for h in handles]
    assert [r.token_ids for r in results] == want
    assert sum(r.figures.drafted_tokens for r in results) > 0


@pytest.fixture(scope="module")
def tiny_int8_bundle(tiny_varied_checkpoint, tmp_path_factory):
    spec = QuantSpec(precision="int8", method="rtn", block_size=16, block_sizes={})
    return build_bundle(tiny_varied_checkpoint, spec, tmp_path_factory.mktemp("spec") / "int8", name="tiny",
                        progress=lambda s: None)


@pytest.mark.parametrize("batch", [1, 4])
def test_draft_model_greedy_equals_plain_greedy_tiny(tiny_bundle, tiny_int8_bundle, batch):
    """The INT8 build drafts for the fp32 one: outputs stay the fp32 model's, token for token."""
    ps = [p[:20] for p in repetitive_prompts(batch)]
    cfg = dict(threads=2, memory_budget_mb=16000, min_context=64, speculative_max_batch=4)
    plain = Engine(tiny_bundle, EngineConfig(**cfg))
    spec = Engine(tiny_bundle, EngineConfig(speculative="draft", **cfg), draft=tiny_int8_bundle)
    want = [plain.generate(p, SamplingParams(max_tokens=40, **GREEDY)).token_ids for p in ps]
    results = run_together(spec, ps, 40)
    assert [r.token_ids for r in results] == want
    drafted = sum(r.figures.drafted_tokens for r in results)
    accepted = sum(r.figures.accepted_tokens for r in results)
    assert drafted > 0 and accepted > drafted / 2  # an int8 draft of the same weights mostly agrees


@pytest.mark.real_model
@pytest.mark.parametrize("batch", [1, 4])
def test_draft_model_greedy_equals_plain_greedy_real(real_fp32_bundle, real_q4_bundle, batch):
    """The real model's INT4 (Q4_1-block) build drafts for its fp32 build."""
    cfg = dict(threads=2, memory_budget_mb=16000, max_context=1024, speculative_max_batch=4)
    plain = Engine(real_fp32_bundle, EngineConfig(**cfg))
    spec = Engine(real_fp32_bundle, EngineConfig(speculative="draft", **cfg), draft=real_q4_bundle)
    tok = plain.tokenizer
    questions = ["Name three planets.", "What is a river?", "Give me a synonym for happy.", "Count to five."][:batch]
    ps = [tok.encode(tok.render_chat([{"role": "user", "content": q}])) for q in questions]
    want = [plain.generate(p, SamplingParams(max_tokens=24, **GREEDY)).token_ids for p in ps]
    results = run_together(spec, ps, 24)
    assert [r.token_ids for r in results] == want
    accepted = sum(r.figures.accepted_tokens for r in results)
    drafted = sum(r.figures.drafted_tokens for r in results)
    print(f"batch {batch}: accepted {accepted} of {drafted} drafted tokens")
    assert accepted > 0


def test_with_a_draft_model_the_prefix_store_gets_its_share_of_the_kv_budget(tiny_bundle, tiny_int8_bundle):
    """The store holds the target's KV only and is sized at that cost per token, not a slot's (target + draft),
    so it gets its whole share of the KV budget."""
    # a budget far above the pytest process's peak RSS, which the engine measures as its baseline
    e = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, speculative="draft"),
               draft=tiny_int8_bundle)
    kv_bytes = e.config.memory_budget_mb * 2**20 - e.baseline_bytes
    block = e.prefix.nbytes // e.prefix.num_blocks
    assert kv_bytes * e.config.prefix_cache_fraction - block < e.prefix.nbytes <= kv_bytes * e.config.prefix_cache_fraction
    slots = e.kv.nbytes * 2  # the draft mirrors every slot at the same geometry
    assert e.prefix.nbytes + slots <= kv_bytes


def test_the_draft_catches_up_on_a_long_prompt_in_prefill_chunks(tiny_bundle, tiny_int8_bundle):
    """The draft catches up on a prompt in prefill chunks, never in one call (one call over a 4,000-token
    prompt takes ~20 MB past the measured budget, kept by ONNX Runtime's arena). Output stays the plain
    greedy one."""
    cfg = dict(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=16)
    prompt = repetitive_prompts(1)[0] * 4
    assert len(prompt) > 100
    want = Engine(tiny_bundle, EngineConfig(**cfg)).generate(prompt, SamplingParams(max_tokens=24, **GREEDY)).token_ids
    spec = Engine(tiny_bundle, EngineConfig(speculative="draft", **cfg), draft=tiny_int8_bundle)
    widths, forward = [], spec.draft.runner.forward
    spec.draft.runner.forward = lambda ids, *a, **kw: (widths.append(ids.shape[1]), forward(ids, *a, **kw))[1]
    out = spec.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))
    assert out.token_ids == want and out.figures.drafted_tokens > 0
    assert widths and max(widths) <= 16, widths


# ---- a draft's head over the first ids (edge-quantize build --head-vocab) -------------------------------------
@pytest.fixture(scope="module")
def tiny_head_bundle(tiny_varied_checkpoint, tmp_path_factory):
    """The tiny model (269 tokens) at fp32 with a head over its first 256 ids: a draft-only bundle."""
    return build_bundle(tiny_varied_checkpoint, QuantSpec(head_vocab=256), tmp_path_factory.mktemp("spec") / "head",
                        name="tiny", progress=lambda s: None)


def test_a_draft_head_gives_the_first_columns_of_the_full_heads_logits(tiny_bundle, tiny_head_bundle):
    from agent.engine.runner import open_runner

    ids = repetitive_prompts(1)[0]
    logits = []
    for bundle in (tiny_bundle, tiny_head_bundle):
        runner = open_runner(bundle, 2)
        n = len(ids)
        logits.append(runner.forward(np.array([ids], np.int64), np.array([n - 1]), np.array([n]),
                                     np.array([list(range(n))]), runner.new_cache(1, 64))[0])
    full, head = logits
    assert head.shape == (len(ids), 256) and full.shape == (len(ids), 269)
    np.testing.assert_allclose(head, full[:, :256], rtol=1e-5, atol=1e-5)


def test_a_draft_head_bundle_drafts_and_the_output_stays_the_targets(tiny_bundle, tiny_head_bundle):
    ps = [p[:20] for p in repetitive_prompts(2)]
    cfg = dict(threads=2, memory_budget_mb=16000, min_context=64, speculative_max_batch=4)
    want = [Engine(tiny_bundle, EngineConfig(**cfg)).generate(p, SamplingParams(max_tokens=40, **GREEDY)).token_ids
            for p in ps]
    spec = Engine(tiny_bundle, EngineConfig(speculative="draft", **cfg), draft=tiny_head_bundle)
    results = run_together(spec, ps, 40)
    assert [r.token_ids for r in results] == want
    assert sum(r.figures.accepted_tokens for r in results) > 0


def test_a_draft_head_bundle_cannot_serve_requests(tiny_head_bundle):
    from agent.engine.bundle import BundleError

    with pytest.raises(BundleError, match=r"is a draft model \(its head covers 256 of 269 tokens\)"):
        Engine(tiny_head_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))


def test_a_draft_head_as_wide_as_the_vocabulary_is_refused(tiny_varied_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="head_vocab 269: a draft's head must be narrower than the model's 269-token"):
        build_bundle(tiny_varied_checkpoint, QuantSpec(head_vocab=269), tmp_path / "b", name="tiny",
                     progress=lambda s: None)
    assert not (tmp_path / "b").exists()
