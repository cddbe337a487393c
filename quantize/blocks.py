"""The decoder block and its variants, as quantize.architectures names them, in ONNX contrib ops.

    layer i:  h, residual = SkipSimplifiedLN(prev_out, residual)           (layer 0: SimplifiedLN of the embedding)
              qkv = h @ Wqkv (+ bias)                                        [QK-norm: RMSNorm per head of q and k]
              a = GQA(qkv, past_i, seqlens_k, query_seqlens; RoPE, window)   @ Wo  [sandwich: RMSNorm(a)] [* m_res]
              h, residual = SkipSimplifiedLN(a, residual)
              gate, up = split(h @ Wgate_up);  out = act(gate) * up @ Wdown  [sandwich: RMSNorm(out)] [* m_res]
                        (a Mixture of Experts: router and experts in one MoE / QMoE node, quantize.moe)

Per layer, the geometry picks the RoPE tables (the global base, or the windowed layers' own base), none at all
for a NoPE layer, and GroupQueryAttention's local window. GroupQueryAttention takes q, k and v packed, except
after a QK-norm, which must see q and k apart. The norms run as nodes on CPU: ONNX Runtime's fused q/k-norm
inputs of GroupQueryAttention are honoured by its CUDA and WebGPU providers only.
"""
from __future__ import annotations

import numpy as np

from agent import wire
from agent.wire import Geometry
from quantize import lora, rope
from quantize.architectures import by_name
from quantize.checkpoint import Checkpoint
from quantize.linear import MS_DOMAIN, GraphBuilder, linear
from quantize.moe import MoEBuildError, moe_layer
from quantize.precision import QuantSpec

GLOBAL_ROPE = ("cos_cache", "sin_cache")
LOCAL_ROPE = ("cos_cache_local", "sin_cache_local")


def uses_local_rope(g: Geometry, i: int) -> bool:
    """Whether layer i turns by the windowed layers' own RoPE base (Gemma 3's local layers)."""
    return g.rope_local_theta is not None and windowed(g, i)


def windowed(g: Geometry, i: int) -> bool:
    return g.sliding_window is not None and (g.window_layers is None or i in g.window_layers)


def rotary_caches(b: GraphBuilder, g: Geometry) -> None:
    """cos/sin tables [context_length, rotary_dim/2] for half-split RoPE, computed by the graph: one pair for the
    global base and, when windowed layers have their own, one for theirs.

    Built from positions x inverse frequencies at session start (ORT folds it to a constant) rather
    than stored: for an 8k context the two tables would add 2 MB to the file.
    """
    dim = g.rotary_dim or g.head_dim
    turned = [i for i in range(g.num_layers) if i not in g.nope_layers]
    if any(not uses_local_rope(g, i) for i in turned):
        _rotary_pair(b, g, rope.inv_freq(g.rope_theta, dim, g.rope_freq_factors), GLOBAL_ROPE, wire.ROPE_TABLE_LIMITS[0])
    if any(uses_local_rope(g, i) for i in turned):
        _rotary_pair(b, g, rope.inv_freq(g.rope_local_theta, dim), LOCAL_ROPE, wire.ROPE_TABLE_LIMITS[1])


def _rotary_pair(b: GraphBuilder, g: Geometry, inv_freq: np.ndarray, outputs: tuple[str, str], limit: str) -> None:
    n = limit.removesuffix(".limit")
    pos = b.one("Range", [b.const(f"{n}.start", np.array(0, np.float32)),
                          b.const(limit, np.array(g.context_length, np.float32)),
                          b.const(f"{n}.delta", np.array(1, np.float32))], f"{n}/Range")
    col = b.one("Unsqueeze", [pos, b.const(f"{n}.axis", np.array([1], np.int64))], f"{n}/Unsqueeze")
    ang = b.one("Mul", [col, b.const(f"{n}.inv_freq", inv_freq.astype(np.float32)[None, :])], f"{n}/Mul")
    for op, out in zip(("Cos", "Sin"), outputs):
        y = b.one(op, [ang], f"{n}/{op}")
        if g.rope_attention_factor != 1:
            y = b.one("Mul", [y, b.const(f"{n}.{op}.factor", np.array(g.rope_attention_factor, np.float32))],
                      f"{n}/{op}/Mul")
        b.nodes[-1].output[0] = out


def rms_norm(b: GraphBuilder, name: str, x: str, gamma: np.ndarray, eps: float) -> str:
    return b.one("SimplifiedLayerNormalization", [x, b.const(f"{name}.weight", gamma)], f"{name}/LayerNorm",
                 epsilon=eps, axis=-1, stash_type=1)


def skip_norm(b: GraphBuilder, name: str, x: str, residual: str, gamma: np.ndarray, eps: float) -> tuple[str, str]:
    """(normed, new residual) = SkipSimplifiedLN(x, residual)."""
    out = b.node("SkipSimplifiedLayerNormalization", [x, residual, b.const(f"{name}.weight", gamma)],
                 f"{name}/SkipLayerNorm", 4, MS_DOMAIN, epsilon=eps)
    return out[0], out[3]


def _head_norm(b: GraphBuilder, name: str, x: str, gamma: np.ndarray, g: Geometry) -> str:
    """RMSNorm over each head_dim slice of x [B, S, heads * head_dim] (Qwen3's and Gemma 3's q/k norms)."""
    heads = b.one("Reshape", [x, b.const(f"{name}.heads", np.array([0, 0, -1, g.head_dim], np.int64))],
                  f"{name}/Reshape")
    normed = rms_norm(b, name, heads, gamma, g.rms_norm_eps)
    return b.one("Reshape", [normed, b.const(f"{name}.flat", np.array([0, 0, -1], np.int64))], f"{name}/Reshape_out")


def _qkv(b: GraphBuilder, ckpt: Checkpoint, i: int, x: str, spec: QuantSpec, plans: dict) -> list[str]:
    """GroupQueryAttention's first three inputs: packed qkv, or q, k and v after a QK-norm."""
    g = ckpt.geometry
    p, n = f"model.layers.{i}.self_attn.", f"/model/layers.{i}/attn"
    wqkv = np.concatenate([ckpt.weights[p + x + ".weight"] for x in ("q_proj", "k_proj", "v_proj")], axis=0)
    qkv = linear(b, f"{n}/qkv_proj", x, wqkv, spec, plans["qkv"][i], p + "q_proj.weight")
    if g.attention_bias:
        bias = np.concatenate([ckpt.weights[p + x + ".bias"] for x in ("q_proj", "k_proj", "v_proj")])
        qkv = b.one("Add", [qkv, b.const(f"{p}qkv_proj.bias", bias.astype(np.float32))], f"{n}/qkv_proj/Add")
    qkv = lora.branch(b, plans["qkv"][i], i, "qkv", x, qkv, wqkv.shape)
    arch = by_name(g.architecture)
    if not arch.qk_norm:
        return [qkv, "", ""]
    q_dim, kv_dim = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    q, k, v = b.node("Split", [qkv, b.const(f"{p}qkv_split", np.array([q_dim, kv_dim, kv_dim], np.int64))],
                     f"{n}/Split", 3, axis=-1)
    if arch.qk_norm_full_width:  # OLMoE: over all of q's channels, and all of k's
        return [rms_norm(b, f"{p}q_norm", q, ckpt.weights[p + "q_norm.weight"], g.rms_norm_eps),
                rms_norm(b, f"{p}k_norm", k, ckpt.weights[p + "k_norm.weight"], g.rms_norm_eps), v]
    return [_head_norm(b, f"{p}q_norm", q, ckpt.weights[p + "q_norm.weight"], g),
            _head_norm(b, f"{p}k_norm", k, ckpt.weights[p + "k_norm.weight"], g), v]


def attention(b: GraphBuilder, ckpt: Checkpoint, i: int, x: str, spec: QuantSpec, plans: dict) -> str:
    g = ckpt.geometry
    p, n = f"model.layers.{i}.self_attn.", f"/model/layers.{i}/attn"
    turned = i not in g.nope_layers
    cos, sin = (LOCAL_ROPE if uses_local_rope(g, i) else GLOBAL_ROPE) if turned else ("", "")
    attrs = {"scale": g.attention_scale} if g.attention_scale is not None else {}
    outs = b.node("GroupQueryAttention",
                  [*_qkv(b, ckpt, i, x, spec, plans), wire.past_key(i), wire.past_value(i), wire.SEQLENS_K,
                   wire.TOTAL_SEQUENCE_LENGTH, cos, sin, "", "", "", "", "", "", "", wire.QUERY_SEQLENS],
                  f"{n}/GroupQueryAttention", 3, MS_DOMAIN,
                  num_heads=g.num_heads, kv_num_heads=g.num_kv_heads, do_rotary=int(turned), rotary_interleaved=0,
                  local_window_size=g.sliding_window if windowed(g, i) else -1, **attrs)
    # GQA's outputs are the graph's present KV: rename them so that IOBinding can bind them by name.
    gqa = b.nodes[-1]
    gqa.output[1], gqa.output[2] = wire.present_key(i), wire.present_value(i)
    y = linear(b, f"{n}/o_proj", outs[0], ckpt.weights[p + "o_proj.weight"], spec, plans["o"][i], p + "o_proj.weight")
    return lora.branch(b, plans["o"][i], i, "o", outs[0], y, ckpt.weights[p + "o_proj.weight"].shape)


def mlp(b: GraphBuilder, ckpt: Checkpoint, i: int, x: str, spec: QuantSpec, plans: dict) -> str:
    if ckpt.geometry.num_experts:
        if plans["gate_up"][i].lora or plans["down"][i].lora:
            raise MoEBuildError("LoRA on gate, up or down of a Mixture of Experts is not supported (its experts "
                                "run inside one QMoE node); adapt q, k, v or o")
        return moe_layer(b, ckpt, i, x, spec)
    p, n = f"model.layers.{i}.mlp.", f"/model/layers.{i}/mlp"
    inter = ckpt.geometry.intermediate_size
    w = np.concatenate([ckpt.weights[p + "gate_proj.weight"], ckpt.weights[p + "up_proj.weight"]], axis=0)
    gu = linear(b, f"{n}/gate_up_proj", x, w, spec, plans["gate_up"][i], p + "gate_proj.weight")
    gu = lora.branch(b, plans["gate_up"][i], i, "gate_up", x, gu, w.shape)
    gate, up = b.node("Split", [gu, b.const(f"{p}split", np.array([inter, inter], np.int64))], f"{n}/Split", 2, axis=-1)
    if by_name(ckpt.geometry.architecture).activation == "gelu_tanh":
        act = b.one("Gelu", [gate], f"{n}/act/Gelu", approximate="tanh")
    else:
        act = b.one("Mul", [gate, b.one("Sigmoid", [gate], f"{n}/act/Sigmoid")], f"{n}/act/Mul")
    h = b.one("Mul", [act, up], f"{n}/Mul")
    y = linear(b, f"{n}/down_proj", h, ckpt.weights[p + "down_proj.weight"], spec, plans["down"][i],
               p + "down_proj.weight")
    return lora.branch(b, plans["down"][i], i, "down", h, y, ckpt.weights[p + "down_proj.weight"].shape)


def _branch_out(b: GraphBuilder, ckpt: Checkpoint, i: int, y: str, post_norm: str) -> str:
    """A block's output as the residual stream adds it: normed after (Gemma), scaled (Granite)."""
    g = ckpt.geometry
    if by_name(g.architecture).sandwich_norm:
        y = rms_norm(b, f"model.layers.{i}.{post_norm}", y, ckpt.layer(i, post_norm + ".weight"), g.rms_norm_eps)
    if g.residual_multiplier != 1:
        m = b.const(f"model.layers.{i}.{post_norm}.multiplier", np.array(g.residual_multiplier, np.float32))
        y = b.one("Mul", [y, m], f"/model/layers.{i}/{post_norm}/residual_multiplier")
    return y


def decoder_layer(b: GraphBuilder, ckpt: Checkpoint, i: int, x: str, residual: str, spec: QuantSpec,
                  plans: dict) -> tuple[str, str]:
    """(block output, residual stream before it): x is the previous block's output (layer 0: the normed
    embedding, with residual the embedding itself)."""
    g = ckpt.geometry
    if i > 0:
        x, residual = skip_norm(b, f"model.layers.{i}.input_layernorm", x, residual,
                                ckpt.layer(i, "input_layernorm.weight"), g.rms_norm_eps)
    sandwich = by_name(g.architecture).sandwich_norm
    attn = _branch_out(b, ckpt, i, attention(b, ckpt, i, x, spec, plans), "post_attention_layernorm")
    pre_mlp = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    x, residual = skip_norm(b, f"model.layers.{i}.{pre_mlp}", attn, residual, ckpt.layer(i, pre_mlp + ".weight"),
                            g.rms_norm_eps)
    return _branch_out(b, ckpt, i, mlp(b, ckpt, i, x, spec, plans), "post_feedforward_layernorm"), residual
