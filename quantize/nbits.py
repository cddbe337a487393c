"""Block-wise n-bit weight quantization for ONNX Runtime's MatMulNBits and GatherBlockQuantized (pure numpy).

A weight w [N out features, K in features] is cut along K into blocks of `block_size`; each block keeps
its own float scale and integer zero point, and dequantizes as (q - zero_point) * scale (the com.microsoft
MatMulNBits / GatherBlockQuantized contrib-op docs). Four ways in, one form out (`BlockQuantized`):
round-to-nearest (`quantize_rtn`), an importance-weighted scale search (`quantize_search`, the idea of
llama.cpp's imatrix quantizers and AWQ: errors on input channels with large activations cost more), GPTQ
error compensation from the layer's input Hessian (`quantize_gptq`, which picks each block's scale with
that same search), and a GGUF tensor's own Q4_0 / Q4_1 / Q8_0 blocks kept bit-for-bit (`from_gguf_blocks`).
No I/O here; the graph builder turns a BlockQuantized into initializers.

Packing, checked against onnxruntime's CPU kernels: codes are packed along K inside each block, low bits
first (for 4 bits the first value is the low nibble); a K that is not a multiple of block_size pads the
last block. Zero points use the same packing per row, [N, ceil(k_blocks * bits / 8)]; when they are
omitted the ops use 2^(bits - 1), which is what the symmetric quantizers here target.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantize.checkpoint import SourceBlocks

SUPPORTED_BITS = (2, 4, 8)  # MatMulNBits' `bits` attribute; packing needs 8 % bits == 0
MIN_BLOCK_SIZE = 16  # both ops: a power of two, at least 16

# Candidate scales for quantize_search, as multiples of the round-to-nearest scale. Below 1 clips the
# block's extreme values to resolve the rest more finely; above 1 lets rounding land better. Each candidate
# is refitted by least squares, so 13 points over +-15 % find the optimum of llama.cpp's wider grids.
DEFAULT_GRID = tuple(float(f) for f in np.round(np.linspace(0.85, 1.15, 13), 4))

# Importance below this fraction of its mean is raised to it. Calibration statistics are noisy; without a
# floor the search sacrifices rarely-activated channels outright (measured on a synthetic 1536x576 int8
# case: 1 % costs 2 % of the weighted gain and cuts the unweighted error blow-up from 10x to 1.7x).
IMPORTANCE_FLOOR = 1e-2

# Elements per chunk in quantize_search: ~4 MB of float32 keeps numpy's temporaries in cache.
_SEARCH_CHUNK_ELEMENTS = 1 << 20

# Columns per lazy batch in quantize_gptq (the reference implementation's `blocksize`): inside a batch each
# column's error is pushed to the batch's later columns one rank-1 update at a time; to the rest of the matrix
# once per batch as one matmul. 128 is the reference's choice; rounded to a multiple of block_size here so
# that every quantization block lies inside one batch and its parameters see its fully updated weights.
_GPTQ_BATCH_COLUMNS = 128

# Rows of w quantize_gptq works on at once, as elements: rows are independent in GPTQ (they share only the
# Hessian), and its working copies of w (transposed, codes, the static search's) cost ~3x w. A 128k-token
# vocabulary's lm_head [128256, 2048] held 2.7 GB of them beside w's 1 GB; in chunks of ~128 MB it holds
# what the block search does. Smaller matrices (all of SmolLM2's, its head included) run in one chunk.
_GPTQ_CHUNK_ELEMENTS = 1 << 25

# GGUF block types we can keep as-is: name -> (MatMulNBits bits, per-block minimum present).
_GGUF_KEEPABLE = {"Q4_0": (4, False), "Q4_1": (4, True), "Q8_0": (8, False)}


def source_bits(src: SourceBlocks) -> int:
    return _GGUF_KEEPABLE[src.ggml_type][0]


@dataclass(frozen=True, eq=False)  # eq=False: numpy fields make a generated __eq__ ambiguous
class BlockQuantized:
    """A weight [N, K] in MatMulNBits' layout; `dequantize()` gives back the float matrix it stands for."""

    bits: int
    block_size: int
    n: int
    k: int
    packed: np.ndarray  # uint8 [N, k_blocks, blob_size], codes packed along K within each block
    scales: np.ndarray  # float32 [N, k_blocks]
    zero_points: np.ndarray | None  # uint8 [N, ceil(k_blocks * bits / 8)] packed; None = 2^(bits-1)

    def __post_init__(self) -> None:
        _check_geometry(self.bits, self.block_size)
        expected = {
            "packed": ((self.n, self.k_blocks, self.blob_size), np.uint8),
            "scales": ((self.n, self.k_blocks), None),
            "zero_points": ((self.n, _packed_len(self.k_blocks, self.bits)), np.uint8),
        }
        for name, (shape, dtype) in expected.items():
            a = getattr(self, name)
            if a is None and name == "zero_points":
                continue
            if tuple(a.shape) != shape or (dtype is not None and a.dtype != dtype):
                raise ValueError(f"BlockQuantized.{name}: got {a.dtype} {tuple(a.shape)}, expected "
                                 f"{np.dtype(dtype) if dtype else 'float'} {shape}")

    @property
    def k_blocks(self) -> int:
        return -(-self.k // self.block_size)

    @property
    def blob_size(self) -> int:
        return self.block_size * self.bits // 8

    @property
    def is_symmetric(self) -> bool:
        return self.zero_points is None

    def codes(self) -> np.ndarray:
        """Unpacked codes, uint8 [N, k_blocks, block_size] (the padded tail of the last block included)."""
        return unpack_bits(self.packed, self.bits, self.block_size)

    def zero_point_values(self) -> np.ndarray:
        """Unpacked zero points, uint8 [N, k_blocks], the op's default 2^(bits-1) when none are stored."""
        if self.zero_points is None:
            return np.full((self.n, self.k_blocks), 1 << (self.bits - 1), np.uint8)
        return unpack_bits(self.zero_points, self.bits, self.k_blocks)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: (q - zero_point) * scale, in float32 as the ops compute it."""
        q = self.codes().astype(np.float32)
        zp = self.zero_point_values().astype(np.float32)[..., None]
        w = (q - zp) * self.scales.astype(np.float32)[..., None]
        return w.reshape(self.n, -1)[:, : self.k]

    def gather_data(self) -> np.ndarray:
        """GatherBlockQuantized's `data`: uint8 [N, ceil(K * bits / 8)], whole rows packed without block padding.

        Equal to packed.reshape(N, -1) when block_size divides K; otherwise the last block's padding is dropped.
        """
        if self.k % self.block_size == 0:
            return self.packed.reshape(self.n, -1)
        return pack_bits(self.codes().reshape(self.n, -1)[:, : self.k], self.bits)


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes [..., L] (each < 2^bits) along the last axis, low bits first -> uint8 [..., ceil(L*bits/8)]."""
    per_byte = 8 // bits
    pad = (-values.shape[-1]) % per_byte
    v = values.astype(np.uint8)
    if pad:
        v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint8)], axis=-1)
    v = v.reshape(v.shape[:-1] + (-1, per_byte))
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(v << shifts, axis=-1).astype(np.uint8)


def unpack_bits(packed: np.ndarray, bits: int, length: int) -> np.ndarray:
    """Inverse of pack_bits: uint8 [..., n_bytes] -> codes uint8 [..., length]."""
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    v = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return v.reshape(packed.shape[:-1] + (-1,))[..., :length]


def quantize_rtn(w: np.ndarray, bits: int, block_size: int, symmetric: bool) -> BlockQuantized:
    """Plain round-to-nearest block quantization of w float32 [N, K].

    Symmetric: the block's largest-magnitude value maps exactly to code 0 (i.e. -2^(bits-1) after the
    default zero point), as llama.cpp's Q4_0 does, so all 2^bits levels are used; the scale may be negative.
    Asymmetric: the range [min(w, 0), max(w, 0)] spans all levels, with an integer zero point.
    """
    _check_geometry(bits, block_size)
    x = _to_blocks(_check_weight(w), block_size)  # [N, k_blocks, block_size]
    scale, zp = _rtn_params(x, bits, symmetric)
    j = _signed_codes(x, _safe_inverse(scale), zp, bits)
    return _assemble(j, scale, zp, bits, block_size, w.shape[1], symmetric)


def quantize_search(w: np.ndarray, bits: int, block_size: int, symmetric: bool,
                    importance: np.ndarray | None = None,
                    grid: tuple[float, ...] = DEFAULT_GRID) -> BlockQuantized:
    """Per block, the scale (and zero point) minimizing sum_k importance[k] * (w - dequant(w))^2.

    w float32 [N, K]; importance float32 [K] >= 0 (e.g. mean squared activation per input channel), None
    for uniform. Candidates are the RTN scale times each grid factor; for each, codes are rounded, then
    the scale is refitted by weighted least squares for those codes (the closed form llama.cpp's
    make_qx_quants uses), and the best is polished by one more round-and-refit. The RTN candidate is
    always tried, so the weighted error never exceeds RTN's.
    """
    _check_geometry(bits, block_size)
    n, k = _check_weight(w).shape
    x = _to_blocks(w, block_size)  # [N, k_blocks, block_size]
    weights = _block_weights(importance, k, block_size)  # [k_blocks, block_size]
    rows_per_chunk = max(1, _SEARCH_CHUNK_ELEMENTS // x[0].size)
    scale = np.empty(x.shape[:2], np.float32)
    zp = np.empty(x.shape[:2], np.float32)
    j = np.empty(x.shape, np.float32)
    for r in range(0, n, rows_per_chunk):
        rows = slice(r, r + rows_per_chunk)
        scale[rows], zp[rows], j[rows] = _search_chunk(x[rows], weights, bits, symmetric, grid)
    return _assemble(j, scale, zp, bits, block_size, k, symmetric)


def quantize_gptq(w: np.ndarray, bits: int, block_size: int, symmetric: bool, hessian: np.ndarray, *,
                  damp: float = 0.01, importance: np.ndarray | None = None,
                  act_order: bool = False, overwrite_hessian: bool = False) -> BlockQuantized:
    """GPTQ (Frantar et al. 2022, arXiv:2210.17323): quantize column by column along K, pushing each column's
    rounding error onto the columns not yet quantized so as to minimise ||X w^T - X dequant(w)^T||_F.

    w float32 [N, K]; hessian float64 [K, K] = sum over calibration tokens of x x^T (x: the layer's input).
    As in the reference code, input channels with a zero diagonal (never active) get H[i, i] = 1 and
    damp * mean(diag(H)) is added to the diagonal; unlike it, their weights are kept, not zeroed. Each
    block's scale and zero point are chosen by quantize_search's weighted search when the sweep reaches
    the block, from its error-updated weights; importance defaults to diag(H). act_order sweeps channels
    by decreasing diag(H) with "static groups": every block's parameters are chosen up front from the
    original w, since blocks no longer come up whole. The result is an ordinary BlockQuantized.

    overwrite_hessian: work in `hessian` itself (float64) rather than a copy, leaving it undefined. Each [K, K]
    float64 buffer is 512 MiB at a 1B Llama's down_proj (K = 8192); at most four are alive at once here
    (copying freely held ~3.5 GB of them, most of a build's peak).
    """
    _check_geometry(bits, block_size)
    n, k = _check_weight(w).shape
    h = _check_hessian(hessian, k, damp, copy=not overwrite_hessian)
    diag = np.diag(h).copy()
    importance = diag if importance is None else importance
    order = np.argsort(-diag, kind="stable") if act_order else np.arange(k)
    if act_order:
        _permute_symmetric(h, order)  # in place: h[np.ix_(order, order)] would be another [K, K] copy
    u = _inverse_hessian_cholesky(h, damp)  # float32 [K, K], sweep order; h is overwritten
    del h
    rows = max(1, _GPTQ_CHUNK_ELEMENTS // k)
    return concat_rows([_gptq_rows(w[r:r + rows], u, order, bits, block_size, symmetric, importance, act_order)
                        for r in range(0, n, rows)])


def _gptq_rows(w: np.ndarray, u: np.ndarray, order: np.ndarray, bits: int, block_size: int, symmetric: bool,
               importance: np.ndarray, act_order: bool) -> BlockQuantized:
    """quantize_gptq's sweep over some rows of w, given the inverse Hessian's factor u in sweep order."""
    n, k = w.shape
    if act_order:
        static = quantize_search(w, bits, block_size, symmetric, importance)
        scale, zp, choose = _static_params(static, order)
    else:
        scale, zp, choose = _searched_params(n, _block_weights(importance, k, block_size), bits, symmetric)
    wt = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T[order])  # [K, N], sweep order
    j = np.zeros((n, scale.shape[1] * block_size), np.float32)  # padding: signed code 0, i.e. the zero point
    j[:, order] = _gptq_sweep(wt, u, bits, block_size, choose).T
    return _assemble(j.reshape(n, -1, block_size), scale, zp, bits, block_size, k, symmetric)


def default_zero_points(q: BlockQuantized) -> np.ndarray:
    """The packed zero points MatMulNBits assumes when it is given none: 2^(bits-1) for every block."""
    if q.bits == 8:
        return np.full((q.n, q.k_blocks), 128, np.uint8)
    return np.full((q.n, _packed_len(q.k_blocks, q.bits)), 0x88, np.uint8)  # two 4-bit eights per byte


def concat_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """Stack block-quantized matrices along N (row chunks, or the fused q/k/v or gate/up rows)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    assert all((p.bits, p.block_size, p.k) == (first.bits, first.block_size, first.k) for p in parts)
    zps = None
    if any(p.zero_points is not None for p in parts):
        # a part without zero points uses the op's default 2^(bits-1): spell it out so all rows agree
        zps = np.concatenate([p.zero_points if p.zero_points is not None else default_zero_points(p) for p in parts])
    return BlockQuantized(first.bits, first.block_size, sum(p.n for p in parts), first.k,
                          np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]), zps)


def quantize_embedding(w: np.ndarray, bits: int, block_size: int, *, symmetric: bool = False) -> BlockQuantized:
    """An embedding table [vocab, hidden] for GatherBlockQuantized: blocks run along hidden, one row per token.

    The same form as a MatMulNBits weight (so a tied lm_head can share it); feed `gather_data()`, `scales`
    and `zero_points` to the op. Importance is uniform: a looked-up row has no input-channel statistics.
    """
    return quantize_search(w, bits, block_size, symmetric)


def from_gguf_blocks(src: SourceBlocks) -> tuple[BlockQuantized, np.ndarray | None]:
    """A GGUF tensor's own blocks, re-laid-out for MatMulNBits without re-rounding anything.

    Q4_0 (w = d * (q - 8)) -> 4-bit blocks of 32, default zero point 8. Q8_0 (w = d * i8) -> 8-bit blocks
    of 32 with code i8 + 128, default zero point 128. Q4_1 (w = d * q + m) -> 4-bit, default zero point 8,
    and the per-block offsets m + 8d float32 [N, k_blocks] are returned second for the graph to add as
    sum_block(x) @ offsets.T; None for the other types. dequantize() (+ offsets) equals gguf's
    dequantization exactly.
    """
    import gguf  # only here: the maths above does not need the GGUF package

    if src.ggml_type not in _GGUF_KEEPABLE:
        raise ValueError(f"cannot keep GGUF blocks of type {src.ggml_type}: supported {sorted(_GGUF_KEEPABLE)}")
    bits, has_min = _GGUF_KEEPABLE[src.ggml_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[src.ggml_type]]
    blocks = _gguf_blocks(src, block_size, type_size)  # uint8 [N, k_blocks, type_size]
    n, k = src.shape
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, k_blocks]
    if src.ggml_type == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockQuantized(bits, block_size, n, k, codes, d, None), None
    start = 4 if has_min else 2
    codes = _unpack_ggml_nibbles(blocks[..., start:])  # [N, k_blocks, 32]
    packed = pack_bits(codes, bits)
    if not has_min:
        return BlockQuantized(bits, block_size, n, k, packed, d, None), None
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    # w = d*q + m = d*(q - 8) + (m + 8d): the default zero point 8 stores nothing, and the correction's
    # per-block offset m + 8d sits near the block's centre, so its product with int8-quantized activation
    # sums stays small (zero point 0 with offset m measured KL 0.014 at accuracy_level 4, this 0.004).
    return BlockQuantized(bits, block_size, n, k, packed, d, None), m + 8 * d


def packed_size_bytes(q: BlockQuantized) -> int:
    """Bytes of the op's initializers as stored: packed codes + scales + zero points (if any)."""
    return int(q.packed.nbytes + q.scales.nbytes + (0 if q.zero_points is None else q.zero_points.nbytes))


def reconstruction_error(w: np.ndarray, q: BlockQuantized, importance: np.ndarray | None = None) -> float:
    """Importance-weighted mean squared error of q against w [N, K] (uniform when importance is None)."""
    err = (w.astype(np.float32) - q.dequantize()) ** 2
    if importance is None:
        return float(err.mean())
    return float((err * importance[None, :]).sum() / (importance.sum() * w.shape[0]))


# --- internals -------------------------------------------------------------------------------------------


def _check_geometry(bits: int, block_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} unsupported: choose one of {SUPPORTED_BITS}")
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} invalid: must be a power of two >= {MIN_BLOCK_SIZE}")


def _check_weight(w: np.ndarray) -> np.ndarray:
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"weight must be a non-empty 2-D [N, K] array, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight contains NaN or infinity")
    return w


def _packed_len(length: int, bits: int) -> int:
    return -(-length * bits // 8)


def _to_blocks(w: np.ndarray, block_size: int) -> np.ndarray:
    """[N, K] -> float32 [N, k_blocks, block_size]; the last block is padded by repeating its final value,
    which leaves the block's min, max and extreme unchanged (padding then gets zero weight in the search)."""
    pad = (-w.shape[1]) % block_size
    x = np.asarray(w, dtype=np.float32)
    if pad:
        x = np.pad(x, ((0, 0), (0, pad)), mode="edge")
    return x.reshape(w.shape[0], -1, block_size)


def _block_weights(importance: np.ndarray | None, k: int, block_size: int) -> np.ndarray:
    """importance [K] -> float32 [k_blocks, block_size], zero on padding.

    The IMPORTANCE_FLOOR also keeps every block's least-squares refit defined when some importance is zero."""
    if importance is None:
        imp = np.ones(k, np.float32)
    else:
        imp = np.asarray(importance, dtype=np.float32)
        if imp.shape != (k,) or not np.isfinite(imp).all() or (imp < 0).any():
            raise ValueError(f"importance must be finite, non-negative, shape ({k},); got shape {imp.shape}")
        imp = np.maximum(imp, np.float32(IMPORTANCE_FLOOR * max(float(imp.mean()), 1e-30)))
    imp = np.pad(imp, (0, (-k) % block_size))
    return imp.reshape(-1, block_size)


def _safe_inverse(scale: np.ndarray) -> np.ndarray:
    """1/scale [..., 1] for broadcasting over a block, 0 where the scale is 0 (an all-zero block)."""
    with np.errstate(divide="ignore"):
        inv = np.where(scale == 0, np.float32(0), np.float32(1) / scale)
    return inv.astype(np.float32)[..., None]


def _rtn_params(x: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest (scale, zero point), both float32 [N, k_blocks], for blocks x [N, k_blocks, B]."""
    max_code = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
        return (extreme / -half).astype(np.float32), np.full(x.shape[:2], half, np.float32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale = ((hi - lo) / max_code).astype(np.float32)
    zp = np.clip(np.rint(-lo * _safe_inverse(scale)[..., 0]), 0, max_code)
    return scale, zp.astype(np.float32)


def _signed_codes(x: np.ndarray, inv_scale: np.ndarray, zp: np.ndarray, bits: int) -> np.ndarray:
    """q - zp for q = clip(round(x / scale + zp), 0, 2^bits - 1): float32 [N, k_blocks, B].

    Adding zp before rounding lets the clip take scalar bounds, ~3x faster than per-block bounds."""
    zp = zp[..., None]
    j = x * inv_scale
    j += zp
    np.rint(j, out=j)
    np.clip(j, 0, (1 << bits) - 1, out=j)
    j -= zp
    return j


def _assemble(j: np.ndarray, scale: np.ndarray, zp: np.ndarray, bits: int, block_size: int, k: int,
              symmetric: bool) -> BlockQuantized:
    """Pack signed codes j [N, k_blocks, B] and float zero points [N, k_blocks] into a BlockQuantized."""
    n = j.shape[0]
    codes = (j + zp[..., None]).astype(np.uint8)
    zero_points = None if symmetric else pack_bits(zp.astype(np.uint8), bits)
    return BlockQuantized(bits, block_size, n, k, pack_bits(codes, bits), scale.astype(np.float32), zero_points)


def _candidates(x: np.ndarray, bits: int, symmetric: bool, grid: tuple[float, ...]):
    """Yield (scale, zero point) pairs, float32 [n, k_blocks] each; the RTN pair comes first."""
    rtn_scale, rtn_zp = _rtn_params(x, bits, symmetric)
    yield rtn_scale, rtn_zp
    max_code = (1 << bits) - 1
    if symmetric:
        # the extreme value on the short side of the code range (-2^(b-1) .. 2^(b-1)-1) too
        other = (rtn_scale * -(1 << (bits - 1)) / ((1 << (bits - 1)) - 1)).astype(np.float32)
        for f in grid:
            yield rtn_scale * np.float32(f), rtn_zp
            yield other * np.float32(f), rtn_zp
        return
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    for f in grid:
        s = rtn_scale * np.float32(f)
        inv = _safe_inverse(s)[..., 0]
        # when f < 1 the range no longer fits: clip at the top (keep min) or at the bottom (keep max)
        yield s, np.clip(np.rint(-lo * inv), 0, max_code).astype(np.float32)
        yield s, np.clip(max_code - np.rint(hi * inv), 0, max_code).astype(np.float32)


def _refit(x_weighted: np.ndarray, weights: np.ndarray, j: np.ndarray, scale0: np.ndarray):
    """Least-squares scale for fixed codes j and its weighted error (up to a constant), [n, k_blocks] each.

    minimise sum w (x - s j)^2 -> s = sum(w x j) / sum(w j^2); error - sum(w x^2) = s^2 sjj - 2 s sxj.
    """
    sxj = np.einsum("nkb,nkb->nk", x_weighted, j)
    sjj = np.einsum("nkb,nkb,kb->nk", j, j, weights, optimize=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.where(sjj > 0, sxj / sjj, scale0).astype(np.float32)
    return s, s * s * sjj - 2 * s * sxj


def _search_chunk(x: np.ndarray, weights: np.ndarray, bits: int, symmetric: bool, grid: tuple[float, ...]):
    """Best (scale, zero point, signed codes) for blocks x [n, k_blocks, B] under weights [k_blocks, B]."""
    xw = x * weights
    best_s0 = best_s = best_zp = best_err = None
    for s0, zp in _candidates(x, bits, symmetric, grid):
        s, err = _refit(xw, weights, _signed_codes(x, _safe_inverse(s0), zp, bits), s0)
        if best_err is None:
            best_s0, best_s, best_zp, best_err = s0, s, zp, err
            continue
        better = err < best_err
        best_s0, best_s = np.where(better, s0, best_s0), np.where(better, s, best_s)
        best_zp, best_err = np.where(better, zp, best_zp), np.where(better, err, best_err)
    # polish: round once more with the refitted scale, keep it where that helps
    j_best = _signed_codes(x, _safe_inverse(best_s0), best_zp, bits)
    j_new = _signed_codes(x, _safe_inverse(best_s), best_zp, bits)
    s_new, err_new = _refit(xw, weights, j_new, best_s)
    better = err_new < best_err
    j = np.where(better[..., None], j_new, j_best)
    return np.where(better, s_new, best_s), best_zp, j


def _check_hessian(hessian: np.ndarray, k: int, damp: float, copy: bool = True) -> np.ndarray:
    """hessian [K, K] -> float64 (a copy, or itself when copy=False and it is float64 already), refusing
    what cannot be sum x x^T."""
    h = np.array(hessian, dtype=np.float64, order="C") if copy else np.asarray(hessian, np.float64, order="C")
    if h.shape != (k, k) or not np.isfinite(h).all():
        raise ValueError(f"hessian must be a finite ({k}, {k}) array (sum of x x^T over calibration tokens), "
                         f"got shape {h.shape}")
    if (np.diag(h) < 0).any() or not _symmetric(h, rtol=1e-5, atol=1e-8 * max(float(np.abs(h).max()), 1e-30)):
        raise ValueError("hessian must be symmetric with a non-negative diagonal (sum of x x^T)")
    if not np.isfinite(damp) or damp < 0:
        raise ValueError(f"damp must be a finite fraction >= 0 of mean(diag(H)), got {damp}")
    return h


def _permute_symmetric(h: np.ndarray, order: np.ndarray) -> None:
    """h := h[np.ix_(order, order)] in place: the rows, then the columns, moved along each cycle of order with
    one line held aside (position i takes the line at order[i])."""
    for line in (lambda i: h[i], lambda i: h[:, i]):
        done = np.zeros(len(order), bool)
        for start in range(len(order)):
            if done[start]:
                continue
            held, i = line(start).copy(), start
            while order[i] != start:
                line(i)[...] = line(order[i])
                done[i], i = True, order[i]
            line(i)[...] = held
            done[i] = True


def _symmetric(h: np.ndarray, rtol: float, atol: float, rows: int = 512) -> bool:
    """np.allclose(h, h.T) a band of rows at a time: whole, its temporaries were three more [K, K] arrays."""
    return all(np.allclose(h[i:i + rows], h[:, i:i + rows].T, rtol=rtol, atol=atol) for i in range(0, len(h), rows))


def _inverse_hessian_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U), float32 [K, K], after the reference's repairs to H,
    which are made in h itself.

    Row i of U, divided by U[i, i], is how an error in column i moves the later columns (the GPTQ paper's
    eq. 3 applied sequentially, in Cholesky form). With J the order reversal, J H J = M M^T for the lower
    triangular M = J U^-1 J, so U = J M^-1 J: one Cholesky and one inverse, where the reference's
    cholesky -> cholesky_inverse -> cholesky costs twice that (equal to 1e-14 at K = 1536)."""
    dead = np.flatnonzero(np.diag(h) == 0)  # channels never active: any value is free, keep H invertible
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * float(np.diag(h).mean())
    try:
        m = np.linalg.cholesky(h[::-1, ::-1])
    except np.linalg.LinAlgError as e:
        raise ValueError(f"hessian is not positive definite after damping with damp={damp}: raise damp, "
                         "or check it is sum x x^T") from e
    inverse = np.linalg.inv(m)
    del m
    u = np.empty(inverse.shape, np.float32)
    u[...] = inverse[::-1, ::-1]  # cast in place: no float64 copy of the reversed view
    return u


def _search_block(x: np.ndarray, weights: np.ndarray, bits: int, symmetric: bool):
    """quantize_search's choice for one block per row: x float32 [N, <= B], weights [B] -> scale, zp [N] each.

    A short (last) block is padded by repeating its last column, which the zero padding weights ignore."""
    pad = weights.shape[0] - x.shape[1]
    x = np.pad(x, ((0, 0), (0, pad)), mode="edge") if pad else x
    scale, zp, _ = _search_chunk(x[:, None, :], weights[None, :], bits, symmetric, DEFAULT_GRID)
    return scale[:, 0], zp[:, 0]


def _static_params(static: BlockQuantized, order: np.ndarray):
    """act_order's static groups: (scale, zp) float32 [N, k_blocks] fixed up front, and the `choose` for
    _gptq_sweep that looks up each sweep column's block (order: sweep position -> column of w)."""
    scale, zp = static.scales, static.zero_point_values().astype(np.float32)
    block_of = order // static.block_size

    def choose(start: int, current: np.ndarray):
        cols = block_of[start:start + current.shape[1]]
        return scale[:, cols], zp[:, cols]
    return scale, zp, choose


def _searched_params(n: int, weights: np.ndarray, bits: int, symmetric: bool):
    """(scale, zp) float32 [N, k_blocks], filled in by the returned `choose` as _gptq_sweep reaches each block
    (in order): the search runs on the block's current, error-updated weights."""
    block_size = weights.shape[1]
    scale = np.empty((n, weights.shape[0]), np.float32)
    zp = np.empty_like(scale)

    def choose(start: int, current: np.ndarray):
        b = start // block_size
        scale[:, b], zp[:, b] = _search_block(current, weights[b], bits, symmetric)
        return scale[:, b:b + 1], zp[:, b:b + 1]
    return scale, zp, choose


def _gptq_sweep(wt: np.ndarray, u: np.ndarray, bits: int, block_size: int, choose) -> np.ndarray:
    """The GPTQ loop over wt = w^T float32 [K, N] (updated in place) with u float32 [K, K], in sweep order.

    Transposed so that a column of w is a contiguous row: the per-column updates run ~5x faster.
    choose(start, current [N, g]) gives (scale, zp), broadcastable to [N, g], for the g sweep columns from
    `start`, when the sweep reaches them. Returns signed codes q - zp, float32 [K, N], in sweep order."""
    k = wt.shape[0]
    batch = max(1, _GPTQ_BATCH_COLUMNS // block_size) * block_size
    j = np.empty_like(wt)
    for b0 in range(0, k, batch):
        b1 = min(b0 + batch, k)
        w1, err = wt[b0:b1], np.empty((b1 - b0, wt.shape[1]), np.float32)  # w1: a view, updated in place
        for g0 in range(0, b1 - b0, block_size):
            g1 = min(g0 + block_size, b1 - b0)
            scale, zp = choose(b0 + g0, w1[g0:g1].T)
            j[b0 + g0:b0 + g1] = _gptq_group(w1, err, u[b0:b1, b0:b1], g0, g1, scale.T, zp.T, bits)
        wt[b1:] -= u[b0:b1, b1:].T @ err  # the batch's errors reach the later batches in one matmul
    return j


def _gptq_group(w1: np.ndarray, err: np.ndarray, u1: np.ndarray, g0: int, g1: int, scale: np.ndarray,
                zp: np.ndarray, bits: int) -> np.ndarray:
    """Quantize rows g0:g1 of w1 [batch, N] (columns of w) one at a time, each to the nearest level of its
    (scale, zp) [g or 1, N], pushing the scaled error onto the batch's later rows; errors go to err [batch, N].

    Returns the signed codes [g1 - g0, N]. scale * code is exactly what dequantize() gives back."""
    g, n = g1 - g0, w1.shape[1]
    scale, zp = np.broadcast_to(scale, (g, n)), np.broadcast_to(zp, (g, n))
    inv = _safe_inverse(scale)[..., 0]
    j = np.empty((g, n), np.float32)
    for c in range(g):
        i = g0 + c
        j[c] = np.clip(np.rint(w1[i] * inv[c] + zp[c]), 0, (1 << bits) - 1) - zp[c]
        err[i] = (w1[i] - j[c] * scale[c]) / u1[i, i]
        w1[i + 1:] -= np.outer(u1[i, i + 1:], err[i])
    return j


def _gguf_blocks(src: SourceBlocks, block_size: int, type_size: int) -> np.ndarray:
    """src.data uint8 [N, bytes_per_row] -> [N, k_blocks, type_size], checking the geometry."""
    n, k = src.shape
    if k % block_size:
        raise ValueError(f"{src.ggml_type} tensor has in_features={k}, not a multiple of its block size {block_size}")
    expected = (n, k // block_size * type_size)
    if src.data.dtype != np.uint8 or tuple(src.data.shape) != expected:
        raise ValueError(f"{src.ggml_type} blocks: got {src.data.dtype} {tuple(src.data.shape)}, expected uint8 {expected}")
    return src.data.reshape(n, k // block_size, type_size)


def _unpack_ggml_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout, byte i = (value i) | (value i + 16) << 4, -> codes uint8 [..., 32] in order.

    (MatMulNBits instead pairs neighbours: byte i = (value 2i) | (value 2i + 1) << 4.)"""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
