"""The graph builder's accumulator and its linear projections, each in the precision a plan gives it.

A projection is y = x @ w.T for an HF-layout weight w [N, K]: a MatMul at fp32, ONNX Runtime's MatMulNBits at
INT8/INT4 (quantized here by RTN, search or GPTQ, or kept from a GGUF's own Q4_0/Q4_1/Q8_0 blocks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from onnx import helper, numpy_helper

from quantize import nbits
from quantize.checkpoint import SourceBlocks
from quantize.precision import Precision, QuantSpec

OPSET = 21
MS_DOMAIN = "com.microsoft"
LM_HEAD = "lm_head.weight"  # the lm_head's HF weight name: its key for calibration, like every projection's

# Per-tensor importance (mean squared activation per input channel), keyed by HF weight name.
Importance = dict[str, np.ndarray]


class HessianSource(Protocol):
    """GPTQ's Hessians by HF weight name, each taken once: a dict, or calibrate.Hessians (made on demand)."""

    def pop(self, key: str, default: np.ndarray | None = None, /) -> np.ndarray | None: ...


@dataclass
class GraphBuilder:
    """Accumulates nodes and initializers; every node gets a readable path-like name."""

    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    report: list[str] = field(default_factory=list)  # what each weight became, for the build report
    importance: Importance = field(default_factory=dict)  # calibration statistics, by HF weight name
    hessians: HessianSource = field(default_factory=dict)  # sum of x x^T [K, K] per input, for GPTQ
    linear_inputs: dict[str, str] = field(default_factory=dict)  # HF weight name -> its input tensor's name
    graph_inputs: list = field(default_factory=list)  # inputs beyond agent.wire's (an adapter-ready graph's LoRA)

    def const(self, name: str, array: np.ndarray) -> str:
        # (np.ascontiguousarray would turn a 0-d scalar into shape [1], which Range rejects)
        self.initializers.append(numpy_helper.from_array(np.require(array, requirements="C"), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        outputs = [f"{name}/output_{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def one(self, op: str, inputs: list[str], name: str, domain: str = "", **attrs) -> str:
        return self.node(op, inputs, name, 1, domain, **attrs)[0]


@dataclass(frozen=True)
class LinearPlan:
    """How one projection is computed: its precision and, if kept from the GGUF, the source blocks."""

    precision: Precision
    block_size: int = 32
    symmetric: bool = False
    source: list[SourceBlocks] | None = None  # the fused rows' blocks, in order
    lora: bool = False  # a LoRA branch beside it (quantize.lora), added by the block after any bias


def linear(b: GraphBuilder, name: str, x: str, w: np.ndarray, spec: QuantSpec, plan: LinearPlan,
           key: str | None = None) -> str:
    """y = x @ w.T for w [N, K], in the plan's precision. Returns the output name.

    key names the (first) HF weight: its calibration importance weights the quantization error, and the
    input tensor is recorded so that calibration can capture it.
    """
    n, k = w.shape
    if key:
        b.linear_inputs[key] = x
    importance = b.importance.get(key) if key else None
    if plan.precision == "fp32":
        b.report.append(f"{name}: fp32 [{n}x{k}]")
        return b.one("MatMul", [x, b.const(f"{name}.weight", w.T.astype(np.float32))], f"{name}/MatMul")
    if plan.source is not None:
        return _linear_from_source(b, name, x, plan.source, spec)
    bits = 8 if plan.precision == "int8" else 4
    # popped: each is read once, and the last reference goes with it (GBs past 1B parameters, all alive while
    # the graph grew to the model's size)
    hessian = b.hessians.pop(key, None) if key else None
    if spec.method == "gptq" and hessian is not None:
        q = nbits.quantize_gptq(w, bits, plan.block_size, plan.symmetric, hessian, importance=importance,
                                act_order=spec.act_order, damp=spec.gptq_damp, overwrite_hessian=True)
    elif spec.method in ("search", "gptq"):
        q = nbits.quantize_search(w, bits, plan.block_size, plan.symmetric, importance)
    else:
        q = nbits.quantize_rtn(w, bits, plan.block_size, plan.symmetric)
    b.report.append(f"{name}: int{bits} {spec.method} block {plan.block_size} "
                    f"{'sym' if plan.symmetric else 'asym'}{' imatrix' if importance is not None else ''}")
    return _matmul_nbits(b, name, x, q, spec.accuracy_level)


def _matmul_nbits(b: GraphBuilder, name: str, x: str, q: nbits.BlockQuantized, accuracy_level: int) -> str:
    inputs = [x, b.const(f"{name}.qweight", q.packed), b.const(f"{name}.scales", q.scales.astype(np.float32))]
    if q.zero_points is not None:
        inputs.append(b.const(f"{name}.zero_points", q.zero_points))
    return b.one("MatMulNBits", inputs, f"{name}/MatMulNBits", MS_DOMAIN, K=q.k, N=q.n, bits=q.bits,
                 block_size=q.block_size, accuracy_level=accuracy_level)


def _linear_from_source(b: GraphBuilder, name: str, x: str, blocks: list[SourceBlocks], spec: QuantSpec) -> str:
    """MatMulNBits over a GGUF's own blocks. Q4_1's per-block minimums m add sum_block(x) @ m.T.

    For a Q4_1 block, w = d*q + m, so x.w = sum(x*d*q) + m*sum(x): the first term is MatMulNBits with
    zero point 0, the second a small [.., k_blocks] x [k_blocks, N] MatMul of per-block activation sums.
    (Float zero points would express it directly but ran ~40x slower on CPU.)
    """
    parts = [nbits.from_gguf_blocks(s) for s in blocks]
    q = nbits.concat_rows([p[0] for p in parts])
    b.report.append(f"{name}: kept source blocks {'+'.join(s.ggml_type for s in blocks)}")
    y = _matmul_nbits(b, name, x, q, spec.accuracy_level)
    mins = [p[1] for p in parts]
    if all(m is None for m in mins):
        return y
    mins = np.concatenate([m if m is not None else np.zeros((s.shape[0], q.k // q.block_size), np.float32)
                           for m, s in zip(mins, blocks)], axis=0)  # [N, k_blocks]
    shape = b.const(f"{name}.block_shape", np.array([0, 0, q.k // q.block_size, q.block_size], np.int64))
    xb = b.one("Reshape", [x, shape], f"{name}/min_correction/Reshape")
    sums = b.one("ReduceSum", [xb, b.const(f"{name}.axis", np.array([-1], np.int64))],
                 f"{name}/min_correction/ReduceSum", keepdims=0)
    corr = b.one("MatMul", [sums, b.const(f"{name}.block_mins", mins.T.astype(np.float32))],
                 f"{name}/min_correction/MatMul")
    return b.one("Add", [y, corr], f"{name}/min_correction/Add")
