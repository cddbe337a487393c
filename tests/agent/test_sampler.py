"""The sampler picks tokens as its parameters say: reproducible by seed, filters exact, penalties on the right logits.

Filters are checked three ways: on a handcrafted distribution (which tokens survive), statistically (draw
frequencies match the renormalised survivors), and against a naive full-sort reference on random
logits (hypothesis). SamplingParams' validation errors must name the field and its range.

Run: .venv/bin/python -m pytest tests/agent/test_sampler.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agent.engine.sampler import apply_penalties, draw, make_rng, min_p_filter, sample, sample_batch, softmax, top_p_filter
from agent.engine.sampling_params import SamplingParams

V = 49152  # the real model's vocabulary size
# A handcrafted distribution: probabilities 0.5, 0.3, 0.15, 0.05 as logits.
HAND_PROBS = np.array([0.5, 0.3, 0.15, 0.05])
HAND_LOGITS = np.log(HAND_PROBS).astype(np.float32)


def random_logits(seed: int, n: int = V, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def draw_counts(logits: np.ndarray, params: SamplingParams, n: int, seed: int = 0) -> np.ndarray:
    rng = make_rng(seed)
    tokens = [sample(logits, params, [], [], rng) for _ in range(n)]
    return np.bincount(tokens, minlength=len(logits))


def assert_frequencies(counts: np.ndarray, expected: np.ndarray) -> None:
    """Each frequency within 5 standard errors of its probability; zero-probability tokens never drawn."""
    n = counts.sum()
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(counts[expected == 0] == 0), counts
    np.testing.assert_array_less(np.abs(counts / n - expected), 5 * sigma + 1e-12)


# ---- reproducibility and greedy ---------------------------------------------------------------------

def test_same_seed_same_tokens_different_seed_different_tokens():
    steps = [random_logits(i) for i in range(10)]
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=7)

    def run(seed):
        rng = make_rng(seed)
        return [sample(x, params, [], [], rng) for x in steps]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(-1) == run(-1)  # negative seeds (an int64 from a client) work too


def test_unseeded_generators_differ():
    x = random_logits(0, scale=0.1)  # nearly flat: two fresh generators agree by chance ~1/49152 per step
    params = SamplingParams()
    a, b = make_rng(None), make_rng(None)
    assert [sample(x, params, [], [], a) for _ in range(5)] != [sample(x, params, [], [], b) for _ in range(5)]


def test_greedy_is_argmax_and_ignores_rng():
    rng = make_rng(0)
    for i in range(10):
        x = random_logits(i)
        assert sample(x, SamplingParams(temperature=0), [], [], rng) == int(np.argmax(x))
    assert rng.bit_generator.state == make_rng(0).bit_generator.state  # greedy never draws


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_top_k_1_is_greedy(temperature):
    rng = make_rng(1)
    for i in range(10):
        x = random_logits(i)
        assert sample(x, SamplingParams(temperature=temperature, top_k=1), [], [], rng) == int(np.argmax(x))


# ---- penalties --------------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    x = np.array([2.0, -2.0, 3.0, -1.0, 0.5], np.float32)
    out = apply_penalties(x, SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], output_ids=[1, 3])
    np.testing.assert_allclose(out, [1.0, -4.0, 3.0, -2.0, 0.5])
    np.testing.assert_array_equal(x, [2.0, -2.0, 3.0, -1.0, 0.5])  # the caller's logits are untouched


def test_frequency_and_presence_penalties_count_output_tokens_only():
    x = np.zeros(5, np.float32)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = apply_penalties(x, params, prompt_ids=[4, 4, 4], output_ids=[1, 1, 1, 2])
    # token 1: 3 * 0.5 + 1; token 2: 1 * 0.5 + 1; token 4 is only in the prompt
    np.testing.assert_allclose(out, [0.0, -2.5, -1.5, 0.0, 0.0])


def test_negative_presence_penalty_encourages_repeats():
    out = apply_penalties(np.zeros(3, np.float32), SamplingParams(presence_penalty=-2.0), [], [2])
    np.testing.assert_allclose(out, [0.0, 0.0, 2.0])


def test_penalty_changes_greedy_choice():
    x = np.array([1.0, 0.9, 0.0], np.float32)
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(x, params, prompt_ids=[0], output_ids=[], rng=make_rng(0)) == 1


def test_logit_bias_is_added_before_the_penalties_and_steers_greedy_and_sampled_choices():
    """OpenAI's logit_bias (vLLM applies it before the penalties): -100 bans a token, +100 all but forces it."""
    x = np.array([2.0, -2.0, 3.0, -1.0], np.float32)
    out = apply_penalties(x, SamplingParams(logit_bias={"0": 1.0, 3: -1.0}, repetition_penalty=2.0), [0], [])
    np.testing.assert_allclose(out, [1.5, -2.0, 3.0, -2.0])  # token 0: (2 + 1) / 2; token 3 unseen: -1 - 1
    greedy = SamplingParams(temperature=0, logit_bias={2: -100.0})
    assert sample(x, greedy, [], [], make_rng(0)) == 0
    forced = SamplingParams(temperature=1.0, logit_bias={1: 100.0}, seed=3)
    assert {sample(x, forced, [], [], make_rng(i)) for i in range(50)} == {1}


@pytest.mark.parametrize("bias, message", [({"a": 1.0}, "keys must be token ids, got 'a'"),
                                           ({-1: 1.0}, "(>= 0), got -1"), ({5: 100.5}, "in [-100, 100]"),
                                           ({5: float("nan")}, "in [-100, 100]"),
                                           # int() refused these after isdigit() passed them: a 500
                                           ({"--5": 1.0}, "got '--5'"), ({"\u00b2": 1.0}, "got '\u00b2'"),
                                           ({"9" * 5000: 1.0}, "keys must be token ids"),
                                           # int() took these without a word
                                           ({"1_0": 1.0}, "got '1_0'"), ({" 7": 1.0}, "got ' 7'"),
                                           ({"\u0663": 1.0}, "keys must be token ids"),
                                           ({"5": 1.0, "05": -1.0}, "names token 5 twice")])
def test_a_bad_logit_bias_names_what_is_wrong(bias, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(logit_bias=bias)


def test_non_finite_logits_fail_the_request_or_pick_the_infinite_token():
    """A +inf logit makes softmax NaN for the whole row, where a draw would fall back to token 0; a NaN row
    means the model broke, so the request fails rather than answering with token 0."""
    x = np.array([1.0, 2.0, np.inf, 0.5, 3.0], np.float32)
    for params in (SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.9), SamplingParams(temperature=0)):
        rng, twin = make_rng(7), make_rng(7)
        assert sample(x, params, [], [], rng) == 2
        if not params.is_greedy:  # one uniform per step, as every sampled step draws
            twin.random()
            assert rng.random() == twin.random()
    x[4] = np.inf  # two: drawn alike, with penalties (which clip them to float32's largest) or without
    for params in (SamplingParams(), SamplingParams(repetition_penalty=1.1)):
        drawn = [sample(x, params, [0], [], make_rng(seed)) for seed in range(400)]
        assert set(drawn) == {2, 4} and 150 < drawn.count(2) < 250
    x[1] = np.nan
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        with pytest.raises(ValueError, match="NaN logits"):
            sample(x, params, [], [], make_rng(0))


# ---- filters on a handcrafted distribution ----------------------------------------------------------

@pytest.mark.parametrize("top_p, kept", [(0.5, [0]), (0.8, [0, 1]), (0.81, [0, 1, 2]), (0.99, [0, 1, 2, 3]),
                                         (0.1, [0])])
def test_top_p_keeps_the_fewest_tokens_reaching_the_mass(top_p, kept):
    ids, probs = top_p_filter(np.arange(4), HAND_PROBS.astype(np.float32), top_p)
    assert sorted(ids.tolist()) == kept


@pytest.mark.parametrize("min_p, kept", [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (1.0, [0])])
def test_min_p_keeps_tokens_at_least_min_p_of_the_top(min_p, kept):
    ids, _ = min_p_filter(np.arange(4), HAND_PROBS.astype(np.float32), min_p)
    assert sorted(ids.tolist()) == kept


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), HAND_PROBS),
    (SamplingParams(top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingParams(top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (SamplingParams(min_p=0.5), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingParams(top_k=3, top_p=0.6), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingParams(temperature=0.5), HAND_PROBS ** 2 / (HAND_PROBS ** 2).sum()),
])
def test_draw_frequencies_match_the_filtered_distribution(params, expected):
    assert_frequencies(draw_counts(HAND_LOGITS, params, 20_000), np.asarray(expected))


def test_draw_across_blocks_of_a_large_vocabulary():
    # 1000 entries span several of draw's blocks; the zeros (every third entry) must never come up.
    weights = np.where(np.arange(1000) % 3 == 0, 0.0, 1.0 + np.arange(1000) % 7).astype(np.float32)
    rng = make_rng(3)
    counts = np.bincount([draw(weights, rng) for _ in range(20_000)], minlength=1000)
    expected = weights / weights.sum()
    assert np.all(counts[weights == 0] == 0)
    grouped = lambda a: a.reshape(10, 100).sum(axis=1)  # noqa: E731  (per-bin counts are too small to test)
    assert_frequencies(grouped(counts), grouped(expected))


# ---- against a naive reference ----------------------------------------------------------------------

def allowed_tokens(logits: np.ndarray, params: SamplingParams) -> set[int]:
    """The filters written the obvious way: a full sort, then top-k, top-p, min-p in turn."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    if params.top_k:
        order = order[:params.top_k]
    z = logits[order].astype(np.float64) / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    before = np.cumsum(p) - p  # mass of the more probable tokens
    keep = before < params.top_p
    order, p = order[keep], p[keep]
    return set(order[p >= params.min_p * p.max()].tolist())


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.sampled_from([5, 50, 3000]), top_k=st.integers(0, 60),
       top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.9), temperature=st.floats(0.2, 3.0))
def test_sampled_token_is_one_the_reference_allows(seed, n, top_k, top_p, min_p, temperature):
    x = random_logits(seed, n)
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    allowed = allowed_tokens(x, params)
    rng = make_rng(seed)
    for _ in range(5):
        assert sample(x, params, [], [], rng) in allowed


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_on_the_full_vocabulary_matches_a_full_sort(top_p):
    # Peaked and flat logits: the nucleus found by growing partitions equals the full-sort one.
    for x in (random_logits(5) + np.where(np.arange(V) < 10, 12, 0).astype(np.float32), random_logits(6, scale=1)):
        probs = softmax(x)
        ids, _ = top_p_filter(np.arange(V), probs, top_p)
        order = np.argsort(-probs, kind="stable")
        n = int(np.searchsorted(np.cumsum(probs[order], dtype=np.float64), top_p)) + 1
        assert set(ids.tolist()) == set(order[:n].tolist())


# ---- batch ------------------------------------------------------------------------------------------

def test_batch_rows_equal_single_samples():
    logits = np.stack([random_logits(i) for i in range(3)])
    params = [SamplingParams(temperature=0), SamplingParams(top_k=20, seed=1), SamplingParams(top_p=0.5, seed=2)]
    histories = [([1, 2], []), ([3], [4, 4]), ([], [5])]
    batch = sample_batch(logits, params, histories, [make_rng(p.seed) for p in params])
    single = [sample(logits[i], params[i], *histories[i], make_rng(params[i].seed)) for i in range(3)]
    assert batch == single


def test_batch_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="all must match"):
        sample_batch(np.zeros((2, 4), np.float32), [SamplingParams()], [([], [])], [make_rng(0)])


# ---- SamplingParams ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, allowed", [
    ("max_tokens", 0, ">= 1"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.5, "in (0, 1]"),
    ("top_k", -2, ">= 0 (0 or -1 = off)"),
    ("min_p", 1.1, "in [0, 1]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("frequency_penalty", -3, "in [-2, 2]"),
    ("seed", 1 << 64, "[-2**63, 2**64)"),
    ("stop", ["a", "b", "c", "d", "e"], "at most 4"),
    ("stop", ["ok", ""], "non-empty"),
])
def test_invalid_params_name_the_field_and_range(field, value, allowed):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    message = e.value.errors()[0]["msg"]
    assert field in message and allowed in message, message
    assert e.value.errors()[0]["loc"] == (field,)


def test_params_defaults_frozen_and_strict():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.stop) == (256, 1.0, 1.0, 0, 0.0, [])
    with pytest.raises(ValidationError):
        p.temperature = 0.5
    with pytest.raises(ValidationError, match="best_of"):
        SamplingParams(best_of=1)
    assert SamplingParams(stop="###").stop == ["###"]  # OpenAI allows a lone string


def test_a_logit_far_below_the_max_gets_probability_zero_without_a_numpy_warning():
    """A logit pushed to -3e38 (a logit_bias, then a low temperature) overflowed to -inf with numpy's "overflow
    encountered in multiply" printed; its probability is 0 either way."""
    import warnings

    from agent.engine.sampler import softmax

    x = np.array([-3e38, 0.0, 1.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probs = softmax(x, 1e-4)
    assert probs[0] == 0.0 and probs[2] == 1.0
