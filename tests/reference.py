"""A plain numpy decoder forward pass: the golden reference that the ONNX graph and the engine are checked against.

Full recomputation, no KV cache, float64 accumulation: RMSNorm, half-split RoPE, grouped-query attention
with a causal (and, per layer, sliding-window) mask, a gated MLP, and each architecture's variants (QK-norm,
Gemma's norms after attention and MLP, partial and per-layer RoPE, multipliers, a Mixture of Experts' routing
in its architecture's own order). Slow, obvious and independent of ONNX Runtime on purpose.
"""
from __future__ import annotations

import numpy as np

from quantize.architectures import by_name
from quantize.checkpoint import Checkpoint


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def rope(x: np.ndarray, theta: float, factors: tuple[float, ...] | None = None, dim: int | None = None,
         attention_factor: float = 1.0) -> np.ndarray:
    # x: [H, T, D]; rotate the two halves of the first dim channels of each head (HF's rotate_half convention,
    # partial when dim < D); factors divide the frequencies (RoPE scaling)
    dim = dim or x.shape[-1]
    inv_freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    ang = np.arange(x.shape[1])[:, None] * inv_freq[None, :]  # [T, dim/2]
    cos, sin = np.cos(ang) * attention_factor, np.sin(ang) * attention_factor
    x1, x2, rest = x[..., : dim // 2], x[..., dim // 2: dim], x[..., dim:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _windowed(g, i: int) -> bool:
    return g.sliding_window is not None and (g.window_layers is None or i in g.window_layers)


def _rope(g, i: int, x: np.ndarray) -> np.ndarray:
    """Layer i's RoPE: none on a NoPE layer, the windowed layers' own base (unscaled) where they have one."""
    if i in g.nope_layers:
        return x
    if g.rope_local_theta is not None and _windowed(g, i):
        return rope(x, g.rope_local_theta, None, g.rotary_dim, g.rope_attention_factor)
    return rope(x, g.rope_theta, g.rope_freq_factors, g.rotary_dim, g.rope_attention_factor)


def attention(ckpt: Checkpoint, i: int, x: np.ndarray) -> np.ndarray:
    g = ckpt.geometry
    t = x.shape[0]

    def proj(name: str, heads: int) -> np.ndarray:
        y = x @ ckpt.layer(i, f"self_attn.{name}.weight").T.astype(np.float64)
        if g.attention_bias:
            y = y + ckpt.layer(i, f"self_attn.{name}.bias")
        norm = f"self_attn.{name[0]}_norm.weight"
        qk_norm = name != "v_proj" and f"model.layers.{i}.{norm}" in ckpt.weights
        if qk_norm and by_name(g.architecture).qk_norm_full_width:  # OLMoE: over all heads' channels at once
            y = rms_norm(y, ckpt.layer(i, norm), g.rms_norm_eps)
        y = y.reshape(t, heads, g.head_dim).transpose(1, 0, 2)  # [H, T, D]
        if qk_norm and not by_name(g.architecture).qk_norm_full_width:  # QK-norm, per head
            y = rms_norm(y, ckpt.layer(i, norm), g.rms_norm_eps)
        return y

    q = _rope(g, i, proj("q_proj", g.num_heads))
    k = _rope(g, i, proj("k_proj", g.num_kv_heads))
    v = proj("v_proj", g.num_kv_heads)
    rep = g.num_heads // g.num_kv_heads
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    scale = g.attention_scale if g.attention_scale is not None else 1 / np.sqrt(g.head_dim)
    scores = q @ k.transpose(0, 2, 1) * scale
    later, earlier = np.indices((t, t))
    masked = (earlier > later) | ((later - earlier >= g.sliding_window) if _windowed(g, i) else False)
    scores = np.where(masked, -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = (p @ v).transpose(1, 0, 2).reshape(t, -1)
    return out @ ckpt.layer(i, "self_attn.o_proj.weight").T


def gated_mlp(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray, activation: str) -> np.ndarray:
    gate, up = x @ gate_w.T, x @ up_w.T
    if activation == "gelu_tanh":
        act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
    else:
        act = gate / (1 + np.exp(-gate))
    return (act * up) @ down_w.T


def route(logits: np.ndarray, k: int, softmax_first: bool, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """One token's (experts, weights) from its router logits [E], in the architecture's order: softmax over all
    then the top k (renormalised when asked), or the top k logits then a softmax over those."""
    top = np.argsort(-logits, kind="stable")[:k]
    if softmax_first:
        p = np.exp(logits - logits.max())
        p /= p.sum()
        w = p[top]
        return top, w / w.sum() if renormalize else w
    w = np.exp(logits[top] - logits[top].max())
    return top, w / w.sum()


def mlp(ckpt: Checkpoint, i: int, x: np.ndarray) -> np.ndarray:
    g, arch = ckpt.geometry, by_name(ckpt.geometry.architecture)
    if not g.num_experts:
        return gated_mlp(x, *(ckpt.layer(i, f"mlp.{n}_proj.weight") for n in ("gate", "up", "down")), arch.activation)
    gate, up, down = (ckpt.layer(i, f"mlp.experts.{n}_proj.weight") for n in ("gate", "up", "down"))
    out = np.zeros_like(x)
    for t, logits in enumerate(x @ ckpt.layer(i, "mlp.gate.weight").T):
        for e, w in zip(*route(logits, g.num_experts_per_tok, arch.moe.softmax_first, g.moe_renormalize)):
            out[t] += w * gated_mlp(x[t], gate[e], up[e], down[e], arch.activation)
    return out


def forward(ckpt: Checkpoint, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] (float64) for every position of ids."""
    g = ckpt.geometry
    sandwich = by_name(g.architecture).sandwich_norm
    pre_mlp = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"

    def branch(i: int, y: np.ndarray, post: str) -> np.ndarray:
        if sandwich:
            y = rms_norm(y, ckpt.layer(i, post + ".weight"), g.rms_norm_eps)
        return y * g.residual_multiplier

    x = ckpt.weights["model.embed_tokens.weight"][np.asarray(ids)].astype(np.float64) * g.embedding_multiplier
    for i in range(g.num_layers):
        a = attention(ckpt, i, rms_norm(x, ckpt.layer(i, "input_layernorm.weight"), g.rms_norm_eps))
        x = x + branch(i, a, "post_attention_layernorm")
        m = mlp(ckpt, i, rms_norm(x, ckpt.layer(i, pre_mlp + ".weight"), g.rms_norm_eps))
        x = x + branch(i, m, "post_feedforward_layernorm")
    x = rms_norm(x, ckpt.weights["model.norm.weight"], g.rms_norm_eps)
    return x @ ckpt.lm_head.T.astype(np.float64) * g.logit_multiplier


def greedy(ckpt: Checkpoint, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, recomputing everything each step."""
    ids = list(ids)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(forward(ckpt, ids)[-1]))
        out.append(nxt)
        ids.append(nxt)
    return out
