"""Scheduling policy: which sequences run in the next step, and how many prompt tokens each prefills.

Pure bookkeeping over Sequence objects and the KV pool; it runs nothing. Admission is first come, first
served within a priority: the head of the queue is admitted when a slot that holds its whole budget
(prompt + max_tokens) is free, and nothing behind it jumps ahead, so no request starves. Prompts are
prefilled in chunks under a per-step token budget so that running streams keep decoding while a long
prompt arrives.
"""
from __future__ import annotations

import heapq
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


class Scheduler:
    def __init__(self, kv: KVPool, prefill_chunk_tokens: int):
        self.kv = kv
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: list[tuple[int, float, int, Sequence]] = []  # heap by (priority, submit time)
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self.waiting, (seq.priority, seq.t_submit, seq.seq_id, seq))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into KV slots while the head of the queue fits."""
        admitted = []
        while self.waiting:
            seq = self.waiting[0][3]
            if seq.cancelled:
                heapq.heappop(self.waiting)
                seq.finish(FinishReason.CANCELLED)
                admitted.append(seq)  # the engine reports it finished
                continue
            if not self.kv.can_allocate(seq.max_total_tokens):
                break
            heapq.heappop(self.waiting)
            pool = self.kv.allocate(seq.seq_id, seq.max_total_tokens)
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
        self.kv.free(seq.seq_id)

    def reap_cancelled(self) -> list[Sequence]:
        gone = [s for s in self.running if s.cancelled]
        for s in gone:
            self.finish(s, FinishReason.CANCELLED)
        return gone
