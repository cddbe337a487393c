"""Build the ONNX decoder graph for ONNX Runtime's CPU provider from a Checkpoint.

The graph uses com.microsoft contrib ops: GroupQueryAttention (rotary inside, past and present KV sharing
one preallocated buffer, ragged rows via seqlens_k / query_seqlens), SkipSimplifiedLayerNormalization and,
for quantized precisions, MatMulNBits and GatherBlockQuantized. The caller picks which positions get
logits (`logits_indices`), so a prefill pays for the vocabulary projection of one position, not all.

    input_ids ─ Embed ─┬─ [layer 0 .. n-1] ─ SkipSimplifiedLN(final) ─ GatherND(logits_indices) ─ lm_head ─ logits

    layer i:  residual, x = SkipSimplifiedLN(prev_out, residual)        (layer 0: SimplifiedLN)
              qkv = x @ Wqkv  ─ GQA(past_i, seqlens_k, query_seqlens) ─ @ Wo ─┐
              residual, x = SkipSimplifiedLN(attn_out, residual)              │ present_i
              gate, up = split(x @ Wgate_up);  out = (silu(gate) * up) @ Wdown
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import onnx
from tqdm import tqdm
from onnx import TensorProto, helper, numpy_helper

from agent import wire
from agent.wire import Geometry
from quantize import nbits, rope
from quantize.checkpoint import Checkpoint, SourceBlocks
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


def embedding(b: GraphBuilder, table: np.ndarray, precision: Precision, spec: QuantSpec) -> str:
    if precision == "fp32":
        b.report.append(f"embed_tokens: fp32 [{table.shape[0]}x{table.shape[1]}]")
        return b.one("Gather", [b.const("model.embed_tokens.weight", table), wire.INPUT_IDS],
                     "/model/embed_tokens/Gather")
    bits = 8 if precision == "int8" else 4
    q = nbits.quantize_embedding(table, bits, spec.block_size)
    b.report.append(f"embed_tokens: int{bits} block {spec.block_size}")
    inputs = [b.const("model.embed_tokens.qweight", q.gather_data()),
              wire.INPUT_IDS, b.const("model.embed_tokens.scales", q.scales.astype(np.float32))]
    if q.zero_points is not None:
        inputs.append(b.const("model.embed_tokens.zero_points", q.zero_points))
    return b.one("GatherBlockQuantized", inputs, "/model/embed_tokens/GatherBlockQuantized", MS_DOMAIN,
                 bits=bits, block_size=q.block_size, gather_axis=0, quantize_axis=1)


def tied_fp32(b: GraphBuilder, table: np.ndarray) -> tuple[str, Callable[[str], str]]:
    """A tied fp32 embedding / lm_head stored once: Gather rows, and Gemm(transB=1) on the same [V, H] table."""
    w = b.const("model.embed_tokens.weight", table)
    x = b.one("Gather", [w, wire.INPUT_IDS], "/model/embed_tokens/Gather")
    b.report.append(f"embed_tokens + lm_head (tied, stored once): fp32 [{table.shape[0]}x{table.shape[1]}]")

    def lm_head(h: str) -> str:
        #   h [B, n, H] -> [B*n, H] -> Gemm(., table^T) [B*n, V] -> [B, n, V]   (Gemm wants 2-D inputs)
        flat = b.one("Reshape", [h, b.const("/lm_head.flat", np.array([-1, table.shape[1]], np.int64))], "/lm_head/Reshape")
        y = b.one("Gemm", [flat, w], "/lm_head/Gemm", transB=1)
        lead = b.one("Shape", [h], "/lm_head/Shape", start=0, end=2)
        shape = b.one("Concat", [lead, b.const("/lm_head.vocab", np.array([table.shape[0]], np.int64))],
                      "/lm_head/Concat", axis=0)
        return b.one("Reshape", [y, shape], "/lm_head/Reshape_out")

    return x, lm_head


def head_block_size(spec: QuantSpec, hidden: int) -> int:
    """The spec's head block size, or else QuantSpec.head_block_size's measured default."""
    if spec.head_block_size:
        return spec.head_block_size
    if spec.precision == "int8":
        return 32
    return next((bs for bs in (128, 64, 32, 16) if hidden % bs == 0), 16)


def tied_int8(b: GraphBuilder, table: np.ndarray, spec: QuantSpec) -> tuple[str, Callable[[str], str]]:
    """A tied 8-bit embedding / lm_head stored once: (embedding output, lm_head builder).

    The lm_head is MatMulNBits over the table's blocks; the embedding gathers the same uint8 blocks and
    scales by token id and dequantizes just those rows, (q - 128) * scale, so the ~28 M-entry table is in
    the file and in memory once instead of twice.
    """
    q = nbits.quantize_search(table, 8, head_block_size(spec, table.shape[1]), symmetric=True)
    weight, scales = b.const("/lm_head.qweight", q.packed), b.const("/lm_head.scales", q.scales.astype(np.float32))
    b.report.append(f"embed_tokens + lm_head (tied, stored once): int8 block {q.block_size}")
    n = "/model/embed_tokens"
    codes = b.one("Gather", [weight, wire.INPUT_IDS], f"{n}/Gather")  # [B, S, k_blocks, block] uint8
    row_scales = b.one("Gather", [scales, wire.INPUT_IDS], f"{n}/scales/Gather")  # [B, S, k_blocks]
    values = b.one("Cast", [codes], f"{n}/Cast", to=TensorProto.FLOAT)
    centred = b.one("Sub", [values, b.const(f"{n}.zero_point", np.array(128, np.float32))], f"{n}/Sub")
    scale4 = b.one("Unsqueeze", [row_scales, b.const(f"{n}.axis", np.array([-1], np.int64))], f"{n}/Unsqueeze")
    deq = b.one("Mul", [centred, scale4], f"{n}/Mul")
    shape = b.const(f"{n}.shape", np.array([0, 0, q.k_blocks * q.block_size], np.int64))
    x = b.one("Reshape", [deq, shape], f"{n}/Reshape")
    if q.k_blocks * q.block_size != q.k:  # drop the last block's padding
        x = b.one("Slice", [x, b.const(f"{n}.starts", np.array([0], np.int64)),
                            b.const(f"{n}.ends", np.array([q.k], np.int64)), b.const(f"{n}.axes", np.array([2], np.int64))],
                  f"{n}/Slice")

    def lm_head(h: str) -> str:
        return b.one("MatMulNBits", [h, weight, scales], "/lm_head/MatMulNBits", MS_DOMAIN, K=q.k, N=q.n, bits=8,
                     block_size=q.block_size, accuracy_level=spec.accuracy_level)

    return x, lm_head


def rotary_cache(b: GraphBuilder, g: Geometry) -> None:
    """cos_cache / sin_cache [context_length, head_dim/2] for half-split RoPE, computed by the graph.

    Built from positions x inverse frequencies at session start (ORT folds it to a constant) rather
    than stored: for an 8k context the two tables would add 2 MB to the file.
    """
    inv_freq = rope.inv_freq(g.rope_theta, g.head_dim, g.rope_freq_factors).astype(np.float32)
    n = "/model/rotary"
    pos = b.one("Range", [b.const(f"{n}.start", np.array(0, np.float32)),
                          b.const(f"{n}.limit", np.array(g.context_length, np.float32)),
                          b.const(f"{n}.delta", np.array(1, np.float32))], f"{n}/Range")
    col = b.one("Unsqueeze", [pos, b.const(f"{n}.axis", np.array([1], np.int64))], f"{n}/Unsqueeze")
    ang = b.one("Mul", [col, b.const(f"{n}.inv_freq", inv_freq[None, :])], f"{n}/Mul")
    b.one("Cos", [ang], f"{n}/Cos")
    b.nodes[-1].output[0] = "cos_cache"
    b.one("Sin", [ang], f"{n}/Sin")
    b.nodes[-1].output[0] = "sin_cache"


def _skip_norm(b: GraphBuilder, name: str, x: str, residual: str, gamma: np.ndarray, eps: float) -> tuple[str, str]:
    """(normed, new residual) = SkipSimplifiedLN(x, residual)."""
    out = b.node("SkipSimplifiedLayerNormalization", [x, residual, b.const(f"{name}.weight", gamma)],
                 f"{name}/SkipLayerNorm", 4, MS_DOMAIN, epsilon=eps)
    return out[0], out[3]


def attention(b: GraphBuilder, ckpt: Checkpoint, i: int, x: str, spec: QuantSpec, plans: dict) -> str:
    g = ckpt.geometry
    p = f"model.layers.{i}.self_attn."
    wqkv = np.concatenate([ckpt.weights[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")], axis=0)
    qkv = linear(b, f"/model/layers.{i}/attn/qkv_proj", x, wqkv, spec, plans["qkv"][i], p + "q_proj.weight")
    if g.attention_bias:
        bias = np.concatenate([ckpt.weights[p + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")])
        qkv = b.one("Add", [qkv, b.const(f"{p}qkv_proj.bias", bias.astype(np.float32))], f"/model/layers.{i}/attn/qkv_proj/Add")
    cos, sin = "cos_cache", "sin_cache"
    outs = b.node("GroupQueryAttention",
                  [qkv, "", "", wire.past_key(i), wire.past_value(i), wire.SEQLENS_K, wire.TOTAL_SEQUENCE_LENGTH,
                   cos, sin, "", "", "", "", "", "", "", wire.QUERY_SEQLENS],
                  f"/model/layers.{i}/attn/GroupQueryAttention", 3, MS_DOMAIN,
                  num_heads=g.num_heads, kv_num_heads=g.num_kv_heads, do_rotary=1, rotary_interleaved=0,
                  local_window_size=g.sliding_window or -1)
    # GQA's outputs are the graph's present KV: rename them so that IOBinding can bind them by name.
    gqa = b.nodes[-1]
    gqa.output[1], gqa.output[2] = wire.present_key(i), wire.present_value(i)
    return linear(b, f"/model/layers.{i}/attn/o_proj", outs[0], ckpt.weights[p + "o_proj.weight"], spec,
                  plans["o"][i], p + "o_proj.weight")


def mlp(b: GraphBuilder, ckpt: Checkpoint, i: int, x: str, spec: QuantSpec, plans: dict) -> str:
    p = f"model.layers.{i}.mlp."
    inter = ckpt.geometry.intermediate_size
    w = np.concatenate([ckpt.weights[p + "gate_proj.weight"], ckpt.weights[p + "up_proj.weight"]], axis=0)
    gu = linear(b, f"/model/layers.{i}/mlp/gate_up_proj", x, w, spec, plans["gate_up"][i], p + "gate_proj.weight")
    gate, up = b.node("Split", [gu, b.const(f"{p}split", np.array([inter, inter], np.int64))],
                      f"/model/layers.{i}/mlp/Split", 2, axis=-1)
    sig = b.one("Sigmoid", [gate], f"/model/layers.{i}/mlp/act/Sigmoid")
    silu = b.one("Mul", [gate, sig], f"/model/layers.{i}/mlp/act/Mul")
    h = b.one("Mul", [silu, up], f"/model/layers.{i}/mlp/Mul")
    return linear(b, f"/model/layers.{i}/mlp/down_proj", h, ckpt.weights[p + "down_proj.weight"], spec,
                  plans["down"][i], p + "down_proj.weight")


def plan_linears(ckpt: Checkpoint, spec: QuantSpec) -> dict:
    """Per layer, a LinearPlan for each fused projection (qkv, o, gate_up, down)."""
    groups = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
              "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    plans: dict[str, list[LinearPlan]] = {k: [] for k in groups}
    for i in range(ckpt.geometry.num_layers):
        for kind, names in groups.items():
            precision = spec.precision_of(kind, i)
            src = [ckpt.source_blocks.get(f"model.layers.{i}.{n}.weight") for n in names]
            # one MatMulNBits has one bit width: a group mixing Q8_0 with Q4_x parts is requantized
            keep = (spec.keep_source_quant and precision != "fp32" and all(s is not None for s in src)
                    and len({nbits.source_bits(s) for s in src}) == 1)
            plans[kind].append(LinearPlan(precision, spec.block_sizes.get(kind, spec.block_size), spec.is_symmetric(kind),
                                          src if keep else None))
    return plans


def capture_width(g: Geometry, key: str) -> int:
    """Width of the input of the projection whose HF weight is key."""
    if key.endswith("down_proj.weight"):
        return g.intermediate_size
    # o_proj reads the heads' outputs, num_heads x head_dim wide: not hidden_size when a config sets head_dim
    # (Mistral-Nemo's 128 with hidden 5120 / 32 heads); taken as hidden_size, every calibrated build of one fails
    return g.num_heads * g.head_dim if key.endswith("o_proj.weight") else g.hidden_size


def _capture_outputs(b: GraphBuilder, g: Geometry) -> list:
    outputs = []
    for key, tensor in b.linear_inputs.items():
        b.one("Identity", [tensor], f"/capture/{key}")
        b.nodes[-1].output[0] = key
        outputs.append(helper.make_tensor_value_info(key, TensorProto.FLOAT, ["batch", "seq", capture_width(g, key)]))
    return outputs


def io_spec(g: Geometry) -> tuple[list, list]:
    inputs = [
        helper.make_tensor_value_info(wire.INPUT_IDS, TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info(wire.SEQLENS_K, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(wire.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, []),
        helper.make_tensor_value_info(wire.QUERY_SEQLENS, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(wire.LOGITS_INDICES, TensorProto.INT64, ["batch", "n_logits"]),
    ]
    outputs = [helper.make_tensor_value_info(wire.LOGITS, TensorProto.FLOAT, ["batch", "n_logits", g.vocab_size])]
    kv_shape = ["batch", g.num_kv_heads, "capacity", g.head_dim]
    for i in range(g.num_layers):
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in (wire.past_key(i), wire.past_value(i))]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in (wire.present_key(i), wire.present_value(i))]
    return inputs, outputs


def build_graph(ckpt: Checkpoint, spec: QuantSpec, importance: Importance | None = None,
                hessians: HessianSource | None = None,
                capture: bool = False, show_progress: bool = False) -> tuple[onnx.ModelProto, list[str]]:
    """The decoder ModelProto and a line per weight saying what precision it got.

    capture=True also exposes every projection's input as a graph output named after its HF weight
    (for calibration); such a graph is for measuring, not for a bundle.
    """
    g = ckpt.geometry
    plans = plan_linears(ckpt, spec)
    b = GraphBuilder(importance=importance or {}, hessians=hessians or {})
    rotary_cache(b, g)
    table = ckpt.weights["model.embed_tokens.weight"]
    if g.tie_word_embeddings and spec.embedding_precision == spec.lm_head_precision == "int8":  # one copy
        x, lm_head = tied_int8(b, table, spec)
    elif g.tie_word_embeddings and spec.embedding_precision == spec.lm_head_precision == "fp32":
        x, lm_head = tied_fp32(b, table)
    else:
        x = embedding(b, table, spec.embedding_precision, spec)
        lm_head = lambda h: linear(b, "/lm_head", h, ckpt.lm_head, spec,  # noqa: E731
                                   LinearPlan(spec.lm_head_precision, spec.block_size, spec.symmetric), key=LM_HEAD)
    residual = x
    x = b.one("SimplifiedLayerNormalization", [x, b.const("model.layers.0.input_layernorm.weight",
              ckpt.layer(0, "input_layernorm.weight"))], "/model/layers.0/input_layernorm/LayerNorm",
              epsilon=g.rms_norm_eps, axis=-1, stash_type=1)
    for i in tqdm(range(g.num_layers), desc=f"  {spec.precision} layers", unit="layer", disable=not show_progress,
                  leave=False):
        if i > 0:
            x, residual = _skip_norm(b, f"model.layers.{i}.input_layernorm", x, residual,
                                     ckpt.layer(i, "input_layernorm.weight"), g.rms_norm_eps)
        attn = attention(b, ckpt, i, x, spec, plans)
        x, residual = _skip_norm(b, f"model.layers.{i}.post_attention_layernorm", attn, residual,
                                 ckpt.layer(i, "post_attention_layernorm.weight"), g.rms_norm_eps)
        x = mlp(b, ckpt, i, x, spec, plans)
    x, _ = _skip_norm(b, "model.norm", x, residual, ckpt.weights["model.norm.weight"], g.rms_norm_eps)
    final = x
    idx = b.one("Unsqueeze", [wire.LOGITS_INDICES, b.const("/model/logits_axis", np.array([-1], np.int64))],
                "/model/logits_indices/Unsqueeze")
    x = b.one("GatherND", [x, idx], "/model/logits_indices/GatherND", batch_dims=1)  # [B, n, hidden]
    lm_head(x)
    b.nodes[-1].output[0] = wire.LOGITS  # the lm_head's node is the last one added
    # calibration sees the lm_head's input at every position, not only where this graph computes logits
    b.linear_inputs[LM_HEAD] = final
    inputs, outputs = io_spec(g)
    if capture:
        outputs += _capture_outputs(b, g)
    graph = helper.make_graph(b.nodes, "decoder", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="edge-quantize")
    model.ir_version = 10
    # The weights go in last, one at a time, each let go of once copied: make_graph and make_model copy every
    # initializer, and three fp32 copies of the model would be alive at once (8.3 GB building SmolLM2-360M's
    # reference graph)
    pending, b.initializers = b.initializers[::-1], []
    while pending:
        model.graph.initializer.append(pending.pop())
    return model, b.report
