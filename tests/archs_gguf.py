"""A TinyArch (tests/archs.py) written as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py writes it.

Per architecture, as the converter's model classes do it:
- metadata: the arch-prefixed hyperparameter keys llama.cpp's loader reads (ARCH_KEYS below);
- tensor names: gguf's own TensorNameMap (the table the converter maps with);
- transforms: Q/K rows permuted to llama.cpp's interleaved rotary pairs for the LlamaModel-derived
  converters only (llama, smollm3, granite); Gemma 3's norms stored with their +1; Phi-3's fused
  qkv_proj / gate_up_proj kept fused; extra tensors rope_freqs (llama3 scaling) and
  rope_factors_long/short (Phi-3 LongRoPE).
All tensors are F32 (general.file_type 0), so llama.cpp computes in full precision.
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFWriter

from archs import TinyArch, llama3_rope_factors
from tiny import CHAT_TEMPLATE, MERGES, vocab

# converters derived from LlamaModel (undo_permute = True): Mixtral's is LlamaModel, Granite-MoE's GraniteModel's
PERMUTED_ARCHS = ("llama", "smollm3", "granite", "granitemoe")


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """LlamaModel.permute: each head's rows go from HF's halves (x0..x(d/2-1) | y0..) to pairs (x0 y0 x1 y1 ..)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of permute_rows."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- metadata ---------------------------------------------------------------------------------------

def _text_model_keys(w: GGUFWriter, c: dict) -> None:
    """TextModel.set_gguf_parameters: what every converter that calls super() writes."""
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _llama_keys(w: GGUFWriter, c: dict) -> None:
    """LlamaModel: + vocab_size and rope.dimension_count (head_dim, else hidden / heads). llama3 RoPE
    scaling writes no key: the factors go into the rope_freqs tensor."""
    _text_model_keys(w, c)
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def _granite_keys(w: GGUFWriter, c: dict) -> None:
    """GraniteModel: LlamaModel's keys with head_dim dropped, + the four multipliers."""
    _llama_keys(w, {k: v for k, v in c.items() if k != "head_dim"})
    w.add_attention_scale(c["attention_multiplier"])  # granite.attention.scale
    w.add_embedding_scale(c["embedding_multiplier"])  # granite.embedding_scale
    w.add_residual_scale(c["residual_multiplier"])  # granite.residual_scale
    w.add_logit_scale(c["logits_scaling"])  # granite.logit_scale (llama.cpp divides the logits by it)


def _gemma3_keys(w: GGUFWriter, c: dict) -> None:
    """Gemma3Model: rope.freq_base is the global layers' base; llama.cpp hard-codes the local base 10,000,
    the 5:1 pattern and 1/sqrt(head_dim) (query_pre_attn_scalar is not written). The window is written
    unless sliding_window_pattern is 1."""
    _text_model_keys(w, c)
    w.add_sliding_window(c["sliding_window"])


def _phi3_keys(w: GGUFWriter, c: dict) -> None:
    """Phi3MiniModel (does not call TextModel's): partial rotary as rope.dimension_count, the original
    context that picks short vs long factors, LongRoPE's attention factor, sliding_window 0 when null."""
    n_embd, n_head = c["hidden_size"], c["num_attention_heads"]
    original = c["original_max_position_embeddings"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(int(c.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_sliding_window(c.get("sliding_window") or 0)
    if c.get("rope_scaling"):
        w.add_rope_scaling_attn_factors(phi3_attn_factor(c))


def phi3_attn_factor(c: dict) -> float:
    """LongRoPE's magnitude correction, as the converter computes it (transformers computes the same)."""
    scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(scale) / math.log(c["original_max_position_embeddings"])) if scale > 1 else 1.0


def _expert_keys(w: GGUFWriter, c: dict) -> None:
    """TextModel.set_gguf_parameters' expert keys (num_experts or num_local_experts, num_experts_per_tok), and
    Qwen3-MoE's expert size (Qwen2MoeModel: moe_intermediate_size)."""
    w.add_expert_count(c.get("num_experts") or c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    if "moe_intermediate_size" in c:
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])


def _with_experts(keys):
    def write(w: GGUFWriter, c: dict) -> None:
        keys(w, c)
        if "num_experts_per_tok" in c:
            _expert_keys(w, c)
    return write


ARCH_KEYS = {"llama": _with_experts(_llama_keys), "smollm3": _llama_keys, "granite": _granite_keys,
             "qwen2": _text_model_keys, "qwen3": _text_model_keys, "gemma3": _gemma3_keys, "phi3": _phi3_keys,
             "qwen3moe": _with_experts(_text_model_keys), "olmoe": _with_experts(_text_model_keys),
             "granitemoe": _with_experts(_granite_keys)}


def _tokenizer_keys(w: GGUFWriter, model: TinyArch) -> None:
    """_set_vocab_gpt2 + SpecialVocab: byte-level BPE tokens, types, merges, special ids, chat template."""
    tokens, types = vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(model.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(model.config["bos_token_id"])
    w.add_eos_token_id(model.config["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


# ---- tensors ----------------------------------------------------------------------------------------

def extra_tensors(model: TinyArch) -> dict[str, np.ndarray]:
    """generate_extra_tensors: written before the checkpoint's own tensors."""
    scaling = model.config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return {"rope_freqs.weight": llama3_rope_factors(model.config)}
    if kind == "longrope":
        return {"rope_factors_long.weight": np.asarray(scaling["long_factor"], np.float32),
                "rope_factors_short.weight": np.asarray(scaling["short_factor"], np.float32)}
    return {}


# transformers' MoE tensor (after "model.layers.{i}.", "{e}": per expert) -> llama.cpp's stacked tensor
_MOE_GGUF = {
    "mlp.gate.weight": "ffn_gate_inp", "block_sparse_moe.gate.weight": "ffn_gate_inp",
    "block_sparse_moe.router.layer.weight": "ffn_gate_inp",
    "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps", "mlp.experts.{e}.up_proj.weight": "ffn_up_exps",
    "mlp.experts.{e}.down_proj.weight": "ffn_down_exps", "block_sparse_moe.experts.{e}.w1.weight": "ffn_gate_exps",
    "block_sparse_moe.experts.{e}.w3.weight": "ffn_up_exps", "block_sparse_moe.experts.{e}.w2.weight": "ffn_down_exps",
    "block_sparse_moe.output_linear.weight": "ffn_down_exps",
}


def moe_tensors(model: TinyArch) -> tuple[dict[str, np.ndarray], set[str]]:
    """(the stacked expert and router tensors as the converters write them, the HF names they came from).
    Per-expert tensors are stacked [E, out, in] in expert order; Granite's input_linear is split into gate (first
    half of its rows) and up."""
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        for pattern, gguf_name in _MOE_GGUF.items():
            if "{e}" in pattern:
                parts = [model.weights.get(p + pattern.format(e=e)) for e in range(64)]
                parts = [x for x in parts if x is not None]
                if parts:
                    out[f"blk.{i}.{gguf_name}.weight"] = np.stack(parts)
                    used |= {p + pattern.format(e=e) for e in range(len(parts))}
            elif p + pattern in model.weights:
                out[f"blk.{i}.{gguf_name}.weight"] = model.weights[p + pattern]
                used.add(p + pattern)
        fused = model.weights.get(p + "block_sparse_moe.input_linear.weight")
        if fused is not None:
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = np.split(fused, 2, axis=1)
            used.add(p + "block_sparse_moe.input_linear.weight")
    return out, used


def gguf_tensors(model: TinyArch) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF, named and transformed as the converter does."""
    c = model.config
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == model.gguf_arch)
    names = gguf.get_tensor_name_map(arch, model.num_layers)
    out = extra_tensors(model)
    experts, used = moe_tensors(model)
    out |= {n: np.ascontiguousarray(w, np.float32) for n, w in experts.items()}
    for hf_name, w in model.weights.items():
        if hf_name in used:
            continue
        if model.gguf_arch in PERMUTED_ARCHS and hf_name.endswith("q_proj.weight"):
            w = permute_rows(w, c["num_attention_heads"])
        elif model.gguf_arch in PERMUTED_ARCHS and hf_name.endswith("k_proj.weight"):
            w = permute_rows(w, c["num_key_value_heads"])
        elif model.gguf_arch == "gemma3" and hf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # Gemma3RMSNorm computes x * (1 + w); llama.cpp multiplies by the weight
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = np.ascontiguousarray(w, np.float32)
    return out


def write_gguf(model: TinyArch, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), model.gguf_arch)
    w.add_type(gguf.GGUFType.MODEL)
    # Not "tiny-phi3": llama.cpp's vocabulary loader sets token attributes on "</s>" for any general.name
    # containing "phi3" or "phi-3" and fails when the vocabulary has no such token (Phi-4's has none).
    w.add_name("tiny-phi4-mini" if model.name == "phi3" else f"tiny-{model.name}")
    ARCH_KEYS[model.gguf_arch](w, model.config)
    _tokenizer_keys(w, model)
    for name, tensor in gguf_tensors(model).items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
