"""Hugging Face folders: GGUF -> HF -> Checkpoint round trip, tiny random Llama/Mistral/Qwen2 folders run
through the fp32 graph against the numpy reference, BF16/F16 conversion, and the errors for what we refuse."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors import TensorSpec, serialize_file
from safetensors.numpy import save_file

import reference
from agent.engine.runner import ModelRunner
from agent.wire import Geometry
from quantize import hf
from quantize.checkpoint import Checkpoint, CheckpointError, expected_weight_shapes, load_checkpoint
from quantize.graph import build_graph
from quantize.package import build_bundle
from quantize.precision import QuantSpec

VOCAB = 269  # the tiny GGUF tokenizer: 3 specials + 256 bytes + 10 merges

BASE_CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_scaling": None, "tie_word_embeddings": False,
}
CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0},
    # head_dim given explicitly and not hidden/heads (as Mistral Nemo does); window wider than the prompt
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 32,
                "sliding_window": 128},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32,
              "max_window_layers": 2},
}
BF16_TENSOR = "model.layers.1.mlp.down_proj.weight"


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights for config (q/k/v biases for Qwen2, no lm_head when tied)."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(VOCAB, hidden, scale=0.5), "model.norm.weight": 1 + rand(hidden, scale=0.1)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(VOCAB, hidden, scale=0.3)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rand(hidden, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + rand(hidden, scale=0.1),
              p + "self_attn.q_proj.weight": rand(q, hidden), p + "self_attn.k_proj.weight": rand(kv, hidden),
              p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.o_proj.weight": rand(hidden, q),
              p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
              p + "mlp.down_proj.weight": rand(hidden, inter)}
        if config["architectures"] == ["Qwen2ForCausalLM"]:
            for n, d in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{n}.bias"] = rand(d, scale=0.5)
    return w


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """The top 16 bits of each float32 (truncation to bfloat16)."""
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def write_bf16_file(path: Path, name: str, w: np.ndarray) -> None:
    """A one-tensor BF16 safetensors file (safetensors.numpy.save_file has no bfloat16 to write)."""
    bits = np.ascontiguousarray(bf16_bits(w))
    serialize_file({name: TensorSpec(dtype="bfloat16", shape=bits.shape, data_ptr=bits.ctypes.data,
                                     data_len=bits.nbytes)}, str(path))


def write_weights(folder: Path, weights: dict[str, np.ndarray]) -> None:
    """Two shards plus an index: shard 1 stores the MLP projections as F16, shard 2 one BF16 tensor."""
    rest = {n: w for n, w in weights.items() if n != BF16_TENSOR}
    save_file({n: w.astype(np.float16) if ".mlp." in n else w for n, w in rest.items()},
              folder / "model-00001-of-00002.safetensors")
    write_bf16_file(folder / "model-00002-of-00002.safetensors", BF16_TENSOR, weights[BF16_TENSOR])
    weight_map = {n: "model-00001-of-00002.safetensors" for n in rest}
    weight_map[BF16_TENSOR] = "model-00002-of-00002.safetensors"
    (folder / hf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_hf_folder(folder: Path, arch: str, tokenizer_json: str, **overrides) -> dict[str, np.ndarray]:
    """A tiny random HF checkpoint folder for arch; returns the float32 weights it was made from."""
    folder.mkdir(parents=True, exist_ok=True)
    config = BASE_CONFIG | CONFIGS[arch] | overrides
    (folder / "config.json").write_text(json.dumps(config))
    weights = random_weights(config)
    write_weights(folder, weights)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
         "chat_template": "{{ messages[0]['content'] }}<|im_end|>"}))
    return weights


@pytest.fixture(scope="module")
def folders(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for arch in CONFIGS:
        write_hf_folder(root / arch, arch, tiny_checkpoint.tokenizer.tokenizer_json)
    return {arch: root / arch for arch in CONFIGS}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def graph_logits(ckpt, ids: list[int], path: Path) -> np.ndarray:
    """Prefill logits [T, vocab] from the fp32 graph run by the agent's ModelRunner."""
    model, _ = build_graph(ckpt, QuantSpec())
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")
    g = ckpt.geometry
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    n = len(ids)
    cache = runner.new_cache(1, 32)
    return runner.forward(np.array([ids]), np.array([n - 1]), np.array([n]), np.arange(n)[None], cache)[0]


# ---- GGUF -> HF -> Checkpoint -------------------------------------------------------------------------

def test_gguf_checkpoint_round_trips_through_an_hf_folder(tiny_checkpoint, tmp_path):
    folder = hf.save_hf(tiny_checkpoint, tmp_path / "out")
    back = load_checkpoint(folder)
    assert back.geometry == tiny_checkpoint.geometry
    assert back.weights.keys() == tiny_checkpoint.weights.keys()
    for name, w in tiny_checkpoint.weights.items():
        np.testing.assert_array_equal(back.weights[name], w, err_msg=name)
    assert back.tokenizer == tiny_checkpoint.tokenizer
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left behind


def test_save_hf_replaces_an_existing_folder_and_writes_float16(tiny_checkpoint, tmp_path):
    folder = tmp_path / "out"
    hf.save_hf(tiny_checkpoint, folder)
    (folder / "stale.txt").write_text("from the previous export")
    hf.save_hf(tiny_checkpoint, folder, dtype="float16")
    assert not (folder / "stale.txt").exists()
    back = hf.load(folder)
    name = "model.layers.0.mlp.up_proj.weight"
    w = tiny_checkpoint.weights[name]
    np.testing.assert_array_equal(back.weights[name], w.astype(np.float16).astype(np.float32))
    with pytest.raises(ValueError, match="bfloat8"):
        hf.save_hf(tiny_checkpoint, folder, dtype="bfloat8")


def test_qwen2_checkpoint_round_trips_with_biases(folders, tmp_path):
    ckpt = hf.load(folders["qwen2"])
    back = hf.load(hf.save_hf(ckpt, tmp_path / "qwen2"))
    assert back.geometry == ckpt.geometry
    for name, w in ckpt.weights.items():
        np.testing.assert_array_equal(back.weights[name], w, err_msg=name)


# ---- tiny random HF folders -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(CONFIGS))
def test_hf_folder_graph_matches_reference(arch, folders, tmp_path):
    ckpt = load_checkpoint(folders[arch])
    ids = np.random.default_rng(3).integers(0, VOCAB, 10).tolist()
    logits = graph_logits(ckpt, ids, tmp_path / "model.onnx")
    assert rel_err(logits, reference.forward(ckpt, ids)) < 1e-4


def test_geometry_read_from_config(folders):
    llama, mistral, qwen2 = (hf.load(folders[a]).geometry for a in ("llama", "mistral", "qwen2"))
    assert (llama.architecture, llama.head_dim, llama.rope_theta) == ("llama", 16, 500000.0)
    assert not llama.tie_word_embeddings
    assert (mistral.architecture, mistral.head_dim, mistral.sliding_window) == ("mistral", 32, 128)
    assert mistral.rope_theta == 10000.0  # the default when config.json has no rope_theta
    assert (qwen2.attention_bias, qwen2.sliding_window, qwen2.tie_word_embeddings) == (True, None, True)
    assert llama.context_length == 256 and llama.num_kv_heads == 2


def test_bf16_and_f16_tensors_are_converted_exactly(tiny_checkpoint, tmp_path):
    weights = write_hf_folder(tmp_path / "llama", "llama", tiny_checkpoint.tokenizer.tokenizer_json)
    ckpt = hf.load(tmp_path / "llama")
    expected_bf16 = (bf16_bits(weights[BF16_TENSOR]).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(ckpt.weights[BF16_TENSOR], expected_bf16)
    up = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_array_equal(ckpt.weights[up], weights[up].astype(np.float16).astype(np.float32))
    assert all(w.dtype == np.float32 for w in ckpt.weights.values())


def test_source_sha256_covers_the_config_and_the_sorted_safetensors_files(folders, tmp_path):
    folder = folders["llama"]
    h = hashlib.sha256(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True,
                                  separators=(",", ":")).encode())
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.read_bytes())
    assert hf.load(folder).source_sha256 == h.hexdigest()
    # found in review: another rope_theta over the same weights had the same digest
    shutil.copytree(folder, tmp_path / "other")
    config = json.loads((folder / "config.json").read_text()) | {"rope_theta": 10000.0}
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    assert hf.load(tmp_path / "other").source_sha256 != h.hexdigest()


def test_unsharded_folder_without_lm_head_is_tied(tiny_checkpoint, tmp_path):
    folder = tmp_path / "untied"
    write_hf_folder(folder, "llama", tiny_checkpoint.tokenizer.tokenizer_json)
    weights = hf.load(folder).weights
    for p in folder.glob("*.safetensors*"):
        p.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({n: w for n, w in weights.items() if n != "lm_head.weight"}, folder / "model.safetensors")
    ckpt = load_checkpoint(folder)  # config still says tie_word_embeddings: false
    assert ckpt.geometry.tie_word_embeddings and "lm_head.weight" not in ckpt.weights


@pytest.mark.parametrize("overrides, window", [
    ({"sliding_window": 4096}, None),  # not smaller than the context: no window
    ({"sliding_window": None}, None),
    # no key at all: transformers' MistralConfig default (found in review: read as no window)
    ({"sliding_window": "absent", "max_position_embeddings": 8192}, 4096),
])
def test_mistral_window_only_when_smaller_than_context(overrides, window, tiny_checkpoint, tmp_path):
    write_hf_folder(tmp_path / "m", "mistral", tiny_checkpoint.tokenizer.tokenizer_json, **overrides)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    if config["sliding_window"] == "absent":
        del config["sliding_window"]
        (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert hf.load(tmp_path / "m").geometry.sliding_window == window


@pytest.mark.parametrize("overrides, window", [
    ({"max_window_layers": 0}, 32),
    ({"max_window_layers": 2}, None),
    ({"max_window_layers": "absent"}, None),  # transformers' default 28: no layer of 2 is windowed
    # found in review: layer_types, which transformers follows, was ignored
    ({"max_window_layers": 2, "layer_types": ["sliding_attention"] * 2}, 32),
    ({"max_window_layers": 1}, "layers 1..1 only"),
    ({"max_window_layers": 0, "layer_types": ["full_attention", "sliding_attention"]}, "layers 1..1 only"),
])
def test_qwen2_window_applies_only_with_use_sliding_window_on_every_layer(overrides, window, tiny_checkpoint,
                                                                         tmp_path):
    write_hf_folder(tmp_path / "q", "qwen2", tiny_checkpoint.tokenizer.tokenizer_json, use_sliding_window=True,
                    **overrides)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    if config["max_window_layers"] == "absent":
        del config["max_window_layers"]
        (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    if isinstance(window, str):
        with pytest.raises(CheckpointError, match=window):
            hf.load(tmp_path / "q")
    else:
        assert hf.load(tmp_path / "q").geometry.sliding_window == window


def test_rope_scaling_and_transformers_5_rope_parameters_are_read(tiny_checkpoint, tmp_path):
    """Found in review: transformers 5 writes rope_theta inside `rope_parameters`, which was ignored (the model
    got theta 10000), and Llama 3's scaling was refused. Both are read; the scaling as divisors of RoPE's
    frequencies: 1 above the high-frequency wavelength, the factor below the low one, blended between."""
    tok = tiny_checkpoint.tokenizer.tokenizer_json
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    write_hf_folder(tmp_path / "v5", "llama", tok)
    config = json.loads((tmp_path / "v5" / "config.json").read_text())
    del config["rope_theta"], config["rope_scaling"]
    config["rope_parameters"] = llama3 | {"rope_theta": 500000.0}
    (tmp_path / "v5" / "config.json").write_text(json.dumps(config))
    g = hf.load(tmp_path / "v5").geometry
    # head_dim 16, theta 5e5: wavelengths 2 pi 5e5^(i/8) = 6, 32, 167, 861 (< 8192/4), 4443 (between), 23k...
    wavelen = 2 * np.pi * 500000.0 ** (4 / 8)
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    assert g.rope_theta == 500000.0
    np.testing.assert_allclose(g.rope_freq_factors, [1, 1, 1, 1, 1 / ((1 - smooth) / 8 + smooth), 8, 8, 8])
    write_hf_folder(tmp_path / "v4", "llama", tok, rope_scaling={"rope_type": "linear", "factor": 2.0})
    g = hf.load(tmp_path / "v4").geometry
    assert (g.rope_theta, g.rope_freq_factors) == (500000.0, (2.0,) * 8)


# ---- what we refuse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, needle", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*LlamaForCausalLM"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3' without 'low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "one set for every layer"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"head_dim": 8}, "head_dim 8 is not supported"),  # found in review: failed inside ONNX Runtime
    # found in review: transformers turns only this part of each head, the graph all of it
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor 0.25"),
])
def test_unsupported_config_is_named(overrides, needle, tiny_checkpoint, tmp_path):
    write_hf_folder(tmp_path / "m", "llama", tiny_checkpoint.tokenizer.tokenizer_json, **overrides)
    with pytest.raises(CheckpointError, match=needle) as e:
        load_checkpoint(tmp_path / "m")
    assert "not a usable number" not in str(e.value)  # found in review: refusals were wrapped in that


def test_a_tied_config_with_a_different_stored_head_is_refused(tiny_checkpoint, tmp_path):
    """Found in review: the stored head was dropped for the embedding (transformers 4) where transformers 5
    uses it; which one a user meant cannot be known."""
    write_hf_folder(tmp_path / "m", "llama", tiny_checkpoint.tokenizer.tokenizer_json)  # untied: has lm_head
    config = json.loads((tmp_path / "m" / "config.json").read_text()) | {"tie_word_embeddings": True}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_checkpoint(tmp_path / "m")


def test_a_calibrated_build_with_head_dim_other_than_hidden_over_heads(folders, tmp_path):
    """Found in review: calibration captured o_proj's input as hidden_size wide, so every GPTQ or search build
    of such a model (Mistral-Nemo's head_dim) failed inside ONNX Runtime."""
    ckpt = load_checkpoint(folders["mistral"])  # head_dim 32, hidden 64 / 4 heads
    bundle = build_bundle(ckpt, QuantSpec(precision="int4", block_size=16), tmp_path / "b", name="m",
                          calibration_text="the cat sat on the mat. " * 20, progress=lambda _: None)
    assert bundle.manifest.precision == "int4"


def test_missing_config_or_weights_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(BASE_CONFIG | CONFIGS["llama"]))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path / "empty")


def test_unexpected_tensor_is_an_error(tiny_checkpoint, tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, "llama", tiny_checkpoint.tokenizer.tokenizer_json)
    save_file({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}, folder / "extra.safetensors")
    (folder / hf.INDEX_FILE).unlink()  # so the glob finds the extra file
    with pytest.raises(CheckpointError, match="o_proj.bias"):
        hf.load(folder)


# found in review (2026-12-04): each was an "internal error" (exit 2) instead of a line naming the file
@pytest.mark.parametrize("cut", [4, 40, -100])
def test_a_truncated_safetensors_file_is_named(cut, tiny_checkpoint, tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, "llama", tiny_checkpoint.tokenizer.tokenizer_json)
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=f"{shard.name}: not a readable safetensors file"):
        load_checkpoint(folder)


@pytest.mark.parametrize("config, needle", [
    ([1, 2], "not a JSON object"),
    (BASE_CONFIG | CONFIGS["llama"] | {"hidden_size": None}, "not a usable number"),
    (BASE_CONFIG | CONFIGS["llama"] | {"num_attention_heads": 0}, "not a usable number"),
])
def test_a_config_json_of_the_wrong_shape_is_named(config, needle, tiny_checkpoint, tmp_path):
    folder = tmp_path / "m"
    write_hf_folder(folder, "llama", tiny_checkpoint.tokenizer.tokenizer_json)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(folder)


def test_a_nan_weight_in_a_safetensors_file_is_an_error_naming_it(tiny_checkpoint, tmp_path):
    weights = write_hf_folder(tmp_path / "m", "llama", tiny_checkpoint.tokenizer.tokenizer_json)
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    write_weights(tmp_path / "m", weights)
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight holds NaN"):
        hf.load(tmp_path / "m")


# ---- save_hf: Gemma 3, and what it refuses to write ----------------------------------------------------

GEMMA3 = dict(architecture="gemma3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=6,
              num_heads=4, num_kv_heads=1, head_dim=32, context_length=256, rope_theta=1e6, rms_norm_eps=1e-6,
              tie_word_embeddings=True, sliding_window=8, window_layers=(0, 1, 2, 3, 4), rope_local_theta=1e4,
              embedding_multiplier=8.0, attention_scale=0.25)


def random_gemma3(tokenizer, seed: int = 0, **overrides) -> Checkpoint:
    """A tiny random Gemma 3 Checkpoint in the internal form (norm weights are the full multiplier, ~1)."""
    rng = np.random.default_rng(seed)
    g = Geometry(**(GEMMA3 | overrides))
    weights = {}
    for name, shape in expected_weight_shapes(g).items():
        scale = 0.1 if name.endswith("norm.weight") else 1 / np.sqrt(shape[-1])
        weights[name] = ((name.endswith("norm.weight")) + scale * rng.standard_normal(shape)).astype(np.float32)
    return Checkpoint(g, weights, tokenizer, "0" * 64, "gemma3-tiny")


def test_gemma3_checkpoint_round_trips_through_an_hf_folder(tiny_checkpoint, tmp_path):
    ckpt = random_gemma3(tiny_checkpoint.tokenizer)
    folder = hf.save_hf(ckpt, tmp_path / "gemma3")
    back = hf.load(folder)
    assert back.geometry == ckpt.geometry
    assert back.weights.keys() == ckpt.weights.keys()
    for name, w in ckpt.weights.items():  # norms: (w - 1) + 1 is exact for w in [0.5, 2] (Sterbenz)
        np.testing.assert_array_equal(back.weights[name], w, err_msg=name)


def test_gemma3_config_and_norms_are_in_transformers_terms(tiny_checkpoint, tmp_path):
    ckpt = random_gemma3(tiny_checkpoint.tokenizer)
    folder = hf.save_hf(ckpt, tmp_path / "gemma3")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["sliding_window"], config["rope_local_base_freq"], config["rope_theta"]) == (8, 1e4, 1e6)
    assert config["query_pre_attn_scalar"] == 16 and config["hidden_activation"] == "gelu_pytorch_tanh"
    stored = hf.read_tensors(folder / "model.safetensors")
    name = "model.layers.2.self_attn.q_norm.weight"  # transformers' Gemma computes x * (1 + w)
    np.testing.assert_array_equal(stored[name], ckpt.weights[name] - 1)
    np.testing.assert_array_equal(stored["model.layers.2.mlp.up_proj.weight"],
                                  ckpt.weights["model.layers.2.mlp.up_proj.weight"])


def test_gemma3_folder_graph_matches_the_reference_of_the_checkpoint(tiny_checkpoint, tmp_path):
    ckpt = random_gemma3(tiny_checkpoint.tokenizer)
    back = load_checkpoint(hf.save_hf(ckpt, tmp_path / "gemma3"))
    ids = np.random.default_rng(4).integers(0, VOCAB, 20).tolist()  # past the 8-token window
    assert rel_err(graph_logits(back, ids, tmp_path / "model.onnx"), reference.forward(ckpt, ids)) < 1e-4


@pytest.mark.parametrize("arch, overrides, needle", [
    ("phi3", {}, "save_hf writes llama, mistral, qwen2, gemma3"),
    ("granite", {}, "save_hf writes"),
    ("llama", {"residual_multiplier": 0.5}, "residual_multiplier=0.5"),
    ("llama", {"attention_scale": 0.1}, "attention_scale=0.1"),
    ("gemma3", {"embedding_multiplier": 1.0}, "embedding_multiplier=1.0"),
])
def test_save_hf_refuses_what_it_cannot_write_before_writing_anything(arch, overrides, needle, tiny_checkpoint,
                                                                        tmp_path):
    base = GEMMA3 if arch == "gemma3" else {k: v for k, v in GEMMA3.items() if k not in (
        "sliding_window", "window_layers", "rope_local_theta", "embedding_multiplier", "attention_scale")}
    g = Geometry(**(base | {"architecture": arch} | overrides))
    ckpt = Checkpoint(g, {}, tiny_checkpoint.tokenizer, "0" * 64, arch)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        hf.save_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []
