"""Tiny random models of each supported architecture, defined once in Hugging Face form.

One builder per architecture returns a TinyArch: a config.json dict (keys as the released checkpoints of
that model_type carry them, in the transformers 4.x style the Hub holds: rope_theta / rope_scaling, not
transformers 5's rope_parameters) and fp32 weights under transformers' tensor names and layouts. Both
writers derive from it: write_hf_folder() here, write_gguf() in archs_gguf.py (as llama.cpp's
convert_hf_to_gguf.py would convert the folder), so the two files hold the same model.

Geometry: hidden 64, 4 query heads / 2 KV heads, head_dim 16 or 32 (ONNX Runtime's GroupQueryAttention
wants head_dim % 16 == 0), intermediate 128, the 269-token byte-level BPE of tests/tiny.py, context 256,
and enough layers for each per-layer pattern to show (Gemma 3: 6, so layer 5 is global; SmolLM3: 4, so
layer 3 has no RoPE).

Run to write the fixtures:  python tests/archs.py OUT_DIR [NAME ...]
(OUT_DIR/<name>/hf/ and OUT_DIR/<name>/model.gguf; every architecture when no NAME is given)
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py, when run as a script

from tiny import CHAT_TEMPLATE, MERGES, SPECIALS, vocab  # noqa: E402

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, CONTEXT = 64, 4, 2, 128, 256
VOCAB = len(vocab()[0])  # 269: 3 specials + 256 bytes + 10 merges
WEIGHT_SCALE = 0.15  # large enough that each position's logits depend on its context

# Pre-tokenizer regexes (tokenizers' Split patterns) for the tokenizer.ggml.pre names used below.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_REGEX = {"gpt-2": _GPT2_REGEX, "llama-bpe": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}


@dataclass(frozen=True)
class TinyArch:
    """One tiny model: what config.json and model.safetensors hold, plus the tokenizer's flavour."""

    name: str  # fixture name, e.g. "llama3.2"
    gguf_arch: str  # general.architecture llama.cpp's converter writes
    config: dict
    weights: dict[str, np.ndarray]  # transformers' names and layouts, float32
    pre: str  # tokenizer.ggml.pre, and the matching split in tokenizer.json
    tokenizer_class: str = "PreTrainedTokenizerFast"

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"]

    @property
    def is_tied(self) -> bool:
        return "lm_head.weight" not in self.weights


# ---- config.json -----------------------------------------------------------------------------------

def _base_config(architecture: str, model_type: str, *, layers: int, tied: bool, rope_theta: float,
                 rms_eps: float = 1e-6, **extra) -> dict:
    config = {
        "architectures": [architecture], "model_type": model_type, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTERMEDIATE, "max_position_embeddings": CONTEXT,
        "num_attention_heads": HEADS, "num_hidden_layers": layers, "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": rms_eps, "rope_scaling": None, "rope_theta": rope_theta, "tie_word_embeddings": tied,
        "torch_dtype": "float32", "transformers_version": "4.55.0", "use_cache": True, "vocab_size": VOCAB,
    }
    config.update(extra)
    return dict(sorted(config.items()))


# ---- weights ----------------------------------------------------------------------------------------

class _Weights:
    """Seeded random tensors under transformers' names (nn.Linear weights are [out_features, in_features])."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {}

    def rand(self, name: str, *shape: int, scale: float = WEIGHT_SCALE) -> None:
        self.tensors[name] = (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(self, name: str, size: int, *, zero_centred: bool = False) -> None:
        """Llama-style norms multiply by w (stored near 1); Gemma's by 1 + w (stored near 0)."""
        self.tensors[name] = ((0.0 if zero_centred else 1.0)
                              + self.rng.standard_normal(size) * 0.1).astype(np.float32)


def _dense_weights(config: dict, seed: int, *, qkv_bias: bool = False, qk_norm: bool = False,
                   sandwich: bool = False, fused: bool = False, zero_centred: bool = False) -> dict[str, np.ndarray]:
    """A decoder's tensors. sandwich: Gemma's post-attention and pre/post-feed-forward norms;
    fused: Phi-3's qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up] rows)."""
    w = _Weights(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    w.rand("model.embed_tokens.weight", VOCAB, hidden, scale=0.5)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.norm(p + "input_layernorm.weight", hidden, zero_centred=zero_centred)
        w.norm(p + "post_attention_layernorm.weight", hidden, zero_centred=zero_centred)
        if sandwich:
            w.norm(p + "pre_feedforward_layernorm.weight", hidden, zero_centred=zero_centred)
            w.norm(p + "post_feedforward_layernorm.weight", hidden, zero_centred=zero_centred)
        if fused:
            w.rand(p + "self_attn.qkv_proj.weight", q_dim + 2 * kv_dim, hidden)
        else:
            for proj, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                w.rand(p + f"self_attn.{proj}.weight", rows, hidden)
                if qkv_bias:
                    w.rand(p + f"self_attn.{proj}.bias", rows, scale=0.5)
        if qk_norm:
            w.norm(p + "self_attn.q_norm.weight", head_dim, zero_centred=zero_centred)
            w.norm(p + "self_attn.k_norm.weight", head_dim, zero_centred=zero_centred)
        w.rand(p + "self_attn.o_proj.weight", hidden, q_dim)
        if fused:
            w.rand(p + "mlp.gate_up_proj.weight", 2 * inter, hidden)
        else:
            w.rand(p + "mlp.gate_proj.weight", inter, hidden)
            w.rand(p + "mlp.up_proj.weight", inter, hidden)
        w.rand(p + "mlp.down_proj.weight", hidden, inter)
    w.norm("model.norm.weight", hidden, zero_centred=zero_centred)
    if not config["tie_word_embeddings"]:
        w.rand("lm_head.weight", VOCAB, hidden, scale=0.3)
    return w.tensors


# ---- the architectures ------------------------------------------------------------------------------

def tiny_llama32() -> TinyArch:
    """Llama 3.2: llama3 RoPE scaling (written to GGUF as a rope_freqs tensor), tied embeddings, head_dim
    given. rope_theta 10,000 rather than 500,000 so that the scaled low frequencies turn visibly within
    the test sequence; original_max_position_embeddings stays 8192 because the converter reads it from
    the top level of the config (absent, so 8192) rather than from rope_scaling."""
    config = _base_config(
        "LlamaForCausalLM", "llama", layers=2, tied=True, rope_theta=10000.0, rms_eps=1e-5,
        attention_bias=False, head_dim=32, mlp_bias=False, pretraining_tp=1,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    return TinyArch("llama3.2", "llama", config, _dense_weights(config, seed=32), pre="llama-bpe")


def tiny_qwen2() -> TinyArch:
    """Qwen2 / Qwen2.5: biases on q, k and v; untied head (as the 7B); sliding_window present but unused."""
    config = _base_config("Qwen2ForCausalLM", "qwen2", layers=2, tied=False, rope_theta=1000000.0,
                          max_window_layers=2, sliding_window=CONTEXT, use_sliding_window=False)
    return TinyArch("qwen2", "qwen2", config, _dense_weights(config, seed=2, qkv_bias=True), pre="qwen2",
                    tokenizer_class="Qwen2Tokenizer")


def tiny_qwen3() -> TinyArch:
    """Qwen3: RMSNorm per head on q and k before RoPE; head_dim 32 given (heads x head_dim = 128 != hidden)."""
    config = _base_config("Qwen3ForCausalLM", "qwen3", layers=2, tied=True, rope_theta=1000000.0,
                          attention_bias=False, head_dim=32, max_window_layers=2, sliding_window=None,
                          use_sliding_window=False)
    return TinyArch("qwen3", "qwen3", config, _dense_weights(config, seed=3, qk_norm=True), pre="qwen2",
                    tokenizer_class="Qwen2Tokenizer")


GEMMA3_WINDOW = 8  # tokens a local layer sees (itself included); the test sequence is several windows long


def tiny_gemma3() -> TinyArch:
    """Gemma 3 (text, as gemma-3-270m/1b): QK-norm, norms before and after attention and MLP, GELU-tanh,
    embedding times sqrt(hidden), 5 local : 1 global layers (local rope base 10,000, global 1,000,000),
    tied head. query_pre_attn_scalar equals head_dim: llama.cpp ignores the key and scales by
    1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B only), so any other value would not agree."""
    layers = 6
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = _base_config(
        "Gemma3ForCausalLM", "gemma3_text", layers=layers, tied=True, rope_theta=1000000.0,
        _sliding_window_pattern=6, attention_bias=False, attn_logit_softcapping=None,
        final_logit_softcapping=None, head_dim=32, hidden_activation="gelu_pytorch_tanh",
        layer_types=layer_types, pad_token_id=0, query_pre_attn_scalar=32, rope_local_base_freq=10000.0,
        sliding_window=GEMMA3_WINDOW, use_bidirectional_attention=False)
    del config["hidden_act"]  # Gemma 3 names it hidden_activation
    weights = _dense_weights(config, seed=33, qk_norm=True, sandwich=True, zero_centred=True)
    return TinyArch("gemma3", "gemma3", config, weights, pre="gpt-2")


# LongRoPE's short factors apply up to the original context, the long ones past it. llama.cpp chooses by its
# context size (n_ctx > original -> long, whatever the sequence), transformers by the sequence length; the
# original context is 256 so that llama.cpp can run each side of it (it pads n_ctx to at least 256).
PHI3_ORIGINAL_CONTEXT, PHI3_CONTEXT = 256, 4096


def tiny_phi3() -> TinyArch:
    """Phi-4-mini style Phi-3: fused qkv_proj and gate_up_proj, partial_rotary_factor 0.75 (48 of 64
    head dims rotate: ONNX Runtime's rotary needs a multiple of 16, as Phi-4-mini's 96 of 128 is), LongRoPE
    with short/long factors (24 each; context 16x the original, so the attention factor is
    sqrt(1 + ln 16 / ln 256)), tied head, sliding_window past the context (Phi-4-mini has 262144)."""
    rng = np.random.default_rng(34)
    hidden, heads = 128, 2
    rope_pairs = int(0.75 * hidden) // heads // 2
    scaling = {"long_factor": [round(float(x), 4) for x in 1.0 + np.sort(rng.uniform(0, 7, rope_pairs))],
               "short_factor": [round(float(x), 4) for x in 1.0 + np.sort(rng.uniform(0, 0.5, rope_pairs))],
               "type": "longrope"}
    config = _base_config(
        "Phi3ForCausalLM", "phi3", layers=2, tied=True, rope_theta=10000.0, rms_eps=1e-5,
        max_position_embeddings=PHI3_CONTEXT, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=1,
        attention_bias=False, embd_pdrop=0.0, full_attn_mod=1, interpolate_factor=1, lm_head_bias=False,
        mlp_bias=False, original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT, pad_token_id=0,
        partial_rotary_factor=0.75, resid_pdrop=0.0, rope_scaling=scaling, sliding_window=262144)
    return TinyArch("phi3", "phi3", config, _dense_weights(config, seed=34, fused=True), pre="gpt-2",
                    tokenizer_class="GPT2Tokenizer")


def tiny_smollm3() -> TinyArch:
    """SmolLM3: no RoPE on every fourth layer (no_rope_layers[i] == 0 where (i + 1) % 4 == 0)."""
    layers, interval = 4, 4
    config = _base_config(
        "SmolLM3ForCausalLM", "smollm3", layers=layers, tied=True, rope_theta=5000000.0,
        attention_bias=False, layer_types=["full_attention"] * layers, max_window_layers=layers,
        mlp_bias=False, no_rope_layer_interval=interval, pad_token_id=0, pretraining_tp=1,
        no_rope_layers=[int((i + 1) % interval != 0) for i in range(layers)], sliding_window=None,
        use_sliding_window=False)
    return TinyArch("smollm3", "smollm3", config, _dense_weights(config, seed=35), pre="llama-bpe")


def tiny_granite() -> TinyArch:
    """Granite 3.x: embedding, attention (replaces 1/sqrt(head_dim)), residual and logits multipliers;
    tied head."""
    config = _base_config(
        "GraniteForCausalLM", "granite", layers=2, tied=True, rope_theta=5000000.0, rms_eps=1e-5,
        attention_bias=False, attention_multiplier=0.0625, embedding_multiplier=12.0, logits_scaling=8.0,
        mlp_bias=False, pad_token_id=0, residual_multiplier=0.22)
    return TinyArch("granite", "granite", config, _dense_weights(config, seed=36), pre="gpt-2")


# ---- Mixture of Experts: 4 experts of 32 intermediate neurons, 2 per token ----------------------------------

EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE = 4, 2, 32
ROUTER_SCALE = 0.6  # router logits spread over a few units: the top 2 of 4 are chosen decisively, not by rounding


def _moe_weights(config: dict, seed: int, layout: str, **dense) -> dict[str, np.ndarray]:
    """A decoder's tensors with each MLP replaced by a router and experts, named as transformers names them:
    layout "qwen" (mlp.gate, mlp.experts.{e}.gate_proj/up_proj/down_proj), "mixtral" (block_sparse_moe.gate,
    experts.{e}.w1 gate / w3 up / w2 down) or "granite" (block_sparse_moe.router.layer, input_linear [E, 2I, H]
    holding gate then up, output_linear [E, H, I])."""
    weights = {n: w for n, w in _dense_weights(config, seed, **dense).items() if ".mlp." not in n}
    w = _Weights(seed + 1000)
    hidden, inter = config["hidden_size"], EXPERT_INTERMEDIATE
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        router = {"qwen": "mlp.gate", "mixtral": "block_sparse_moe.gate", "granite": "block_sparse_moe.router.layer"}
        w.rand(p + router[layout] + ".weight", EXPERTS, hidden, scale=ROUTER_SCALE)
        if layout == "granite":
            w.rand(p + "block_sparse_moe.input_linear.weight", EXPERTS, 2 * inter, hidden)
            w.rand(p + "block_sparse_moe.output_linear.weight", EXPERTS, hidden, inter)
            continue
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}." if layout == "qwen" else f"{p}block_sparse_moe.experts.{e}."
            names = ("gate_proj", "up_proj", "down_proj") if layout == "qwen" else ("w1", "w3", "w2")
            w.rand(q + names[0] + ".weight", inter, hidden)
            w.rand(q + names[1] + ".weight", inter, hidden)
            w.rand(q + names[2] + ".weight", hidden, inter)
    return weights | w.tensors


def tiny_qwen3moe() -> TinyArch:
    """Qwen3-MoE (as Qwen3-30B-A3B): QK-norm per head, head_dim 32 given, softmax then top 2 of 4 experts,
    renormalised (norm_topk_prob); the dense intermediate_size is present and unused."""
    config = _base_config("Qwen3MoeForCausalLM", "qwen3_moe", layers=2, tied=False, rope_theta=1000000.0,
                          attention_bias=False, head_dim=32, max_window_layers=2, sliding_window=None,
                          use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
                          moe_intermediate_size=EXPERT_INTERMEDIATE, norm_topk_prob=True, num_experts=EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN, output_router_logits=False,
                          router_aux_loss_coef=0.001)
    return TinyArch("qwen3moe", "qwen3moe", config, _moe_weights(config, 40, "qwen", qk_norm=True), pre="qwen2",
                    tokenizer_class="Qwen2Tokenizer")


def tiny_olmoe() -> TinyArch:
    """OLMoE: QK-norm over all of q's and k's channels (not per head), softmax then top 2 of 4 without
    renormalising, untied head. 4 KV heads: llama.cpp sizes the k-norm n_embd wide, so no GQA."""
    config = _base_config("OlmoeForCausalLM", "olmoe", layers=2, tied=False, rope_theta=10000.0, rms_eps=1e-5,
                          num_key_value_heads=HEADS, intermediate_size=EXPERT_INTERMEDIATE, attention_bias=False,
                          clip_qkv=None, norm_topk_prob=False, num_experts=EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN, output_router_logits=False,
                          router_aux_loss_coef=0.01, pad_token_id=1)
    weights = _moe_weights(config, 41, "qwen")
    for i in range(2):  # full-width norms
        p = f"model.layers.{i}.self_attn."
        for n, seed in (("q_norm", 410 + i), ("k_norm", 420 + i)):
            weights[p + n + ".weight"] = (1 + np.random.default_rng(seed).standard_normal(HIDDEN) * 0.1).astype(np.float32)
    return TinyArch("olmoe", "olmoe", config, weights, pre="gpt-2")


def tiny_granitemoe() -> TinyArch:
    """Granite-MoE (3.x 1B-A400M style): Granite's four multipliers, top 2 of 4 logits then a softmax over them,
    stacked experts with gate and up in one input_linear, tied head."""
    config = _base_config(
        "GraniteMoeForCausalLM", "granitemoe", layers=2, tied=True, rope_theta=10000.0, rms_eps=1e-6,
        intermediate_size=EXPERT_INTERMEDIATE, attention_bias=False, attention_multiplier=0.0625,
        embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, num_local_experts=EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN, output_router_logits=False, router_aux_loss_coef=0.0, pad_token_id=0)
    return TinyArch("granitemoe", "granitemoe", config, _moe_weights(config, 42, "granite"), pre="gpt-2")


def tiny_mixtral() -> TinyArch:
    """Mixtral: a Llama block with top 2 of 4 logits then a softmax over them; llama.cpp's GGUF says "llama"
    with llama.expert_count."""
    config = _base_config("MixtralForCausalLM", "mixtral", layers=2, tied=False, rope_theta=1000000.0, rms_eps=1e-5,
                          intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN, output_router_logits=False,
                          router_aux_loss_coef=0.02, router_jitter_noise=0.0, sliding_window=None)
    return TinyArch("mixtral", "llama", config, _moe_weights(config, 43, "mixtral"), pre="llama-bpe")


MOE_BUILDERS = {"qwen3moe": tiny_qwen3moe, "olmoe": tiny_olmoe, "granitemoe": tiny_granitemoe,
                "mixtral": tiny_mixtral}
BUILDERS = {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3, "smollm3": tiny_smollm3,
            "granite": tiny_granite, "llama3.2": tiny_llama32, "phi3": tiny_phi3, **MOE_BUILDERS}


# ---- Hugging Face folder ----------------------------------------------------------------------------

def tokenizer_json(pre: str) -> dict:
    """A `tokenizers` byte-level BPE document over tests/tiny.py's vocabulary."""
    tokens, _ = vocab()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": pre == "gpt-2"}
    pre_tokenizer = byte_level if pre == "gpt-2" else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": PRE_REGEX[pre]}, "behavior": "Isolated", "invert": False},
        byte_level]}
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": pre == "llama-bpe", "vocab": {t: i for i, t in enumerate(tokens)},
                      "merges": [m.split(" ") for m in MERGES]}}


def tokenizer_config(model: TinyArch) -> dict:
    decoder = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
            "bos_token": SPECIALS[0], "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
            "eos_token": SPECIALS[0], "model_max_length": CONTEXT, "tokenizer_class": model.tokenizer_class}


def write_hf_folder(model: TinyArch, folder: Path) -> Path:
    """config.json, model.safetensors (fp32, transformers' names) and the tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config, indent=2) + "\n", encoding="utf-8")
    save_file(dict(sorted(model.weights.items())), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(model.pre), ensure_ascii=False),
                                           encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model), indent=2) + "\n",
                                                  encoding="utf-8")
    return folder


def llama3_rope_factors(config: dict) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for rope_type llama3: the divisor of each
    rotary pair's frequency. It reads original_max_position_embeddings from the top level of the config."""
    scaling, dim = config["rope_scaling"], config.get("head_dim") or HIDDEN // HEADS
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_context = config.get("original_max_position_embeddings", 8192)
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def write_all(out: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Each named architecture's HF folder (out/<name>/hf) and GGUF (out/<name>/model.gguf)."""
    from archs_gguf import write_gguf

    unknown = set(names or ()) - set(BUILDERS)
    if unknown:
        raise SystemExit(f"unknown architecture(s) {sorted(unknown)}; known: {', '.join(BUILDERS)}")
    written = {}
    for name in names or BUILDERS:
        model = BUILDERS[name]()
        write_hf_folder(model, out / name / "hf")
        written[name] = write_gguf(model, out / name / "model.gguf")
    return written


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for name, path in write_all(Path(sys.argv[1]), sys.argv[2:]).items():
        print(name, path)
