"""Read a llama.cpp GGUF file of any architecture in quantize.architectures into the internal Checkpoint form.

Tensors are dequantized to float32 with the `gguf` package. For Llama-style models llama.cpp's converter
permutes the rows of the Q and K projections so that rotary pairs are interleaved (GGML's RoPE mode 0); we
undo that so the checkpoint is in Hugging Face's half-split order, the order the graph's GroupQueryAttention rotary uses
(`rotary_interleaved=0`). Q4_0, Q4_1 and Q8_0 tensors also keep their raw blocks for --keep-source-quant.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize

from agent.engine.bundle import file_sha256
from agent.wire import Geometry
from quantize import rope
from quantize.architectures import BY_GGUF, GLOBAL_NAMES, WITH_EXPERTS, Architecture, supported
from quantize.checkpoint import Checkpoint, CheckpointError, SourceBlocks, finite
from quantize.gguf_layout import check_layout
from quantize.tokenizer import tokenizer_from_gguf

# Q5_0 / Q5_1: llama-quantize's fallbacks for Q4_K / Q5_K when a row is not a multiple of 256 (SmolLM2's
# 576-wide rows), so most of a small model's Q4_K_M or Q5_K_M file is in them.
SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)
KEPT_BLOCK_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q8_0)

ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE divisors: read into the geometry
LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's, likewise
IGNORED_SUFFIXES = (".attn_rot_embd",)  # old converters' RoPE inverse frequencies: recomputed from rope_theta


def open_reader(path: Path) -> GGUFReader:
    """GGUFReader, with any parse failure (truncated file, bad magic) turned into one clear error."""
    try:
        check_layout(path)  # every count and offset against the file size: GGUFReader trusts them
        return GGUFReader(path)
    except CheckpointError:
        raise
    except Exception as e:  # the gguf package raises assorted ValueError/IndexError/struct errors
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


_REQUIRED = object()


def _field(reader: GGUFReader, key: str, default=_REQUIRED):
    """A metadata value; a missing required key is a CheckpointError naming it."""
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise CheckpointError(f"missing metadata key {key}")
        return default
    return f.contents()


def _bounded(key: str, value, limit: int) -> int:
    """A positive integer no larger than limit (a corrupt header must not make us allocate for it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < int(value) <= limit:
        raise CheckpointError(f"metadata {key} = {value!r} is out of range (1..{limit})")
    return int(value)


def _real(key: str, value) -> float:
    """A float32 metadata value (or its default) as a Python float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"metadata {key} = {value!r} is not a number")
    return float(value)


def _vocab_size(reader: GGUFReader, a: str, path: Path) -> int:
    """{arch}.vocab_size is optional: llama.cpp then counts tokenizer.ggml.tokens, as here, and without a token
    list the embedding's rows. Every fallback is a Python int, the type the key itself (a uint32) reads as:
    _bounded takes Python numbers only."""
    given = _field(reader, a + "vocab_size", None)
    if given is not None:
        return given
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise CheckpointError(f"{path}: no {a}vocab_size, no tokenizer.ggml.tokens and no 2-D token_embd.weight "
                              "to take the vocabulary size from")
    return int(embd.shape[1])  # GGUF lists shapes innermost first: [hidden, vocab]


def architecture_of(reader: GGUFReader, path: Path) -> Architecture:
    name = _field(reader, "general.architecture", None)
    if name not in BY_GGUF:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {name!r} (supported: {supported('gguf')})")
    if name in WITH_EXPERTS and _field(reader, f"{name}.expert_count", 0):
        return WITH_EXPERTS[name]
    return BY_GGUF[name]


# Routing that llama.cpp computes and ONNX Runtime's MoE/QMoE kernels cannot (they take softmax over the router
# logits, the top k, and optionally renormalise): refused by the key that asks for it
_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (2 is sigmoid)


def _experts(reader: GGUFReader, arch: Architecture, path: Path) -> dict:
    """The Geometry fields of a Mixture of Experts, as llama.cpp reads them (renormalisation is hard-coded per
    architecture there); any routing the kernel cannot compute is refused, naming its key."""
    a = arch.key_prefix
    if arch.moe is None:
        if _field(reader, a + "expert_count", 0):
            raise CheckpointError(f"{path}: {a}expert_count is set, but {arch.name} is not read as a Mixture of "
                                  "Experts")
        return {}
    unsupported = {
        "expert_shared_count": (_field(reader, a + "expert_shared_count", 0), 0),  # shared experts
        "expert_gating_func": (_field(reader, a + "expert_gating_func", _GATING_SOFTMAX), _GATING_SOFTMAX),
        "expert_weights_scale": (_field(reader, a + "expert_weights_scale", 1.0) or 1.0, 1.0),
        "leading_dense_block_count": (_field(reader, a + "leading_dense_block_count", 0), 0),
    }
    wrong = [f"{a}{k}={v!r}" for k, (v, ok) in unsupported.items() if v != ok]
    if wrong:
        raise CheckpointError(f"{path}: unsupported Mixture of Experts routing ({', '.join(wrong)}): ONNX Runtime's "
                              "MoE kernel takes a softmax over the router's logits and the top k of every layer's "
                              "experts only")
    experts = _bounded("expert_count", _field(reader, a + "expert_count"), 1 << 12)
    return {"num_experts": experts,
            "num_experts_per_tok": _bounded("expert_used_count", _field(reader, a + "expert_used_count"), experts),
            "moe_renormalize": arch.moe.gguf_renormalize}


def read_geometry(reader: GGUFReader, path: Path) -> Geometry:
    """The model's shape from the `{arch}.*` keys: the ones llama.cpp requires (context, embedding and feed-forward
    lengths, block and head counts, the RMS norm epsilon) and the optional ones at llama.cpp's defaults."""
    arch = architecture_of(reader, path)
    a = arch.key_prefix
    hidden = _bounded(a + "embedding_length", _field(reader, a + "embedding_length"), 1 << 16)
    heads = _bounded(a + "attention.head_count", _field(reader, a + "attention.head_count"), 1024)
    layers = _bounded(a + "block_count", _field(reader, a + "block_count"), 1024)
    names = {t.name for t in reader.tensors}
    if not any(n.startswith(f"blk.{layers - 1}.") for n in names) or any(n.startswith(f"blk.{layers}.") for n in names):
        raise CheckpointError(f"block_count {layers} does not match the tensors in the file")
    head_dim = _bounded("key_length", _field(reader, a + "attention.key_length", hidden // heads), 1 << 16)
    # a Mixture of Experts' expert size: Qwen3-MoE writes it apart from its (unused) dense feed_forward_length
    ffn_key = a + ("expert_feed_forward_length" if _field(reader, a + "expert_feed_forward_length", None)
                   else "feed_forward_length")
    return Geometry(
        architecture=arch.name,
        vocab_size=_bounded("vocab_size", _vocab_size(reader, a, path), 1 << 22),
        hidden_size=hidden,
        intermediate_size=_bounded(ffn_key, _field(reader, ffn_key), 1 << 18),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_bounded("head_count_kv", _field(reader, a + "attention.head_count_kv", heads), heads),
        head_dim=head_dim,
        context_length=_bounded("context_length", _field(reader, a + "context_length", 2048), 1 << 20),
        rope_theta=_real("rope.freq_base", _field(reader, a + "rope.freq_base", 10000.0)),
        rms_norm_eps=_real("layer_norm_rms_epsilon", _field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch.qkv_bias,
        **_rope_scaling(reader, a, head_dim, path),
        **_variant(reader, arch, hidden, head_dim, layers),
        **_experts(reader, arch, path),
    )


def _variant(reader: GGUFReader, arch: Architecture, hidden: int, head_dim: int, layers: int) -> dict:
    """The Geometry fields of the architecture's block variant, from the keys llama.cpp reads for it (its
    hard-coded values where it has no key: Gemma 3's window pattern and local RoPE base, SmolLM3's NoPE step)."""
    a = arch.key_prefix
    window = _field(reader, a + "attention.sliding_window", None)
    numbers = {
        "rotary_dim": _rotary_dim(reader, a, head_dim),
        "embedding_multiplier": hidden ** 0.5 if arch.embedding_scale_sqrt_hidden
        else _real("embedding_scale", _field(reader, a + "embedding_scale", 1.0)),
        "attention_scale": None if (s := _field(reader, a + "attention.scale", None)) is None
        else _real("attention.scale", s),
        "residual_multiplier": _real("residual_scale", _field(reader, a + "residual_scale", 1.0)),
        "logit_multiplier": 1 / _real("logit_scale", _field(reader, a + "logit_scale", 1.0) or 1.0),
    }
    if arch.swa_period and not window:  # llama.cpp then runs every layer globally and soft-caps the logits
        raise CheckpointError(f"a {arch.name} GGUF without {a}attention.sliding_window is not supported")
    if window:
        numbers["sliding_window"] = _bounded("attention.sliding_window", window, 1 << 20)
        if arch.swa_period:
            period = _bounded("attention.sliding_window_pattern",
                              _field(reader, a + "attention.sliding_window_pattern", arch.swa_period), layers + 1)
            numbers["window_layers"] = tuple(i for i in range(layers) if (i + 1) % period)
            numbers["rope_local_theta"] = _real("rope.freq_base_swa", _field(
                reader, a + "rope.freq_base_swa", arch.default_rope_local_theta))
    if arch.nope_period:
        numbers["nope_layers"] = tuple(i for i in range(layers) if (i + 1) % arch.nope_period == 0)
    if numbers["rotary_dim"] == head_dim:
        numbers["rotary_dim"] = None
    return numbers


def _rotary_dim(reader: GGUFReader, a: str, head_dim: int) -> int:
    return _bounded("rope.dimension_count", _field(reader, a + "rope.dimension_count", head_dim), head_dim)


def _rope_scaling(reader: GGUFReader, a: str, head_dim: int, path: Path) -> dict:
    """rope_freq_factors (and LongRoPE's rope_attention_factor) as llama.cpp reads them: Phi-3's short and long
    factor tensors, else the scaling type, factor and Llama 3's rope_freqs (see _rope_factors)."""
    half = _rotary_dim(reader, a, head_dim) // 2
    tensors = {t.name: t for t in reader.tensors if t.name in LONGROPE}
    if not tensors:
        return {"rope_freq_factors": _rope_factors(reader, a, half * 2, path)}
    if len(tensors) != 2:
        raise CheckpointError(f"{path}: LongRoPE needs both {' and '.join(LONGROPE)}")
    short, long = (_tensor_rows(tensors[n], path)[0].reshape(-1).tolist() for n in LONGROPE)
    original = _bounded("rope.scaling.original_context_length",
                        _field(reader, a + "rope.scaling.original_context_length"), 1 << 20)
    context = _bounded("context_length", _field(reader, a + "context_length", 2048), 1 << 20)
    factor = _field(reader, a + "rope.scaling.attn_factor", None)
    factors, attention = rope.longrope(short, long, original, context, None if factor is None else
                                       _real("rope.scaling.attn_factor", factor), half, str(path))
    return {"rope_freq_factors": factors, "rope_attention_factor": attention}


def _rope_factors(reader: GGUFReader, a: str, head_dim: int, path: Path) -> rope.Factors:
    """RoPE scaling as llama.cpp reads it: a type (linear when only a factor is given), a factor (or the old
    `rope.scale_linear`), and Llama 3's per-frequency divisors in the rope_freqs tensor."""
    kind = _field(reader, a + "rope.scaling.type", "linear")
    factor = _field(reader, a + "rope.scaling.factor", 0.0) or _field(reader, a + "rope.scale_linear", 0.0) or 1.0
    if not isinstance(kind, str) or isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise CheckpointError(f"malformed RoPE scaling metadata (type {kind!r}, factor {factor!r})")
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    return rope.gguf_factors(kind, float(factor), None if t is None else _tensor_rows(t, path)[0], head_dim,
                             str(path))


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation on a [out, ...] matrix (rows are heads * head_dim).

    The converter maps HF's half-split rows (x0..x31, y0..y31 per head) to interleaved pairs
    (x0 y0 x1 y1 ...): reshape(n_heads, 2, d/2).swapaxes(1, 2). This is its inverse.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_names(arch: Architecture, gguf_name: str) -> list[str] | None:
    """The internal name(s) a GGUF tensor holds (a fused tensor holds several), None if the architecture has none."""
    if gguf_name in GLOBAL_NAMES:
        return [GLOBAL_NAMES[gguf_name]]
    parts = gguf_name.split(".", 2)
    if parts[0] != "blk" or len(parts) != 3 or parts[2] not in arch.block_names:
        return None
    name = f"model.layers.{parts[1]}.{arch.block_names[parts[2]]}"
    if name.endswith("qkv_proj.weight"):
        return [name.replace("qkv_proj", x) for x in ("q_proj", "k_proj", "v_proj")]
    if name.endswith("gate_up_proj.weight"):
        return [name.replace("gate_up_proj", x) for x in ("gate_proj", "up_proj")]
    return [name]


def _tensor_rows(t, path: Path) -> tuple[np.ndarray, tuple[int, ...]]:
    """The tensor as float32 in [out, in] layout (GGUF lists shapes innermost first)."""
    if t.tensor_type not in SUPPORTED_TYPES:
        raise CheckpointError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name} "
                              f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    shape = tuple(int(s) for s in reversed(t.shape))
    try:
        # a damaged scale makes NaN or inf here: finite() below names the tensor, so numpy need not warn too
        with np.errstate(invalid="ignore", over="ignore"):
            w = dequantize(np.asarray(t.data), t.tensor_type)
    except Exception as e:
        raise CheckpointError(f"{path}: tensor {t.name} could not be read ({e})") from e
    return finite(np.ascontiguousarray(w.reshape(shape), dtype=np.float32), t.name, path), shape


def load(path: Path) -> Checkpoint:
    path = Path(path)
    try:
        return _load(path)
    except CheckpointError as e:
        raise e if str(path) in str(e) else CheckpointError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration, OverflowError,
            ZeroDivisionError, MemoryError) as e:
        # a corrupt file can break any assumption about field types and shapes: one clear error, not a trace
        also = " or not enough memory" if isinstance(e, MemoryError) else ""
        raise CheckpointError(f"{path}: malformed GGUF{also} ({type(e).__name__}: {e})") from e


def _split_rows(names: list[str], w: np.ndarray, g: Geometry) -> list[np.ndarray]:
    """A fused tensor's rows, one part per name: q, k, v by head counts, gate and up in halves."""
    if len(names) == 1:
        return [w]
    sizes = ([g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim, g.num_kv_heads * g.head_dim] if len(names) == 3
             else [g.intermediate_size] * 2)
    if sum(sizes) != w.shape[0]:
        raise CheckpointError(f"fused tensor {names[0]} has {w.shape[0]} rows, expected {sum(sizes)}")
    return np.split(w, np.cumsum(sizes)[:-1], axis=0)


def _load(path: Path) -> Checkpoint:
    reader = open_reader(path)
    arch = architecture_of(reader, path)
    geometry = read_geometry(reader, path)
    weights: dict[str, np.ndarray] = {}
    blocks: dict[str, SourceBlocks] = {}
    for t in reader.tensors:
        if t.name in (ROPE_FREQS, *LONGROPE) or t.name.endswith(IGNORED_SUFFIXES):
            continue
        names = hf_names(arch, t.name)
        if names is None:  # a bias, say: building the model without it would give a wrong model, silently
            raise CheckpointError(f"{path}: tensor {t.name} is not supported for architecture {arch.name!r} "
                                  f"({_why_unsupported(t.name)})")
        w, shape = _tensor_rows(t, path)
        raw = np.asarray(t.data).reshape(shape[0], -1) if t.tensor_type in KEPT_BLOCK_TYPES and len(shape) == 2 else None
        parts = zip(names, _split_rows(names, w, geometry),
                    _split_rows(names, raw, geometry) if raw is not None else [None] * len(names))
        for name, rows, raw_rows in parts:
            n_heads = _permuted_heads(arch, name, geometry)
            weights[name] = unpermute_rows(rows, n_heads) if n_heads else rows
            if raw_rows is not None:
                blocks[name] = SourceBlocks(t.tensor_type.name, (rows.shape[0], shape[1]),
                                            unpermute_rows(raw_rows, n_heads) if n_heads else raw_rows)
    return Checkpoint(
        geometry=geometry,
        weights=weights,
        tokenizer=tokenizer_from_gguf(reader),
        source_sha256=file_sha256(path),
        source_name=path.name,
        source_blocks=blocks,
    )


def _why_unsupported(name: str) -> str:
    if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", name):
        return ("one expert's tensor, as old converters wrote Mixtral; llama.cpp's convert_hf_to_gguf.py now stacks "
                "them as ffn_*_exps: convert the model again")
    return "the graph has no place for it"


def _permuted_heads(arch: Architecture, name: str, g: Geometry) -> int | None:
    """The head count whose rows llama.cpp's converter interleaved in this tensor, None if it did not."""
    if not arch.permuted_qk:
        return None
    return {"self_attn.q_proj.weight": g.num_heads, "self_attn.k_proj.weight": g.num_kv_heads}.get(
        name.split(".", 3)[-1])
