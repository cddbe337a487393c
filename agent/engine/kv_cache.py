"""The KV-cache pool: preallocated slots in a few size classes, updated in place by the graph.

Each size class is one buffer per layer, keys and values [slots, kv_heads, capacity, head_dim]. Live
sequences occupy slots 0..n-1 of their class (kept compact: a finished sequence's slot is refilled by
moving the last live one into it), so a decode step binds the contiguous view [0:n] of each buffer and no
step ever copies the cache; a prefill binds the one-slot view [i:i+1]. The pool holds numpy buffers only:
the runner wraps a view for the runtime (ModelRunner.view).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agent.engine.memory import MB, KVPlan, MemoryBudgetError, SizeClass
from agent.process import lazy_zeros, release_pages


@dataclass(eq=False)  # identity semantics: a runner keys its views of a pool by the pool
class SlotPool:
    """One size class. `owners[i]` is the id of the sequence in slot i; slots >= len(owners) are free."""

    capacity: int
    num_slots: int
    keys: list[np.ndarray]
    values: list[np.ndarray]
    owners: list[int] = field(default_factory=list)
    lengths: dict[int, int] = field(default_factory=dict)  # sequence id -> tokens held

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self.owners)

    @property
    def slot_nbytes(self) -> int:
        """KV bytes one slot holds (keys and values, every layer)."""
        return self.keys[0][0].nbytes * 2 * len(self.keys)

    def slot_of(self, seq_id: int) -> int:
        return self.owners.index(seq_id)

    def allocate(self, seq_id: int) -> int:
        assert self.num_free > 0, "allocate() without can_allocate()"
        self.owners.append(seq_id)
        self.lengths[seq_id] = 0
        return len(self.owners) - 1

    def free(self, seq_id: int) -> None:
        """Release a slot; the last live sequence moves into it so live slots stay 0..n-1.

        The vacated slot's pages go back to the OS, so RSS follows the tokens held, not their high water.
        """
        hole, last = self.slot_of(seq_id), len(self.owners) - 1
        del self.lengths[seq_id]
        if hole != last:
            moved = self.owners[last]
            n = self.lengths[moved]
            for buf in self.keys + self.values:
                buf[hole, :, :n] = buf[last, :, :n]
            self.owners[hole] = moved
        for buf in self.keys + self.values:
            release_pages(buf[last])
        self.owners.pop()


class KVPool:
    """All size classes. A sequence gets the smallest class with a free slot that holds what it needs now, and
    moves to a larger class when it outgrows it."""

    def __init__(self, classes: list[SizeClass], num_layers: int, kv_heads: int, head_dim: int,
                 dtype: np.dtype = np.dtype(np.float32)):
        self.size_classes = sorted(classes, key=lambda c: c.capacity_tokens)
        self.classes = [self._make(c, num_layers, kv_heads, head_dim, dtype) for c in self.size_classes]
        self.where: dict[int, SlotPool] = {}
        self.mirror: KVPool | None = None  # a draft model's cache, slot for slot

    def attach_mirror(self, num_layers: int, kv_heads: int, head_dim: int, dtype: np.dtype) -> "KVPool":
        """A pool with the same classes for another model (the speculative draft), allocated and freed in
        lockstep so a sequence has the same slot index in both."""
        self.mirror = KVPool(self.size_classes, num_layers, kv_heads, head_dim, dtype)
        return self.mirror

    @staticmethod
    def _make(c: SizeClass, layers: int, kv_heads: int, head_dim: int, dtype: np.dtype) -> SlotPool:
        shape = (c.num_slots, kv_heads, c.capacity_tokens, head_dim)
        # lazy_zeros: pages become resident 4 KB at a time as tokens are written (no transparent huge pages),
        # so RSS grows with the tokens actually held, not with the slots reserved
        return SlotPool(c.capacity_tokens, c.num_slots, [lazy_zeros(shape, dtype) for _ in range(layers)],
                        [lazy_zeros(shape, dtype) for _ in range(layers)])

    @property
    def max_capacity(self) -> int:
        return self.classes[-1].capacity

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for p in self.classes for a in p.keys + p.values)

    def fitting(self, tokens: int) -> SlotPool | None:
        """The smallest class with a free slot that holds `tokens`, else None."""
        return next((p for p in self.classes if p.capacity >= tokens and p.num_free > 0), None)

    def smallest_capacity_for(self, tokens: int) -> int:
        """Capacity of the smallest class that could ever hold `tokens` (free or not)."""
        return next(p.capacity for p in self.classes if p.capacity >= tokens)

    def can_allocate(self, tokens: int) -> bool:
        return self.fitting(tokens) is not None

    def allocate(self, seq_id: int, tokens: int) -> SlotPool:
        pool = self.fitting(tokens)
        assert pool is not None, "allocate() without can_allocate()"
        pool.allocate(seq_id)
        self.where[seq_id] = pool
        if self.mirror is not None:
            self.mirror.allocate(seq_id, tokens)
        return pool

    def free(self, seq_id: int) -> None:
        self.where.pop(seq_id).free(seq_id)
        if self.mirror is not None:
            self.mirror.free(seq_id)

    def larger_free(self, seq_id: int, tokens: int) -> SlotPool | None:
        """The smallest class larger than seq_id's with a free slot that holds `tokens`, else None."""
        current = self.where[seq_id].capacity
        return next((p for p in self.classes if p.capacity >= tokens and p.capacity > current and p.num_free > 0),
                    None)

    def move(self, seq_id: int, new: SlotPool) -> None:
        """Move a sequence that outgrew its slot to a free slot of `new` (a larger class: see larger_free), with
        the KV it has so far (a copy of its written positions); the old slot is freed."""
        old = self.where[seq_id]
        n, src, dst = old.lengths[seq_id], old.slot_of(seq_id), new.allocate(seq_id)
        for a, b in zip(old.keys + old.values, new.keys + new.values):
            b[dst, :, :n] = a[src, :, :n]
        new.lengths[seq_id] = n
        old.free(seq_id)
        self.where[seq_id] = new
        if self.mirror is not None:  # the same steps, so the draft's slot index stays the target's
            index = next(i for i, p in enumerate(self.classes) if p is new)
            self.mirror.move(seq_id, self.mirror.classes[index])

    def utilization(self) -> float:
        """Tokens held / tokens allocated (over all slots of all classes)."""
        held = sum(sum(p.lengths.values()) for p in self.classes)
        total = sum(p.capacity * p.num_slots for p in self.classes)
        return held / total if total else 0.0


def allocate_pool(plan: KVPlan, budget_mb: int, num_layers: int, kv_heads: int, head_dim: int,
                  dtype: np.dtype) -> KVPool:
    """The plan's slots; MemoryBudgetError if this machine cannot reserve them (address space is reserved up
    front, though pages come on use)."""
    try:
        return KVPool(plan.classes, num_layers, kv_heads, head_dim, dtype)
    except (MemoryError, OSError) as e:
        raise MemoryBudgetError(f"memory_budget_mb={budget_mb}: the KV cache it plans ({plan.kv_bytes / MB:.0f} MB) "
                                f"cannot be allocated here ({e}); set a budget this machine has") from None
