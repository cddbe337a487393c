"""Adapter-ready graphs: which projections take a LoRA adapter, and the low-rank branch beside each.

A bundle built with LoRA targets carries, beside every fused projection holding a target (q, k and v share
qkv_proj, gate and up share gate_up_proj), a branch whose weights are graph inputs (agent.wire.lora_a/lora_b):

    x ─┬─ MatMulNBits / MatMul ─── y ─ Add ─ y'         A: [in, rank]   B: [rank, out], scale folded in
       └─ MatMul(A) ─ MatMul(B) ──────┘

Their defaults have rank 0 (A [in, 0], B [0, out]): x @ A is [.., 0], and the product of a zero-length inner
dimension is zeros, so with no adapter bound the branch adds +0.0 and y' is y bit for bit. An adapter binds
tensors of rank r in their place (quantize.adapter writes them).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper
from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent import wire
from agent.wire import LoraTarget
from quantize.architectures import by_name
from quantize.linear import GraphBuilder, LinearPlan


class LoraSpec(BaseModel):
    """edge-quantize build --lora-targets / --max-lora-rank, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    targets: tuple[LoraTarget, ...] = Field(min_length=1)
    max_rank: int = Field(16, ge=1, le=1024)

    @field_validator("targets")
    @classmethod
    def _canonical(cls, targets: tuple[LoraTarget, ...]) -> tuple[LoraTarget, ...]:
        return tuple(t for t in wire.LORA_TARGETS if t in targets)  # one order, no repeats

    @property
    def projections(self) -> frozenset[str]:
        """The fused projections (agent.wire.LORA_PROJECTIONS' keys) that get a branch."""
        return frozenset(wire.LORA_PROJECTION_OF[t] for t in self.targets)

    def capacity(self) -> wire.LoraCapacity:
        return wire.LoraCapacity(targets=list(self.targets), max_rank=self.max_rank)


def parse_targets(text: str) -> tuple[LoraTarget, ...]:
    """"q,k,v,o" -> ("q", "k", "v", "o"); ValueError naming an unknown one and the allowed."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in wire.LORA_TARGETS]
    if unknown or not items:
        raise ValueError(f"--lora-targets {text!r}: {', '.join(unknown) or 'none given'}; "
                         f"choose from {','.join(wire.LORA_TARGETS)}")
    return tuple(items)  # type: ignore[return-value]


def check_architecture(architecture: str) -> None:
    """ValueError for an architecture whose checkpoints fuse the projections LoRA adapts: their adapters hold
    qkv_proj / gate_up_proj deltas that would need splitting by rows, which is not done."""
    if by_name(architecture).fused:
        raise ValueError(f"--lora-targets: adapters for {architecture} are not supported (its checkpoints fuse "
                         f"q, k, v and gate, up into single projections)")


def branch(b: GraphBuilder, plan: LinearPlan, i: int, projection: str, x: str, y: str,
           shape: tuple[int, ...]) -> str:
    """y + (x @ A) @ B for layer i's fused projection (its HF weight shape [out, in]), A and B graph inputs
    of rank 0 by default, when the plan has a branch; else y itself. Returns the output's name."""
    if not plan.lora:
        return y
    n_out, k_in = shape
    a, bb = wire.lora_a(i, projection), wire.lora_b(i, projection)
    rank = f"lora_rank_{i}_{projection}"  # one symbolic dimension: A's columns are B's rows
    b.graph_inputs += [helper.make_tensor_value_info(a, TensorProto.FLOAT, [k_in, rank]),
                       helper.make_tensor_value_info(bb, TensorProto.FLOAT, [rank, n_out])]
    b.const(a, np.zeros((k_in, 0), np.float32))
    b.const(bb, np.zeros((0, n_out), np.float32))
    name = f"/model/layers.{i}/{wire.LORA_PROJECTIONS[projection][0].replace('.', '/')}/lora"
    xa = b.one("MatMul", [x, a], f"{name}/MatMul_A")  # [B, S, rank]
    delta = b.one("MatMul", [xa, bb], f"{name}/MatMul_B")  # [B, S, out]
    b.report.append(f"{name}: LoRA branch [{k_in}x0] [0x{n_out}]")
    return b.one("Add", [y, delta], f"{name}/Add")
