"""Scheduling policy: which sequences run in the next step, and how many prompt tokens each prefills.

Pure bookkeeping over Sequence objects and the KV pool; it runs nothing. Admission is first come, first
served within a priority (which ages; past max_queue_wait_s arrival order alone): the head of the queue is
admitted when a slot that holds its tokens so far plus the next one is free, and nothing behind it jumps
ahead, so no request starves. A sequence that fills its
slot moves to a free slot of a larger class (never one that a waiting request ahead of it needs); when
none is free, a holder of a large-enough slot that came after it is preempted (the smallest such slot,
then the last come), or the sequence itself when there is none: its slot is freed, it waits again with
its tokens kept, and it recomputes their KV when readmitted (vLLM's recompute preemption). Slots are thus
sized by what requests use, not by their max_tokens. Prompts are prefilled in chunks under a per-step
token budget so that running streams keep decoding while a long prompt arrives; while others decode, a
chunk deep into a long prompt is smaller, in proportion to what its attention adds to the step's cost.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.engine.kv_cache import KVPool, SlotPool
from agent.engine.sequence import FinishReason, Sequence, Status
from agent.wire import ModelConfig


@dataclass
class StepPlan:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    decodes: dict[int, list[Sequence]] = field(default_factory=dict)  # pool index -> decoding sequences

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


AGING_S = 10.0  # a waiting request gains one priority level per this many seconds
# Attention's multiply-adds cost ~1.4x the projections' (their kernels are faster): SmolLM2 INT4, 2 threads, a
# 128-token chunk took 137 / 253 / 381 / 637 ms at 0 / 2,000 / 4,000 / 7,800 tokens of context, which fits
# 1 + context / ~2,200 tokens, where the multiply-adds alone give 1 + context / 3,070.
ATTENTION_EFFICIENCY = 0.7
# ONNX Runtime rounds a step's last row differently when the step's width leaves it alone in a tile: a
# one-token step, and (measured, fp32) 33 or 65 tokens on a tiny model with head_dim 16, 129 or 257 on
# SmolLM2 (head_dim 64). That position's logits then differ by up to ~3e-5 from any other split of the
# same tokens, while widths without a lone row give the same bits whatever the split. A cold run and a
# prefix-cache hit split a prompt differently, so prefill steps avoid those widths: otherwise a near-tie
# could flip a greedy token between the two. The tile measured on both models is twice head_dim, and 32
# divides that for every head_dim the quantizer accepts (a multiple of 16).
LONE_ROW_TILE = 32


def has_lone_row(width: int) -> bool:
    """Whether a step this many tokens wide rounds its last row apart from the rest (see LONE_ROW_TILE)."""
    return width % LONE_ROW_TILE == 1


def attention_tokens(c: ModelConfig) -> int:
    """The context at which a prompt token's attention costs what its projections do: past it, a prefill chunk
    costs more than its width says (1 + context / this, as a multiple of a chunk at the start)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    # a Mixture of Experts runs its router and the num_experts_per_tok experts it picks (intermediate_size each)
    mlp = (c.num_experts_per_tok or 1) * 3 * c.hidden_size * c.intermediate_size + c.hidden_size * c.num_experts
    projections = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + mlp
    return max(1, int(ATTENTION_EFFICIENCY * projections / (2 * q)))  # a query row: q*context for QK, again for AV


class Scheduler:
    def __init__(self, kv: KVPool, prefill_chunk_tokens: int, max_queue_wait_s: float = 60.0,
                 retire: Callable[[int, SlotPool], None] | None = None, attention_tokens: int | None = None):
        self.kv = kv
        self.retire = retire  # called with (sequence id, its pool) just before its slot is freed
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.attention_tokens = attention_tokens  # see attention_tokens(); None: chunks cost their width
        self.max_queue_wait_s = max_queue_wait_s
        self.waiting: list[Sequence] = []  # short (bounded by max_queue): scanned, not heaped, because priorities age
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_queued(self) -> int:
        """Waiting requests never admitted (the bounded queue's depth; preempted ones were admitted once)."""
        return sum(1 for s in self.waiting if s.t_admit is None)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _order_key(self, now: float):
        """Queue order: effective priority (lower first, aged by time since submission), then arrival. A request
        submitted more than max_queue_wait_s ago (a preempted one: a new one is refused by then) comes before
        all others, in arrival order: priorities span 2^32 levels, more than aging alone overcomes, and a
        preempted request is not refused, so without this a stream of higher priorities could keep it
        waiting for ever."""
        overdue_before = now - self.max_queue_wait_s
        return lambda s: ((0, s.t_submit, s.seq_id) if s.t_submit < overdue_before
                          else (1, s.priority - (now - s.t_submit) // AGING_S, s.t_submit, s.seq_id))

    def _queue_order(self, now: float) -> list[Sequence]:
        return sorted(self.waiting, key=self._order_key(now))

    @staticmethod
    def admission_need(seq: Sequence) -> int:
        """Tokens a slot must hold to admit seq: its prompt (and, after a preemption, its output so far) and
        the token the first decode writes, never more than the request can reach."""
        return min(seq.num_tokens + 1, seq.max_total_tokens)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into KV slots in queue order. Returns them, and any that ended in the queue
        (cancelled, or waited longer than max_queue_wait_s: 'overloaded').

        When the head does not fit, later requests may still start, but only in size classes smaller than
        the one the head is waiting for, so they can never take the head's slot and starve it.
        """
        now, admitted, ceiling = time.perf_counter(), [], None
        for seq in self._queue_order(now):
            waited_too_long = seq.t_admit is None and now - seq.t_submit > self.max_queue_wait_s  # not a preempted one
            if seq.cancelled or waited_too_long:
                self.waiting.remove(seq)
                seq.finish(FinishReason.CANCELLED if seq.cancelled else FinishReason.ERROR,
                           None if seq.cancelled else "overloaded: no capacity within the queue's maximum wait")
                admitted.append(seq)
                continue
            need = self.admission_need(seq)
            pool = self.kv.fitting(need)
            if pool is None or (ceiling is not None and pool.capacity >= ceiling):
                if ceiling is None:
                    ceiling = self.kv.smallest_capacity_for(need)
                continue
            self.waiting.remove(seq)
            self.kv.allocate(seq.seq_id, need)
            seq.kv_bytes = max(seq.kv_bytes, pool.slot_nbytes)
            seq.admit()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def plan(self) -> StepPlan:
        """The budget is prefill_chunk_tokens of chunks at the start of a context. While others decode, a chunk
        deeper in costs more per token (its attention over the context before it), so it gets fewer: on one
        core a 128-token chunk 7,800 tokens into a prompt takes 0.75 s, which every running stream would wait
        for each token. Alone, a prompt takes whole chunks (the fastest TTFT)."""
        # a float: each prompt's cost rounded up to a whole token let fewer short prompts share a step
        plan, budget = StepPlan(), float(self.prefill_chunk_tokens)
        decoding = any(seq.status is Status.DECODING for seq in self.running)
        for seq in self.running:
            if seq.status is Status.PREFILLING:
                cost = 1.0 + seq.num_computed / self.attention_tokens if decoding and self.attention_tokens else 1.0
                affordable = int(budget / cost)
                if not plan.prefills:  # the first prefilling sequence always progresses: at least 16 tokens
                    affordable = max(affordable, 16)
                if n := self._chunk(seq.num_uncomputed, affordable):
                    plan.prefills.append((seq, n))
                    budget = max(0.0, budget - n * cost)
            elif seq.status is Status.DECODING:
                idx = self.kv.classes.index(self.kv.where[seq.seq_id])
                plan.decodes.setdefault(idx, []).append(seq)
        return plan

    @staticmethod
    def _chunk(left: int, budget: int) -> int:
        """Prompt tokens to compute now (0: none this step): what the budget allows, but no step, this one or
        a later one, whose width has a lone row (has_lone_row), unless the prompt is a single token.
        The first prefilling sequence always progresses: prefill_chunk_tokens is at least 16."""
        n = min(left, budget)
        while n > 0 and (has_lone_row(n) or has_lone_row(left - n)) and left > 1:
            n -= 1
        return n

    def grow(self) -> list[Sequence]:
        """Before admitting and planning a step: every decoding sequence whose slot is full moves to a larger one,
        earliest first. With none free, the last come among it and the holders of large-enough slots is
        preempted. A sequence behind the queue's head takes no slot the head could use, as in admit().
        Returns the preempted sequences."""
        full = [s for s in self.running if s.status is Status.DECODING and s.num_tokens > self.pool_of(s).capacity]
        if not full:  # the common step
            return []
        preempted: list[Sequence] = []
        key = self._order_key(time.perf_counter())
        head = min(self.waiting, key=key, default=None)
        for seq in sorted(full, key=key):
            if seq.status is not Status.DECODING:
                continue  # preempted by an earlier one this round
            need = seq.num_tokens + 1  # (<= max_total_tokens, which the largest class holds: it is still running)
            behind = head is not None and key(head) < key(seq)
            head_need = self.admission_need(head) if behind else 0
            while not self._move_up(seq, need, head_need):
                victim = self._victim(seq, need, self.kv.smallest_capacity_for(head_need) if behind else None, key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                seq.kv_bytes = max(seq.kv_bytes, self.pool_of(seq).slot_nbytes)
        return preempted

    def _move_up(self, seq: Sequence, need: int, head_need: int) -> bool:
        """Move seq to the smallest free slot of a larger class that holds `need` tokens, unless that slot is the
        last free one that holds `head_need` (a waiting request ahead of seq; 0: none). Returns whether it moved."""
        target = self.kv.larger_free(seq.seq_id, need)
        if target is None:
            return False
        if head_need and target.capacity >= head_need:
            if sum(p.num_free for p in self.kv.classes if p.capacity >= head_need) <= 1:
                return False
        self.kv.move(seq.seq_id, target)
        return True

    def _victim(self, grower: Sequence, need: int, ceiling: int | None, key) -> Sequence:
        """Whom grower's growth preempts: a running sequence that came after it (in queue order `key`) and holds a
        slot of at least `need` tokens (below `ceiling`, the class a waiting request ahead of grower needs, if
        any), the smallest such slot (the least recompute) and of those the last come; grower itself when there
        is none."""
        def fits(s: Sequence) -> bool:
            c = self.pool_of(s).capacity
            return c >= need and (ceiling is None or c < ceiling)

        later = [s for s in self.running if s is not grower and key(s) > key(grower) and fits(s)]
        if not later:
            return grower
        smallest = min(self.pool_of(s).capacity for s in later)
        return max((s for s in later if self.pool_of(s).capacity == smallest), key=key)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.preempt()
        self.waiting.append(seq)

    def pool_of(self, seq: Sequence) -> SlotPool:
        return self.kv.where[seq.seq_id]

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a running sequence and free its slot at once."""
        seq.finish(reason)
        self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if self.retire is not None:
            self.retire(seq.seq_id, self.kv.where[seq.seq_id])
        self.kv.free(seq.seq_id)

    def reap_cancelled(self) -> list[Sequence]:
        gone = [s for s in self.running if s.cancelled]
        for s in gone:
            self.finish(s, FinishReason.CANCELLED)
        return gone
