"""Speculative decoding: propose a few tokens cheaply, verify them in one model step, keep what the model
would have produced anyway.

Drafts come from prompt lookup (the continuation of the longest recent n-gram that already occurred in
the prompt or output) or from a draft model. The target runs [last token, d1..dk] in one pass (k+1
query rows on top of the cache); rejected positions are simply overwritten by the next step.

Acceptance keeps the output exactly what plain decoding would give: the same tokens for a greedy request,
the target's distribution for a sampled one.

Prompt lookup's drafts, and a draft model's for a greedy request, are one token per position (q is
one-hot). There the target samples its own token exactly as plain decoding does (argmax, or one draw from
the request's generator) and the draft token is accepted when it is that token: accepted with probability
p(d), else the output is p's draw given it is not d, the speculative-sampling rule of Leviathan et al. and
Chen et al. (2023) for a one-hot q. Drawing it this way uses the generator exactly as plain decoding would
(once per emitted token), so a seeded request gives the same text with or without speculation and whatever
else is in the batch, up to rounding.

For a sampled request a draft model draws each token from its own distribution q (the request's
temperature and filters over the draft's logits, from a generator of its own spawned from the request's),
and the target accepts d with probability min(1, p(d)/q(d)), else emits a draw from the residual
max(0, p - q) renormalized: the general rule, whose output follows p whatever q is, and which accepts
sum(min(p, q)) of the time where the one-hot rule accepts p(argmax q). A seeded request then gives the
same text for the same steps (drafts and batch), but not the text plain decoding gives.

Up to rounding: the target's logits for a position verified in a k+1-row step (or decoded in a step padded
to a neighbour's drafts) differ from a one-row step's in the last bits (ONNX Runtime rounds the two widths
apart, ~1e-5 in fp32), so at a near-tie the token can differ, as it can after vLLM's speculative decoding.
On INT4/INT8 bundles the rows' activations are quantized apart too, and the difference is larger. A request
that asks for log-probabilities keeps speculating: each emitted token's come from the verify row it was
sampled from.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from agent.engine.logprobs import TokenLogprobs, token_logprobs
from agent.engine.sampler import apply_penalties, draw, filtered, sample_with_logprobs
from agent.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the draft model runs the runtime; a sequence holds this module's controllers
    from agent.config import EngineConfig
    from agent.engine.draft import DraftModel
    from agent.engine.sequence import Sequence as Request


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
    """A draft model's draft length: the k that gives the most tokens per second from measured acceptance and
    measured costs, and speculation turned off while it does not pay (prompt lookup has LookupLength).

    A k-token draft emits 1 + p + ... + p^k tokens (each draft token accepted with probability p, the first
    rejection ending the run) for one plain step plus k draft tokens (`draft_cost` of a plain step each) and k
    extra verify rows (`row_cost` each), so k is the one that maximizes their ratio. On a CPU whose int8 matmul
    kernels are compute-bound an extra row is not free (Qwen2.5-Coder 1.5B INT4: ~0.2 of a step a row, a 0.5B
    draft token ~0.25-0.35; bench/draft_cost.py), so this k is short where acceptance alone would pick the
    longest. All three figures are measured as it runs. A probe drafts at least one token a step for its first
    PROBE_STEPS steps; after them, when no k beats a plain step, or speculating measures slower per emitted
    token than plain steps, it pauses, for twice as long each time it fails again (plain
    steps refresh the plain figure), and probes again with the prior.
    """

    k_max: int = 5
    hits: float = 1.5  # draft tokens accepted and rejected, decayed by DECAY a token: a prior p of 0.6
    misses: float = 1.0
    draft_cost: float = 0.3  # a draft token's seconds over a plain step's (moving average)
    row_cost: float = 0.25  # an extra verify row's
    pause_steps: int = 3  # the first steps run plain: their cost is the yardstick
    spec_cost: float | None = None  # moving averages of seconds per emitted token
    plain_cost: float | None = None
    spec_steps: int = 0  # speculative steps since the last pause
    backoff: int = 16  # the next pause's length
    draft_s: float = 0.0  # the last draft's seconds, part of the verify step's measured time
    catch_up_s: float = 0.0  # the last draft's prefill of a new prompt, left out of every cost

    DECAY = 0.8
    PROBE_STEPS = 4  # a probe drafts this many steps before its figures may stop it

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def best_k(self) -> int:
        return best_draft_length(self.acceptance, self.draft_cost + self.row_cost, self.k_max)

    def current(self) -> int:
        if self.pause_steps > 0:
            self.pause_steps -= 1
            return 0
        k = self.best_k()
        if self.spec_steps < self.PROBE_STEPS:  # too few measurements to judge by yet
            return max(k, 1)
        if k == 0:
            self._pause()
            return self.current()  # this step is the pause's first
        return k

    def observe_plain(self, seconds: float, token: int | None = None) -> None:
        """A plain step took `seconds` (the token it produced matters to LookupLength only)."""
        self.plain_cost = _ema(self.plain_cost, seconds)

    def observe_draft(self, seconds: float, k: int, catch_up: float = 0.0) -> None:
        """Drafting k tokens took `seconds`, `catch_up` of them the draft's prefill of a new prompt (paid once:
        neither a draft token's cost nor the verify step's)."""
        self.draft_s, self.catch_up_s = seconds - catch_up, catch_up
        if self.plain_cost:
            self.draft_cost = _ema(self.draft_cost, min(self.draft_s / k / self.plain_cost, 2.0))

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A verify step of `drafted` tokens that took `seconds`, its draft included, accepted `accepted`."""
        if drafted == 0:
            return
        decay = self.DECAY ** (accepted + int(accepted < drafted))  # per token checked
        self.hits = decay * self.hits + accepted
        self.misses = decay * self.misses + int(accepted < drafted)
        self.spec_steps += 1
        if seconds is not None:
            seconds, self.catch_up_s = seconds - self.catch_up_s, 0.0
            self.spec_cost = _ema(self.spec_cost, seconds / (accepted + 1))
            if self.plain_cost:
                extra = ((seconds - self.draft_s) / self.plain_cost - 1) / drafted
                self.row_cost = _ema(self.row_cost, min(max(extra, 0.02), 2.0))
        slower = (self.spec_steps >= self.PROBE_STEPS and self.spec_cost is not None and self.plain_cost is not None
                  and self.spec_cost > self.plain_cost)
        if slower:
            self._pause()
        elif self.spec_steps >= self.PROBE_STEPS and self.plain_cost is not None:
            self.backoff = 16  # it pays: the next failure rests briefly again

    def _pause(self) -> None:
        """Rest, then probe from the prior acceptance (the costs measured stay)."""
        self.pause_steps, self.backoff = self.backoff, min(2 * self.backoff, 256)
        self.hits, self.misses = DraftLength.hits, DraftLength.misses
        self.spec_cost, self.spec_steps = None, 0


def best_draft_length(p: float, cost: float, k_max: int) -> int:
    """The k in 0..k_max that maximizes the tokens a step emits, 1 + p + ... + p^k, over its cost, 1 + k * cost
    plain steps (0: a plain step, when no draft beats it)."""
    best, best_gain, emitted = 0, 1.0, 1.0
    for k in range(1, k_max + 1):
        emitted += p ** k
        gain = emitted / (1 + k * cost)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def next_draft_length(mode: str, last_backoff: int | None) -> DraftLength | LookupLength:
    """A new sequence's controller for its speculative mode. A draft model's starts from what the engine's
    previous sequence in that mode learned: when speculation kept failing there (a long backoff), the new
    sequence starts paused for half that long, since each probe costs and a draft model's first probe also
    catches up on the whole prompt, so a mode that does not pay on this machine stays off across requests
    instead of being relearned by each one. Prompt lookup's probes cost nothing (LookupLength)."""
    if mode == "ngram":
        return LookupLength()
    if not last_backoff or last_backoff <= DraftLength.backoff:
        return DraftLength()
    return DraftLength(pause_steps=last_backoff // 2, backoff=last_backoff)


def learned_backoff(dl: DraftLength, drafted: bool) -> int:
    """What a finished sequence hands to the next one: its backoff, halved if it never drafted (so that a
    run of short requests, each ending inside its pause, still lets speculation be tried again)."""
    return dl.backoff if drafted else max(DraftLength.backoff, dl.backoff // 2)


@dataclass
class LookupLength:
    """Prompt lookup's draft length, chosen at each step for the most tokens per second it can expect.

    A lookup draft costs nothing to make, only to verify: each extra row of a verify step costs `row_cost`
    of a plain step (measured as it runs; INT4 SmolLM2 with a 500-token past, one row 6.4 ms, two 8.2, six
    13.5: ~0.27). If each draft token is accepted with probability p, a k-token draft emits
    1 + p + ... + p^k tokens in 1 + k * row_cost plain steps' time, so k is the one that maximizes that
    ratio, and 0 (a plain step) when none beats 1. While it does not draft it still looks the draft up and
    checks its first token against what the model produced, so p follows the text for free and drafting
    resumes as soon as the output quotes its source again. (DraftLength's pauses, which double, kept prompt
    lookup off for up to 64 steps of a quote after one reworded sentence: bench/speculative.py's quotes, INT4,
    1.21x against 1.57x with this controller; docs/benchmarks.md.)
    """

    k_max: int = 8
    hits: float = 1.0  # draft tokens accepted and rejected, decayed by DECAY a token: a prior p of 0.5
    misses: float = 1.0
    row_cost: float = 0.25  # an extra row's seconds over a plain step's (moving average)
    plain_s: float | None = None  # a plain step's seconds (moving average)
    shadow: int | None = None  # the token a 1-token lookup proposed for a plain step, checked after it

    DECAY = 0.8  # p follows the last ~5 tokens checked: a quote is left, and picked up again, within a few

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def best_k(self) -> int:
        return best_draft_length(self.acceptance, self.row_cost, self.k_max)

    def propose(self, ids: Sequence[int], room: int) -> list[int]:
        """This step's draft (at most `room` tokens), or [] for a plain step."""
        k = min(self.best_k(), room)
        if k > 0:
            return ngram_draft(ids, k)
        shadow = ngram_draft(ids, 1) if room > 0 else []
        self.shadow = shadow[0] if shadow else None
        return []

    def observe_plain(self, seconds: float, token: int | None = None) -> None:
        self.plain_s = _ema(self.plain_s, seconds)
        if self.shadow is not None and token is not None:
            self._observe(int(token == self.shadow), int(token != self.shadow))
        self.shadow = None

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A verify step: `accepted` of `drafted` tokens, the first rejection (if any) ending the run."""
        if drafted == 0:
            return
        self._observe(accepted, int(accepted < drafted))
        if seconds is not None and self.plain_s:
            extra = (seconds / self.plain_s - 1) / drafted
            self.row_cost = _ema(self.row_cost, min(max(extra, 0.02), 2.0))

    def _observe(self, hits: int, misses: int) -> None:
        decay = self.DECAY ** (hits + misses)  # per token seen, however many one step saw
        self.hits = decay * self.hits + hits
        self.misses = decay * self.misses + misses


def _room(seq: Request, capacity: int) -> int:
    """Tokens a step may verify beyond the one it samples: within max_tokens, the context and the slot."""
    return min(seq.params.max_tokens - len(seq.output_ids), min(seq.max_total_tokens, capacity) - seq.num_tokens) - 1


def _ema(old: float | None, new: float) -> float:
    return new if old is None else 0.7 * old + 0.3 * new


Proposal = tuple[np.ndarray, np.ndarray]  # a sampled draft token's q: (candidate ids, their probabilities)


def verify(draft: list[int], logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
           output_ids: Sequence[int], rng: np.random.Generator,
           logprobs: list[TokenLogprobs | None] | None = None, constraint=None,
           q: Sequence[Proposal | None] | None = None) -> list[int]:
    """The tokens to append: the accepted prefix of the draft plus one token from the target.

    logits [len(draft) + 1, V]: row i predicts the token after draft[:i]. logprobs: when given, each returned
    token's log-probabilities (None unless params.logprobs is set) are appended to it, from the same row.
    constraint: a grammar's matcher (agent.engine.constraint.Constraint): each position draws as constrained
    decoding does there, the matcher advanced past the draft tokens accepted before it, so the output is exactly
    what plain constrained decoding gives; a draft the grammar forces is accepted whole. The matcher is left as
    it was: the step accepts the tokens it appends.
    q: the distribution each draft token was drawn from (None at a position drafted greedily): such a position is
    verified by the p/q rule (module docstring), the others by the one-hot rule.
    """
    out: list[int] = []
    history = list(output_ids)
    consumed = 0
    try:
        for i in range(len(draft) + 1):
            proposal = q[i] if q is not None and i < len(draft) and constraint is None else None
            if proposal is not None and not params.is_greedy:
                token, lp = _accept_or_resample(logits[i], params, prompt_ids, history, rng, draft[i], proposal)
            else:  # what plain decoding gives here
                token, lp = sample_with_logprobs(logits[i], params, prompt_ids, history, rng, constraint)
            out.append(token)
            history.append(token)
            if logprobs is not None:
                logprobs.append(lp)
            if i == len(draft) or token != draft[i]:
                return out
            if constraint is not None:  # never an end id: drafts are cut before one (Constraint.legal_prefix)
                constraint.accept(token)
                consumed += 1
        return out
    finally:
        if constraint is not None:
            constraint.rollback(consumed)


def _accept_or_resample(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                        history: Sequence[int], rng: np.random.Generator, d: int,
                        proposal: Proposal) -> tuple[int, TokenLogprobs | None]:
    """d, accepted with probability min(1, p(d)/q(d)), else a draw from max(0, p - q): a token distributed as p,
    the target's distribution after penalties and filters (a row p cannot be formed from, NaN or +inf logits,
    is left to the one-hot rule, which handles it as plain decoding does)."""
    x = apply_penalties(logits, params, prompt_ids, history)
    if not np.isfinite(x.max()):
        return sample_with_logprobs(logits, params, prompt_ids, history, rng)
    ids, p = filtered(x, params)
    q_ids, q_probs = proposal
    q_d = float(q_probs[q_ids == d].sum())  # > 0: d was drawn from q
    if rng.random() * q_d < float(p[ids == d].sum()):
        token = d
    else:
        q_dense = np.zeros(len(x), np.float32)
        q_dense[q_ids] = q_probs
        residual = np.maximum(p - q_dense[ids], 0)
        token = int(ids[draw(residual if residual.sum() > 0 else p, rng)])
    return token, None if params.logprobs is None else token_logprobs(x, token, params)


def greedy(row: np.ndarray) -> int:
    """The draft model's choice for a greedy request: the argmax of its logits."""
    return int(row.argmax())


def sampled_chooser(params: SamplingParams, rng: np.random.Generator, proposals: list[Proposal]):
    """The draft model's choice for a sampled request: a draw from q, the draft's logits under the request's
    temperature and filters, each q appended to proposals. No penalties: any q keeps the output exact (they
    would only bring q nearer p), and a draft head narrower than the vocabulary could not index them."""
    def choose(row: np.ndarray) -> int:
        ids, probs = filtered(row, params)
        proposals.append((ids, probs))
        return int(ids[draw(probs, rng)])
    return choose


@dataclass
class Speculation:
    """The engine's speculative decoding: each request's mode and draft-length controller, its drafts, the
    accounting of a verify step, and what a finished request's controller hands to the next in its mode.

    `config` is the engine's current config, replaced whole by Engine.update_settings (live settings change
    `speculative` and `speculative_max_batch`); a value, not a callback into the engine, so that a dropped
    engine is freed at once rather than kept by a reference cycle until the next garbage collection.
    The engine thread calls everything but start(), which submit() calls.
    """

    config: EngineConfig
    draft: DraftModel | None = None
    backoff: dict[str, int] = field(default_factory=dict)  # mode -> the last finished sequence's backoff
    proposals: dict[int, list[Proposal]] = field(default_factory=dict)  # seq id -> its sampled draft's q's
    prepared: dict[int, list[int]] = field(default_factory=dict)  # this step's drafts made by prepare()
    costs: tuple[float, float, float] | None = None  # the last draft controller's plain step, draft token, row

    def mode_of(self, seq: Request) -> str:
        return seq.params.speculative or self.config.speculative

    def start(self, seq: Request) -> None:
        """Give a new sequence its mode's controller (see next_draft_length)."""
        mode = self.mode_of(seq)
        seq.draft_length = dl = next_draft_length(mode, self.backoff.get(mode))
        if isinstance(dl, DraftLength) and self.costs is not None:
            # the engine already measured this model's steps: no plain steps just to learn them again
            dl.plain_cost, dl.draft_cost, dl.row_cost = self.costs
            if dl.pause_steps == DraftLength.pause_steps:
                dl.pause_steps = 0

    def draft_for(self, seq: Request, batch: int, capacity: int) -> tuple[list[int], bool]:
        """(tokens to verify this step, whether the grammar forces them). A constrained sequence's draft is the
        tokens its grammar forces, else the speculative draft cut at its first illegal token."""
        if seq.constraint is None:
            return self.propose(seq, batch, capacity), False
        # like drafts, forced tokens widen every row of the step: only in a batch small enough for drafts
        forced = seq.constraint.forced_tokens(_room(seq, capacity)) if batch <= self.config.speculative_max_batch else []
        if forced:
            return forced, True
        return seq.constraint.legal_prefix(self.propose(seq, batch, capacity)), False

    def propose(self, seq: Request, batch: int, capacity: int) -> list[int]:
        """This step's draft (prompt lookup's or the draft model's), or [] when speculation is off, paused or not
        worth it. capacity: the tokens seq's slot holds (a draft model writes its tokens into its own slot)."""
        mode = self.mode_of(seq)
        if mode == "off" or batch > self.config.speculative_max_batch:
            return []
        room = _room(seq, capacity)
        if mode == "ngram":
            return seq.draft_length.propose(seq.all_ids, room)
        if seq.seq_id in self.prepared:  # prepare() consulted its controller and drafted this step
            return self.prepared.pop(seq.seq_id)
        if seq.draft_behind:
            # It decoded in a batch too large to draft: to draft again the draft model would first have to prefill
            # its whole context, which the rest of an answer does not repay
            return []
        k = min(seq.draft_length.current(), room)
        if k <= 0 or self.draft is None:
            return []
        t0 = time.perf_counter()
        draft = self.draft.propose(seq.seq_id, seq.all_ids, k, self._chooser(seq))
        seq.draft_length.observe_draft(time.perf_counter() - t0, k, self.draft.catch_up_s)
        return draft

    def prepare(self, seqs: list[Request], capacity: int) -> None:
        """Draft at once for a decode step's sequences that draft from the draft model without a grammar: one
        draft-model call per draft position for all of them (DraftModel.propose_many), each charged the whole
        drafting time, which is what its draft alone would have cost. propose() hands each its draft."""
        self.prepared.clear()
        if self.draft is None:
            return
        if len(seqs) > self.config.speculative_max_batch:
            for seq in seqs:  # the draft does not follow them now: see propose()
                seq.draft_behind = True
            return
        wants = {}
        for seq in seqs:
            if self.mode_of(seq) == "draft" and seq.constraint is None and not seq.draft_behind:
                k = min(seq.draft_length.current(), _room(seq, capacity))
                self.prepared[seq.seq_id] = []
                if k > 0:
                    wants[seq.seq_id] = (seq.all_ids, k, self._chooser(seq))
        if not wants:
            return
        t0 = time.perf_counter()
        self.prepared |= self.draft.propose_many(wants)
        seconds = time.perf_counter() - t0
        for seq_id, (_, k, _) in wants.items():
            next(s for s in seqs if s.seq_id == seq_id).draft_length.observe_draft(seconds, k, self.draft.catch_up_s)

    def _chooser(self, seq: Request):
        """How the draft model picks seq's tokens: greedy for a greedy or constrained request (the one-hot rule
        verifies it: a grammar cuts drafts), else a draw from q, kept for verify's p/q rule."""
        if seq.params.is_greedy or seq.constraint is not None:
            return greedy
        if seq.draft_rng is None:  # its own stream: the request's draws stay one per emitted token
            seq.draft_rng = seq.rng.spawn(1)[0]
        proposals = self.proposals[seq.seq_id] = []
        return sampled_chooser(seq.params, seq.draft_rng, proposals)

    def verified(self, seq: Request, draft: list[int], logits: np.ndarray, seconds: float,
                 forced: bool = False) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens a verify step that took `seconds` gives (see verify) and their log-probabilities, counted
        in seq's figures and controller (forced tokens are the grammar's, not a draft's: not counted there).
        logits [len(draft) + 1, V]."""
        logprobs: list[TokenLogprobs | None] = []
        tokens = verify(draft, logits, seq.params, seq.prompt_ids, seq.output_ids, seq.rng, logprobs, seq.constraint,
                        self.proposals.pop(seq.seq_id, None))
        accepted = len(tokens) - 1
        if forced:
            seq.forced_tokens += accepted
            return tokens, logprobs
        seq.drafted_tokens += len(draft)
        seq.accepted_tokens += accepted
        seq.draft_length.update(len(draft), accepted, seconds)
        return tokens, logprobs

    def computed(self, seq: Request) -> None:
        """After a step: the draft model's cache matches seq for its computed tokens only."""
        if self.draft is not None:
            self.draft.accepted(seq.seq_id, seq.num_computed)

    def forget(self, seq_id: int) -> None:
        """seq_id left its slot (finished or preempted): the draft model's cache of it is gone."""
        self.proposals.pop(seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq_id)

    def finished(self, seq: Request) -> None:
        self.forget(seq.seq_id)
        if seq.num_computed > len(seq.prompt_ids) and isinstance(seq.draft_length, DraftLength):
            # it decoded: what it learned about a draft model's speculation counts
            dl = seq.draft_length
            self.backoff[self.mode_of(seq)] = learned_backoff(dl, seq.drafted_tokens > 0)
            if dl.plain_cost is not None and seq.drafted_tokens > 0:
                self.costs = (dl.plain_cost, dl.draft_cost, dl.row_cost)
