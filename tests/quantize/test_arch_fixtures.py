"""The tiny architecture fixtures (tests/quantize/data/arch_logits/<name>/) are self-consistent.

Each fixture holds one tiny model twice: an HF folder and the GGUF llama.cpp's converter would make of it,
plus the logits llama.cpp and transformers computed (tests/quantize/record_arch_logits.py). These tests
need neither peer: the GGUF is the one recorded; after undoing the converter's documented transforms
(Q/K row permutation for llama/smollm3/granite, Gemma's +1 on norms) it holds the HF folder's weights;
its metadata follows config.json; the recorded peers agree.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors.numpy import load_file

DATA = Path(__file__).parent / "data" / "arch_logits"
NAMES = ("qwen2", "qwen3", "gemma3", "smollm3", "granite", "llama3.2", "phi3", "qwen3moe", "olmoe", "granitemoe",
         "mixtral")
# converters derived from LlamaModel permute Q and K rows (Mixtral's is LlamaModel, Granite-MoE's GraniteModel)
PERMUTED = ("llama3.2", "smollm3", "granite", "granitemoe", "mixtral")

# transformers' per-layer tensor names -> llama.cpp's (blk.N.<name>); Gemma 3 overrides one below.
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: [gate; up] rows, split by llama.cpp's SWIGLU as transformers' chunk(2)
    # Mixtures of Experts, once per-expert tensors are stacked (stack_experts)
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.router.layer": "ffn_gate_inp",
    "experts.gate": "ffn_gate_exps", "experts.up": "ffn_up_exps", "experts.down": "ffn_down_exps",
}
# transformers' per-expert (or Granite's stacked) expert tensors -> the stacked module names above
EXPERT_PARTS = {"gate_proj": "experts.gate", "up_proj": "experts.up", "down_proj": "experts.down", "w1": "experts.gate",
                "w3": "experts.up", "w2": "experts.down", "output_linear": "experts.down"}


def stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The HF tensors as llama.cpp's converters stack them: experts.{e}.<part> along a new first axis in expert
    order, Granite's input_linear split into its gate and up halves."""
    out, parts = {}, {}
    for name, w in weights.items():
        pieces = name.split(".")
        if "experts" in pieces:
            at = pieces.index("experts")
            layer, expert, part = pieces[2], int(pieces[at + 1]), pieces[at + 2]
            parts.setdefault(f"model.layers.{layer}.{EXPERT_PARTS[part]}.weight", {})[expert] = w
        elif name.endswith("input_linear.weight"):
            gate, up = np.split(w, 2, axis=1)
            out[f"model.layers.{pieces[2]}.experts.gate.weight"] = gate
            out[f"model.layers.{pieces[2]}.experts.up.weight"] = up
        elif name.endswith("output_linear.weight"):
            out[f"model.layers.{pieces[2]}.experts.down.weight"] = w
        else:
            out[name] = w
    return out | {name: np.stack([by[e] for e in sorted(by)]) for name, by in parts.items()}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(name: str, hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    if name == "gemma3" and module == "post_attention_layernorm":
        module_name = "post_attention_norm"  # Gemma's sandwich: ffn_norm is pre_feedforward_layernorm
    else:
        module_name = LAYER_NAMES[module]
    return f"blk.{layer}.{module_name}.{suffix}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation: per head, interleaved rotary pairs back to HF's two halves."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class Fixture:
    def __init__(self, name: str):
        folder = DATA / name
        self.name = name
        self.gguf_path = folder / "model.gguf"
        self.reader = GGUFReader(self.gguf_path)
        self.config = json.loads((folder / "hf" / "config.json").read_text(encoding="utf-8"))
        self.weights = load_file(folder / "hf" / "model.safetensors")
        self.recorded = np.load(folder / "logits.npz")
        self.arch = self.field("general.architecture")

    def field(self, key: str):
        return self.reader.fields[key].contents() if key in self.reader.fields else None

    def tensors(self) -> dict[str, np.ndarray]:
        return {t.name: np.asarray(t.data) for t in self.reader.tensors}


@pytest.fixture(scope="module", params=NAMES)
def fixture(request) -> Fixture:
    return Fixture(request.param)


def test_the_gguf_is_the_one_the_logits_were_recorded_from(fixture):
    assert hashlib.sha256(fixture.gguf_path.read_bytes()).hexdigest() == str(fixture.recorded["gguf_sha256"])


def test_the_gguf_holds_the_hf_weights_after_undoing_the_converter_transforms(fixture):
    c, tensors = fixture.config, fixture.tensors()
    for hf_name, hf in stack_experts(fixture.weights).items():
        w = tensors.pop(gguf_name(fixture.name, hf_name))
        assert w.dtype == np.float32 and w.shape == hf.shape, hf_name
        if fixture.name in PERMUTED and hf_name.endswith("q_proj.weight"):
            w = unpermute_rows(w, c["num_attention_heads"])
        elif fixture.name in PERMUTED and hf_name.endswith("k_proj.weight"):
            w = unpermute_rows(w, c["num_key_value_heads"])
        if fixture.name == "gemma3" and hf_name.endswith("norm.weight"):
            hf = hf + np.float32(1.0)  # Gemma3RMSNorm scales by 1 + w; the GGUF stores 1 + w
        np.testing.assert_array_equal(w, hf, err_msg=hf_name)
    extras = {"llama3.2": {"rope_freqs.weight"}, "phi3": {"rope_factors_long.weight", "rope_factors_short.weight"}}
    assert set(tensors) == extras.get(fixture.name, set())


def test_a_tied_model_has_no_output_tensor_in_either_file(fixture):
    tied = fixture.config["tie_word_embeddings"]
    assert ("lm_head.weight" in fixture.weights) is not tied
    assert ("output.weight" in fixture.tensors()) is not tied


def test_the_permutation_only_moves_rows_within_a_head():
    """The transform the GGUF readers undo: rows (x0..x7 | y0..y7) of one 16-wide head become x0 y0 x1 y1 .."""
    head = np.arange(16)[:, None]
    permuted = head.reshape(1, 2, 8, 1).swapaxes(1, 2).reshape(16, 1)
    assert permuted[:4, 0].tolist() == [0, 8, 1, 9]
    np.testing.assert_array_equal(unpermute_rows(permuted, 1), head)


def test_phi3_keeps_qkv_and_gate_up_fused_with_the_split_in_config_order():
    fixture = Fixture("phi3")
    c, tensors = fixture.config, fixture.tensors()
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q_rows, kv_rows = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    qkv = tensors["blk.0.attn_qkv.weight"]
    assert qkv.shape == (q_rows + 2 * kv_rows, c["hidden_size"])
    q, k, v = np.split(qkv, [q_rows, q_rows + kv_rows])
    assert q.shape[0] == q_rows and k.shape == v.shape == (kv_rows, c["hidden_size"])
    assert tensors["blk.0.ffn_up.weight"].shape == (2 * c["intermediate_size"], c["hidden_size"])
    assert "blk.0.ffn_gate.weight" not in tensors


def _llama3_factors(config: dict) -> np.ndarray:
    """llama3 RoPE scaling as frequency divisors (transformers' _compute_llama3_parameters, inverted)."""
    s, dim = config["rope_scaling"], config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * np.pi / inv_freq
    old = s["original_max_position_embeddings"]
    smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    scaled = 1 / ((1 - smooth) / s["factor"] + smooth)
    return np.where(wavelen < old / s["high_freq_factor"], 1.0,
                    np.where(wavelen > old / s["low_freq_factor"], s["factor"], scaled))


def test_rope_factor_tensors_hold_the_config_scaling():
    llama = Fixture("llama3.2")
    factors = llama.tensors()["rope_freqs.weight"]
    np.testing.assert_allclose(factors, _llama3_factors(llama.config), rtol=1e-6)
    assert factors[0] == 1.0 and factors[-1] == llama.config["rope_scaling"]["factor"]
    assert ((factors > 1) & (factors < 32)).any(), "the smoothed band shows too"
    phi = Fixture("phi3")
    tensors, scaling = phi.tensors(), phi.config["rope_scaling"]
    np.testing.assert_array_equal(tensors["rope_factors_long.weight"], np.float32(scaling["long_factor"]))
    np.testing.assert_array_equal(tensors["rope_factors_short.weight"], np.float32(scaling["short_factor"]))


GGUF_ARCH = {"llama3.2": "llama", "mixtral": "llama"}  # general.architecture, where not the fixture's name


def expected_metadata(name: str, c: dict) -> dict:
    """The GGUF keys llama.cpp's loader reads, as the converter derives them from config.json."""
    arch = GGUF_ARCH.get(name, name)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    keys = {"block_count": c["num_hidden_layers"], "context_length": c["max_position_embeddings"],
            "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
            "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": c["num_key_value_heads"],
            "rope.freq_base": c["rope_theta"], "attention.layer_norm_rms_epsilon": c["rms_norm_eps"]}
    if name in ("llama3.2", "qwen3", "gemma3", "qwen3moe"):  # head_dim given in config.json
        keys |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    if name in ("llama3.2", "smollm3", "granite", "granitemoe", "mixtral"):
        keys |= {"vocab_size": c["vocab_size"], "rope.dimension_count": head_dim}
    if name in ("qwen3moe", "olmoe", "granitemoe", "mixtral"):
        keys |= {"expert_count": c.get("num_experts") or c["num_local_experts"],
                 "expert_used_count": c["num_experts_per_tok"]}
    if name == "qwen3moe":  # its expert size apart from the (unused) dense feed_forward_length
        keys["expert_feed_forward_length"] = c["moe_intermediate_size"]
    if name == "gemma3":
        keys |= {"attention.sliding_window": c["sliding_window"]}  # the global base is rope.freq_base
    if name in ("granite", "granitemoe"):
        keys |= {"attention.scale": c["attention_multiplier"], "embedding_scale": c["embedding_multiplier"],
                 "residual_scale": c["residual_multiplier"], "logit_scale": c["logits_scaling"]}
    if name == "phi3":
        original = c["original_max_position_embeddings"]
        scale = c["max_position_embeddings"] / original
        keys |= {"rope.dimension_count": int(c["partial_rotary_factor"] * head_dim),
                 "rope.scaling.original_context_length": original, "attention.sliding_window": c["sliding_window"],
                 "rope.scaling.attn_factor": math.sqrt(1 + math.log(scale) / math.log(original))}
    return {f"{arch}.{k}": v for k, v in keys.items()}


def test_gguf_metadata_follows_the_config(fixture):
    assert fixture.arch == GGUF_ARCH.get(fixture.name, fixture.name)
    for key, value in expected_metadata(fixture.name, fixture.config).items():
        assert fixture.field(key) == pytest.approx(value, rel=1e-6), key
    assert fixture.field("general.file_type") == 0  # all F32


def test_gguf_and_hf_tokenizers_hold_the_same_vocabulary(fixture):
    tokenizer = json.loads((DATA / fixture.name / "hf" / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = sorted(tokenizer["model"]["vocab"], key=tokenizer["model"]["vocab"].get)
    assert fixture.field("tokenizer.ggml.tokens") == by_id
    assert fixture.field("tokenizer.ggml.merges") == [" ".join(m) for m in tokenizer["model"]["merges"]]
    assert len(by_id) == fixture.config["vocab_size"]


def test_the_recorded_peers_agree(fixture):
    r = fixture.recorded
    ids = r["token_ids"]
    assert len(ids) >= 40
    if fixture.name == "gemma3":
        assert len(ids) >= 4 * fixture.config["sliding_window"], "the local layers' window must matter"
    runs = [("logits", "logits_transformers")] + ([("logits_long", "logits_long_transformers")]
                                                  if fixture.name == "phi3" else [])
    for ours, theirs in runs:
        assert r[ours].shape == r[theirs].shape == (len(ids), fixture.config["vocab_size"])
        assert r[ours].dtype == np.float32 and np.isfinite(r[ours]).all()
        assert np.abs(r[ours] - r[theirs]).max() <= 1e-3 * np.abs(r[theirs]).max(), ours


def test_phi3_long_and_short_factor_runs_differ():
    """llama.cpp's n_ctx (256 = the original context: short factors; 512: long) picks the factors."""
    r = Fixture("phi3").recorded
    assert int(r["n_ctx"]) == 256 and int(r["n_ctx_long"]) == 512
    assert np.abs(r["logits"] - r["logits_long"]).max() > 1.0


def test_the_builders_still_describe_the_committed_fixtures(fixture):
    """tests/archs*.py edited without re-recording would leave the fixtures stale: configs, tensor names and
    shapes must match (values are not compared: they come from numpy's RNG, which may change)."""
    from archs import BUILDERS
    from archs_gguf import gguf_tensors

    model = BUILDERS[fixture.name]()
    assert model.config == fixture.config
    assert {k: v.shape for k, v in model.weights.items()} == {k: v.shape for k, v in fixture.weights.items()}
    assert {k: v.shape for k, v in gguf_tensors(model).items()} == {k: v.shape for k, v in fixture.tensors().items()}
