"""Speculative decoding: propose a few tokens cheaply, verify them in one model step, keep what the model
would have produced anyway.

Drafts come from prompt lookup (the continuation of the longest recent n-gram that already occurred in
the prompt or output) or from a draft model. The target runs [last token, d1..dk] in one pass (k+1
query rows on top of the cache); rejected positions are simply overwritten by the next step.

Acceptance keeps the output exactly what plain decoding would give. Both kinds of draft are one token per
position (prompt lookup, and the draft model's greedy choice: q is one-hot), so at each position the target
samples its own token exactly as plain decoding does (argmax, or one draw from the request's generator)
and the draft token is accepted when it is that token. A draft token is thus accepted with probability
p(d), else the output is p's draw given it is not d: the speculative-sampling rule of Leviathan et al. and
Chen et al. (2023) for a one-hot q. Drawing it this way uses the generator exactly as plain decoding would,
so a seeded request gives the same text with or without speculation and whatever else is in the batch
(found in review: the accept-then-residual form drew a varying number of times), up to rounding: the
target's logits for a position verified in a k+1-row step (or decoded in a step padded to a neighbour's
drafts) differ from a one-row step's in the last bits (ONNX Runtime rounds the two widths apart, ~1e-5 in
fp32), so at a near-tie the token can differ, as it can after vLLM's speculative decoding. On INT4/INT8
bundles the rows' activations are quantized apart too, and the difference is larger.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agent.sampler import sample
from agent.sampling_params import SamplingParams


def ngram_draft(ids: Sequence[int], k: int, max_ngram: int = 4, min_ngram: int = 2, window: int = 4096) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of ids' longest suffix n-gram."""
    if k <= 0:
        return []
    arr = np.asarray(ids[-window:], np.int64)
    n_total = len(arr)
    for n in range(min(max_ngram, n_total - 1), min_ngram - 1, -1):
        suffix = arr[n_total - n:]
        # candidate starts whose n-gram equals the suffix, excluding the suffix itself
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(arr[:-1], n) == suffix, axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return arr[follow:follow + k].tolist()
    return []


@dataclass
class DraftLength:
    """Adapts k to the acceptance rate, and turns speculation off while it does not pay.

    A verify step costs more than a plain decode step (k+1 rows through the model, plus the draft model's
    own steps), so speculation only pays while enough of each draft is accepted. Acceptance alone cannot
    tell: a draft model nearly as slow as the target loses even when most of its tokens are accepted. So
    the seconds per emitted token are measured both ways, and when speculating is the slower of the two
    it pauses, for twice as long each time it fails again (plain steps refresh the plain figure).
    """

    k_max: int = 5
    k: int = 3
    acceptance: float = 0.6  # exponential moving average of accepted / drafted
    pause_steps: int = 3  # the first steps run plain: their cost is the yardstick
    spec_cost: float | None = None  # moving averages of seconds per emitted token
    plain_cost: float | None = None
    spec_steps: int = 0  # speculative steps since the last pause
    backoff: int = 16  # the next pause's length

    def current(self) -> int:
        if self.pause_steps > 0:
            self.pause_steps -= 1
            return 0
        return self.k

    def observe_plain(self, seconds: float) -> None:
        self.plain_cost = _ema(self.plain_cost, seconds)

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        if drafted == 0:
            return
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / drafted)
        self.spec_steps += 1
        if seconds is not None:
            self.spec_cost = _ema(self.spec_cost, seconds / (accepted + 1))
        slower = (self.spec_steps >= 4 and self.spec_cost is not None and self.plain_cost is not None
                  and self.spec_cost > self.plain_cost)
        if self.acceptance < 0.25 or slower:
            self._pause()
            return
        if self.spec_steps >= 4 and self.plain_cost is not None:
            self.backoff = 16  # it pays: the next failure rests briefly again
        self.k = max(1, min(self.k_max, round(1 + self.acceptance * self.k_max)))

    def _pause(self) -> None:
        """Rest, then probe with short drafts."""
        self.pause_steps, self.backoff = self.backoff, min(2 * self.backoff, 256)
        self.k, self.acceptance, self.spec_cost, self.spec_steps = 2, 0.5, None, 0


def next_draft_length(last_backoff: int | None) -> DraftLength:
    """A new sequence's controller, starting from what the engine's previous one in the same mode learned.

    When speculation kept failing there (a long backoff), the new sequence starts paused for half that
    long: each probe costs, and a draft model's first probe also catches up on the whole prompt, so a mode
    that does not pay on this machine stays off across requests instead of being relearned by each one.
    """
    if not last_backoff or last_backoff <= DraftLength.backoff:
        return DraftLength()
    return DraftLength(pause_steps=last_backoff // 2, backoff=last_backoff)


def learned_backoff(dl: DraftLength, drafted: bool) -> int:
    """What a finished sequence hands to the next one: its backoff, halved if it never drafted (so that a
    run of short requests, each ending inside its pause, still lets speculation be tried again)."""
    return dl.backoff if drafted else max(DraftLength.backoff, dl.backoff // 2)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else 0.7 * old + 0.3 * new


def verify(draft: list[int], logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
           output_ids: Sequence[int], rng: np.random.Generator) -> list[int]:
    """The tokens to append: the accepted prefix of the draft plus one token from the target.

    logits [len(draft) + 1, V]: row i predicts the token after draft[:i].
    """
    out: list[int] = []
    history = list(output_ids)
    for i, d in enumerate(draft):
        token = sample(logits[i], params, prompt_ids, history, rng)  # what plain decoding gives here
        out.append(token)
        history.append(token)
        if token != d:
            return out
    out.append(sample(logits[len(draft)], params, prompt_ids, history, rng))
    return out
