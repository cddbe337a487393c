"""Every architecture the quantizer reads, one row each: the single place model-specific knowledge lives.

Both readers (quantize.gguf_reader, quantize.hf) find a model's row by its name in the file, map tensor names
and undo storage transforms by it, and the graph builder (quantize.blocks) picks the block variant by it. The
per-model numbers a row's variant needs (windows, multipliers, rotary width) are read into the Geometry.

Internal weight names are transformers' (`model.layers.{i}.self_attn.q_proj.weight`, [out, in]), whatever the
file: fused tensors are split, llama.cpp's Q/K row permutation is undone and norm weights hold the factor the
model multiplies by. A norm's name keeps its transformers meaning for its architecture: Llama's
`post_attention_layernorm` is the norm before the MLP, Gemma's the one after attention.

A Mixture-of-Experts row (`moe` set) replaces the MLP by a router and stacked experts, whatever the file's
layout: `mlp.gate.weight` [E, H] (the router), `mlp.experts.{gate,up}_proj.weight` [E, I, H] and
`mlp.experts.down_proj.weight` [E, H, I], with I the expert's intermediate size (Geometry.intermediate_size).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# GGUF tensor name (after "blk.{i}.") -> internal name (after "model.layers.{i}."), as llama.cpp's converter
# names a Llama-style block (llama-arch.cpp's LLM_TENSOR_NAMES)
LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QKV_BIAS = {f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma's four norms: before and after attention, before and after the MLP
SANDWICH = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 stores q, k and v as one tensor and gate and up as another; they are split on reading
FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
# llama.cpp's stacked expert tensors (GGUF shape [H, I, E] innermost first: [E, I, H] read) and router
MOE_BLOCK = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
LLAMA_ATTENTION = {k: v for k, v in LLAMA_BLOCK.items() if not k.startswith(("ffn_gate.", "ffn_up.", "ffn_down."))}
# transformers' MoE tensors (after "model.layers.{i}.") -> internal names: "{e}" is the expert's index, and the
# per-expert tensors are stacked along a new first axis on reading
QWEN_MOE_HF = {
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.experts.{e}.gate_proj.weight": "mlp.experts.gate_proj.weight",
    "mlp.experts.{e}.up_proj.weight": "mlp.experts.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight": "mlp.experts.down_proj.weight",
}
MIXTRAL_HF = {
    "block_sparse_moe.gate.weight": "mlp.gate.weight",
    "block_sparse_moe.experts.{e}.w1.weight": "mlp.experts.gate_proj.weight",
    "block_sparse_moe.experts.{e}.w3.weight": "mlp.experts.up_proj.weight",
    "block_sparse_moe.experts.{e}.w2.weight": "mlp.experts.down_proj.weight",
}
# Granite's experts are stored stacked already; input_linear holds [gate; up] along its rows (split on reading)
GRANITE_MOE_HF = {
    "block_sparse_moe.router.layer.weight": "mlp.gate.weight",
    "block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj.weight",
    "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj.weight",
}


@dataclass(frozen=True)
class MoE:
    """How a Mixture-of-Experts row routes each token to its experts, as the model computes it.

    softmax_first: softmax over all E router logits, then the top k of those probabilities (Qwen3-MoE, OLMoE);
    otherwise the top k logits, then a softmax over those k (Mixtral, Granite-MoE), which is the same as the
    first order with the k weights renormalised to sum to 1. renormalize: whether a softmax_first model divides
    its k weights by their sum (None: the HF config's norm_topk_prob decides, transformers' default False; llama.cpp
    hard-codes it per architecture: gguf_renormalize).
    """

    hf_names: dict[str, str]
    softmax_first: bool
    renormalize: bool | None
    gguf_renormalize: bool


GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class Architecture:
    name: str  # Geometry.architecture
    hf_classes: tuple[str, ...]  # config.json's architectures[0]
    gguf: str | None  # general.architecture; None: GGUF files of this model say "llama"
    block_names: dict[str, str] = field(default_factory=lambda: dict(LLAMA_BLOCK))
    # llama.cpp's converter interleaves each head's Q/K rows for its "normal" RoPE; "neox" models keep
    # transformers' half-split order, the one GroupQueryAttention turns (rotary_interleaved=0)
    permuted_qk: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE
    qk_norm_full_width: bool = False  # the QK-norm is over all of q's (and k's) channels at once (OLMoE)
    sandwich_norm: bool = False  # a norm after attention and after the MLP too, before the residual add
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the gated MLP: act(gate) * up
    hf_norm_offset: float = 0.0  # transformers stores norm weights minus this (Gemma computes x * (1 + w))
    embedding_scale_sqrt_hidden: bool = False  # the embedding is multiplied by sqrt(hidden_size) (Gemma)
    fused: bool = False  # qkv and gate_up tensors, split on reading (Phi-3)
    swa_period: int | None = None  # every swa_period-th layer is global, the others windowed (Gemma 3: 6)
    default_rope_local_theta: float | None = None  # the windowed layers' RoPE base (Gemma 3; not in its GGUF)
    nope_period: int | None = None  # every nope_period-th layer has no RoPE (SmolLM3: 4)
    gguf_keys_from: str | None = None  # prefix of its GGUF metadata keys, when not gguf (Mistral's "llama")
    moe: MoE | None = None  # a router and experts in place of the MLP
    # a GGUF of this general.architecture with {arch}.expert_count > 0 is this row (Mixtral's files say "llama")
    gguf_with_experts_of: str | None = None

    @property
    def key_prefix(self) -> str:
        return (self.gguf or self.gguf_keys_from or self.name) + "."


LLAMA = Architecture("llama", ("LlamaForCausalLM",), "llama")
ARCHITECTURES: tuple[Architecture, ...] = (
    LLAMA,
    Architecture("mistral", ("MistralForCausalLM",), None, gguf_keys_from="llama"),
    Architecture("qwen2", ("Qwen2ForCausalLM",), "qwen2", block_names=LLAMA_BLOCK | QKV_BIAS, permuted_qk=False,
                 qkv_bias=True),
    Architecture("qwen3", ("Qwen3ForCausalLM",), "qwen3", block_names=LLAMA_BLOCK | QK_NORM, permuted_qk=False,
                 qk_norm=True),
    Architecture("gemma3", ("Gemma3ForCausalLM",), "gemma3", block_names=LLAMA_BLOCK | SANDWICH | QK_NORM,
                 permuted_qk=False, qk_norm=True, sandwich_norm=True, activation="gelu_tanh", hf_norm_offset=1.0,
                 embedding_scale_sqrt_hidden=True, swa_period=6, default_rope_local_theta=10000.0),
    Architecture("phi3", ("Phi3ForCausalLM",), "phi3", block_names=LLAMA_BLOCK | FUSED, permuted_qk=False,
                 fused=True),
    Architecture("smollm3", ("SmolLM3ForCausalLM",), "smollm3", nope_period=4),
    Architecture("granite", ("GraniteForCausalLM",), "granite"),
    Architecture("qwen3moe", ("Qwen3MoeForCausalLM",), "qwen3moe", block_names=LLAMA_ATTENTION | QK_NORM | MOE_BLOCK,
                 permuted_qk=False, qk_norm=True,
                 moe=MoE(QWEN_MOE_HF, softmax_first=True, renormalize=None, gguf_renormalize=True)),
    Architecture("olmoe", ("OlmoeForCausalLM",), "olmoe", block_names=LLAMA_ATTENTION | QK_NORM | MOE_BLOCK,
                 permuted_qk=False, qk_norm=True, qk_norm_full_width=True,
                 moe=MoE(QWEN_MOE_HF, softmax_first=True, renormalize=None, gguf_renormalize=False)),
    Architecture("granitemoe", ("GraniteMoeForCausalLM",), "granitemoe", block_names=LLAMA_ATTENTION | MOE_BLOCK,
                 moe=MoE(GRANITE_MOE_HF, softmax_first=False, renormalize=True, gguf_renormalize=True)),
    Architecture("mixtral", ("MixtralForCausalLM",), None, block_names=LLAMA_ATTENTION | MOE_BLOCK,
                 gguf_keys_from="llama", gguf_with_experts_of="llama",
                 moe=MoE(MIXTRAL_HF, softmax_first=False, renormalize=True, gguf_renormalize=True)),
)
BY_NAME = {a.name: a for a in ARCHITECTURES}
BY_HF_CLASS = {c: a for a in ARCHITECTURES for c in a.hf_classes}
BY_GGUF = {a.gguf: a for a in ARCHITECTURES if a.gguf}
WITH_EXPERTS = {a.gguf_with_experts_of: a for a in ARCHITECTURES if a.gguf_with_experts_of}


def by_name(name: str) -> Architecture:
    return BY_NAME[name]


def supported(kind: str) -> str:
    """The supported names of one kind ("gguf" or "hf"), for an error message."""
    return ", ".join(sorted(BY_GGUF if kind == "gguf" else BY_HF_CLASS))
