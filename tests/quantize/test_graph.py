"""The fp32 ONNX graph against the numpy reference: prefill, decode through the in-place KV cache, ragged batches."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import reference
from agent.engine.runner import ModelRunner
from quantize.graph import build_graph
from quantize.precision import QuantSpec


def save(model: onnx.ModelProto, path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")


@pytest.fixture(scope="module")
def tiny_runner(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("graph") / "model.onnx"
    model, _ = build_graph(tiny_checkpoint, QuantSpec())
    save(model, path)
    g = tiny_checkpoint.geometry
    return ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_prefill_then_16_decode_steps_match_reference(tiny_checkpoint, tiny_runner):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, tiny_checkpoint.geometry.vocab_size, 24).tolist()
    ref = reference.forward(tiny_checkpoint, ids)
    cache = tiny_runner.new_cache(1, 64)
    n = 8
    logits = tiny_runner.forward(np.array([ids[:n]]), np.array([n - 1]), np.array([n]), np.arange(n)[None], cache)
    assert rel_err(logits[0], ref[:n]) < 1e-4
    for t in range(n, n + 16):
        logits = tiny_runner.forward(np.array([[ids[t]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64), cache)
        assert rel_err(logits[0, 0], ref[t]) < 1e-4, f"decode step at position {t}"


def test_ragged_batch_with_padding_matches_reference(tiny_checkpoint, tiny_runner):
    """Two rows of different lengths in one call, the shorter right-padded (query_seqlens), then a chunk on top."""
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 200, 10).tolist(), rng.integers(0, 200, 6).tolist()
    cache = tiny_runner.new_cache(2, 32)
    ids = np.zeros((2, 7), np.int64)
    ids[0, :7], ids[1, :4] = a[:7], b[:4]
    logits = tiny_runner.forward(ids, np.array([6, 3]), np.array([7, 4]), np.array([[6], [3]]), cache)
    assert rel_err(logits[0, 0], reference.forward(tiny_checkpoint, a[:7])[-1]) < 1e-4
    assert rel_err(logits[1, 0], reference.forward(tiny_checkpoint, b[:4])[-1]) < 1e-4
    # second chunk: row 0 adds 3 tokens, row 1 adds 2 (logits for all of them)
    ids = np.zeros((2, 3), np.int64)
    ids[0], ids[1, :2] = a[7:10], b[4:6]
    logits = tiny_runner.forward(ids, np.array([9, 5]), np.array([3, 2]), np.array([[0, 1, 2], [0, 1, 1]]), cache)
    assert rel_err(logits[0], reference.forward(tiny_checkpoint, a)[7:10]) < 1e-4
    assert rel_err(logits[1, :2], reference.forward(tiny_checkpoint, b)[4:6]) < 1e-4


def test_node_names_are_readable(tiny_checkpoint):
    model, _ = build_graph(tiny_checkpoint, QuantSpec())
    names = {n.name for n in model.graph.node}
    assert "/model/layers.0/attn/qkv_proj/MatMul" in names
    assert "/model/layers.1/attn/GroupQueryAttention" in names


def test_int4_recipe_sets_bits_and_zero_points_per_projection(tiny_checkpoint):
    """int4_symmetric_kinds drops those kinds' zero points; int4_int8_layers keeps the named ones at 8 bits."""
    spec = QuantSpec(precision="int4", method="rtn", block_size=16, block_sizes={},
                     int4_symmetric_kinds=frozenset({"o"}), int4_int8_layers={"qkv": [1]})
    model, _ = build_graph(tiny_checkpoint, spec)
    nodes = {n.name: n for n in model.graph.node if n.op_type == "MatMulNBits"}

    def bits(name: str) -> int:
        return next(a.i for a in nodes[name].attribute if a.name == "bits")

    def has_zero_points(name: str) -> bool:
        return len(nodes[name].input) == 4
    assert [bits(f"/model/layers.{i}/attn/qkv_proj/MatMulNBits") for i in (0, 1)] == [4, 8]
    assert bits("/model/layers.1/mlp/down_proj/MatMulNBits") == 4
    assert not has_zero_points("/model/layers.0/attn/o_proj/MatMulNBits")
    assert has_zero_points("/model/layers.0/attn/qkv_proj/MatMulNBits")
    assert has_zero_points("/model/layers.0/mlp/gate_up_proj/MatMulNBits")
    # an int8 bundle ignores the INT4-only fields
    model, _ = build_graph(tiny_checkpoint, spec.model_copy(update={"precision": "int8"}))
    assert all(len(n.input) == 4 for n in model.graph.node if n.op_type == "MatMulNBits" and "layers" in n.name)


def test_k_quant_and_bf16_tensors_load_and_match_reference(tmp_path):
    """BF16, Q4_K, Q5_K and Q6_K tensors (256-wide rows) go through the same reader, graph and reference."""
    from gguf import GGMLQuantizationType as QT

    from quantize.checkpoint import load_checkpoint
    from tiny import write_tiny_llama

    path = write_tiny_llama(tmp_path / "k.gguf", hidden=256, intermediate=256, heads=4, kv_heads=2,
                            types=(QT.BF16, QT.Q4_K, QT.Q5_K, QT.Q6_K))
    ckpt = load_checkpoint(path)
    assert all(np.isfinite(w).all() for w in ckpt.weights.values())
    model, _ = build_graph(ckpt, QuantSpec())
    save(model, tmp_path / "model.onnx")
    g = ckpt.geometry
    runner = ModelRunner(tmp_path / "model.onnx", g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    ids = list(range(5, 17))
    logits = runner.forward(np.array([ids]), np.array([11]), np.array([12]), np.arange(12)[None], runner.new_cache(1, 16))
    assert rel_err(logits[0], reference.forward(ckpt, ids)) < 1e-4


def test_rope_scaling_reaches_the_graph(tmp_path):
    """The graph's rotary tables divide the frequencies by the checkpoint's factors, as the reference does; a
    graph without them differs from it (so the factors are not a no-op on this model)."""
    import dataclasses

    from quantize.checkpoint import load_checkpoint
    from tiny import write_tiny_llama

    def llama3(writer):
        writer.add_tensor("rope_freqs.weight", np.array([1, 1, 1.5, 2, 4, 8, 8, 8], np.float32))

    ckpt = load_checkpoint(write_tiny_llama(tmp_path / "l3.gguf", extra=llama3))
    model, _ = build_graph(ckpt, QuantSpec())
    save(model, tmp_path / "model.onnx")
    g = ckpt.geometry
    runner = ModelRunner(tmp_path / "model.onnx", g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    ids = list(range(5, 45))
    logits = runner.forward(np.array([ids]), np.array([39]), np.array([40]), np.arange(40)[None],
                            runner.new_cache(1, 48))[0]
    assert rel_err(logits, reference.forward(ckpt, ids)) < 1e-4
    unscaled = dataclasses.replace(ckpt, geometry=g.model_copy(update={"rope_freq_factors": None}))
    assert rel_err(logits, reference.forward(unscaled, ids)) > 1e-3


def test_windows_start_with_bos_when_prompts_do():
    """Found in review: calibration and evaluation ran text without the BOS the engine puts before every prompt
    of an add_bos_token model; each window now starts with it, as llama.cpp's perplexity does per chunk."""
    from quantize.evaluate import windows

    assert windows(list(range(1, 8)), 4) == [[1, 2, 3, 4], [5, 6, 7]]
    assert windows(list(range(1, 8)), 4, bos=0) == [[0, 1, 2, 3], [0, 4, 5, 6], [0, 7]]


def test_keep_source_quant_requantizes_a_group_of_mixed_bit_widths(tiny_checkpoint):
    """Found in review: layer 1's fused q/k/v of the tiny model (Q8_0 + Q4_0 + Q4_1) hit a bare assert, an
    internal error. One MatMulNBits has one bit width, so that group is requantized; uniform ones are kept."""
    _, report = build_graph(tiny_checkpoint, QuantSpec(precision="int4", keep_source_quant=True))
    assert "/model/layers.1/attn/qkv_proj: int4 gptq block 64 asym" in report
    assert "/model/layers.0/attn/o_proj: kept source blocks Q4_0" in report
