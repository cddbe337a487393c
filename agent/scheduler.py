"""Scheduling policy: which sequences run in the next step, and how many prompt tokens each prefills.

Pure bookkeeping over Sequence objects and the KV pool; it runs nothing. Admission is first come, first
served within a priority: the head of the queue is admitted when a slot that holds its whole budget
(prompt + max_tokens) is free, and nothing behind it jumps ahead, so no request starves. Prompts are
prefilled in chunks under a per-step token budget so that running streams keep decoding while a long
prompt arrives.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.kv_cache import KVPool, SlotPool
from agent.sequence import FinishReason, Sequence, Status


@dataclass
class StepPlan:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    decodes: dict[int, list[Sequence]] = field(default_factory=dict)  # pool index -> decoding sequences

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


AGING_S = 10.0  # a waiting request gains one priority level per this many seconds, so none starves


class Scheduler:
    def __init__(self, kv: KVPool, prefill_chunk_tokens: int, max_queue_wait_s: float = 60.0,
                 retire: Callable[[int, SlotPool], None] | None = None):
        self.kv = kv
        self.retire = retire  # called with (sequence id, its pool) just before its slot is freed
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_queue_wait_s = max_queue_wait_s
        self.waiting: list[Sequence] = []  # short (bounded by max_queue): scanned, not heaped, because priorities age
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _queue_order(self, now: float) -> list[Sequence]:
        """Waiting sequences by effective priority (lower first, aged by waiting time), then arrival."""
        return sorted(self.waiting, key=lambda s: (s.priority - (now - s.t_submit) // AGING_S, s.t_submit, s.seq_id))

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into KV slots in queue order. Returns them, and any that ended in the queue
        (cancelled, or waited longer than max_queue_wait_s: 'overloaded').

        When the head does not fit, later requests may still start, but only in size classes smaller than
        the one the head is waiting for, so they can never take the head's slot and starve it.
        """
        now, admitted, ceiling = time.perf_counter(), [], None
        for seq in self._queue_order(now):
            if seq.cancelled or now - seq.t_submit > self.max_queue_wait_s:
                self.waiting.remove(seq)
                seq.finish(FinishReason.CANCELLED if seq.cancelled else FinishReason.ERROR,
                           None if seq.cancelled else "overloaded: no capacity within the queue's maximum wait")
                admitted.append(seq)
                continue
            pool = self.kv.fitting(seq.max_total_tokens)
            if pool is None or (ceiling is not None and pool.capacity >= ceiling):
                if ceiling is None:
                    ceiling = self.kv.smallest_capacity_for(seq.max_total_tokens)
                continue
            self.waiting.remove(seq)
            self.kv.allocate(seq.seq_id, seq.max_total_tokens)
            seq.kv_bytes = pool.keys[0][0].nbytes * 2 * len(pool.keys)
            seq.admit()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def plan(self) -> StepPlan:
        plan, budget = StepPlan(), self.prefill_chunk_tokens
        for seq in self.running:
            if seq.status is Status.PREFILLING and budget > 0:
                n = min(seq.num_uncomputed, budget)
                plan.prefills.append((seq, n))
                budget -= n
            elif seq.status is Status.DECODING:
                idx = self.kv.classes.index(self.kv.where[seq.seq_id])
                plan.decodes.setdefault(idx, []).append(seq)
        return plan

    def pool_of(self, seq: Sequence) -> SlotPool:
        return self.kv.where[seq.seq_id]

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a running sequence and free its slot at once."""
        seq.finish(reason)
        self.running.remove(seq)
        if self.retire is not None:
            self.retire(seq.seq_id, self.kv.where[seq.seq_id])
        self.kv.free(seq.seq_id)

    def reap_cancelled(self) -> list[Sequence]:
        gone = [s for s in self.running if s.cancelled]
        for s in gone:
            self.finish(s, FinishReason.CANCELLED)
        return gone
