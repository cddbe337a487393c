"""One engine step, on the engine thread: take in submitted requests, carry out the scheduler's plan, turn
logits into tokens (sampling, or verifying a draft) and stream them to their requests.

A step runs each prompt chunk the scheduler picked (one-slot view of its pool) and then, per size class, one
decode call over its live slots [0:n] for each LoRA adapter its decoding rows use (the base counting as one),
as llama.cpp does: rows that are not decoding, or decode with another adapter, pass query_seqlens = 0 so they
neither compute into nor change their cache. Only the engine thread calls a Stepper.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING

import numpy as np

from agent.engine.adapters import Adapter
from agent.engine.constraint import ConstraintError
from agent.engine.prefix_cache import PrefixCache
from agent.engine.request import RequestHandle
from agent.engine.logprobs import TokenLogprobs
from agent.engine.sampler import sample_with_logprobs
from agent.engine.scheduler import Scheduler
from agent.engine.sequence import FinishReason, Sequence
from agent.engine.speculative import Speculation
from agent.engine.tokenizer import TextTokenizer

if TYPE_CHECKING:  # handed a runner, never loading one: this module imports without the runtime
    from agent.engine.runner import LoraTensors, ModelRunner

log = logging.getLogger(__name__)


class Stepper:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, prefix: PrefixCache | None, spec: Speculation,
                 tokenizer: TextTokenizer, eos_ids: set[int], inbox: queue.Queue[RequestHandle],
                 adapters: dict[str, Adapter] | None = None):
        self.scheduler, self.runner, self.prefix, self.spec = scheduler, runner, prefix, spec
        self.adapters = adapters or {}
        self.tokenizer, self.eos_ids, self.inbox = tokenizer, eos_ids, inbox
        self.streams: dict[int, RequestHandle] = {}  # the requests taken in whose stream is open
        self.kv_utilization = 0.0

    def fail_running(self, message: str) -> None:
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq, FinishReason.ERROR)
            seq.error = message
            if seq.seq_id in self.streams:
                self._finish_stream(seq)
        # a request the failed step had taken from the inbox, or finished, without ending its stream: its
        # client would wait forever
        waiting = {seq.seq_id for seq in self.scheduler.waiting}
        for handle in [h for k, h in self.streams.items() if k not in waiting]:
            if not handle.seq.is_finished:
                handle.seq.finish(FinishReason.ERROR, message)
            self._finish_stream(handle.seq)

    def end_held(self, message: str) -> None:
        """End every request held (queued, waiting or running) with an error: none is left waiting."""
        self.take_in()
        self.scheduler.waiting.clear()  # their streams end below, with the running ones'
        self.fail_running(message)

    def step(self) -> bool:
        """One scheduling round and model step. Returns False when there was nothing to do."""
        self.take_in()
        for seq in self.scheduler.reap_cancelled():
            self._finish_stream(seq)
        # running sequences that outgrew their slots first: a request admitted now is never preempted unrun
        for seq in self.scheduler.grow():  # preempted: back in the queue, its stream open, its KV to recompute
            log.info("request %d preempted at %d tokens: no larger KV slot free", seq.seq_id, seq.num_tokens)
            self.spec.forget(seq.seq_id)
        for seq in self.scheduler.admit():
            if seq.is_finished:  # cancelled, or waited too long
                self._finish_stream(seq)
            elif self.prefix is not None:
                self._load_prefix(seq)
        plan = self.scheduler.plan()
        self.kv_utilization = self.scheduler.kv.utilization()  # a snapshot any thread may read
        if plan.is_empty:
            return False
        for seq, n in plan.prefills:
            self._prefill(seq, n)
        for idx, seqs in plan.decodes.items():
            self._decode(idx, seqs)
        return True

    def take_in(self) -> None:
        while True:
            try:
                handle = self.inbox.get_nowait()
            except queue.Empty:
                return
            seq = handle.seq
            handle.detok = self.tokenizer.detokenizer(seq.params.stop, seq.prompt_ids)
            self.streams[seq.seq_id] = handle
            self.scheduler.add(seq)

    def _load_prefix(self, seq: Sequence) -> None:
        pool = self.scheduler.pool_of(seq)
        first = seq.preemptions == 0  # a readmission finds its own retired blocks: not a hit for the figures
        n = self.prefix.load(seq.prompt_ids, pool, pool.slot_of(seq.seq_id), count=first, salt=self._salt(seq))
        seq.num_computed = n
        if first:
            seq.cached_prompt_tokens = n
        pool.lengths[seq.seq_id] = n

    def _prefill(self, seq: Sequence, n: int) -> None:
        pool = self.scheduler.pool_of(seq)
        start, is_last = seq.num_computed, n == seq.num_uncomputed  # only the last chunk's logits are sampled
        logits = self.runner.forward_slot(pool, pool.slot_of(seq.seq_id), seq.all_ids[start:start + n], start, is_last,
                                          self._tensors(seq.adapter))
        seq.num_computed += n
        pool.lengths[seq.seq_id] = seq.num_computed
        if seq.num_uncomputed == 0:  # prompt (and any recomputed output) done: sample the next token
            if self.prefix is not None:
                self.prefix.store(seq.seq_id, seq.prompt_ids, self._salt(seq))
            seq.start_decoding()
            try:
                self._accept(seq, *self._sample(seq, logits[0, 0]), time.perf_counter())
            except Exception as e:
                self._fail_one(seq, e)

    def _decode(self, idx: int, seqs: list[Sequence]) -> None:
        """One decode call over the pool's live slots [0:n]: a decoding sequence runs its one uncomputed token
        and its draft, if any ([last, d1..dk])."""
        pool = self.scheduler.kv.classes[idx]
        decoding = {s.seq_id: s for s in seqs}
        t0 = time.perf_counter()
        self.spec.prepare(seqs, pool.capacity)
        plans = {s.seq_id: self.spec.draft_for(s, len(seqs), pool.capacity) for s in seqs}  # (draft, forced)
        drafts = {k: d for k, (d, _) in plans.items()}
        # GQA needs room for the whole padded row in every slot: cached tokens + width <= capacity
        cached = [decoding[o].num_computed if o in decoding else max(pool.lengths[o], 1) for o in pool.owners]
        width = min(1 + max(len(d) for d in drafts.values()), pool.capacity - max(cached))
        drafts = {k: d[:width - 1] for k, d in drafts.items()}
        logits = self._decode_by_adapter(pool, seqs, {s.seq_id: (s.num_computed, [s.output_ids[-1]] + drafts[s.seq_id])
                                                      for s in seqs})
        seconds = time.perf_counter() - t0  # drafting and the model calls: what speculation must pay for
        for s in seqs:  # positions this step wrote: a slot that a finish below moves must carry them along
            pool.lengths[s.seq_id] = s.num_computed + 1 + len(drafts[s.seq_id])
        for s in seqs:
            try:
                self._advance(s, pool, drafts[s.seq_id], logits[s.seq_id], seconds, plans[s.seq_id][1])
            except Exception as e:
                self._fail_one(s, e)

    def _decode_by_adapter(self, pool, seqs: list[Sequence], runs: dict[int, tuple[int, list[int]]]
                           ) -> dict[int, np.ndarray]:
        """One decode call per adapter among seqs -> each sequence's logits [width, V]. A call runs only its
        adapter's rows (the others idle), so a row gets the logits and KV its own adapter gives it."""
        groups: dict[str | None, list[int]] = {}
        for s in seqs:
            groups.setdefault(s.adapter, []).append(s.seq_id)
        rows = {owner: row for row, owner in enumerate(pool.owners)}
        out = {}
        for name, ids in groups.items():
            logits = self.runner.forward_decode(pool, {k: runs[k] for k in ids}, self._tensors(name))
            out.update({k: logits[rows[k]] for k in ids})
        return out

    def _tensors(self, adapter: str | None) -> LoraTensors | None:
        return self.adapters[adapter].tensors if adapter is not None else None

    def _salt(self, seq: Sequence) -> bytes:
        return self.adapters[seq.adapter].prefix_salt if seq.adapter is not None else b""

    def _fail_one(self, seq: Sequence, error: Exception) -> None:
        """End one request whose sampling or streaming failed, and only it: the others in the step are fine
        (a penalty that overflows one request's logits ends that request, not every one in flight; so does a
        grammar that reaches a dead end, whose message the client gets)."""
        if isinstance(error, ConstraintError):
            log.warning("request %d ended: %s", seq.seq_id, error)
        else:
            log.error("request %d failed; ending it with an error", seq.seq_id, exc_info=error)
        if seq in self.scheduler.running:
            self.scheduler.finish(seq, FinishReason.ERROR)
        seq.finish(FinishReason.ERROR, str(error) if isinstance(error, ConstraintError) else "internal error")
        if seq.seq_id in self.streams:
            self._finish_stream(seq)

    def _advance(self, seq: Sequence, pool, draft: list[int], logits: np.ndarray, seconds: float,
                 forced: bool = False) -> None:
        """Account for the tokens the step computed and append what verification accepted."""
        if draft:
            tokens, logprobs = self.spec.verified(seq, draft, logits, seconds, forced)
        else:
            token, lp = self._sample(seq, logits[0])
            tokens, logprobs = [token], [lp]
            seq.draft_length.observe_plain(seconds, token)
        seq.num_computed += len(tokens)  # the last token + the accepted drafts now have valid KV
        self.spec.computed(seq)
        pool.lengths[seq.seq_id] = seq.num_computed
        now = time.perf_counter()  # the step's tokens reach the client together
        for t, lp in zip(tokens, logprobs):
            self._accept(seq, t, lp, now)
            if seq.is_finished:
                return

    def _sample(self, seq: Sequence, logits: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        """The next token from logits [V] and, when the request asks, its log-probabilities."""
        return sample_with_logprobs(logits, seq.params, seq.prompt_ids, seq.output_ids, seq.rng, seq.constraint)

    def _accept(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, now: float) -> None:
        """Append a sampled token, stream its text (with its log-probabilities), and finish the request if it is
        done."""
        if seq.constraint is not None:
            seq.constraint.accept(token)
        seq.append_token(token, now)
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        stopped = self.streams[seq.seq_id].add_token(token, is_eos, logprobs)
        reason = None
        if stopped or is_eos:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= seq.max_total_tokens:
            reason = FinishReason.LENGTH
        if reason:
            self.scheduler.finish(seq, reason)
            self._finish_stream(seq)

    def _finish_stream(self, seq: Sequence) -> None:
        self.spec.finished(seq)
        self.streams.pop(seq.seq_id).finish()
