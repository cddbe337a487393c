"""The ONNX decoder graph's input and output names, and its LoRA inputs: the contract between the graph the
quantizer builds (quantize.graph) and the runner that feeds it (agent.engine.runner). agent.wire re-exports
every name, so either module may be imported for them; they are defined here alone.
"""
from __future__ import annotations

from typing import Literal, get_args

INPUT_IDS = "input_ids"  # int64 [batch, seq]
SEQLENS_K = "seqlens_k"  # int32 [batch]: tokens in the cache after this step, minus one (GQA's definition)
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"  # int32 scalar: an upper bound of seqlens_k + 1
QUERY_SEQLENS = "query_seqlens"  # int32 [batch]: valid (non-padded) tokens of each row in this step
LOGITS_INDICES = "logits_indices"  # int64 [batch, n]: positions within seq whose logits are wanted
LOGITS = "logits"  # float32 [batch, n, vocab]


def past_key(i: int) -> str:
    return f"past_key_values.{i}.key"  # [batch, kv_heads, capacity, head_dim], shared with present


def past_value(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key(i: int) -> str:
    return f"present.{i}.key"


def present_value(i: int) -> str:
    return f"present.{i}.value"


# LoRA inputs of an adapter-ready graph. q, k and v share one fused projection, as gate and up do, and each fused
# projection that takes adapters has one low-rank branch: y += (x @ A) @ B. An adapter's tensors replace these
# inputs for a run; their defaults have rank 0 (A [in, 0], B [0, out]), so without one the branch adds zeros.
LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]
LORA_TARGETS: tuple[LoraTarget, ...] = get_args(LoraTarget)  # the order manifests list them in
# fused projection -> (its path in tensor names, the targets whose output columns it holds, in column order)
LORA_PROJECTIONS: dict[str, tuple[str, tuple[LoraTarget, ...]]] = {
    "qkv": ("attn.qkv_proj", ("q", "k", "v")),
    "o": ("attn.o_proj", ("o",)),
    "gate_up": ("mlp.gate_up_proj", ("gate", "up")),
    "down": ("mlp.down_proj", ("down",)),
}
LORA_PROJECTION_OF: dict[LoraTarget, str] = {t: p for p, (_, ts) in LORA_PROJECTIONS.items() for t in ts}


def lora_a(i: int, projection: str) -> str:
    """float32 [in, rank]: the fused projection's A, its targets' A^T side by side along rank."""
    return f"model.layers.{i}.{LORA_PROJECTIONS[projection][0]}.lora_A"


def lora_b(i: int, projection: str) -> str:
    """float32 [rank, out]: block-diagonal, each target's (scale * B)^T in its rows and output columns."""
    return f"model.layers.{i}.{LORA_PROJECTIONS[projection][0]}.lora_B"
