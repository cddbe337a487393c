"""A plain numpy Llama forward pass: the golden reference that the ONNX graph and the engine are checked against.

Full recomputation, no KV cache, float64 accumulation: RMSNorm, half-split RoPE, grouped-query attention
with a causal mask, SwiGLU. Slow, obvious and independent of ONNX Runtime on purpose.
"""
from __future__ import annotations

import numpy as np

from quantize.checkpoint import Checkpoint


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def rope(x: np.ndarray, theta: float, factors: tuple[float, ...] | None = None) -> np.ndarray:
    # x: [H, T, D]; rotate the two halves of each head (HF's rotate_half convention); factors divide the
    # frequencies (RoPE scaling)
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    ang = np.arange(x.shape[1])[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(ckpt: Checkpoint, i: int, x: np.ndarray) -> np.ndarray:
    g = ckpt.geometry
    t = x.shape[0]

    def proj(name: str, heads: int) -> np.ndarray:
        y = x @ ckpt.layer(i, f"self_attn.{name}.weight").T.astype(np.float64)
        if g.attention_bias:
            y = y + ckpt.layer(i, f"self_attn.{name}.bias")
        return y.reshape(t, heads, g.head_dim).transpose(1, 0, 2)  # [H, T, D]

    q = rope(proj("q_proj", g.num_heads), g.rope_theta, g.rope_freq_factors)
    k = rope(proj("k_proj", g.num_kv_heads), g.rope_theta, g.rope_freq_factors)
    v = proj("v_proj", g.num_kv_heads)
    rep = g.num_heads // g.num_kv_heads
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(g.head_dim)
    scores = scores + np.triu(np.full((t, t), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = (p @ v).transpose(1, 0, 2).reshape(t, -1)
    return out @ ckpt.layer(i, "self_attn.o_proj.weight").T


def mlp(ckpt: Checkpoint, i: int, x: np.ndarray) -> np.ndarray:
    gate = x @ ckpt.layer(i, "mlp.gate_proj.weight").T
    up = x @ ckpt.layer(i, "mlp.up_proj.weight").T
    return (gate / (1 + np.exp(-gate)) * up) @ ckpt.layer(i, "mlp.down_proj.weight").T


def forward(ckpt: Checkpoint, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] (float64) for every position of ids."""
    g = ckpt.geometry
    x = ckpt.weights["model.embed_tokens.weight"][np.asarray(ids)].astype(np.float64)
    for i in range(g.num_layers):
        x = x + attention(ckpt, i, rms_norm(x, ckpt.layer(i, "input_layernorm.weight"), g.rms_norm_eps))
        x = x + mlp(ckpt, i, rms_norm(x, ckpt.layer(i, "post_attention_layernorm.weight"), g.rms_norm_eps))
    x = rms_norm(x, ckpt.weights["model.norm.weight"], g.rms_norm_eps)
    return x @ ckpt.lm_head.T.astype(np.float64)


def greedy(ckpt: Checkpoint, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, recomputing everything each step."""
    ids = list(ids)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(forward(ckpt, ids)[-1]))
        out.append(nxt)
        ids.append(nxt)
    return out
