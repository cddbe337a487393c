"""A Mixture of Experts layer in the graph: a router MatMul, then one ONNX Runtime MoE (fp32) or QMoE (INT8/INT4)
node that routes each token to its top k experts and sums their SwiGLU MLPs by routing weight.

    x [B, S, H] ─┬─ MatMul(router^T) [B, S, E] ─ Reshape [B*S, E] ─┬──────────────┐  (router logits: fp32)
                 │                                   [QMoE, no renormalising: Softmax ─ router_weights]
                 └──────────────────────────────────────────────── MoE / QMoE(k, renormalise) ─ y [B, S, H]
                      fc1 [E, 2I, H]: gate and up rows interleaved (g0 u0 g1 u1 ...), fc2 [E, H, I]

What the CPU kernels compute, measured on onnxruntime 1.32 against numpy (tests/quantize/test_moe.py): a
softmax over all E logits, the top k, weights divided by their sum when normalize_routing_weights=1, and
SwiGLU silu(g) * u with activation_alpha 1 and activation_beta 0 from fc1's interleaved rows (swiglu_fusion=1:
the only layout the CPU kernels take). QMoE, unlike MoE, renormalises the top k weights whatever
normalize_routing_weights says, unless router_weights are given: then it picks the top k of router_probs and
weighs them by router_weights' values as they are (renormalised only with normalize_routing_weights=1), so a
model that does not renormalise (OLMoE) gives it the softmax as router_weights. Top-k-then-softmax routing
(Mixtral, Granite-MoE) is the same as softmax-then-top-k renormalised. Tied logits pick the highest-numbered
experts. QMoE's 4-bit experts at accuracy_level 0 match the dequantized weights to fp32
rounding; its block-wise 8-bit experts (and 4-bit at accuracy_level 4) quantize activations to int8 per block,
as MatMulNBits does at accuracy_level 4. Its speed at one decode token (SmolLM2's split sizes, top 2 of 8, an
interleaved microbenchmark, fastest of 30 rounds at load ~2.5): 22 us against 84 us for the dense MLP's two
MatMulNBits (3.8x; the weights read are a quarter), so the layer is not what keeps a model's speed-up under its
active share. These raw weights take the kernel's QNBit path with or without zero points (turned off by
ORT_QMOE_CPU_QNBIT_GEMM=0 it is ~10x slower); symmetric experts, block 32, weights_prepacked=-1 and
ep.cpu.qmoe_deferred_scale were no faster than the defaults here, block 16 and accuracy_level 0 slower.

Experts are quantized per expert by the dense projections' methods. Under GPTQ, calibration routes the layer's
input to the experts (quantize.expert_hessians): an expert's projection that saw at least its input width in
tokens gets GPTQ from its own tokens' Hessian, and one that saw fewer keeps error-searched scales; the build
report counts both per layer. Importance weighting (imatrix) is not applied to experts.
"""
from __future__ import annotations

import numpy as np

from agent.wire import Geometry
from quantize import nbits
from quantize.checkpoint import Checkpoint
from quantize.expert_hessians import ExpertHessians, experts_key, min_gptq_tokens
from quantize.linear import MS_DOMAIN, GraphBuilder
from quantize.precision import QuantSpec


class MoEBuildError(ValueError):
    """A Mixture of Experts layer the kernels cannot run as asked: the message names what."""


def interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """fc1 for swiglu_fusion=1: [E, 2I, H] with row 2j gate's j and row 2j+1 up's j."""
    e, i, h = gate.shape
    return np.stack([gate, up], axis=2).reshape(e, 2 * i, h)


def expert_block_size(spec: QuantSpec, hidden: int, inter: int) -> int:
    """QMoE's one block size for fc1 and fc2: the spec's gate_up block size, or the largest power of two below it
    (down to 16) that divides both the hidden and the expert's intermediate size (the kernel requires both)."""
    wanted = spec.block_sizes.get("gate_up", spec.block_size)
    for bs in (128, 64, 32, 16):
        if bs <= wanted and hidden % bs == 0 and inter % bs == 0:
            return bs
    raise MoEBuildError(f"no QMoE block size of 16..{wanted} divides both hidden size {hidden} and expert "
                        f"intermediate size {inter}")


def quantize_experts(w: np.ndarray, bits: int, block_size: int, symmetric: bool, method: str,
                     spec: QuantSpec | None = None, hessians: np.ndarray | None = None,
                     tokens: np.ndarray | None = None) -> tuple[list[nbits.BlockQuantized], int]:
    """Each expert's [N, K] weight quantized on its own: rounding to nearest or the error-searched scales, or GPTQ
    (spec's damping and order) from its Hessian [K, K] in hessians [E, K, K] when its token count reaches
    min_gptq_tokens(K). Returns the experts and how many got GPTQ; the Hessians are consumed."""
    quantize = nbits.quantize_rtn if method == "rtn" else nbits.quantize_search
    enough = np.zeros(w.shape[0], bool) if tokens is None else tokens >= min_gptq_tokens(w.shape[2])
    out = []
    for e in range(w.shape[0]):
        if enough[e]:
            out.append(nbits.quantize_gptq(w[e], bits, block_size, symmetric, hessians[e], act_order=spec.act_order,
                                           damp=spec.gptq_damp, overwrite_hessian=True))
        else:
            out.append(quantize(w[e], bits, block_size, symmetric))
    return out, int(enough.sum())


def _stacked(b: GraphBuilder, name: str, qs: list[nbits.BlockQuantized]) -> list[str]:
    """[weights, scales, zero points or ""] as QMoE takes them: [E, N, K*bits/8], [E, N, K/block], [E, N, ...]."""
    weights = b.const(f"{name}.qweight", np.stack([q.packed.reshape(q.n, -1) for q in qs]))
    scales = b.const(f"{name}.scales", np.stack([q.scales for q in qs]).astype(np.float32))
    zero_points = "" if qs[0].zero_points is None else b.const(f"{name}.zero_points",
                                                                 np.stack([q.zero_points for q in qs]))
    return [weights, scales, zero_points]


def moe_layer(b: GraphBuilder, ckpt: Checkpoint, i: int, x: str, spec: QuantSpec) -> str:
    """Layer i's experts applied to x [B, S, H]; returns y [B, S, H]."""
    g = ckpt.geometry
    p, n = f"model.layers.{i}.mlp.", f"/model/layers.{i}/moe"
    b.linear_inputs[experts_key(i)] = x  # calibration routes it to the experts for their Hessians
    router = ckpt.weights[p + "gate.weight"]  # [E, H]
    logits = b.one("MatMul", [x, b.const(f"{p}gate.weight", router.T.astype(np.float32))], f"{n}/router/MatMul")
    probs = b.one("Reshape", [logits, b.const(f"{p}gate.shape", np.array([-1, g.num_experts], np.int64))],
                  f"{n}/router/Reshape")
    fc1 = interleave(ckpt.weights[p + "experts.gate_proj.weight"], ckpt.weights[p + "experts.up_proj.weight"])
    fc2 = ckpt.weights[p + "experts.down_proj.weight"]
    routing = dict(k=g.num_experts_per_tok, normalize_routing_weights=int(g.moe_renormalize),
                   activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0)
    if spec.precision == "fp32":
        b.report.append(f"{n}: router fp32, experts fp32 {_shape(fc1)} (MoE, top {g.num_experts_per_tok})")
        return b.one("MoE", [x, probs, b.const(f"{p}experts.fc1", fc1.astype(np.float32)), "",
                             b.const(f"{p}experts.fc2", fc2.astype(np.float32))], f"{n}/MoE", MS_DOMAIN, **routing)
    return _qmoe(b, g, p, n, [x, probs], fc1, fc2, spec, routing, experts_key(i))


def _shape(fc1: np.ndarray) -> str:
    return f"[{fc1.shape[0]}x{fc1.shape[1]}x{fc1.shape[2]}]"


def _qmoe(b: GraphBuilder, g: Geometry, p: str, n: str, inputs: list[str], fc1: np.ndarray, fc2: np.ndarray,
          spec: QuantSpec, routing: dict, key: str) -> str:
    """The QMoE node over [x, router logits], its experts quantized per expert as the spec asks (GPTQ from the
    layer's routed Hessians under key, where calibration gave them)."""
    x, probs = inputs
    bits = spec.bits
    block = expert_block_size(spec, g.hidden_size, g.intermediate_size)
    method = "rtn" if spec.method == "rtn" else "search"
    routed = b.hessians.pop(key, None) if spec.method == "gptq" else None
    h1, h2, tokens = (None, None, None) if routed is None else (routed.fc1, routed.fc2, routed.tokens)
    q1, gptq1 = quantize_experts(fc1, bits, block, spec.is_symmetric("gate_up"), method, spec, h1, tokens)
    w1 = _stacked(b, f"{p}experts.fc1", q1)
    q2, gptq2 = quantize_experts(fc2, bits, block, spec.is_symmetric("down"), method, spec, h2, tokens)
    w2 = _stacked(b, f"{p}experts.fc2", q2)
    b.report.append(f"{n}: router fp32, experts int{bits} {method if routed is None else 'gptq'} block {block} "
                    f"{_shape(fc1)} (QMoE, top {g.num_experts_per_tok}){_notes(spec, b, routed, gptq1, gptq2)}")
    # QMoE's router_weights (input 14): the softmax, for a model whose top k weights are not renormalised
    weights = "" if g.moe_renormalize else b.one("Softmax", [probs], f"{n}/router/Softmax", axis=-1)
    inputs = [x, probs, w1[0], w1[1], "", w2[0], w2[1], "", "", "", "", w1[2], w2[2], "", weights]
    while not inputs[-1]:  # optional inputs left out at the end rather than named ""
        inputs.pop()
    return b.one("QMoE", inputs, f"{n}/QMoE", MS_DOMAIN, expert_weight_bits=bits, block_size=block, weights_prepacked=0,
                 accuracy_level=spec.accuracy_level, **routing)


def _notes(spec: QuantSpec, b: GraphBuilder, routed: ExpertHessians | None, gptq1: int, gptq2: int) -> str:
    """The report's account of what the experts did not get: GPTQ (per expert, with the token counts) and
    importance, the source's blocks."""
    notes = ""
    if routed is not None:
        e, h, inter = len(routed.tokens), routed.fc1.shape[1], routed.fc2.shape[1]
        notes = (f" GPTQ for gate_up of {gptq1}/{e} experts, down of {gptq2}/{e}; tokens per expert "
                 f"{routed.tokens.min()}..{routed.tokens.max()}")
        if gptq1 < e or gptq2 < e:
            notes += (f"; the rest saw fewer tokens than the input width ({min_gptq_tokens(h)} for gate_up, "
                      f"{min_gptq_tokens(inter)} for down) and keep error-searched scales")
    elif spec.method == "gptq":
        notes = " (GPTQ needs calibration: experts keep error-searched scales)"
    if b.importance:
        notes += " (calibration importance is not applied to experts)"
    if spec.keep_source_quant:  # a GGUF's stacked expert blocks are read dequantized and requantized here
        notes += " (the source's blocks are not kept for experts)"
    return notes
