"""The generation loop: requests in, tokens out, one batched model step at a time.

The engine loads the model (and a draft model, and the LoRA adapters a request may name: agent.engine.adapters),
sizes the KV cache to what the memory budget leaves after them, and runs the
engine thread: a loop of steps (agent.engine.step) that alone touches the scheduler, the KV pool and the
runner. Other threads call `submit()` (thread-safe) and read their request's event queue; `cancel()` only
sets a flag the loop acts on at its next step, and live settings reach the loop as messages.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from agent.config import EngineConfig
from agent.engine.adapters import Adapter, check_adapter
from agent.engine.bundle import Bundle
from agent.engine.constraint import GrammarError, Grammars
from agent.engine.draft import DraftModel
from agent.engine.kv_cache import KVPool, allocate_pool
from agent.engine.memory import MB, describe_parameters, kv_bytes_per_token, plan_with_adapters
from agent.engine.prefix_cache import PrefixCache
from agent.engine.request import Finished, RequestError, RequestHandle, check_request
from agent.engine.runner import open_runner
from agent.engine.sampler import make_rng
from agent.engine.sampling_params import SamplingParams
from agent.engine.scheduler import Scheduler, attention_tokens
from agent.engine.sequence import FinishReason, Sequence, Status
from agent.engine.speculative import Speculation
from agent.engine.step import Stepper
from agent.engine.tokenizer import TextTokenizer
from agent.process import peak_rss_bytes, reset_peak_rss, return_free_heap, rss_bytes

log = logging.getLogger(__name__)
# spin_wait "auto" is re-measured at the first idle moment this many seconds after the last measurement
# (0.25 s each; a rebuild, ~1-2 s, only when the answer changes)
SPIN_RECHECK_S = 600.0
MAX_FAILED_STEPS = 3  # steps in a row that raise before the engine stops (the watchdog then restarts it)
SETTINGS_WAIT_S = 2.0  # how long update_settings waits for the engine thread to apply a change


class Engine:
    def __init__(self, bundle: Bundle, config: EngineConfig = EngineConfig(), draft: Bundle | None = None,
                 heartbeat: Callable[[], None] | None = None, idle_wait_s: float = 0.5,
                 adapters: Mapping[str, Path] | None = None):
        self.bundle, self.config = bundle, config
        bundle.check_servable()
        # name -> adapter: verified and fitted first, their tensors read only after the budget took their bytes
        self.adapters: dict[str, Adapter] = {n: check_adapter(n, p, bundle) for n, p in (adapters or {}).items()}
        # called by the loop itself every iteration (busy or idle): a watchdog fed from here stops being fed
        # when the loop is stuck, which a free-running timer would not notice
        self.heartbeat = heartbeat or (lambda: None)
        c = bundle.config
        self.tokenizer = TextTokenizer(bundle.tokenizer_json(), c)
        self.grammars = Grammars(bundle.tokenizer_json, c.vocab_size, c.eos_token_ids)  # structured output
        self.max_context = config.sequence_limit(c.context_length)
        reset_peak_rss()
        self.runner = open_runner(bundle, config.threads, config.spin_wait, config.kv_dtype, self.max_context)
        return_free_heap()  # what loading freed (the model's proto, initializers copied by prepacking): ~90 MB for Gemma 3
        before_draft = rss_bytes()
        self.draft = DraftModel(draft, bundle, config.threads, config.prefill_chunk_tokens) if draft else None
        self.draft_bytes = rss_bytes() - before_draft if draft else 0  # its weights and session, for the budget's error
        if config.speculative == "draft" and self.draft is None:  # refused: it would quietly run prompt lookup
            raise ValueError(f"speculative = 'draft' needs a draft model: {bundle.label} carries none (edge-quantize "
                             "build --draft) and none was given (generate --draft-model); without one use 'ngram' or 'off'")
        self.spec = Speculation(config, self.draft)
        self.kv = self._plan_kv()
        self.adapters = {n: a.load_tensors(self.runner) for n, a in self.adapters.items()}
        self.max_prompt_tokens = self.kv.max_capacity - 1  # the largest slot, with one generated token
        self.scheduler = Scheduler(self.kv, config.prefill_chunk_tokens, config.max_queue_wait_s,
                                   self.prefix.retire if self.prefix is not None else None, attention_tokens(c))
        self._inbox: queue.Queue[RequestHandle] = queue.Queue()
        self.steps = Stepper(self.scheduler, self.runner, self.prefix, self.spec, self.tokenizer, set(c.eos_token_ids),
                             self._inbox, self.adapters)
        self._settings: queue.Queue[tuple[EngineConfig, threading.Event]] = queue.Queue()  # for the engine thread
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()  # a request is either queued before stop() or refused after it
        self._wake_interval_s = idle_wait_s  # idle loop period: also the heartbeat's period when there is no work
        self._thread: threading.Thread | None = None
        self._spin_checked = time.monotonic()

    def _plan_kv(self) -> KVPool:
        """Measure what the model costs with its largest step, then give the rest of the budget to KV."""
        c, dtype = self.bundle.config, self.runner.kv_dtype
        # the prefix store holds the target's KV only; a slot's token costs the draft's mirror too
        store_per_token = per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype.itemsize)
        if self.draft is not None:  # the draft's cache mirrors every slot, so a token costs both
            per_token += self.draft.kv_bytes_per_token
        self.runner.warm_up(self.config.prefill_chunk_tokens, self.max_context)
        if self.draft is not None:  # its catch-up runs in the same chunks
            self.draft.runner.warm_up(self.config.prefill_chunk_tokens, self.max_context)
        self.baseline_bytes = int(peak_rss_bytes() * 1.05)  # 5% headroom for allocator slack
        model = self.bundle.label
        if (m := self.bundle.manifest) is not None and m.parameters is not None:  # a refusal and the plan say both
            model += f" ({describe_parameters(m.parameters)})"
        if self.draft is not None:  # a pair that does not fit names both, and what the draft takes of the budget
            model += f" with its draft {self.draft.bundle.label} ({self.draft_bytes / 2**20:.0f} MB of it loaded)"
        plan = plan_with_adapters(self.config, c.context_length, self.baseline_bytes, per_token, store_per_token, model,
                                  {a.label: a.nbytes for a in self.adapters.values()})
        pool = allocate_pool(plan, self.config.memory_budget_mb, c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        if self.draft is not None:
            self.draft.attach(pool)
        self.prefix = (PrefixCache(plan.prefix_blocks, self.config.prefix_block_tokens, pool, c.num_layers,
                                   c.num_kv_heads, c.head_dim, dtype) if plan.prefix_blocks > 0 else None)
        log.info("KV cache: %s (%.0f MB) + prefix cache %d blocks of %d tokens (%.0f MB), budget %d MB",
                 ", ".join(f"{x.num_slots}x{x.capacity_tokens}" for x in plan.classes), pool.nbytes / MB,
                 plan.prefix_blocks, self.config.prefix_block_tokens, self.prefix.nbytes / MB if self.prefix else 0,
                 self.config.memory_budget_mb)
        log.info("model: %s", model)
        return pool

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ---- submission (any thread) ----
    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
               adapter: str | None = None) -> RequestHandle:
        """Queue a request; adapter: the name of one of self.adapters its every step runs with (None: the base)."""
        if self._stop.is_set():  # checked again below, under the lock; this one before a closed engine's state
            raise RequestError("the engine has stopped (a model switch or shutdown)", "engine_stopped")
        if adapter is not None and adapter not in self.adapters:
            raise RequestError(f"no adapter {adapter!r} on {self.bundle.label} (it serves "
                               f"{', '.join(self.adapters) or 'none'})", "model_not_found", param="model")
        check_request(prompt_ids, params, self.max_prompt_tokens, self.kv.max_capacity, self.bundle.config.vocab_size,
                      self.draft is not None)
        total = min(len(prompt_ids) + params.max_tokens, self.kv.max_capacity)
        seq = Sequence(list(prompt_ids), params, make_rng(params.seed), total, priority=priority, adapter=adapter)
        if params.structure is not None:  # compiled here, on the submitter's thread, never in a step
            try:
                seq.constraint = self.grammars.constraint(params.structure)
            except GrammarError as e:
                raise RequestError(str(e), "invalid_value", param=e.param) from None
        self.spec.start(seq)
        # the table is built on the first request that asks (~80 ms), by its submitter rather than the engine thread
        handle = RequestHandle(seq, token_bytes=self.tokenizer.token_bytes if params.logprobs is not None else None)
        if adapter is not None:
            m = self.adapters[adapter].manifest
            handle.adapter = f"{m.name}@{m.version}"
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
        step, which this call waits for (up to SETTINGS_WAIT_S: a step is milliseconds to a prefill chunk's
        second), or this call does when that thread is not running (nothing else touches the scheduler then)."""
        self.config = self.spec.config = self.config.model_copy(update=changed)
        applied = threading.Event()
        self._settings.put((self.config, applied))
        if self.is_running:
            self._wake.set()
            applied.wait(SETTINGS_WAIT_S)
        else:
            self._apply_settings()

    def generate(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None) -> Finished:
        """Submit and wait (the loop must be running, or this drives it in the calling thread)."""
        handle = self.submit(prompt_ids, params, adapter=adapter)
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
        self.steps.end_held("unavailable: the engine stopped before the request finished")

    def close(self) -> None:
        """After stop(): let go of the model session, the KV cache and the prefix cache now. A stopped engine
        never runs again, but references to it outlive it (the API's backend, telemetry), and a model switch
        that has to drain the old model first needs that memory for the new one."""
        if self.is_running:
            raise RuntimeError("close() an engine after stop()")
        self.runner = self.draft = self.spec.draft = self.prefix = self.steps.runner = self.steps.prefix = None
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
                self.steps.fail_running("internal error")
                busy, failed = True, failed + 1
                if failed >= MAX_FAILED_STEPS:  # not one request's bad luck: the model itself no longer runs
                    self._give_up(f"{failed} engine steps in a row failed")
            if not busy:
                self._recheck_spinning()
                self._wake.wait(self._wake_interval_s)
                self._wake.clear()
        self.steps.end_held("unavailable: the engine stopped before the request finished")

    def _give_up(self, why: str) -> None:
        """From the loop: stop it. _run then ends what it holds, and with no heartbeat after it systemd's
        watchdog restarts the service."""
        log.critical("%s: stopping, so that the service restarts", why)
        with self._submit_lock:
            self._stop.set()

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

    def step(self) -> bool:
        """One scheduling round and model step. Returns False when there was nothing to do."""
        self._apply_settings()
        return self.steps.step()

    def _apply_settings(self) -> None:
        """The scheduler's share of each config update_settings posted, in order."""
        while True:
            try:
                config, applied = self._settings.get_nowait()
            except queue.Empty:
                return
            self.scheduler.max_queue_wait_s = config.max_queue_wait_s
            applied.set()

    # ---- state for health, metrics and telemetry ----
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self._inbox.qsize()

    @property
    def streams(self) -> dict[int, RequestHandle]:
        """The requests the engine thread has taken in whose stream is still open."""
        return self.steps.streams

    def kv_utilization(self) -> float:
        """Tokens held / allocated, as of the last step (a snapshot: safe to read from any thread)."""
        return self.steps.kv_utilization

    def prefix_cache_hit_ratio(self) -> float:
        return self.prefix.hit_ratio if self.prefix else 0.0

    def is_decoding(self, seq: Sequence) -> bool:
        return seq.status is Status.DECODING
