"""Every block variant of quantize.architectures, built as an fp32 graph from a random in-memory checkpoint,
against the numpy reference: prefill, then decode through the KV cache past the sliding window."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper
import pytest

import reference
from agent import wire
from agent.engine.runner import ModelRunner, graph_for_positions
from agent.wire import Geometry
from quantize.checkpoint import Checkpoint, expected_weight_shapes, validate
from quantize.graph import build_graph
from quantize.precision import QuantSpec


def save(model: onnx.ModelProto, path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4, num_kv_heads=2,
            head_dim=16, context_length=128, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
VARIANTS = {
    "llama3": dict(architecture="llama", tie_word_embeddings=True, rope_freq_factors=(1.0, 1.0, 1.5, 2, 4, 8, 8, 8)),
    "mistral": dict(architecture="mistral", sliding_window=8),
    "qwen2": dict(architecture="qwen2", attention_bias=True),
    "qwen3": dict(architecture="qwen3", head_dim=32, tie_word_embeddings=True),
    "gemma3": dict(architecture="gemma3", head_dim=32, num_kv_heads=1, tie_word_embeddings=True, sliding_window=8,
                   window_layers=(0, 1, 2, 3, 4), rope_theta=1e6, rope_local_theta=1e4, embedding_multiplier=8.0,
                   attention_scale=0.2),
    "smollm3": dict(architecture="smollm3", nope_layers=(3,)),
    "granite": dict(architecture="granite", embedding_multiplier=12.0, attention_scale=0.1,
                    residual_multiplier=0.22, logit_multiplier=0.125),
    "phi3": dict(architecture="phi3", head_dim=32, rotary_dim=16, rope_attention_factor=1.19,
                 rope_freq_factors=(1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0)),
}


def random_checkpoint(name: str, seed: int = 0) -> Checkpoint:
    rng = np.random.default_rng(seed)
    g = Geometry(**(BASE | VARIANTS[name]))
    weights = {}
    for key, shape in expected_weight_shapes(g).items():
        if key.endswith("norm.weight"):
            weights[key] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[key] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    ckpt = Checkpoint(g, weights, tokenizer=None, source_sha256="0" * 64, source_name=name)
    validate(ckpt)
    return ckpt


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_reference_through_the_kv_cache(name, tmp_path):
    ckpt = random_checkpoint(name)
    g = ckpt.geometry
    path = tmp_path / "model.onnx"
    save(build_graph(ckpt, QuantSpec())[0], path)
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    ids = np.random.default_rng(1).integers(0, g.vocab_size, 40).tolist()
    ref = reference.forward(ckpt, ids)
    cache = runner.new_cache(1, 64)
    n = 12  # beyond the 8-token window already in the prefill
    logits = runner.forward(np.array([ids[:n]]), np.array([n - 1]), np.array([n]), np.arange(n)[None], cache)
    assert rel_err(logits[0], ref[:n]) < 1e-4
    for t in range(n, len(ids)):
        logits = runner.forward(np.array([[ids[t]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64), cache)
        assert rel_err(logits[0, 0], ref[t]) < 1e-4, f"decode step at position {t}"


NEUTRAL = dict(sliding_window=None, window_layers=None, rope_local_theta=None, nope_layers=(), rotary_dim=None,
               rope_attention_factor=1.0, embedding_multiplier=1.0, attention_scale=None, residual_multiplier=1.0,
               logit_multiplier=1.0, rope_freq_factors=None)


@pytest.mark.parametrize("name", ["mistral", "gemma3", "smollm3", "granite", "phi3", "llama3"])
def test_each_variants_numbers_change_the_reference(name):
    """Without its numbers (windows, RoPE bases, NoPE layers, multipliers, partial rotary) a variant's
    reference logits differ: the test above cannot pass by both sides ignoring one."""
    ckpt = random_checkpoint(name)
    plain = Geometry(**(ckpt.geometry.model_dump() | NEUTRAL))
    ids = list(range(1, 30))
    stripped = reference.forward(Checkpoint(plain, ckpt.weights, None, "0" * 64, name), ids)
    assert np.abs(stripped - reference.forward(ckpt, ids)).max() > 1e-3


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_int4_build_of_a_variant_runs_and_agrees(name, tmp_path):
    ckpt = random_checkpoint(name)
    g = ckpt.geometry
    path = tmp_path / "model.onnx"
    save(build_graph(ckpt, QuantSpec(precision="int4", method="rtn"))[0], path)
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    ids = np.random.default_rng(2).integers(0, g.vocab_size, 20).tolist()
    cache = runner.new_cache(1, 32)
    logits = runner.forward(np.array([ids]), np.array([19]), np.array([20]), np.arange(20)[None], cache)[0]
    ref = reference.forward(ckpt, ids)
    assert np.corrcoef(logits.ravel(), ref.ravel())[0, 1] > 0.9


def test_rope_tables_cut_to_the_runners_positions_give_the_same_logits(tmp_path):
    """A runner told the most positions it will use folds RoPE tables only that long (Gemma 3's two bases over its
    32,768 positions were 64 MB of the session), and computes what the full tables compute up to there."""
    ckpt = random_checkpoint("gemma3")
    g = ckpt.geometry
    path = tmp_path / "model.onnx"
    save(build_graph(ckpt, QuantSpec())[0], path)
    cut = graph_for_positions(path, 32)
    limits = {i.name: float(numpy_helper.to_array(i)) for i in onnx.load_from_string(cut).graph.initializer
              if i.name in wire.ROPE_TABLE_LIMITS}
    assert limits == {name: 32.0 for name in wire.ROPE_TABLE_LIMITS}
    assert graph_for_positions(path, g.context_length) is None  # nothing longer to cut
    ids = np.random.default_rng(3).integers(0, g.vocab_size, 32).tolist()
    outs = []
    for positions in (None, 32):
        runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2, max_positions=positions)
        cache = runner.new_cache(1, 32)
        steps = [runner.forward(np.array([ids[:12]]), np.array([11]), np.array([12]), np.arange(12)[None], cache)[0]]
        for t in range(12, 32):  # up to the last position the cut tables hold
            steps.append(runner.forward(np.array([[ids[t]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64),
                                        cache)[0])
        outs.append(np.concatenate(steps))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5)


def test_a_tied_int4_table_is_stored_once_and_agrees(tmp_path):
    """embedding int4 + lm_head int4 on a tied model: one packed table that GatherBlockQuantized looks rows up in
    and MatMulNBits multiplies by, equal to the table's dequantized rows on both sides."""
    ckpt = random_checkpoint("gemma3")
    g = ckpt.geometry
    model, report = build_graph(ckpt, QuantSpec(precision="int4", method="rtn", embedding="int4", lm_head="int4",
                                                head_block_size=16))
    users = [n for n in model.graph.node if "/lm_head.qweight" in n.input]
    assert sorted(n.op_type for n in users) == ["GatherBlockQuantized", "MatMulNBits"]
    assert sorted(i.name for i in model.graph.initializer if i.dims[:1] == [g.vocab_size]) == [
        "/lm_head.qweight", "/lm_head.scales", "/model/embed_tokens.scales"]  # the table once, its scales twice
    assert any("tied, stored once): int4" in line for line in report)
    path = tmp_path / "model.onnx"
    save(model, path)
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    ids = np.random.default_rng(2).integers(0, g.vocab_size, 20).tolist()
    cache = runner.new_cache(1, 32)
    logits = runner.forward(np.array([ids]), np.array([19]), np.array([20]), np.arange(20)[None], cache)[0]
    assert np.corrcoef(logits.ravel(), reference.forward(ckpt, ids).ravel())[0, 1] > 0.9
