"""Build the ONNX decoder graph for ONNX Runtime's CPU provider from a Checkpoint.

The graph uses com.microsoft contrib ops: GroupQueryAttention (rotary inside, past and present KV sharing
one preallocated buffer, ragged rows via seqlens_k / query_seqlens), SkipSimplifiedLayerNormalization and,
for quantized precisions, MatMulNBits and GatherBlockQuantized. The caller picks which positions get
logits (`logits_indices`), so a prefill pays for the vocabulary projection of one position, not all.

    input_ids ─ Embed [* m_emb] ─┬─ [layer 0 .. n-1] ─ SkipSimplifiedLN(final) ─ GatherND(logits_indices) ─ lm_head
                                                                                                 [* m_logit] ─ logits

The layers are quantize.blocks' (the block variant is the architecture's); the graph's inputs and outputs
(agent.wire) are the same for every architecture.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from tqdm import tqdm
from onnx import TensorProto, helper

from agent import wire
from agent.wire import Geometry
from quantize import nbits
from quantize.blocks import decoder_layer, rms_norm, rotary_caches, skip_norm
from quantize.checkpoint import Checkpoint
from quantize.linear import (LM_HEAD, MS_DOMAIN, OPSET, GraphBuilder, HessianSource, Importance, LinearPlan,
                             linear)
from quantize.lora import LoraSpec
from quantize.precision import Precision, QuantSpec

__all__ = ["LM_HEAD", "Importance", "build_graph", "capture_width"]


def embedding(b: GraphBuilder, table: np.ndarray, precision: Precision, spec: QuantSpec) -> str:
    if precision == "fp32":
        b.report.append(f"embed_tokens: fp32 [{table.shape[0]}x{table.shape[1]}]")
        return b.one("Gather", [b.const("model.embed_tokens.weight", table), wire.INPUT_IDS],
                     "/model/embed_tokens/Gather")
    bits = 8 if precision == "int8" else 4
    q = nbits.quantize_embedding(table, bits, spec.embedding_block_size or spec.block_size)
    b.report.append(f"embed_tokens: int{bits} block {q.block_size}")
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
        # allowzero: a call that asks for no logits (n = 0) gets [B, 0, V], where a 0 would copy y's V
        return b.one("Reshape", [y, shape], "/lm_head/Reshape_out", allowzero=1)

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


def quantize_head(b: GraphBuilder, table: np.ndarray, bits: int, block_size: int,
                  spec: QuantSpec) -> nbits.BlockQuantized:
    """A tied table quantized symmetrically as the lm_head it also is: GPTQ'd on the head's calibration Hessian when
    the build has one (its logits' error is what the bundle's KL measures), else searched (importance-weighted when
    calibrated); the embedding looks its rows up in the same codes."""
    hessian = b.hessians.pop(LM_HEAD, None)
    importance = b.importance.get(LM_HEAD)
    if spec.method == "gptq" and hessian is not None:
        return nbits.quantize_gptq(table, bits, block_size, True, hessian, importance=importance,
                                   act_order=spec.act_order, damp=spec.gptq_damp, overwrite_hessian=True)
    if spec.method in ("search", "gptq"):
        return nbits.quantize_search(table, bits, block_size, True, importance)
    return nbits.quantize_rtn(table, bits, block_size, True)


def tied_int4(b: GraphBuilder, table: np.ndarray, spec: QuantSpec) -> tuple[str, Callable[[str], str]]:
    """A tied 4-bit embedding / lm_head stored once (symmetric, zero point 8): (embedding output, lm_head builder).

    MatMulNBits takes the packed table as it validates it, [V, k_blocks, block / 2] with scales [V, k_blocks];
    GatherBlockQuantized reads the same initializer with each block as a row of its last axis (quantize_axis 2),
    which wants the scales as [V, k_blocks, 1]. Those scales are stored a second time in that shape (Gemma 3:
    +21 MB of file) rather than reshaped in the graph: ONNX Runtime would fold the Reshape into a copy held by the
    session, where the stored copy is read through the runner's mapping, only the rows looked up. The table is
    quantized when the head is built, after the layers, so that a GPTQ build takes the head's Hessian in the
    order calibration hands them out.
    """
    hidden = table.shape[1]
    block_size = head_block_size(spec, hidden)
    if hidden % block_size:
        raise ValueError(f"a tied 4-bit table needs a head block size dividing the hidden size {hidden}")
    n = "/model/embed_tokens"
    weight, scales, block_scales = "/lm_head.qweight", "/lm_head.scales", f"{n}.scales"  # added by lm_head()
    rows = b.one("GatherBlockQuantized", [weight, wire.INPUT_IDS, block_scales], f"{n}/GatherBlockQuantized",
                 MS_DOMAIN, bits=4, block_size=block_size, gather_axis=0, quantize_axis=2)  # [B, S, k_blocks, block]
    x = b.one("Reshape", [rows, b.const(f"{n}.shape", np.array([0, 0, hidden], np.int64))], f"{n}/Reshape")

    def lm_head(h: str) -> str:
        q = quantize_head(b, table, 4, block_size, spec)
        b.const(weight, q.packed)
        b.const(scales, q.scales.astype(np.float32))
        b.const(block_scales, q.scales.astype(np.float32)[..., None])  # [V, k_blocks, 1]
        b.report.append(f"embed_tokens + lm_head (tied, stored once): int4 sym block {block_size} {spec.method}")
        return b.one("MatMulNBits", [h, weight, scales], "/lm_head/MatMulNBits", MS_DOMAIN, K=q.k, N=q.n, bits=4,
                     block_size=block_size, accuracy_level=spec.accuracy_level)

    return x, lm_head


def plan_linears(ckpt: Checkpoint, spec: QuantSpec, lora: LoraSpec | None = None) -> dict:
    """Per layer, a LinearPlan for each fused projection (qkv, o, gate_up, down); with lora, those holding one
    of its targets get a LoRA branch."""
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
                                          src if keep else None, lora is not None and kind in lora.projections))
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


def io_spec(g: Geometry, logits_width: int | None = None) -> tuple[list, list]:
    """The graph's inputs and outputs (agent/wire.py's names); logits_width: a draft head's (QuantSpec.head_vocab),
    else the vocabulary."""
    inputs = [
        helper.make_tensor_value_info(wire.INPUT_IDS, TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info(wire.SEQLENS_K, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(wire.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, []),
        helper.make_tensor_value_info(wire.QUERY_SEQLENS, TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info(wire.LOGITS_INDICES, TensorProto.INT64, ["batch", "n_logits"]),
    ]
    outputs = [helper.make_tensor_value_info(wire.LOGITS, TensorProto.FLOAT,
                                             ["batch", "n_logits", logits_width or g.vocab_size])]
    kv_shape = ["batch", g.num_kv_heads, "capacity", g.head_dim]
    for i in range(g.num_layers):
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in (wire.past_key(i), wire.past_value(i))]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, kv_shape) for n in (wire.present_key(i), wire.present_value(i))]
    return inputs, outputs


def _embedding_and_head(b: GraphBuilder, ckpt: Checkpoint, spec: QuantSpec) -> tuple[str, Callable[[str], str]]:
    """(the embedding's output, scaled by the embedding multiplier, and the lm_head builder), sharing one table
    when they are tied and of one precision."""
    g = ckpt.geometry
    table = ckpt.weights["model.embed_tokens.weight"]
    if spec.head_vocab:  # a draft's head over the first ids (QuantSpec.head_vocab): apart from the embedding
        x = embedding(b, table, spec.embedding_precision, spec)
        lm_head = lambda h: linear(b, "/lm_head", h, ckpt.lm_head[:spec.head_vocab], spec,  # noqa: E731
                                   LinearPlan(spec.lm_head_precision, spec.head_block_size or spec.block_size, spec.symmetric),
                                   key=LM_HEAD)
    elif g.tie_word_embeddings and spec.embedding_precision == spec.lm_head_precision == "int8":  # one copy
        x, lm_head = tied_int8(b, table, spec)
    elif g.tie_word_embeddings and spec.embedding_precision == spec.lm_head_precision == "int4":
        x, lm_head = tied_int4(b, table, spec)
    elif g.tie_word_embeddings and spec.embedding_precision == spec.lm_head_precision == "fp32":
        x, lm_head = tied_fp32(b, table)
    else:
        x = embedding(b, table, spec.embedding_precision, spec)
        lm_head = lambda h: linear(b, "/lm_head", h, ckpt.lm_head, spec,  # noqa: E731
                                   LinearPlan(spec.lm_head_precision, spec.head_block_size or spec.block_size, spec.symmetric),
                                   key=LM_HEAD)
    if g.embedding_multiplier != 1:
        x = b.one("Mul", [x, b.const("/model/embed_tokens.multiplier", np.array(g.embedding_multiplier, np.float32))],
                  "/model/embed_tokens/multiplier")
    return x, lm_head


def build_graph(ckpt: Checkpoint, spec: QuantSpec, importance: Importance | None = None,
                hessians: HessianSource | None = None,
                capture: bool = False, show_progress: bool = False,
                lora: LoraSpec | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """The decoder ModelProto and a line per weight saying what precision it got; with lora, adapter-ready
    (quantize.lora).

    capture=True also exposes every projection's input as a graph output named after its HF weight
    (for calibration); such a graph is for measuring, not for a bundle.
    """
    g = ckpt.geometry
    if spec.head_vocab and spec.head_vocab >= g.vocab_size:
        raise ValueError(f"head_vocab {spec.head_vocab}: a draft's head must be narrower than the model's "
                         f"{g.vocab_size}-token vocabulary")
    plans = plan_linears(ckpt, spec, lora)
    b = GraphBuilder(importance=importance or {}, hessians=hessians or {})
    rotary_caches(b, g)
    x, lm_head = _embedding_and_head(b, ckpt, spec)
    residual = x
    x = rms_norm(b, "model.layers.0.input_layernorm", x, ckpt.layer(0, "input_layernorm.weight"), g.rms_norm_eps)
    for i in tqdm(range(g.num_layers), desc=f"  {spec.precision} layers", unit="layer", disable=not show_progress,
                  leave=False):
        x, residual = decoder_layer(b, ckpt, i, x, residual, spec, plans)
    x, _ = skip_norm(b, "model.norm", x, residual, ckpt.weights["model.norm.weight"], g.rms_norm_eps)
    final = x
    idx = b.one("Unsqueeze", [wire.LOGITS_INDICES, b.const("/model/logits_axis", np.array([-1], np.int64))],
                "/model/logits_indices/Unsqueeze")
    x = b.one("GatherND", [x, idx], "/model/logits_indices/GatherND", batch_dims=1)  # [B, n, hidden]
    logits = lm_head(x)
    if g.logit_multiplier != 1:
        b.one("Mul", [logits, b.const("/lm_head.multiplier", np.array(g.logit_multiplier, np.float32))],
              "/lm_head/logit_multiplier")
    b.nodes[-1].output[0] = wire.LOGITS  # the lm_head's (or its multiplier's) node is the last one added
    # calibration sees the lm_head's input at every position, not only where this graph computes logits
    b.linear_inputs[LM_HEAD] = final
    inputs, outputs = io_spec(g, spec.head_vocab)
    inputs += b.graph_inputs
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
