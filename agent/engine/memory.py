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

from agent.config import EngineConfig
from agent.wire import Parameters

MB = 1 << 20


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def describe_parameters(p: Parameters) -> str:
    """A Mixture of Experts' two sizes: the budget must hold every expert (total), while a token's decode reads
    only the experts it is routed to (active), which its speed follows."""
    return (f"a Mixture of Experts of {_count(p.total)} parameters, all resident in the memory budget, "
            f"{_count(p.active)} active per token (what decode speed follows)")


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
    gets half the KV bytes (never less than min_context): giving it all of them would leave a small budget
    one slot that serves one request at a time. A prompt longer than the largest slot is
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
    sequence after the prefix cache took its fraction (so a budget of exactly the figure a refusal names
    starts)."""
    return baseline_bytes + math.ceil(min_context * bytes_per_token / (1 - prefix_fraction)) + bytes_per_token


@dataclass(frozen=True)
class KVPlan:
    classes: list[SizeClass]  # the slots
    prefix_blocks: int  # the prefix store's blocks, of EngineConfig.prefix_block_tokens tokens each
    kv_bytes: int  # the budget left after the baseline, for both


def plan_kv(config: EngineConfig, model_context: int, baseline_bytes: int, per_token: int, store_per_token: int,
            model: str) -> KVPlan:
    """Split what the budget leaves after the measured baseline (weights, runtime, the largest step) between
    the prefix store and the slots; MemoryBudgetError, naming the budget `model` needs, if it is too small.

    per_token: a slot token's KV bytes (with a draft model, its mirrored cache's too); store_per_token: the
    target's alone, all that the prefix store holds.
    """
    budget = config.memory_budget_mb * MB
    min_tokens = config.min_kv_tokens(model_context)
    need = required_budget_bytes(baseline_bytes, per_token, min_tokens, config.prefix_cache_fraction)
    if budget < need:
        raise MemoryBudgetError(f"memory_budget_mb={config.memory_budget_mb} is too small for "
                                f"{model}: it needs at least "
                                f"{-(-need // MB)} MB ({baseline_bytes / MB:.0f} MB model and runtime + a "
                                f"{min_tokens}-token KV cache, beside prefix_cache_fraction="
                                f"{config.prefix_cache_fraction:g} of it for the prefix cache)")
    max_context = config.sequence_limit(model_context)
    capacities = class_capacities(max_context, min(config.kv_smallest_class, max_context))
    kv_bytes = budget - baseline_bytes
    # the store is sized at its own cost per token, so that it gets its whole fraction of the KV budget
    # with a draft model too (at the slots' cost it got 0.04 of it instead of 0.2, and the rest went unused)
    block_bytes = store_per_token * config.prefix_block_tokens
    prefix_blocks = int(kv_bytes * config.prefix_cache_fraction) // block_bytes
    classes = plan_slots(kv_bytes - prefix_blocks * block_bytes, per_token, capacities, min_tokens)
    return KVPlan(classes, prefix_blocks, kv_bytes)


def plan_with_adapters(config: EngineConfig, model_context: int, baseline_bytes: int, per_token: int,
                       store_per_token: int, model: str, adapters: dict[str, int]) -> KVPlan:
    """plan_kv with the adapters' bytes (name -> bytes, in load order) held beside the baseline, as the prefix
    store's are: the first adapter that leaves too little for the smallest KV cache is refused by name, at load,
    rather than a request running out of memory later. A model that does not fit alone gets plan_kv's error."""
    plan = plan_kv(config, model_context, baseline_bytes, per_token, store_per_token, model)
    if not adapters:
        return plan
    min_tokens, held = config.min_kv_tokens(model_context), baseline_bytes
    for name, nbytes in adapters.items():
        held += nbytes
        need = required_budget_bytes(held, per_token, min_tokens, config.prefix_cache_fraction)
        if config.memory_budget_mb * MB < need:
            raise MemoryBudgetError(f"adapter {name!r} ({nbytes / MB:.1f} MB) does not fit memory_budget_mb="
                                    f"{config.memory_budget_mb}: with {model} and the adapters loaded before it "
                                    f"({(held - nbytes - baseline_bytes) / MB:.1f} MB) it needs at least "
                                    f"{-(-need // MB)} MB")
    return plan_kv(config, model_context, held, per_token, store_per_token, model)
