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


def _last_tensor(path):
    """The tensor whose data ends the file, and the byte its data ends at."""
    from gguf import GGUFReader

    last = max(GGUFReader(path).tensors, key=lambda t: t.data_offset)
    return last, int(last.data_offset) + int(last.n_bytes)


def test_a_file_cut_inside_the_tensor_data_names_the_tensor_and_the_bytes(tiny_gguf, tmp_path):
    """Found by an outside probe: gguf's reader failed with numpy's "cannot reshape array of size …"."""
    last, end = _last_tensor(tiny_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:int(last.data_offset) + 10])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(cut)
    assert str(e.value) == (f"{cut}: the file ends at byte {int(last.data_offset) + 10}; tensor {last.name} needs "
                            f"bytes up to {end} (a file cut short, or a corrupt tensor offset or shape)")


@pytest.mark.parametrize("count", [2**32, 2**64 - 1])
def test_an_absurd_tensor_count_is_named_against_the_file_size(tiny_gguf, tmp_path, count):
    """Found by an outside probe: gguf's reader read the descriptions past the end of the file and failed with
    numpy's "index 0 is out of bounds for axis 0 with size 0"."""
    data = bytearray(tiny_gguf.read_bytes())
    data[8:16] = count.to_bytes(8, "little")  # after the magic and the version: the tensor count
    bad = tmp_path / "many.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"the header lists {count} tensors: the file ends at byte "
                                              rf"{len(data)}; their descriptions alone need bytes up to \d+"):
        load_checkpoint(bad)


def test_a_tensor_offset_past_the_end_names_the_tensor(tmp_path):
    """A corrupt offset (not a cut) gets the same message: the tensor and the bytes it would need."""
    from gguf import GGUFReader

    path = write_tiny_llama(tmp_path / "t.gguf", types=(QT.F32,))
    t = next(t for t in GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    at = t.field.offset + 8 + len(t.name) + 4 + 8 * len(t.shape) + 4  # name, n_dims, dims, type: the offset
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"; tensor blk\.1\.ffn_up\.weight needs bytes up to \d{13}"):
        load_checkpoint(path)


def test_a_source_that_is_not_a_regular_file_says_what_it_is(tmp_path):
    """Found by an outside probe: `build /dev/zero` said "no such file or directory" of a file that exists."""
    import os

    with pytest.raises(CheckpointError, match="^/dev/zero: not a regular file \\(a character device\\)"):
        load_checkpoint("/dev/zero")
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CheckpointError, match="pipe: not a regular file \\(a named pipe\\)"):
        load_checkpoint(tmp_path / "pipe")
    with pytest.raises(CheckpointError, match="nope.gguf: no such file or directory"):
        load_checkpoint(tmp_path / "nope.gguf")


# What llama.cpp's loader requires of a `llama` GGUF (llama_model::load_hparams and the BPE vocabulary loader);
# everything else (vocab_size, head_count_kv, rope.*, key_length, token types, BOS/EOS ids...) is optional.
LLAMA_CPP_REQUIRED_KEYS = ("general.architecture", "llama.context_length", "llama.embedding_length",
                           "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count",
                           "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
                           "tokenizer.ggml.merges")


def rewrite_with_keys(source, path, keys):
    """source's tensors and only the named metadata keys, written anew with gguf's GGUFWriter."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    writer = GGUFWriter(str(path), reader.fields["general.architecture"].contents())  # writes the architecture
    for key in keys:
        f = reader.fields[key]
        if key != "general.architecture":
            sub_type = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keys", ["llama.cpp's required keys only", "all but llama.vocab_size"])
def test_a_gguf_with_only_the_keys_llama_cpp_requires_builds(keys, tmp_path):
    """Found by an outside probe: without llama.vocab_size (optional; several converters leave it out) the
    fallback was a numpy integer, refused as "metadata vocab_size = np.uint64(…) is out of range"."""
    from gguf import GGUFReader

    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    full = write_tiny_llama(tmp_path / "full.gguf", kv_heads=4)  # head_count_kv is optional: it defaults to heads
    wanted = (LLAMA_CPP_REQUIRED_KEYS if keys.startswith("llama.cpp")
              else [k for k in GGUFReader(full).fields if not k.startswith("GGUF.") and k != "llama.vocab_size"])
    path = rewrite_with_keys(full, tmp_path / "few.gguf", wanted)
    assert "llama.vocab_size" not in GGUFReader(path).fields
    ckpt = load_checkpoint(path)
    reference = load_checkpoint(full)
    g = ckpt.geometry
    assert type(g.vocab_size) is int and g.vocab_size == reference.geometry.vocab_size
    assert (g.num_kv_heads, g.rope_theta, g.head_dim) == (4, 10000.0, 16)  # llama.cpp's defaults
    bundle = build_bundle(ckpt, QuantSpec(), tmp_path / "b", name="few", progress=lambda s: None)
    assert bundle.config.vocab_size == g.vocab_size
