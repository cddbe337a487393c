"""Each architecture read as llama.cpp and transformers read it: the tiny fixtures of data/arch_logits/ (one
model per architecture, as a GGUF and as a Hugging Face folder, with the logits llama.cpp and transformers
computed on them) through our readers and fp32 graph, prefilled and then decoded through the KV cache."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest

import archs
from agent.engine.runner import ModelRunner
from quantize.checkpoint import CheckpointError, load_checkpoint
from quantize.graph import build_graph
from quantize.precision import QuantSpec

DATA = Path(__file__).parent / "data" / "arch_logits"
ARCHS = ["qwen2", "qwen3", "gemma3", "smollm3", "granite", "llama3.2", "phi3", "qwen3moe", "olmoe", "granitemoe",
         "mixtral"]
# llama.cpp computes GELU through an fp16 table: Gemma's logits differ from exact GELU by ~1e-4 of their scale
TOLERANCE = {"gemma3": 3e-4}


def recorded(name: str) -> dict:
    with np.load(DATA / name / "logits.npz") as z:
        return dict(z)


def our_logits(source: Path, ids: list[int], tmp_path: Path) -> np.ndarray:
    ckpt = load_checkpoint(source)
    g = ckpt.geometry
    path = tmp_path / f"{source.name}.onnx"
    onnx.save_model(build_graph(ckpt, QuantSpec())[0], str(path), save_as_external_data=True,
                    location=path.name + ".data")
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    cache = runner.new_cache(1, len(ids))
    n = len(ids) // 2
    out = [runner.forward(np.array([ids[:n]]), np.array([n - 1]), np.array([n]), np.arange(n)[None], cache)[0]]
    for t in range(n, len(ids)):
        out.append(runner.forward(np.array([[ids[t]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64),
                                  cache)[0])
    return np.concatenate(out)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, tmp_path_factory):
    name = request.param
    ref = recorded(name)
    ids = ref["token_ids"].tolist()
    tmp = tmp_path_factory.mktemp(name)
    return name, ref, our_logits(DATA / name / "model.gguf", ids, tmp), our_logits(DATA / name / "hf", ids, tmp)


def llama_cpp_logits(name: str, ref: dict) -> np.ndarray:
    """llama.cpp's logits at our graph's context: Phi-3's LongRoPE factors are the long ones past the original
    context, and our graph is built for the model's whole context (4096 > 256)."""
    return ref["logits_long"] if name == "phi3" else ref["logits"]


def test_gguf_build_matches_llama_cpp(arch):
    name, ref, from_gguf, _ = arch
    assert rel_err(from_gguf, llama_cpp_logits(name, ref)) < TOLERANCE.get(name, 1e-4)


def test_hf_build_matches_transformers(arch):
    name, ref, _, from_hf = arch
    expected = ref["logits_long_transformers"] if name == "phi3" else ref["logits_transformers"]
    assert rel_err(from_hf, expected) < 1e-4


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("source", ["model.gguf", "hf"])
def test_both_formats_read_as_the_numpy_reference_computes(name, source):
    """The checkpoint each format reads, run by tests/reference.py, gives the logits llama.cpp recorded: the
    reference implements each variant as llama.cpp does, independently of the graph."""
    import reference

    ref = recorded(name)
    logits = reference.forward(load_checkpoint(DATA / name / source), ref["token_ids"].tolist())
    assert rel_err(logits, llama_cpp_logits(name, ref)) < TOLERANCE.get(name, 1e-4)


def test_gguf_and_hf_builds_of_the_same_weights_agree(arch):
    name, _, from_gguf, from_hf = arch
    assert rel_err(from_gguf, from_hf) < 1e-5


# ---- what the graph cannot compute exactly is refused, naming it ----------------------------------------

def _gguf_without_window(path: Path) -> Path:
    import gguf

    import archs_gguf

    model = archs.tiny_gemma3()
    writer_class = gguf.GGUFWriter
    add_window = writer_class.add_sliding_window
    writer_class.add_sliding_window = lambda self, value: None  # the converter's output for pattern 1
    try:
        return archs_gguf.write_gguf(model, path)
    finally:
        writer_class.add_sliding_window = add_window


def test_a_gemma3_gguf_without_a_window_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="without gemma3.attention.sliding_window"):
        load_checkpoint(_gguf_without_window(tmp_path / "g.gguf"))


@pytest.mark.parametrize("name, change, needle", [
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_act 'gelu'"),
    ("phi3", {"partial_rotary_factor": 0.5, "rope_scaling": None}, "partial_rotary_factor 0.5"),  # 32 of 64: read
    ("phi3", {"partial_rotary_factor": 0.4}, "partial_rotary_factor 0.4"),
    ("phi3", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "LongRoPE needs 24 positive factors"),
    ("qwen3", {"architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM.*Gemma3ForCausalLM"),
])
def test_unsupported_variants_of_an_architecture_are_named(name, change, needle, tmp_path):
    model = getattr(archs, f"tiny_{name}")()
    folder = archs.write_hf_folder(dataclasses.replace(model, config=model.config | change), tmp_path / name)
    if needle == "partial_rotary_factor 0.5":  # a width ONNX Runtime's rotary takes: read, not refused
        assert load_checkpoint(folder).geometry.rotary_dim == 32
        return
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(folder)
