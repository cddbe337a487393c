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
from dataclasses import dataclass, field

import numpy as np

from agent.engine.bundle import Bundle
from agent.config import EngineConfig
from agent.engine.draft import DraftModel
from agent.engine.kv_cache import KVPool
from agent.engine.memory import MB, MemoryBudgetError, class_capacities, kv_bytes_per_token, plan_slots, required_budget_bytes
from agent.engine.prefix_cache import PrefixCache
from agent.engine.runner import open_runner
from agent.process import peak_rss_bytes, reset_peak_rss
from agent.engine.sampler import make_rng, sample
from agent.engine.sampling_params import SamplingParams
from agent.engine.scheduler import Scheduler, attention_tokens
from agent.engine.sequence import FinishReason, Sequence, Status
from agent.engine.speculative import DraftLength, learned_backoff, next_draft_length, verify
from agent.engine.tokenizer import IncrementalDetokenizer, TextTokenizer
from agent.wire import RequestFigures

log = logging.getLogger(__name__)
# spin_wait "auto" is re-measured at the first idle moment this many seconds after the last measurement
# (0.25 s each; a rebuild, ~1-2 s, only when the answer changes)
SPIN_RECHECK_S = 600.0
MAX_FAILED_STEPS = 3  # steps in a row that raise before the engine stops (the watchdog then restarts it)


class RequestError(ValueError):
    """A request the engine refuses up front; `code` follows OpenAI's error codes."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None,
                 refused: "Finished | None" = None):
        super().__init__(message)
        self.code, self.param = code, param  # param: the request field at fault, when it is not the prompt
        self.refused = refused  # a request turned away for load: its figures, for telemetry like a shed one's


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    text: str  # the whole completion
    token_ids: list[int]
    figures: RequestFigures
    error: str | None = None  # set when figures.finish_reason == "error"
    # "overloaded" (no capacity within the queue's wait), "unavailable" (the engine stopped first) or "internal"
    error_code: str | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each generated token (Sequence's)


class RequestHandle:
    """The submitter's side of a request: iterate its events; cancel() from any thread."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.events: queue.Queue = queue.Queue()
        self.text_parts: list[str] = []  # written by the engine thread only

    def cancel(self) -> None:
        self.seq.cancelled = True

    def __iter__(self):
        while True:
            ev = self.events.get()
            yield ev
            if isinstance(ev, Finished):
                return

    def result(self) -> Finished:
        *_, last = iter(self)
        return last


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
        if config.speculative == "draft" and self.draft is None:  # found in review: it quietly ran prompt lookup
            raise ValueError("speculative = 'draft' needs a draft model (generate --draft-model); without one use "
                             "'ngram' or 'off'")
        self.max_context = config.sequence_limit(c.context_length)
        self.kv = self._plan_kv()
        self.max_prompt_tokens = self.kv.max_capacity - 1  # the largest slot, with one generated token
        self.scheduler = Scheduler(self.kv, config.prefill_chunk_tokens, config.max_queue_wait_s,
                                   self.prefix.retire if self.prefix is not None else None, attention_tokens(c))
        self.streams: dict[int, tuple[RequestHandle, IncrementalDetokenizer]] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()  # a request is either queued before stop() or refused after it
        self._kv_utilization = 0.0
        self._spec_backoff: dict[str, int] = {}  # speculative mode -> the last finished sequence's backoff
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
        budget = self.config.memory_budget_mb * MB
        min_tokens = self.config.min_kv_tokens(self.bundle.config.context_length)
        need = required_budget_bytes(self.baseline_bytes, per_token, min_tokens, self.config.prefix_cache_fraction)
        if budget < need:
            raise MemoryBudgetError(f"memory_budget_mb={self.config.memory_budget_mb} is too small for "
                                    f"{self.bundle.manifest.name}@{self.bundle.manifest.version}: it needs at least "
                                    f"{-(-need // MB)} MB ({self.baseline_bytes / MB:.0f} MB model and runtime + a "
                                    f"{min_tokens}-token KV cache, beside prefix_cache_fraction="
                                    f"{self.config.prefix_cache_fraction:g} of it for the prefix cache)")
        capacities = class_capacities(self.max_context, min(self.config.kv_smallest_class, self.max_context))
        kv_bytes = budget - self.baseline_bytes
        # found in review: the store was sized at the slots' cost per token, so with a draft model it got a
        # fraction of its share (0.04 of the KV budget instead of 0.2) and the rest was never allocated
        block_bytes = store_per_token * self.config.prefix_block_tokens
        prefix_blocks = int(kv_bytes * self.config.prefix_cache_fraction) // block_bytes
        classes = plan_slots(kv_bytes - prefix_blocks * block_bytes, per_token, capacities, min_tokens)
        try:
            pool = KVPool(classes, c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        except (MemoryError, OSError) as e:  # address space is reserved up front, though pages come on use
            raise MemoryBudgetError(f"memory_budget_mb={self.config.memory_budget_mb}: the KV cache it plans "
                                    f"({kv_bytes / MB:.0f} MB) cannot be allocated here ({e}); "
                                    f"set a budget this machine has") from None
        if self.draft is not None:
            self.draft.attach(pool)
        self.prefix = (PrefixCache(prefix_blocks, self.config.prefix_block_tokens, pool, c.num_layers,
                                   c.num_kv_heads, c.head_dim, dtype) if prefix_blocks > 0 else None)
        log.info("KV cache: %s (%.0f MB) + prefix cache %d blocks of %d tokens (%.0f MB), budget %d MB",
                 ", ".join(f"{x.num_slots}x{x.capacity_tokens}" for x in classes), pool.nbytes / MB, prefix_blocks,
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
        mode = self._spec_mode(seq)
        seq.draft_length = next_draft_length(mode, self._spec_backoff.get(mode))
        handle = RequestHandle(seq)
        with self._submit_lock:  # counted and queued as one: simultaneous submits cannot all pass the check
            if self._stop.is_set():
                raise RequestError("the engine has stopped (a model switch or shutdown)", "engine_stopped")
            queued = self.scheduler.num_queued + self._inbox.qsize()  # preempted ones wait too, but were admitted
            if queued >= self.config.max_queue:
                # recorded like one shed from the queue later (found in review: refused at the door, it left no
                # row, and the fleet saw an overloaded device with a clean record)
                seq.finish(FinishReason.ERROR, f"overloaded: {queued} requests are already waiting")
                raise RequestError(seq.error, "overloaded", refused=Finished("", [], seq.figures(), seq.error,
                                                                             "overloaded"))
            self._inbox.put(handle)
        self._wake.set()
        return handle

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
        self.runner = self.draft = self.prefix = None
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
        for handle, _ in [v for k, v in self.streams.items() if k not in waiting]:
            if not handle.seq.is_finished:
                handle.seq.finish(FinishReason.ERROR, message)
            self._finish_stream(handle.seq)

    def step(self) -> bool:
        """One scheduling round and model step. Returns False when there was nothing to do."""
        self._drain_inbox()
        for seq in self.scheduler.reap_cancelled():
            self._finish_stream(seq)
        # running sequences that outgrew their slots first: a request admitted now is never preempted unrun
        for seq in self.scheduler.grow():  # preempted: back in the queue, its stream open, its KV to recompute
            log.info("request %d preempted at %d tokens: no larger KV slot free", seq.seq_id, seq.num_tokens)
            if self.draft is not None:
                self.draft.forget(seq.seq_id)
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

    def _drain_inbox(self) -> None:
        while True:
            try:
                handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            seq = handle.seq
            self.streams[seq.seq_id] = (handle, self.tokenizer.detokenizer(seq.params.stop, seq.prompt_ids))
            self.scheduler.add(handle.seq)

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
        slot = pool.slot_of(seq.seq_id)
        start = seq.num_computed
        ids = np.array([seq.all_ids[start:start + n]], np.int64)
        logits = self.runner.forward(ids, np.array([start + n - 1]), np.array([n]), np.array([[n - 1]]),
                                     self.runner.view(pool, slot, slot + 1))
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
        """One decode call over the pool's live slots [0:n]. A row with a draft runs [last, d1..dk];
        the batch is right-padded to the longest row (query_seqlens tells each row's length)."""
        pool = self.kv.classes[idx]
        n = len(pool.owners)
        decoding = {s.seq_id: s for s in seqs}
        t0 = time.perf_counter()
        drafts = {s.seq_id: self._draft(s, len(seqs)) for s in seqs}
        # GQA needs room for the whole padded row in every slot: cached tokens + width <= capacity
        cached = [decoding[o].num_computed if o in decoding else max(pool.lengths[o], 1) for o in pool.owners]
        width = min(1 + max(len(d) for d in drafts.values()), pool.capacity - max(cached))
        drafts = {k: d[:width - 1] for k, d in drafts.items()}
        ids = np.zeros((n, width), np.int64)
        seqlens = np.zeros(n, np.int32)
        q = np.zeros(n, np.int32)
        for row, owner in enumerate(pool.owners):
            s = decoding.get(owner)
            if s is not None:
                run = [s.output_ids[-1]] + drafts[owner]  # a decoding sequence's one uncomputed token
                ids[row, :len(run)], seqlens[row], q[row] = run, s.num_computed + len(run) - 1, len(run)
            else:  # a slot still prefilling: idle row, cache untouched
                seqlens[row] = max(pool.lengths[owner] - 1, 0)
        positions = np.minimum(np.arange(width)[None, :], np.maximum(q, 1)[:, None] - 1)  # [n, width]
        logits = self.runner.forward(ids, seqlens, q, positions, self.runner.view(pool, 0, n))
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

    def _spec_mode(self, seq: Sequence) -> str:
        return seq.params.speculative or self.config.speculative

    def _draft(self, seq: Sequence, batch: int) -> list[int]:
        """This step's draft (prompt lookup's or the draft model's), or [] when speculation is off, paused or not
        worth it."""
        mode = self._spec_mode(seq)
        if mode == "off" or batch > self.config.speculative_max_batch:
            return []
        capacity = self.scheduler.pool_of(seq).capacity  # a draft model writes its tokens into its own slot
        room = min(seq.params.max_tokens - len(seq.output_ids), min(seq.max_total_tokens, capacity) - seq.num_tokens) - 1
        if mode == "ngram":
            return seq.draft_length.propose(seq.all_ids, room)
        k = min(seq.draft_length.current(), room)
        return self.draft.propose(seq.seq_id, seq.all_ids, k) if k > 0 and self.draft is not None else []

    def _advance(self, seq: Sequence, pool, draft: list[int], logits: np.ndarray, seconds: float) -> None:
        """Account for the tokens the step computed and append what verification accepted."""
        if draft:
            tokens = verify(draft, logits, seq.params, seq.prompt_ids, seq.output_ids, seq.rng)
            accepted = len(tokens) - 1
            seq.drafted_tokens += len(draft)
            seq.accepted_tokens += accepted
            seq.draft_length.update(len(draft), accepted, seconds)
        else:
            tokens = [self._sample(seq, logits[0])]
            seq.draft_length.observe_plain(seconds, tokens[0])
        seq.num_computed += len(tokens)  # the last token + the accepted drafts now have valid KV
        if self.draft is not None:
            self.draft.accepted(seq.seq_id, seq.num_computed)
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
        handle, detok = self.streams[seq.seq_id]
        is_eos = token in self.eos_ids and not seq.params.ignore_eos
        delta = "" if is_eos else detok.add(token)
        if delta:
            handle.text_parts.append(delta)
            handle.events.put(TextDelta(delta))
        reason = None
        if detok.stopped or is_eos:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= seq.max_total_tokens:
            reason = FinishReason.LENGTH
        if reason:
            self.scheduler.finish(seq, reason)
            self._finish_stream(seq)

    def _finish_stream(self, seq: Sequence) -> None:
        if self.draft is not None:
            self.draft.forget(seq.seq_id)
        if seq.num_computed > len(seq.prompt_ids) and isinstance(seq.draft_length, DraftLength):
            # it decoded: what it learned about a draft model's speculation counts
            self._spec_backoff[self._spec_mode(seq)] = learned_backoff(seq.draft_length, seq.drafted_tokens > 0)
        handle, detok = self.streams.pop(seq.seq_id)
        tail = detok.flush()  # held-back text that turned out not to be a stop string
        if tail:
            handle.text_parts.append(tail)
            handle.events.put(TextDelta(tail))
        code = None
        if seq.finish_reason is FinishReason.ERROR:
            code = next((c for c in ("overloaded", "unavailable") if (seq.error or "").startswith(c)), "internal")
        handle.events.put(Finished("".join(handle.text_parts), list(seq.output_ids), seq.figures(), seq.error, code,
                                   list(seq.token_times)))

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
