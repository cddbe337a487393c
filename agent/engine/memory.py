"""Memory planning, pure arithmetic: from a byte budget to KV-cache slots.

The whole process must stay under `memory_budget_mb`. What is left after the measured baseline (weights,
runtime, activations of the largest step) goes to the KV cache, split into a few size classes of slots
(ONNX Runtime's CPU attention has no paged kernel, so a sequence's KV must be one contiguous row of a
[slots, kv_heads, capacity, head_dim] buffer; several capacities keep short requests from holding
long rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MB = 1 << 20


class MemoryBudgetError(ValueError):
    """The model cannot run inside the budget; the message says how much it needs."""


@dataclass(frozen=True)
class SizeClass:
    capacity_tokens: int  # tokens one slot holds
    num_slots: int


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, bytes_per_value: int = 4) -> int:
    """Keys and values of one token across all layers."""
    return 2 * num_layers * kv_heads * head_dim * bytes_per_value


def class_capacities(max_context: int, smallest: int = 256, ratio: int = 4) -> list[int]:
    """Capacities from `smallest` up to max_context, each `ratio` times the previous (e.g. 256, 1024, 4096)."""
    caps, c = [], smallest
    while c < max_context:
        caps.append(c)
        c *= ratio
    return caps + [max_context]


def plan_slots(kv_budget_bytes: int, bytes_per_token: int, capacities: list[int], min_context: int) -> list[SizeClass]:
    """Give each class an equal share of the KV bytes, after one slot of the largest class.

    The largest class always gets a slot so that a full-context request can run; the rest is shared so that
    short requests (the common case) get many slots. When the full context does not fit, the largest slot
    gets half the KV bytes (never less than min_context): giving it all of them, as before 2026-12-03, left a
    small budget one slot that served one request at a time. A prompt longer than the largest slot is
    refused up front. Raises MemoryBudgetError if not even one sequence of min_context tokens fits.
    """
    if kv_budget_bytes < min_context * bytes_per_token:
        raise MemoryBudgetError(f"KV cache gets {kv_budget_bytes / MB:.0f} MB, one {min_context}-token sequence needs "
                                f"{min_context * bytes_per_token / MB:.0f} MB")
    largest = capacities[-1]
    if largest * bytes_per_token > kv_budget_bytes:
        largest = max(min_context, kv_budget_bytes // (2 * bytes_per_token))
        capacities = [c for c in capacities if c < largest] + [largest]
    left = kv_budget_bytes - largest * bytes_per_token
    share = left // len(capacities)
    slots = {c: share // (c * bytes_per_token) for c in capacities}
    slots[largest] += 1
    return [SizeClass(c, n) for c, n in slots.items() if n > 0]


def required_budget_bytes(baseline_bytes: int, bytes_per_token: int, min_context: int,
                          prefix_fraction: float = 0.0) -> int:
    """The smallest budget that starts: the baseline, then a KV share that still holds one min_context
    sequence after the prefix cache took its fraction (found in review: the fraction was left out, so the
    figure the refusal named was refused too)."""
    return baseline_bytes + math.ceil(min_context * bytes_per_token / (1 - prefix_fraction)) + bytes_per_token
