"""Choose the next token from a row of logits: penalties, then greedy or temperature/top-k/top-p/min-p and a draw.

Pure numpy, no I/O. Each request owns a `np.random.Generator` made by `make_rng(params.seed)` and every
non-greedy step draws exactly one uniform number from it (a constrained step whose first draw was illegal, a
second), so the same seed and the same logits give the same tokens, whatever else is in the batch. Filters run in the order HF transformers applies its warpers
(temperature, top-k, top-p, min-p; vLLM applies min-p before top-k/top-p, so with both set it keeps fewer
tokens, and llama.cpp applies temperature last, so its top-p and min-p see the distribution at
temperature 1), and only on the surviving candidates: top-k uses argpartition, top-p
sorts just the few tokens that hold its probability mass, so a step over a 49k vocabulary stays well
under a millisecond in the common settings.

Example:
    rng = make_rng(params.seed)
    token_id = sample(logits[0], params, prompt_ids, output_ids, rng)
    token_id = sample_constrained(logits[0], params, prompt_ids, output_ids, rng, constraint)  # one it allows
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from agent.engine.logprobs import TokenLogprobs, token_logprobs
from agent.engine.sampling_params import SamplingParams

_TOP_P_FIRST_GUESS = 64  # candidates partitioned out first when looking for top_p's mass; grows x4 on a miss
_DRAW_BLOCK = 256  # entries per block of the two-level draw: ~sqrt(49152) balances the two cumsums
_UINT64 = (1 << 64) - 1
_F32 = np.finfo(np.float32)


def make_rng(seed: int | None) -> np.random.Generator:
    """A request's generator: seeded when seed is given, else fresh OS entropy."""
    # A negative seed is read as its 64-bit two's complement, as a C client's int64 would be.
    return np.random.default_rng(None if seed is None else seed & _UINT64)


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> np.ndarray:
    """logits [V] with the logit bias and the repetition, presence and frequency penalties applied (a copy;
    input untouched)."""
    if not params.adjusts_logits:
        return logits
    x = np.array(logits, dtype=np.float32, copy=True)
    if params.logit_bias:
        ids, biases = params.logit_bias_arrays
        x[ids] += biases
    if params.repetition_penalty != 1:
        # vLLM: every token seen in prompt or output; dividing a positive logit and multiplying a
        # negative one both make the token less likely when the penalty is > 1.
        seen = np.unique(np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)]))
        v = x[seen]
        with np.errstate(over="ignore"):  # clipped below
            x[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if (params.presence_penalty != 0 or params.frequency_penalty != 0) and len(output_ids):
        # OpenAI API: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c over output tokens.
        ids, counts = np.unique(np.asarray(output_ids, np.int64), return_counts=True)
        x[ids] -= (counts * params.frequency_penalty + params.presence_penalty).astype(np.float32)
    # a penalty near 0 divides logits past float32's range: +inf made softmax NaN for the whole row
    return np.clip(x, _F32.min, _F32.max, out=x)


def top_k_candidates(x: np.ndarray, top_k: int) -> np.ndarray:
    """Ids of the top_k largest entries of x [V], unordered; all ids when top_k is 0 (off) or >= V."""
    if top_k == 0 or top_k >= len(x):
        return np.arange(len(x))
    return np.argpartition(x, len(x) - top_k)[len(x) - top_k:]


def softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Probabilities of x [n] / temperature as a new float32 array (float32 exp is SIMD, ~7 digits a term)."""
    e = np.subtract(x, np.max(x), dtype=np.float32)
    with np.errstate(over="ignore"):  # a logit far below the max (a -1e38 bias) scales to -inf: probability 0
        e *= np.float32(1 / temperature)
    np.exp(e, out=e)  # in place: each 49k-entry temporary costs fresh pages
    e /= e.sum(dtype=np.float64)
    return e


def _most_probable_first(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Positions of the most probable entries, descending, covering at least top_p of the mass.

    Partitions out 64, 256, ... entries until they hold top_p, then sorts only those: a peaked
    distribution (the usual case) never pays for sorting the whole vocabulary.
    """
    n, k = len(probs), _TOP_P_FIRST_GUESS
    while k < n:
        head = np.argpartition(probs, n - k)[n - k:]
        if probs[head].sum(dtype=np.float64) >= top_p:
            return head[np.argsort(-probs[head], kind="stable")]
        k *= 4
    return np.argsort(-probs, kind="stable")


def top_p_filter(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The fewest most-probable candidates whose probability reaches top_p (nucleus sampling)."""
    if top_p >= 1:
        return ids, probs
    order = _most_probable_first(probs, top_p)
    cumulative = np.cumsum(probs[order], dtype=np.float64)
    keep = min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, len(order))
    return ids[order[:keep]], probs[order[:keep]]


def min_p_filter(ids: np.ndarray, probs: np.ndarray, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Candidates at least min_p times as probable as the most probable one."""
    if min_p <= 0:
        return ids, probs
    keep = probs >= min_p * probs.max()
    return ids[keep], probs[keep]


def _position(weights: np.ndarray, target: float) -> tuple[int, float]:
    """First position whose cumulative weight exceeds target, and the weight before it.

    Never a position of weight 0, even when rounding puts target past the end.
    """
    cumulative = np.cumsum(weights, dtype=np.float64)
    i = min(int(np.searchsorted(cumulative, target, side="right")), int(np.flatnonzero(weights)[-1]))
    return i, float(cumulative[i - 1]) if i else 0.0


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A position drawn in proportion to probs [n] (need not sum to 1), using exactly one rng.random().

    Two levels: the masses of blocks of _DRAW_BLOCK entries, then a cumulative sum inside the chosen block
    only. One float64 cumsum over a 49k vocabulary costs ~0.5 ms; a float32 one drifts by ~1e-3.
    """
    if not np.isfinite(probs).all() or not (probs > 0).any():
        # nothing left to weigh (every candidate filtered to 0, or NaN logits): the most probable, not a crash
        return int(np.nanargmax(np.where(np.isfinite(probs), probs, -np.inf))) if np.isfinite(probs).any() else 0
    starts = np.arange(0, len(probs), _DRAW_BLOCK)
    # float32 block sums (256 terms: relative error ~1e-5); a float64 copy of probs would cost more than the draw
    block_mass = np.add.reduceat(probs, starts)
    target = rng.random() * block_mass.sum(dtype=np.float64)
    block, mass_before = _position(block_mass, target)
    offset, _ = _position(probs[starts[block]:starts[block] + _DRAW_BLOCK], target - mass_before)
    return int(starts[block]) + offset


class TokenFilter(Protocol):
    """Which tokens may come next (a constrained sequence's matcher, agent.engine.constraint.Constraint)."""

    def allows(self, token: int) -> bool: ...

    def legal_mask(self) -> np.ndarray: ...  # bool [V]


def filtered(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, their probabilities) after temperature, top-k, top-p and min-p; x [V] finite at its max."""
    ids = top_k_candidates(x, params.top_k)
    probs = softmax(x if len(ids) == len(x) else x[ids], params.temperature)
    ids, probs = top_p_filter(ids, probs, params.top_p)
    return min_p_filter(ids, probs, params.min_p)


def sample(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
           rng: np.random.Generator) -> int:
    """The next token id from logits [V] float32."""
    return _choose(apply_penalties(logits, params, prompt_ids, output_ids), params, rng)


def sample_constrained(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                       output_ids: Sequence[int], rng: np.random.Generator, constraint: TokenFilter) -> int:
    """The next token id from logits [V] float32 among those the constraint allows.

    The token is drawn as usual and checked (nanoseconds); only when it is illegal is the mask computed and a
    second token drawn from the candidates restricted to the legal ones (see redraw). Accepting a legal first
    draw and redrawing otherwise gives each legal candidate p(t) + (1 - L) p(t) / L = p(t) / L, L the legal
    mass: exactly the filtered distribution conditioned on legality.
    """
    return sample_with_logprobs(logits, params, prompt_ids, output_ids, rng, constraint)[0]


def sample_with_logprobs(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                         output_ids: Sequence[int], rng: np.random.Generator,
                         constraint: TokenFilter | None = None) -> tuple[int, TokenLogprobs | None]:
    """The token sample (or, given a constraint, sample_constrained) chooses, drawing from rng exactly as they
    do, and its log-probabilities when params.logprobs is set (agent.engine.logprobs), else None."""
    x = apply_penalties(logits, params, prompt_ids, output_ids)
    (token, candidates), legal = _choose_among(x, params, rng), None
    if constraint is not None and not constraint.allows(token):
        legal = constraint.legal_mask()
        token = redraw(x, params, legal, rng, candidates)
    if params.logprobs is None:
        return token, None
    if constraint is not None and legal is None:  # the grammar's mask is part of the distribution drawn from
        legal = constraint.legal_mask()
    return token, token_logprobs(x, token, params, legal)


def _choose(x: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy or a draw from x [V] (penalties applied)."""
    return _choose_among(x, params, rng)[0]


def _choose_among(x: np.ndarray, params: SamplingParams,
                  rng: np.random.Generator) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
    """(_choose's token, the filtered candidates it was drawn from; None when greedy or among +inf logits)."""
    best = int(np.argmax(x))  # ties go to the lowest id; a NaN anywhere is found first, +inf before finite
    if np.isnan(x[best]):  # a broken model or graph: fail this request rather than answer with token 0
        raise ValueError("the model produced NaN logits")
    if params.is_greedy:
        return best, None
    if np.isposinf(x[best]):  # softmax would be NaN (inf - inf); its limit: the +inf tokens alike, one uniform
        infinite = np.flatnonzero(np.isposinf(x))  # as when penalties clip them to float32's largest
        return int(infinite[min(int(rng.random() * len(infinite)), len(infinite) - 1)]), None
    ids, probs = filtered(x, params)
    return int(ids[draw(probs, rng)]), (ids, probs)


def redraw(x: np.ndarray, params: SamplingParams, legal: np.ndarray, rng: np.random.Generator,
           candidates: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """A token from logits x [V] (penalties applied) among the legal ones (bool [V], at least one True).

    Greedy: the most probable legal token. Sampled: the filtered candidates that are legal, or, when no legal
    token survives the filters, the filters applied to the legal tokens alone. candidates: the first draw's
    filtered (ids, probs) of x, which are not computed again.
    """
    masked = np.where(legal, x, -np.inf).astype(np.float32, copy=False)
    # +inf logits: the first draw's candidates were the +inf tokens, none of them legal
    if not params.is_greedy and not np.isposinf(x).any():
        ids, probs = candidates if candidates is not None else filtered(x, params)
        keep = legal[ids]
        if keep.any() and probs[keep].sum() > 0:
            return int(ids[keep][draw(probs[keep], rng)])
    return _choose(masked, params, rng)  # greedy, or no legal token among the candidates: the legal ones alone


def sample_batch(logits: np.ndarray, params_list: Sequence[SamplingParams],
                 histories: Sequence[tuple[Sequence[int], Sequence[int]]],
                 rngs: Sequence[np.random.Generator]) -> list[int]:
    """One token per row of logits [B, V]; histories[i] is row i's (prompt_ids, output_ids).

    Rows are independent (each has its own params and generator), so this is a loop: at edge batch
    sizes the per-row filters cost far less than the model step that produced the logits.
    """
    if not len(logits) == len(params_list) == len(histories) == len(rngs):
        raise ValueError(f"sample_batch: {len(logits)} logit rows, {len(params_list)} params, "
                         f"{len(histories)} histories and {len(rngs)} generators; all must match")
    return [sample(row, p, prompt, output, rng)
            for row, p, (prompt, output), rng in zip(logits, params_list, histories, rngs)]
