"""The generation loop: requests in, tokens out, one batched model step at a time.

Only the engine thread touches the scheduler, the KV pool and the runner. Other threads call `submit()`
(thread-safe) and read their request's event queue; `cancel()` only sets a flag the loop acts on at its
next step. A step runs each prompt chunk the scheduler picked (one-slot view of its pool) and then one
decode call per size class over its live slots [0:n], rows that are not decoding passing
query_seqlens = 0 so they neither compute into nor change their cache.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from agent.config import EngineConfig
from agent.engine.bundle import Bundle
from agent.engine.draft import DraftModel
from agent.engine.kv_cache import KVPool
from agent.engine.memory import MB, MemoryBudgetError, kv_bytes_per_token, plan_kv
from agent.engine.prefix_cache import PrefixCache
from agent.engine.request import Finished, RequestError, RequestHandle
from agent.engine.runner import open_runner
from agent.engine.sampler import make_rng, sample
from agent.engine.sampling_params import SamplingParams
from agent.engine.scheduler import Scheduler, attention_tokens
from agent.engine.sequence import FinishReason, Sequence, Status
from agent.engine.speculative import Speculation
from agent.engine.tokenizer import TextTokenizer
from agent.process import peak_rss_bytes, reset_peak_rss

log = logging.getLogger(__name__)
# spin_wait "auto" is re-measured at the first idle moment this many seconds after the last measurement
# (0.25 s each; a rebuild, ~1-2 s, only when the answer changes)
SPIN_RECHECK_S = 600.0
MAX_FAILED_STEPS = 3  # steps in a row that raise before the engine stops (the watchdog then restarts it)


class Engine:
    def __init__(self, bundle: Bundle, config: EngineConfig = EngineConfig(), draft: Bundle | None = None,
                 heartbeat: Callable[[], None] | None = None, idle_wait_s: float = 0.5):
        self.bundle, self.config = bundle, config
        # called by the loop itself every iteration (busy or idle): a watchdog fed from here stops being fed
        # when the loop is stuck, which a free-running timer would not notice
        self.heartbeat = heartbeat or (lambda: None)
        c = bundle.config
        self.tokenizer = TextTokenizer(bundle.tokenizer_json(), c)
        self.eos_ids = set(c.eos_token_ids)
        reset_peak_rss()
        self.runner = open_runner(bundle, config.threads, config.spin_wait, config.kv_dtype)
        self.draft = self._load_draft(draft)
        if config.speculative == "draft" and self.draft is None:  # refused: it would quietly run prompt lookup
            raise ValueError("speculative = 'draft' needs a draft model (generate --draft-model); without one use "
                             "'ngram' or 'off'")
        self.spec = Speculation(lambda: self.config, self.draft)
        self.max_context = config.sequence_limit(c.context_length)
        self.kv = self._plan_kv()
        self.max_prompt_tokens = self.kv.max_capacity - 1  # the largest slot, with one generated token
        self.scheduler = Scheduler(self.kv, config.prefill_chunk_tokens, config.max_queue_wait_s,
                                   self.prefix.retire if self.prefix is not None else None, attention_tokens(c))
        self.streams: dict[int, RequestHandle] = {}
        self._inbox: queue.Queue[RequestHandle] = queue.Queue()
        self._settings: queue.Queue[EngineConfig] = queue.Queue()  # configs for the engine thread to apply
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()  # a request is either queued before stop() or refused after it
        self._kv_utilization = 0.0
        self._wake_interval_s = idle_wait_s  # idle loop period: also the heartbeat's period when there is no work
        self._thread: threading.Thread | None = None
        self._spin_checked = time.monotonic()

    def _load_draft(self, draft: Bundle | None) -> DraftModel | None:
        if draft is None:
            return None
        if draft.tokenizer_json() != self.bundle.tokenizer_json():
            raise RequestError(f"draft model {draft.manifest.name}@{draft.manifest.version} has another tokenizer "
                               f"than {self.bundle.manifest.name}; speculative decoding needs the same one")
        return DraftModel(draft, self.config.threads, self.config.prefill_chunk_tokens)

    # ---- memory ----
    def _plan_kv(self) -> KVPool:
        """Measure what the model costs with its largest step, then give the rest of the budget to KV."""
        c = self.bundle.config
        dtype = self.runner.kv_dtype
        # the prefix store holds the target's KV only; a slot's token costs the draft's mirror too
        store_per_token = per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype.itemsize)
        if self.draft is not None:  # the draft's cache mirrors every slot, so a token costs both
            d = self.draft.bundle.config
            per_token += kv_bytes_per_token(d.num_layers, d.num_kv_heads, d.head_dim,
                                            self.draft.runner.kv_dtype.itemsize)
        self.runner.warm_up(self.config.prefill_chunk_tokens, self.max_context)
        if self.draft is not None:  # its catch-up runs in the same chunks
            self.draft.runner.warm_up(self.config.prefill_chunk_tokens, self.max_context)
        self.baseline_bytes = int(peak_rss_bytes() * 1.05)  # 5% headroom for allocator slack
        m = self.bundle.manifest
        plan = plan_kv(self.config, c.context_length, self.baseline_bytes, per_token, store_per_token,
                       f"{m.name}@{m.version}" if m is not None else str(self.bundle.path))
        try:
            pool = KVPool(plan.classes, c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        except (MemoryError, OSError) as e:  # address space is reserved up front, though pages come on use
            raise MemoryBudgetError(f"memory_budget_mb={self.config.memory_budget_mb}: the KV cache it plans "
                                    f"({plan.kv_bytes / MB:.0f} MB) cannot be allocated here ({e}); "
                                    f"set a budget this machine has") from None
        if self.draft is not None:
            self.draft.attach(pool)
        self.prefix = (PrefixCache(plan.prefix_blocks, self.config.prefix_block_tokens, pool, c.num_layers,
                                   c.num_kv_heads, c.head_dim, dtype) if plan.prefix_blocks > 0 else None)
        log.info("KV cache: %s (%.0f MB) + prefix cache %d blocks of %d tokens (%.0f MB), budget %d MB",
                 ", ".join(f"{x.num_slots}x{x.capacity_tokens}" for x in plan.classes), pool.nbytes / MB,
                 plan.prefix_blocks,
                 self.config.prefix_block_tokens, self.prefix.nbytes / MB if self.prefix else 0,
                 self.config.memory_budget_mb)
        return pool

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ---- submission (any thread) ----
    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> RequestHandle:
        if self._stop.is_set():  # checked again below, under the lock; this one before a closed engine's state
            raise RequestError("the engine has stopped (a model switch or shutdown)", "engine_stopped")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) > self.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context holds "
                               f"{self.kv.max_capacity} (prompt plus at least one generated token)",
                               "context_length_exceeded")
        vocab_size = self.bundle.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab_size:
            raise RequestError(f"logit_bias: token id {max(params.logit_bias)} is outside this model's vocabulary "
                               f"[0, {vocab_size})", "invalid_value", param="logit_bias")
        if params.speculative == "draft" and self.draft is None:
            raise RequestError("speculative='draft' needs the agent to run with a draft model (--draft-model)",
                               param="speculative")
        total = min(len(prompt_ids) + params.max_tokens, self.kv.max_capacity)
        seq = Sequence(list(prompt_ids), params, make_rng(params.seed), total, priority=priority)
        self.spec.start(seq)
        handle = RequestHandle(seq)
        with self._submit_lock:  # counted and queued as one: simultaneous submits cannot all pass the check
            if self._stop.is_set():
                raise RequestError("the engine has stopped (a model switch or shutdown)", "engine_stopped")
            queued = self.scheduler.num_queued + self._inbox.qsize()  # preempted ones wait too, but were admitted
            if queued >= self.config.max_queue:
                # finished and handed back like one shed from the queue later, so that telemetry records a refusal
                # at the door too and an overloaded device's record shows it
                seq.finish(FinishReason.ERROR, f"overloaded: {queued} requests are already waiting")
                raise RequestError(seq.error, "overloaded", refused=Finished("", [], seq.figures(), seq.error,
                                                                             "overloaded"))
            self._inbox.put(handle)
        self._wake.set()
        return handle

    def update_settings(self, changed: dict) -> None:
        """Apply live settings (EngineConfig fields). The config is replaced at once, never mutated, so a reader
        sees the old or the new one; what they change in the scheduler the engine thread applies at its next
        step, or this call does when that thread is not running (nothing else touches the scheduler then)."""
        self.config = self.config.model_copy(update=changed)
        self._settings.put(self.config)
        if self.is_running:
            self._wake.set()
        else:
            self._apply_settings()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Finished:
        """Submit and wait (the loop must be running, or this drives it in the calling thread)."""
        handle = self.submit(prompt_ids, params)
        if self._thread is None:
            while not handle.seq.is_finished or not handle.events.empty():
                self.step()
                if handle.seq.is_finished:
                    break
        return handle.result()

    # ---- the loop (engine thread) ----
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; every request still held ends with an "unavailable" error, none is left waiting."""
        with self._submit_lock:
            self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join()
        self._end_held("unavailable: the engine stopped before the request finished")

    def close(self) -> None:
        """After stop(): let go of the model session, the KV cache and the prefix cache now. A stopped engine
        never runs again, but references to it outlive it (the API's backend, telemetry), and a model switch
        that has to drain the old model first needs that memory for the new one."""
        if self.is_running:
            raise RuntimeError("close() an engine after stop()")
        self.runner = self.draft = self.spec.draft = self.prefix = None
        self.kv = self.scheduler.kv = self.scheduler.retire = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        failed = 0  # steps in a row that raised, with no step that did work in between
        while not self._stop.is_set():
            self.heartbeat()
            try:
                busy = self.step()
                failed = 0 if busy else failed
            except Exception:  # a bug must not take the service down: fail what was in flight, keep serving
                log.exception("engine step failed; ending the running requests with an error")
                self._fail_running("internal error")
                busy, failed = True, failed + 1
                if failed >= MAX_FAILED_STEPS:  # not one request's bad luck: the model itself no longer runs
                    self._give_up(f"{failed} engine steps in a row failed")
            if not busy:
                self._recheck_spinning()
                self._wake.wait(self._wake_interval_s)
                self._wake.clear()
        self._end_held("unavailable: the engine stopped before the request finished")

    def _give_up(self, why: str) -> None:
        """From the loop: stop it. _run then ends what it holds, and with no heartbeat after it systemd's
        watchdog restarts the service."""
        log.critical("%s: stopping, so that the service restarts", why)
        with self._submit_lock:
            self._stop.set()

    def _end_held(self, message: str) -> None:
        """End every request held (queued, waiting or running) with an error: none is left waiting."""
        self._drain_inbox()
        self.scheduler.waiting.clear()  # their streams end below, with the running ones'
        self._fail_running(message)

    def _recheck_spinning(self) -> None:
        """When idle and SPIN_RECHECK_S after the last time, let the runner re-measure whether its workers spin."""
        if (time.monotonic() - self._spin_checked < SPIN_RECHECK_S or self.scheduler.has_work()
                or not self._inbox.empty()):
            return
        self._spin_checked = time.monotonic()
        try:
            if self.runner.recheck_spinning():
                log.info("other load changed: the runner's workers now %s", "spin" if self.runner.spinning else "sleep")
        except Exception:  # the loop must outlive a failed measurement or rebuild
            log.exception("re-measuring spin_wait failed")
            if self.runner.session is None:  # neither the new session nor the old one could be built
                self._give_up("the engine has no model session left")

    def _fail_running(self, message: str) -> None:
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

    def step(self) -> bool:
        """One scheduling round and model step. Returns False when there was nothing to do."""
        self._apply_settings()
        self._drain_inbox()
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
        self._kv_utilization = self.kv.utilization()
        if plan.is_empty:
            return False
        for seq, n in plan.prefills:
            self._prefill(seq, n)
        for idx, seqs in plan.decodes.items():
            self._decode(idx, seqs)
        return True

    def _apply_settings(self) -> None:
        """The scheduler's share of each config update_settings posted, in order."""
        while True:
            try:
                config = self._settings.get_nowait()
            except queue.Empty:
                return
            self.scheduler.max_queue_wait_s = config.max_queue_wait_s

    def _drain_inbox(self) -> None:
        while True:
            try:
                handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            seq = handle.seq
            handle.detok = self.tokenizer.detokenizer(seq.params.stop, seq.prompt_ids)
            self.streams[seq.seq_id] = handle
            self.scheduler.add(seq)

    def _load_prefix(self, seq: Sequence) -> None:
        pool = self.scheduler.pool_of(seq)
        first = seq.preemptions == 0  # a readmission finds its own retired blocks: not a hit for the figures
        n = self.prefix.load(seq.prompt_ids, pool, pool.slot_of(seq.seq_id), count=first)
        seq.num_computed = n
        if first:
            seq.cached_prompt_tokens = n
        pool.lengths[seq.seq_id] = n

    def _prefill(self, seq: Sequence, n: int) -> None:
        pool = self.scheduler.pool_of(seq)
        start = seq.num_computed
        logits = self.runner.forward_slot(pool, pool.slot_of(seq.seq_id), seq.all_ids[start:start + n], start)
        seq.num_computed += n
        pool.lengths[seq.seq_id] = seq.num_computed
        if seq.num_uncomputed == 0:  # prompt (and any recomputed output) done: sample the next token
            if self.prefix is not None:
                self.prefix.store(seq.seq_id, seq.prompt_ids)
            seq.start_decoding()
            try:
                self._accept(seq, self._sample(seq, logits[0, 0]), time.perf_counter())
            except Exception:
                self._fail_one(seq)

    def _decode(self, idx: int, seqs: list[Sequence]) -> None:
        """One decode call over the pool's live slots [0:n]: a decoding sequence runs its one uncomputed token
        and its draft, if any ([last, d1..dk])."""
        pool = self.kv.classes[idx]
        decoding = {s.seq_id: s for s in seqs}
        t0 = time.perf_counter()
        drafts = {s.seq_id: self.spec.propose(s, len(seqs), pool.capacity) for s in seqs}
        # GQA needs room for the whole padded row in every slot: cached tokens + width <= capacity
        cached = [decoding[o].num_computed if o in decoding else max(pool.lengths[o], 1) for o in pool.owners]
        width = min(1 + max(len(d) for d in drafts.values()), pool.capacity - max(cached))
        drafts = {k: d[:width - 1] for k, d in drafts.items()}
        logits = self.runner.forward_decode(pool, {s.seq_id: (s.num_computed, [s.output_ids[-1]] + drafts[s.seq_id])
                                                   for s in seqs})
        seconds = time.perf_counter() - t0  # drafting and the model call: what speculation must pay for
        rows = {owner: row for row, owner in enumerate(pool.owners)}
        for s in seqs:  # positions this step wrote: a slot that a finish below moves must carry them along
            pool.lengths[s.seq_id] = s.num_computed + 1 + len(drafts[s.seq_id])
        for s in seqs:
            try:
                self._advance(s, pool, drafts[s.seq_id], logits[rows[s.seq_id]], seconds)
            except Exception:
                self._fail_one(s)

    def _fail_one(self, seq: Sequence) -> None:
        """End one request whose sampling or streaming failed, and only it: the others in the step are fine
        (a penalty that overflowed the logits of one request used to end every request in flight)."""
        log.exception("request %d failed; ending it with an error", seq.seq_id)
        if seq in self.scheduler.running:
            self.scheduler.finish(seq, FinishReason.ERROR)
        seq.finish(FinishReason.ERROR, "internal error")
        if seq.seq_id in self.streams:
            self._finish_stream(seq)

    def _advance(self, seq: Sequence, pool, draft: list[int], logits: np.ndarray, seconds: float) -> None:
        """Account for the tokens the step computed and append what verification accepted."""
        if draft:
            tokens = self.spec.verified(seq, draft, logits, seconds)
        else:
            tokens = [self._sample(seq, logits[0])]
            seq.draft_length.observe_plain(seconds, tokens[0])
        seq.num_computed += len(tokens)  # the last token + the accepted drafts now have valid KV
        self.spec.computed(seq)
        pool.lengths[seq.seq_id] = seq.num_computed
        now = time.perf_counter()  # the step's tokens reach the client together
        for t in tokens:
            self._accept(seq, t, now)
            if seq.is_finished:
                return

    def _sample(self, seq: Sequence, logits: np.ndarray) -> int:
        return sample(logits, seq.params, seq.prompt_ids, seq.output_ids, seq.rng)

    def _accept(self, seq: Sequence, token: int, now: float) -> None:
        """Append a sampled token, stream its text, and finish the request if it is done."""
        seq.append_token(token, now)
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        stopped = self.streams[seq.seq_id].add_token(token, is_eos)
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

    # ---- state for health, metrics and telemetry ----
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self._inbox.qsize()

    def kv_utilization(self) -> float:
        """Tokens held / allocated, as of the last step (a snapshot: safe to read from any thread)."""
        return self._kv_utilization

    def prefix_cache_hit_ratio(self) -> float:
        return self.prefix.hit_ratio if self.prefix else 0.0

    def is_decoding(self, seq: Sequence) -> bool:
        return seq.status is Status.DECODING
