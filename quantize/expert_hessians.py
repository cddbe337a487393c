"""GPTQ's Hessians for a Mixture of Experts layer: the calibration tokens routed as the layer's router routes them,
so that each expert's Hessians sum only the tokens that reach it.

Calibration captures the MoE layer's input x [T, H] (under `experts_key`); here each token goes to the top k of
its router logits, and expert e accumulates
    fc1 (gate and up, input x):              sum over its tokens of x x^T                      [H, H]
    fc2 (down, input silu(gate x) * (up x)):  sum over its tokens of a a^T, a from fp32 weights [I, I]
and counts its tokens. Which experts a token reaches is the top k of its logits under every routing rule the
graph computes (softmax before or after the top k, renormalised or not: softmax is monotonic, and the rules
differ only in the weights), ties going to the highest-numbered experts as ONNX Runtime's kernels break them
(tests/quantize/test_moe.py). The tokens are not weighted by their routing weights: GPTQ fits each expert's
weights to its own inputs, as a dense projection's are.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from agent.wire import Geometry
from quantize.checkpoint import Checkpoint


def experts_key(i: int) -> str:
    """Layer i's MoE input under calibration: its capture output and its Hessians' key."""
    return f"model.layers.{i}.mlp.experts"


def experts_layer(key: str) -> int | None:
    """The layer whose experts_key this is, or None for any other key."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts", key)
    return int(m[1]) if m else None


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """[T, k] expert ids each token reaches: its k largest logits, ties to the highest-numbered expert."""
    e = logits.shape[1]
    # a stable sort of the reversed, negated logits puts the highest-numbered of tied experts first
    order = np.argsort(-logits[:, ::-1], axis=1, kind="stable")[:, :k]
    return e - 1 - order


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def min_gptq_tokens(input_width: int) -> int:
    """Tokens an expert's projection needs for GPTQ: its input width K. A Hessian summing T < K outer products
    has rank at most T, so in K - T directions only the damping term (1% of its mean diagonal) constrains the
    error GPTQ pushes there, which the calibration tokens never see and every other token does; from K tokens on
    it can have full rank. Below that the expert keeps error-searched scales."""
    return input_width


@dataclass
class ExpertHessians:
    """One MoE layer's per-expert Hessians (float64) and token counts, summed over calibration chunks by `add`."""

    router: np.ndarray  # [E, H]
    gate: np.ndarray  # [E, I, H]
    up: np.ndarray  # [E, I, H]
    k: int
    fc1: np.ndarray  # [E, H, H]: gate and up's input
    fc2: np.ndarray  # [E, I, I]: down's input
    tokens: np.ndarray  # [E] int64

    @classmethod
    def zeros(cls, ckpt: Checkpoint, i: int) -> ExpertHessians:
        g, p = ckpt.geometry, f"model.layers.{i}.mlp."
        e, h, inter = g.num_experts, g.hidden_size, g.intermediate_size
        return cls(ckpt.weights[p + "gate.weight"], ckpt.weights[p + "experts.gate_proj.weight"],
                   ckpt.weights[p + "experts.up_proj.weight"], g.num_experts_per_tok,
                   np.zeros((e, h, h)), np.zeros((e, inter, inter)), np.zeros(e, np.int64))

    @staticmethod
    def nbytes_for(g: Geometry) -> int:
        return g.num_experts * (g.hidden_size ** 2 + g.intermediate_size ** 2) * np.dtype(np.float64).itemsize

    @property
    def nbytes(self) -> int:
        return self.fc1.nbytes + self.fc2.nbytes

    def add(self, x: np.ndarray) -> None:
        """Route the tokens x [T, H] and add each expert's share."""
        chosen = top_k(x @ self.router.T, self.k)  # [T, k]
        for e in range(len(self.tokens)):
            xe = x[(chosen == e).any(axis=1)]  # [T_e, H]
            if not len(xe):
                continue
            a = silu(xe @ self.gate[e].T) * (xe @ self.up[e].T)  # [T_e, I]
            self.fc1[e] += (xe.T @ xe).astype(np.float64)
            self.fc2[e] += (a.T @ a).astype(np.float64)
            self.tokens[e] += len(xe)
