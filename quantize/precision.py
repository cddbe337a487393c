"""What to quantize and how: the quantization settings as pure, validated data.

One `QuantSpec` describes a whole bundle's precision. The graph builder reads it; the manifest records it.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_serializer, model_validator

Precision = Literal["fp32", "int8", "int4"]
Kind = Literal["qkv", "o", "gate_up", "down"]  # a layer's fused projections


class QuantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    precision: Precision = "fp32"
    # The defaults are the measured best INT4 recipe at no more than llama.cpp Q4_0's size for SmolLM2
    # (docs/benchmarks.md), and any model without a row in quantize/recipes.py gets them: blocks of 64, down_proj (K = 1536) in blocks of 128 to pay for zero points,
    # GPTQ with activation order when a calibration text is given. For INT8, GPTQ in blocks of 32.
    block_size: Literal[16, 32, 64, 128] = 64
    # Per-projection overrides of block_size, by fused kind: "qkv", "o", "gate_up", "down". A block that
    # does not divide K pads the row, so keep these to divisors of the projection's input size.
    block_sizes: dict[Kind, Literal[16, 32, 64, 128]] = {"down": 128}
    symmetric: bool = False
    # INT4 only: kinds quantized symmetric whatever `symmetric` says, and projections kept at 8 bits as
    # {kind: [layer index, ...]} (indices past the model's last layer are ignored). Measured on SmolLM2
    # (mean KL over eval_en.txt / a held-out GPL-3 excerpt, bundle MB): all asymmetric 0.1364 / 0.1937,
    # 91.84 (over Q4_0's 91.7); o and gate_up symmetric 0.1437 / 0.1980, 91.28; that plus layer 18's qkv
    # at 8 bits (found by a search over single projections) 0.1330 / 0.1921, 91.56.
    int4_symmetric_kinds: frozenset[Kind] = frozenset({"o", "gate_up"})
    int4_int8_layers: dict[Kind, list[int]] = {"qkv": [18]}
    # MatMulNBits accuracy_level: 4 quantizes activations to int8 per block (fast int8 kernels on CPU),
    # 0 keeps them in fp32. Per-block activation scales keep quality (unlike per-tensor dynamic quantization).
    accuracy_level: Literal[0, 1, 4] = 4
    # "rtn": round to nearest; "search": per-block error-minimizing scale search, importance-weighted
    # when a calibration text is given; "gptq": search plus GPTQ error compensation (needs calibration).
    method: Literal["rtn", "search", "gptq"] = "gptq"
    # GPTQ's column order: by decreasing activation energy (static groups keep the block structure)
    act_order: bool = True
    # GPTQ's damping, a fraction of mean(diag(H)) added to H's diagonal. With ~900 calibration tokens a
    # small damping overfits them: SmolLM2 INT4 mean KL over eval_en.txt was 0.177 at 0.01, 0.145 at 0.1,
    # 0.137 at 0.2, 0.141 at 1.0, and on a held-out text 0.166 / 0.133 / 0.135 at 0.01 / 0.2 / 1.0.
    gptq_damp: float = Field(0.2, ge=0, le=10)
    # Block size of the 8-bit embedding / lm_head (stored once when tied). None: 32 for an INT8 bundle
    # (the lm_head's activations are quantized per block too, and on SmolLM2 INT8 mean KL was 0.0037 with
    # blocks of 64, 0.0028 with 32); for INT4 the largest that divides the hidden size, as space is
    # what INT4 is for (and a block that does not divide the row pads it). An lm_head stored apart from
    # the embedding takes this block size when it is set, block_size otherwise.
    head_block_size: Literal[16, 32, 64, 128] | None = None
    # Block size of an embedding stored apart from the lm_head (None: block_size). A looked-up row feeds
    # one position's residual stream, not every logit, so it tolerates coarser blocks than the head.
    embedding_block_size: Literal[16, 32, 64, 128] | None = None
    embedding: Precision | None = None  # None: same as `precision` but never below int8
    # None: int8 when precision is int4 (the lm_head is ~1/5 of the weights). On SmolLM2 a 4-bit head (GPTQ,
    # stored apart from the 8-bit embedding) raised INT4's mean KL from 0.134 to 0.158 and the bundle from
    # 91.6 to 108.2 MB for ~10% faster decode (docs/benchmarks.md): an option, not the default.
    lm_head: Precision | None = None
    # Keep a GGUF's own Q4_0/Q4_1/Q8_0 blocks instead of requantizing from dequantized weights.
    keep_source_quant: bool = False
    # A draft model's head over the first head_vocab token ids only (None: the whole vocabulary). Byte-level BPE
    # numbers its tokens in merge order, so the first ids are the frequent ones, and a draft's rare-token guesses
    # are the ones verification would reject anyway. A 32k head is a fifth of Qwen2.5's 151,936-row one, which
    # is ~40% of what the 0.5B reads per token. Such a bundle never serves requests: its argmax cannot be an id
    # past head_vocab, end ids included (agent.engine.bundle refuses it as a target).
    head_vocab: int | None = Field(None, ge=256)

    @field_serializer("int4_symmetric_kinds")
    def _sorted(self, kinds: frozenset[Kind]) -> list[Kind]:
        return sorted(kinds)  # a set's order changes between runs: the same build gave another model_config.json

    @model_serializer(mode="wrap")
    def _without_unset_head_vocab(self, handler):
        # a bundle's quant dict (and so its version) is what it was before head_vocab existed unless it is set
        data = handler(self)
        if data.get("head_vocab", 0) is None:
            del data["head_vocab"]
        return data

    @model_validator(mode="after")
    def _check(self) -> "QuantSpec":
        if self.precision == "fp32" and self.keep_source_quant:
            raise ValueError("keep_source_quant needs precision int8 or int4")
        return self

    @property
    def embedding_precision(self) -> Precision:
        if self.embedding:
            return self.embedding
        return "fp32" if self.precision == "fp32" else "int8"

    @property
    def lm_head_precision(self) -> Precision:
        if self.lm_head:
            return self.lm_head
        return "fp32" if self.precision == "fp32" else "int8"

    def is_symmetric(self, kind: Kind) -> bool:
        return self.symmetric or (self.precision == "int4" and kind in self.int4_symmetric_kinds)

    def precision_of(self, kind: Kind, layer: int) -> Precision:
        if self.precision == "int4" and layer in self.int4_int8_layers.get(kind, ()):
            return "int8"
        return self.precision

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}[self.precision]
