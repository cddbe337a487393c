"""quantize.nbits: packing, RTN, search and GPTQ quantizers, GGUF block reuse, and real onnxruntime MatMulNBits /
GatherBlockQuantized against BlockQuantized.dequantize().

Run: .venv/bin/python -m pytest tests/quantize/test_nbits.py -q
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType, quants
from onnx import TensorProto, helper, numpy_helper

from quantize import nbits
from quantize.checkpoint import SourceBlocks

MS_DOMAIN = "com.microsoft"


def weights(shape, heavy_tailed=False, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_t(2.5, shape) if heavy_tailed else rng.standard_normal(shape)
    return (0.02 * w).astype(np.float32)


# --- packing and the BlockQuantized form -----------------------------------------------------------------


@pytest.mark.parametrize("bits", nbits.SUPPORTED_BITS)
@pytest.mark.parametrize("length", [1, 7, 32, 33])
def test_pack_unpack_round_trip(bits, length):
    codes = np.random.default_rng(1).integers(0, 1 << bits, (3, length)).astype(np.uint8)
    packed = nbits.pack_bits(codes, bits)
    assert packed.shape == (3, -(-length * bits // 8))
    np.testing.assert_array_equal(nbits.unpack_bits(packed, bits, length), codes)


def test_pack_4bit_puts_first_value_in_low_nibble():
    assert nbits.pack_bits(np.array([[0x1, 0xA]], np.uint8), 4).tolist() == [[0xA1]]
    assert nbits.pack_bits(np.array([[1, 2, 3, 0]], np.uint8), 2).tolist() == [[0b00111001]]


def test_dequantize_is_code_minus_zero_point_times_scale():
    codes = np.array([[[0, 15] * 8, [3, 9] * 8]], np.uint8)  # [N=1, k_blocks=2, 16]
    scales = np.array([[0.5, -2.0]], np.float32)
    q = nbits.BlockQuantized(4, 16, 1, 32, nbits.pack_bits(codes, 4), scales, nbits.pack_bits(np.array([[1, 9]]), 4))
    np.testing.assert_array_equal(q.dequantize()[0, :2], [-0.5, 7.0])
    np.testing.assert_array_equal(q.dequantize()[0, 16:18], [12.0, 0.0])
    sym = nbits.BlockQuantized(4, 16, 1, 32, q.packed, scales, None)  # default zero point 8
    np.testing.assert_array_equal(sym.dequantize()[0, :2], [-4.0, 3.5])


def test_block_quantized_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="packed"):
        nbits.BlockQuantized(4, 32, 2, 64, np.zeros((2, 2, 8), np.uint8), np.ones((2, 2), np.float32), None)
    with pytest.raises(ValueError, match="block_size"):
        nbits.quantize_rtn(weights((4, 64)), 4, 24, True)
    with pytest.raises(ValueError, match="bits"):
        nbits.quantize_rtn(weights((4, 64)), 3, 32, True)


def test_packed_size_bytes():
    q = nbits.quantize_rtn(weights((8, 256)), 4, 32, symmetric=False)
    assert nbits.packed_size_bytes(q) == 8 * 128 + 8 * 8 * 4 + 8 * 4
    assert nbits.packed_size_bytes(nbits.quantize_rtn(weights((8, 256)), 8, 32, True)) == 8 * 256 + 8 * 8 * 4


# --- round-to-nearest ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", nbits.SUPPORTED_BITS)
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("k", [256, 100])
def test_rtn_error_bounds(bits, block_size, k):
    w = weights((24, k), heavy_tailed=True)
    sym, asym = (nbits.quantize_rtn(w, bits, block_size, s) for s in (True, False))
    for q, bound_in_steps in ((asym, 0.5), (sym, 1.0)):  # symmetric: the short side may clip by one step
        step = np.repeat(np.abs(q.scales), block_size, axis=1)[:, :k]
        assert q.dequantize().shape == (24, k)
        assert (np.abs(w - q.dequantize()) <= bound_in_steps * step * (1 + 1e-5) + 1e-9).all()


def test_rtn_symmetric_is_idempotent_and_keeps_zeros():
    w = weights((16, 128))
    w[3] = 0.0
    once = nbits.quantize_rtn(w, 4, 32, True).dequantize()
    np.testing.assert_array_equal(once[3], 0.0)
    np.testing.assert_allclose(nbits.quantize_rtn(once, 4, 32, True).dequantize(), once, rtol=0, atol=1e-9)


def test_rtn_asymmetric_represents_constant_blocks_exactly():
    w = np.full((2, 64), 0.75, np.float32)
    np.testing.assert_allclose(nbits.quantize_rtn(w, 4, 32, False).dequantize(), w, rtol=1e-6)


# --- importance-weighted search ---------------------------------------------------------------------------


@pytest.mark.parametrize("heavy_tailed", [False, True])
@pytest.mark.parametrize("bits,block_size,symmetric", [(4, 32, True), (4, 32, False), (4, 128, True),
                                                       (8, 32, True), (8, 128, False), (2, 16, False)])
def test_search_never_worse_than_rtn(heavy_tailed, bits, block_size, symmetric):
    w = weights((64, 320), heavy_tailed)
    rtn = nbits.reconstruction_error(w, nbits.quantize_rtn(w, bits, block_size, symmetric))
    search = nbits.reconstruction_error(w, nbits.quantize_search(w, bits, block_size, symmetric))
    assert search <= rtn * (1 + 1e-6)


@pytest.mark.parametrize("heavy_tailed", [False, True])
def test_search_strictly_better_than_rtn_on_average(heavy_tailed):
    w = weights((128, 512), heavy_tailed, seed=2)
    ratios = [nbits.reconstruction_error(w, nbits.quantize_search(w, 4, bs, sym))
              / nbits.reconstruction_error(w, nbits.quantize_rtn(w, 4, bs, sym))
              for bs in (32, 128) for sym in (True, False)]
    assert max(ratios) < 1.0
    assert np.mean(ratios) < 0.95


def test_importance_lowers_weighted_error():
    w = weights((128, 256), heavy_tailed=True, seed=3)
    importance = (np.random.default_rng(4).random(256) ** 3 * 10).astype(np.float32)
    for symmetric in (True, False):
        plain = nbits.quantize_search(w, 4, 32, symmetric)
        weighted = nbits.quantize_search(w, 4, 32, symmetric, importance)
        assert (nbits.reconstruction_error(w, weighted, importance)
                < 0.97 * nbits.reconstruction_error(w, plain, importance))


def test_search_handles_partial_blocks_and_zero_rows():
    w = weights((8, 100))
    w[0] = 0.0
    importance = np.ones(100, np.float32)
    importance[:10] = 0.0
    q = nbits.quantize_search(w, 4, 32, False, importance)
    assert q.packed.shape == (8, 4, 16) and q.dequantize().shape == (8, 100)
    np.testing.assert_array_equal(q.dequantize()[0], 0.0)
    with pytest.raises(ValueError, match="importance"):
        nbits.quantize_search(w, 4, 32, False, -importance)


# --- GPTQ ----------------------------------------------------------------------------------------------------


def correlated_inputs(k, tokens=512, seed=11) -> np.ndarray:
    """Activations float64 [tokens, k]: mixed channels (so H is far from diagonal) with heavy-tailed scales."""
    rng = np.random.default_rng(seed)
    mix = np.eye(k) + 0.3 * rng.standard_normal((k, k))
    return rng.standard_normal((tokens, k)) @ mix * (np.abs(rng.standard_t(2.5, k)) + 0.1)


def output_error(x, w, q) -> float:
    """||x w^T - x dequant(w)^T||_F, what GPTQ minimises."""
    return float(np.linalg.norm(x @ (w.astype(np.float64) - q.dequantize()).T))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_beats_search_on_correlated_inputs(symmetric, act_order):
    w, x = weights((96, 256), seed=12), correlated_inputs(256)
    h = x.T @ x
    search = nbits.quantize_search(w, 4, 64, symmetric, np.diag(h))
    gptq = nbits.quantize_gptq(w, 4, 64, symmetric, h, act_order=act_order)
    assert output_error(x, w, gptq) < 0.9 * output_error(x, w, search)  # measured 0.70, act_order 0.51


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_with_diagonal_hessian_is_search_with_nearest_rounding(symmetric):
    # no correlations, so no error to move: each block gets the search's parameters and codes rounded to
    # the nearest level, which can only lower the (diagonal) weighted error
    w = weights((64, 192), heavy_tailed=True, seed=13)
    d = (np.random.default_rng(14).random(192) ** 2 * 10 + 0.1)
    gptq = nbits.quantize_gptq(w, 4, 64, symmetric, np.diag(d))
    search = nbits.quantize_search(w, 4, 64, symmetric, d)
    # (not bit-equal: a block at a time sums in another order, which can flip near-ties between candidates)
    ratio = nbits.reconstruction_error(w, gptq, d) / nbits.reconstruction_error(w, search, d)
    assert 0.95 < ratio <= 1 + 1e-4


def test_gptq_handles_rank_deficient_hessian_and_keeps_dead_channel_weights():
    w, x = weights((32, 128), seed=15), correlated_inputs(128, tokens=40)  # 40 tokens: rank 40 < K
    x[:, 5] = 0.0  # a dead input channel: zero row and column in H
    h = x.T @ x
    q = nbits.quantize_gptq(w, 4, 32, False, h)
    assert np.isfinite(q.dequantize()).all()
    assert output_error(x, w, q) < output_error(x, w, nbits.quantize_search(w, 4, 32, False, np.diag(h)))
    step = np.abs(q.scales[:, 0])  # the dead channel is quantized, not zeroed as the reference code does
    assert (np.abs(q.dequantize()[:, 5] - w[:, 5]) <= step * (1 + 1e-5)).mean() > 0.9
    assert np.isfinite(nbits.quantize_gptq(w, 4, 32, True, np.zeros((128, 128))).dequantize()).all()


def test_gptq_handles_partial_last_block():
    w, x = weights((16, 100), seed=16), correlated_inputs(100, seed=17)
    q = nbits.quantize_gptq(w, 4, 64, True, x.T @ x)
    assert q.packed.shape == (16, 2, 32) and q.dequantize().shape == (16, 100)
    search = nbits.quantize_search(w, 4, 64, True, np.einsum("tk,tk->k", x, x))
    assert output_error(x, w, q) < output_error(x, w, search)


def test_gptq_rejects_what_is_not_a_hessian():
    w = weights((8, 64))
    with pytest.raises(ValueError, match="hessian must be a finite"):
        nbits.quantize_gptq(w, 4, 32, True, np.eye(32))
    with pytest.raises(ValueError, match="hessian must be a finite"):
        nbits.quantize_gptq(w, 4, 32, True, np.full((64, 64), np.nan))
    with pytest.raises(ValueError, match="symmetric"):
        nbits.quantize_gptq(w, 4, 32, True, np.triu(np.ones((64, 64))))
    indefinite = np.eye(64)
    indefinite[0, 1] = indefinite[1, 0] = 2.0
    with pytest.raises(ValueError, match="positive definite"):
        nbits.quantize_gptq(w, 4, 32, True, indefinite)
    with pytest.raises(ValueError, match="damp"):
        nbits.quantize_gptq(w, 4, 32, True, np.eye(64), damp=-1.0)


# --- GGUF blocks kept as they are -------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0", "Q4_1"])
def test_from_gguf_blocks_matches_gguf_dequantize_exactly(ggml_type):
    qtype = GGMLQuantizationType[ggml_type]
    w = weights((48, 192), heavy_tailed=True, seed=5)
    raw = quants.quantize(w, qtype)  # uint8 [48, bytes_per_row]
    q, mins = nbits.from_gguf_blocks(SourceBlocks(ggml_type, w.shape, raw))
    assert (q.bits, q.block_size) == ((8 if ggml_type == "Q8_0" else 4), 32)
    assert (mins is not None) == (ggml_type == "Q4_1")
    ours = q.dequantize() + (0 if mins is None else np.repeat(mins, 32, axis=1))
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qtype))


def test_from_gguf_blocks_refuses_what_it_cannot_keep():
    w = weights((4, 64))
    with pytest.raises(ValueError, match="Q5_0"):
        nbits.from_gguf_blocks(SourceBlocks("Q5_0", w.shape, quants.quantize(w, GGMLQuantizationType.Q5_0)))
    with pytest.raises(ValueError, match="expected"):
        nbits.from_gguf_blocks(SourceBlocks("Q4_0", (4, 96), quants.quantize(w, GGMLQuantizationType.Q4_0)))


# --- real onnxruntime ---------------------------------------------------------------------------------------


def one_node_session(node: onnx.NodeProto, inputs, output, initializers) -> ort.InferenceSession:
    graph = helper.make_graph([node], "g", inputs, [output], [numpy_helper.from_array(a, n) for n, a in initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 10  # as quantize/graph.py writes: onnx stamps its newest, which an older runtime refuses
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def matmul_nbits(q: nbits.BlockQuantized, accuracy_level: int = 0) -> ort.InferenceSession:
    inits = [("B", q.packed), ("scales", q.scales)] + ([("zp", q.zero_points)] if q.zero_points is not None else [])
    node = helper.make_node("MatMulNBits", ["A"] + [n for n, _ in inits], ["Y"], domain=MS_DOMAIN, K=q.k, N=q.n,
                            bits=q.bits, block_size=q.block_size, accuracy_level=accuracy_level)
    return one_node_session(node, [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, q.k])],
                            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, q.n]), inits)


def assert_relative_close(actual, expected, rel=1e-4):
    assert np.abs(actual - expected).max() <= rel * np.abs(expected).max()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block_size,k", [(16, 128), (32, 576), (128, 576), (32, 100)])
def test_ort_matmul_nbits_matches_dequantize(bits, symmetric, block_size, k):
    w = weights((96, k), heavy_tailed=True, seed=6)
    q = nbits.quantize_search(w, bits, block_size, symmetric)
    x = np.random.default_rng(7).standard_normal((5, k)).astype(np.float32)
    (y,) = matmul_nbits(q).run(None, {"A": x})
    assert_relative_close(y, x @ q.dequantize().T)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block_size,k,act_order", [(64, 576, False), (128, 576, False), (32, 100, False),
                                                    (64, 576, True), (128, 576, True)])
def test_ort_matmul_nbits_matches_gptq_dequantize(bits, symmetric, block_size, k, act_order):
    w, x = weights((96, k), heavy_tailed=True, seed=18), correlated_inputs(k, tokens=256, seed=19)
    q = nbits.quantize_gptq(w, bits, block_size, symmetric, x.T @ x, act_order=act_order)
    a = x[:5].astype(np.float32)
    (y,) = matmul_nbits(q).run(None, {"A": a})
    assert_relative_close(y, a @ q.dequantize().T)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q8_0", "Q4_1"])
def test_ort_matmul_nbits_runs_gguf_blocks(ggml_type):
    qtype = GGMLQuantizationType[ggml_type]
    w = weights((64, 256), seed=8)
    raw = quants.quantize(w, qtype)
    q, mins = nbits.from_gguf_blocks(SourceBlocks(ggml_type, w.shape, raw))
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    (y,) = matmul_nbits(q).run(None, {"A": x})
    if mins is not None:  # what the graph adds: per-block sums of x times the block minimums
        y = y + x.reshape(3, -1, 32).sum(-1) @ mins.T
    assert_relative_close(y, x @ quants.dequantize(raw, qtype).T)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block_size,hidden", [(32, 576), (128, 576), (16, 100)])
def test_ort_gather_block_quantized_matches_dequantize(bits, symmetric, block_size, hidden):
    table = weights((200, hidden), seed=10)
    q = nbits.quantize_embedding(table, bits, block_size, symmetric=symmetric)
    inits = [("data", q.gather_data()), ("scales", q.scales)]
    inits += [("zp", q.zero_points)] if q.zero_points is not None else []
    node = helper.make_node("GatherBlockQuantized", ["data", "ids", "scales"] + (["zp"] if len(inits) == 3 else []),
                            ["Y"], domain=MS_DOMAIN, bits=bits, block_size=block_size, gather_axis=0, quantize_axis=1)
    sess = one_node_session(node, [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, None])],
                            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, None, hidden]), inits)
    ids = np.array([[0, 5, 199, 5], [17, 42, 3, 100]], np.int64)
    (y,) = sess.run(None, {"ids": ids})
    assert_relative_close(y, q.dequantize()[ids])
    assert nbits.reconstruction_error(table, q) < (0.02 * (0.1 if bits == 4 else 0.01)) ** 2


def test_gptq_working_in_the_hessian_itself_gives_the_same_blocks():
    """overwrite_hessian saves the [K, K] float64 copies (512 MiB each at a 1B model's down_proj) and must not
    change the result; without it the caller's Hessian is left as it was."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 128)).astype(np.float32)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    h = (x.T @ x).astype(np.float64)
    kept = h.copy()
    for act_order in (False, True):
        a = nbits.quantize_gptq(w, 4, 32, False, h, act_order=act_order)
        np.testing.assert_array_equal(h, kept)
        b = nbits.quantize_gptq(w, 4, 32, False, h.copy(), act_order=act_order, overwrite_hessian=True)
        np.testing.assert_array_equal(a.packed, b.packed)
        np.testing.assert_array_equal(a.scales, b.scales)
        np.testing.assert_array_equal(a.zero_points, b.zero_points)


@pytest.mark.parametrize("bits,symmetric,act_order", [(4, False, True), (4, True, False), (8, True, True), (8, False, False)])
def test_gptq_in_row_chunks_gives_the_same_blocks(monkeypatch, bits, symmetric, act_order):
    """A big lm_head is swept a chunk of rows at a time (rows share only the Hessian): the same bundle as
    one sweep, with a working set of a chunk's rather than of the whole matrix (2.7 GB for a 128k vocab)."""
    w, x = weights((101, 192), seed=21), correlated_inputs(192, seed=22)
    h = x.T @ x
    whole = nbits.quantize_gptq(w, bits, 64, symmetric, h, act_order=act_order)
    monkeypatch.setattr(nbits, "_GPTQ_CHUNK_ELEMENTS", 192 * 16)  # chunks of 16 rows, the last of 5
    chunked = nbits.quantize_gptq(w, bits, 64, symmetric, h, act_order=act_order)
    # The codes are the same; without act_order a block's scale comes from error-updated weights, and BLAS
    # sums a matmul of another width in another order, which moves some scales by an ulp (static groups:
    # bit for bit)
    assert (chunked.zero_points is None) == (whole.zero_points is None) == symmetric
    np.testing.assert_array_equal(chunked.packed, whole.packed)
    if not symmetric:
        np.testing.assert_array_equal(chunked.zero_points, whole.zero_points)
    if act_order:
        np.testing.assert_array_equal(chunked.scales, whole.scales)
    np.testing.assert_allclose(chunked.scales, whole.scales, rtol=1e-6)


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_on_a_tall_matrix_holds_a_chunk_of_working_copies(monkeypatch, act_order):
    """Found while GPTQ'ing lm_heads: its working copies of w came to ~5x w (a 128k vocab's head of 1 GB
    took 2.7 GB more than its block search). Rows a chunk at a time, as the search already worked."""
    import tracemalloc

    w, x = weights((4096, 256), seed=23), correlated_inputs(256, seed=24)
    monkeypatch.setattr(nbits, "_GPTQ_CHUNK_ELEMENTS", 256 * 256)  # 16 chunks
    tracemalloc.start()
    try:
        nbits.quantize_gptq(w, 4, 64, False, x.T @ x, act_order=act_order)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.0 * w.nbytes  # measured 0.56x (5.3x in one chunk)
