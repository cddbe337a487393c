"""Reading GGUF files: geometry, dequantized tensors, the rotary un-permutation and clear errors."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from quantize.checkpoint import CheckpointError, load_checkpoint
from quantize.gguf_reader import unpermute_rows
from tiny import permute_rows, write_tiny_llama


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(w, 8), 8), w)


def test_f32_tensors_come_back_exactly_in_hf_order(tmp_path):
    path = write_tiny_llama(tmp_path / "f32.gguf", types=(QT.F32,), seed=3)
    ckpt = load_checkpoint(path)
    rng = np.random.default_rng(3)  # replay the writer's draws to get the HF-order originals
    rng.standard_normal((269, 64))
    rng.standard_normal(64), rng.standard_normal(64)
    q = (rng.standard_normal((64, 64)) * 0.08).astype(np.float32)
    assert np.array_equal(ckpt.layer(0, "self_attn.q_proj.weight"), q)


def test_geometry_and_source_blocks(tiny_checkpoint):
    g = tiny_checkpoint.geometry
    assert (g.num_layers, g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim) == (2, 64, 4, 2, 16)
    assert g.tie_word_embeddings
    kinds = {b.ggml_type for b in tiny_checkpoint.source_blocks.values()}
    assert {"Q8_0", "Q4_0", "Q4_1"} <= kinds


def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_checkpoint(cut)


@pytest.mark.parametrize("count", [2**24, 2**40, 2**64 - 1])
def test_a_corrupt_array_count_is_a_clear_error_not_a_memory_blowup(tiny_gguf, tmp_path, count):
    """Found by the reliability fuzz: gguf's reader looped (and allocated) once per claimed array element,
    reading past the end of the file, until the machine ran out of memory."""
    data = bytearray(tiny_gguf.read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4  # value type ARRAY, then the element type, then the count
    data[at:at + 8] = count.to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="past the end of the file"):
        load_checkpoint(bad)


def test_unknown_architecture_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "gpt.gguf", architecture="gptneox")
    with pytest.raises(CheckpointError, match="gptneox"):
        load_checkpoint(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "q2.gguf", hidden=256, intermediate=256, types=(QT.Q2_K,))
    with pytest.raises(CheckpointError, match="Q2_K"):
        load_checkpoint(path)


def test_q5_0_and_q5_1_read_as_the_same_weights_as_q8_0(tmp_path):
    """Found in review: Q5_0 / Q5_1 (llama-quantize's fallbacks for Q4_K / Q5_K on SmolLM2's 576-wide rows, so
    most of its Q4_K_M file) were refused. The same random model in Q8_0 is the yardstick: any mistake in
    reading the blocks or un-permuting the rows would be far bigger than the 5-bit rounding."""
    exact = load_checkpoint(write_tiny_llama(tmp_path / "q8.gguf", types=(QT.Q8_0,), seed=4))
    five = load_checkpoint(write_tiny_llama(tmp_path / "q5.gguf", types=(QT.Q5_0, QT.Q5_1), seed=4))
    for name, w in exact.weights.items():
        assert np.abs(five.weights[name] - w).max() < 0.06 * max(np.abs(w).max(), 0.1), name


def test_a_tensor_the_graph_has_no_place_for_is_an_error_not_dropped(tmp_path):
    """Found in review: attn_q.bias and the like were skipped, building a model that silently differed."""
    def bias(writer):
        writer.add_tensor("blk.0.attn_q.bias", np.ones(64, np.float32))

    with pytest.raises(CheckpointError, match="blk.0.attn_q.bias"):
        load_checkpoint(write_tiny_llama(tmp_path / "bias.gguf", extra=bias))


def test_rope_scaling_is_read_as_llama_cpp_reads_it(tmp_path):
    """Found in review: rope_freqs (every Llama 3.1/3.2 GGUF) and linear scaling were ignored. The divisors are
    the rope_freqs tensor times the linear factor; YaRN is refused."""
    freqs = np.linspace(1.0, 8.0, 8).astype(np.float32)  # head_dim 16: 8 frequencies

    def llama3(writer):
        writer.add_tensor("rope_freqs.weight", freqs)

    def linear(writer):
        writer.add_string("llama.rope.scaling.type", "linear")
        writer.add_float32("llama.rope.scaling.factor", 4.0)

    def yarn(writer):
        writer.add_string("llama.rope.scaling.type", "yarn")
        writer.add_float32("llama.rope.scaling.factor", 4.0)

    plain = load_checkpoint(write_tiny_llama(tmp_path / "plain.gguf")).geometry
    assert plain.rope_freq_factors is None
    g = load_checkpoint(write_tiny_llama(tmp_path / "l3.gguf", extra=llama3)).geometry
    np.testing.assert_allclose(g.rope_freq_factors, freqs)
    g = load_checkpoint(write_tiny_llama(tmp_path / "lin.gguf", extra=linear)).geometry
    assert g.rope_freq_factors == (4.0,) * 8
    with pytest.raises(CheckpointError, match="yarn"):
        load_checkpoint(write_tiny_llama(tmp_path / "yarn.gguf", extra=yarn))


def test_a_damaged_block_scale_is_that_error_without_numpy_warnings(tmp_path):
    """An infinite Q8_0 scale times a zero code dequantizes to NaN: the clear error, and no numpy
    RuntimeWarning printed above it (seen in the bad-input fuzz's warnings summary)."""
    from gguf import GGUFReader
    path = write_tiny_llama(tmp_path / "inf.gguf", types=(QT.Q8_0,))
    t = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    data = bytearray(path.read_bytes())
    block = int(t.data_offset)  # Q8_0 block: an f16 scale, then 32 int8 codes
    data[block:block + 3] = np.float16(np.inf).tobytes() + b"\x00"
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would surface as "could not be read" here
        with pytest.raises(CheckpointError, match="blk.0.ffn_down.weight holds NaN"):
            load_checkpoint(path)


def test_a_nan_or_infinite_weight_is_an_error_naming_the_tensor(tmp_path):
    """Seen in the bad-input fuzz: a flipped scale byte dequantized to NaN, and the model was accepted (every
    answer would have been NaN)."""
    path = write_tiny_llama(tmp_path / "nan.gguf", types=(QT.F32,))
    data = bytearray(path.read_bytes())
    ckpt = load_checkpoint(path)
    w = ckpt.weights["model.layers.0.mlp.down_proj.weight"]
    needle = w[:1, :4].tobytes()  # the F32 tensor's first values, as stored (down is not permuted)
    at = bytes(data).find(needle)
    assert at > 0
    data[at:at + 4] = np.float32(np.nan).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="blk.0.ffn_down.weight holds NaN"):
        load_checkpoint(path)
