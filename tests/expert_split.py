"""A dense Llama-block checkpoint turned into a Mixture of Experts that computes the same thing: the test tool that
proves packing, routing and the MoE / QMoE path on real weights (SmolLM2) when no real MoE weights are at hand.

Each layer's gated MLP of intermediate size I is split into E experts of I/E neurons: expert e holds rows
e*I/E .. (e+1)*I/E of gate and up and the same columns of down. A SwiGLU MLP is a sum over its neurons, so the
experts' outputs summed with weight 1 each are the dense MLP's output. The router is all zeros: the softmax gives
every expert 1/E, and with all E chosen (k = E) each down is scaled by E to make that weight 1 (both exact in
fp32 for E a power of two). With k < E the router is random (seeded) and the model is only a speed proxy: it no
longer computes the dense model.

Used by tests/quantize/test_expert_split.py, in memory: nothing is written.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from quantize.checkpoint import Checkpoint, validate


def split_experts(ckpt: Checkpoint, experts: int, per_token: int | None = None, seed: int = 0) -> Checkpoint:
    """ckpt (a llama or mistral model) as a Mixtral of `experts` experts, `per_token` (default: all) chosen per
    token; exact when all are chosen."""
    g = ckpt.geometry
    per_token = per_token or experts
    if g.architecture not in ("llama", "mistral"):
        raise ValueError(f"a {g.architecture} model cannot be split into a Mixtral (llama and mistral blocks only)")
    if g.intermediate_size % experts:
        raise ValueError(f"intermediate size {g.intermediate_size} does not split into {experts} experts")
    inter = g.intermediate_size // experts
    rng = np.random.default_rng(seed)
    weights = {n: w for n, w in ckpt.weights.items() if ".mlp." not in n}
    for i in range(g.num_layers):
        p = f"model.layers.{i}.mlp."
        gate, up, down = (ckpt.weights[p + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
        weights[p + "experts.gate_proj.weight"] = gate.reshape(experts, inter, g.hidden_size)
        weights[p + "experts.up_proj.weight"] = up.reshape(experts, inter, g.hidden_size)
        # down [H, I] -> [E, H, I/E]; times the routing weight's inverse (1/E each with all chosen)
        weights[p + "experts.down_proj.weight"] = np.ascontiguousarray(
            down.reshape(g.hidden_size, experts, inter).transpose(1, 0, 2) * np.float32(per_token))
        weights[p + "gate.weight"] = (np.zeros((experts, g.hidden_size), np.float32) if per_token == experts
                                      else rng.standard_normal((experts, g.hidden_size)).astype(np.float32))
    geometry = g.model_copy(update={"architecture": "mixtral", "intermediate_size": inter, "num_experts": experts,
                                    "num_experts_per_tok": per_token, "moe_renormalize": True})
    split = dataclasses.replace(ckpt, geometry=geometry, weights=weights, source_blocks={},
                                source_name=f"{ckpt.source_name}-{experts}x{per_token}")
    validate(split)
    return split

