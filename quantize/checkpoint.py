"""One internal form for a decoder checkpoint, whatever file it came from.

A `Checkpoint` is the geometry (`agent.wire.Geometry`, the shape a bundle's model_config.json carries),
the weights as named float32 numpy arrays in Hugging Face Llama naming and layout
(`model.layers.{i}.self_attn.q_proj.weight` is [out_features, in_features], Q/K rows in HF's half-split
rotary order), and the tokenizer. The graph builder only ever sees this form, so it never knows whether
weights came from GGUF or safetensors (the onnxruntime-genai builder's split).
"""
from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent.wire import Geometry
from quantize.architectures import by_name


class CheckpointError(ValueError):
    """A checkpoint we cannot read: the message names what is unsupported or broken."""


def finite(w: np.ndarray, name: str, where: Path | str) -> np.ndarray:
    """w, if every value is a number: a NaN or infinity (a damaged scale, a bad conversion) would otherwise be
    built into a model whose every answer is NaN. llama.cpp checks this only with --check-tensors."""
    if not np.isfinite(w).all():
        raise CheckpointError(f"{where}: tensor {name} holds NaN or infinite values (a damaged or badly "
                              "converted file)")
    return w


@dataclass(frozen=True)
class TokenizerInfo:
    tokenizer_json: str  # a `tokenizers` library JSON document
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None

    @property
    def prompt_bos(self) -> int | None:
        """The token the engine puts before every prompt, if any (calibration and evaluation do the same)."""
        return self.bos_token_id if self.add_bos_token else None


@dataclass(frozen=True)
class SourceBlocks:
    """A GGUF tensor's original quantized blocks, kept for --keep-source-quant (raw bytes, not dequantized)."""

    ggml_type: str  # "Q4_0", "Q4_1", "Q8_0"
    shape: tuple[int, int]  # [out_features, in_features], HF layout (rows already un-permuted)
    data: np.ndarray  # uint8 [out_features, n_bytes_per_row]


@dataclass
class Checkpoint:
    geometry: Geometry
    weights: dict[str, np.ndarray]  # float32, HF names and layout
    tokenizer: TokenizerInfo
    source_sha256: str
    source_name: str
    source_blocks: dict[str, SourceBlocks] = field(default_factory=dict)

    def layer(self, i: int, name: str) -> np.ndarray:
        return self.weights[f"model.layers.{i}.{name}"]

    @property
    def lm_head(self) -> np.ndarray:
        if self.geometry.tie_word_embeddings:
            return self.weights["model.embed_tokens.weight"]
        return self.weights["lm_head.weight"]


def expected_weight_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of geometry g must hold, with its HF shape."""
    arch = by_name(g.architecture)
    q_dim, kv_dim = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (g.vocab_size, g.hidden_size),
        "model.norm.weight": (g.hidden_size,),
    }
    if not g.tie_word_embeddings:
        shapes["lm_head.weight"] = (g.vocab_size, g.hidden_size)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if arch.sandwich_norm:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(g.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + n + ".weight": (g.hidden_size,) for n in norms}
        shapes |= {
            p + "self_attn.q_proj.weight": (q_dim, g.hidden_size),
            p + "self_attn.k_proj.weight": (kv_dim, g.hidden_size),
            p + "self_attn.v_proj.weight": (kv_dim, g.hidden_size),
            p + "self_attn.o_proj.weight": (g.hidden_size, q_dim),
        }
        shapes |= {p + n: shape for n, shape in mlp_shapes(g).items()}
        if g.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_dim,),
                p + "self_attn.k_proj.bias": (kv_dim,),
                p + "self_attn.v_proj.bias": (kv_dim,),
            }
        if arch.qk_norm:  # per head, or over all of q's and k's channels (OLMoE)
            q_norm, k_norm = (q_dim, kv_dim) if arch.qk_norm_full_width else (g.head_dim, g.head_dim)
            shapes |= {p + "self_attn.q_norm.weight": (q_norm,), p + "self_attn.k_norm.weight": (k_norm,)}
    return shapes


def mlp_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors (after "model.layers.{i}."): the dense gated MLP, or the router and stacked experts."""
    h, i, e = g.hidden_size, g.intermediate_size, g.num_experts
    if not e:
        return {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    return {"mlp.gate.weight": (e, h), "mlp.experts.gate_proj.weight": (e, i, h),
            "mlp.experts.up_proj.weight": (e, i, h), "mlp.experts.down_proj.weight": (e, h, i)}


def parameter_counts(g: Geometry) -> tuple[int, int]:
    """(total, active): every weight of a model of geometry g, and those one token reads (the experts it is not
    routed to left out; the embedding counted once even when the lm_head is the same table)."""
    total = sum(int(np.prod(s)) for s in expected_weight_shapes(g).values())
    idle_experts = g.num_experts - g.num_experts_per_tok if g.num_experts else 0
    return total, total - g.num_layers * idle_experts * 3 * g.hidden_size * g.intermediate_size


def validate(ckpt: Checkpoint) -> None:
    """Raise CheckpointError unless every expected tensor is present with the right shape and ONNX Runtime's
    GroupQueryAttention can run the heads (with its rotary embedding it needs a head size that is a multiple
    of 16; head_dim 8 fails inside ONNX Runtime, not here)."""
    if ckpt.geometry.head_dim % 16:
        raise CheckpointError(f"{ckpt.source_name}: head_dim {ckpt.geometry.head_dim} is not supported (ONNX "
                              "Runtime's GroupQueryAttention needs a multiple of 16)")
    rotary = ckpt.geometry.rotary_dim
    if rotary is not None and (rotary % 16 or rotary > ckpt.geometry.head_dim):
        raise CheckpointError(f"{ckpt.source_name}: a rotary width of {rotary} channels is not supported (ONNX "
                              "Runtime's rotary needs a multiple of 16, at most head_dim)")
    for name, shape in expected_weight_shapes(ckpt.geometry).items():
        w = ckpt.weights.get(name)
        if w is None:
            raise CheckpointError(f"{ckpt.source_name}: missing tensor {name}")
        if tuple(w.shape) != shape:
            raise CheckpointError(f"{ckpt.source_name}: tensor {name} has shape {tuple(w.shape)}, expected {shape}")


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"))


def file_kind(path: Path) -> str | None:
    """What is at path ("a character device", "a directory", ...), following links; None if nothing is."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: a parent is a file
        return None
    return next((name for test, name in _KINDS if test(mode)), "an unknown kind of file")


def load_checkpoint(source: Path) -> Checkpoint:
    """Read a GGUF file or a Hugging Face folder (config.json + *.safetensors) into a Checkpoint."""
    source = Path(source)
    kind = file_kind(source)
    if kind == "a directory":
        from quantize import hf

        ckpt = hf.load(source)
    elif kind == "a regular file":
        from quantize import gguf_reader

        ckpt = gguf_reader.load(source)
    elif kind is None:
        raise CheckpointError(f"{source}: no such file or directory")
    else:  # /dev/zero, a FIFO: reading one would never end, or never begin
        raise CheckpointError(f"{source}: not a regular file ({kind}): give a GGUF file or a Hugging Face folder")
    validate(ckpt)
    return ckpt
