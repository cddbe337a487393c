"""Read and write Hugging Face checkpoint folders (config.json + *.safetensors + tokenizer files).

`load(folder)` turns a folder of any architecture in quantize.architectures into the internal Checkpoint form
(HF naming and [out, in] layout are already ours, so tensors are converted to float32 — F16 by numpy, BF16 by
bit shifts because safetensors' numpy backend has no bfloat16 — fused ones split and experts stacked).
`save_hf(ckpt, folder)` writes a Checkpoint back out as such a folder, so a GGUF model can be fed to tools that
only read HF folders (the benchmarks give it to onnxruntime-genai's model builder).

Run: python -m quantize.hf MODEL_DIR_OR_GGUF OUT_DIR   # re-save any checkpoint as an fp32 HF folder
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from agent import durable
from agent.wire import Geometry
from quantize import experts, rope
from quantize.architectures import BY_HF_CLASS, Architecture, by_name, supported
from quantize.checkpoint import Checkpoint, CheckpointError, expected_weight_shapes, finite
from quantize.tokenizer import tokenizer_from_hf_folder

SAVE_DTYPES = {"float32": np.float32, "float16": np.float16}
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors refuses larger headers too; a corrupt length must not read the file
# Tensors some exporters include that carry nothing we need (recomputed from rope_theta).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# transformers' defaults for keys a config may leave out (MistralConfig, Qwen2Config)
MISTRAL_DEFAULT_WINDOW = 4096
QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28


# ---- config.json -> Geometry ------------------------------------------------------------------------

def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


def _architecture(config: dict, folder: Path) -> Architecture:
    names = config.get("architectures") or [None]
    if names[0] not in BY_HF_CLASS:
        raise CheckpointError(f"{folder}: unsupported architecture {names[0]!r} (supported: {supported('hf')})")
    return BY_HF_CLASS[names[0]]


def _check_supported_options(config: dict, arch: Architecture, folder: Path) -> None:
    """Reject config options that change the maths the graph builder implements (RoPE's: quantize.rope)."""
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    expected = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}[arch.activation]
    if act not in expected:
        raise CheckpointError(f"{folder}: unsupported hidden_act {act!r} (supported for {arch.name}: "
                              f"{', '.join(map(repr, expected))})")
    # Llama's attention_bias also puts a bias on o_proj, and mlp_bias on every MLP projection; the
    # graph only has Qwen2's q/k/v biases.
    for key in ("attention_bias", "mlp_bias"):
        if not arch.qkv_bias and config.get(key):
            raise CheckpointError(f"{folder}: unsupported {key}=true for {arch.name} "
                                  "(only Qwen2's q/k/v biases are supported)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise CheckpointError(f"{folder}: unsupported {key}={config[key]!r} (no soft-capping is supported)")


def _layer_kinds(config: dict, num_layers: int, default_windowed) -> list[bool]:
    """Per layer, whether it is windowed: transformers' `layer_types` when given, else default_windowed(i)."""
    kinds = config.get("layer_types")
    if kinds:
        return [kind == "sliding_attention" for kind in kinds]
    return [bool(default_windowed(i)) for i in range(num_layers)]


def _sliding_window(config: dict, arch: Architecture, num_layers: int, folder: Path) -> dict:
    """sliding_window and window_layers, as transformers reads them (none when every layer sees everything).

    Mistral applies `sliding_window` to every layer (transformers' default when the key is missing: 4096).
    Qwen2 and Qwen3 apply it only when `use_sliding_window` is true, and then to the layers `layer_types` marks
    "sliding_attention" or, without that list, to layers >= `max_window_layers` (default 28); a window on
    some of their layers only is refused. Gemma 3 windows the layers `layer_types` marks, or all but every
    `sliding_window_pattern`-th.
    """
    window = config.get("sliding_window", MISTRAL_DEFAULT_WINDOW if arch.name == "mistral" else None)
    if arch.name in ("llama", "granite", "smollm3", "phi3", "olmoe", "granitemoe") or window is None:
        return {}
    windowed = [True] * num_layers
    if arch.swa_period:
        period = int(config.get("sliding_window_pattern") or arch.swa_period)
        windowed = _layer_kinds(config, num_layers, lambda i: (i + 1) % period)
    elif arch.name in ("qwen2", "qwen3", "qwen3moe"):
        if not config.get("use_sliding_window", False):
            return {}
        first = int(config.get("max_window_layers", QWEN2_DEFAULT_MAX_WINDOW_LAYERS))
        windowed = _layer_kinds(config, num_layers, lambda i: i >= first)
        layers = [i for i, w in enumerate(windowed) if w]
        if layers and len(layers) < num_layers:
            raise CheckpointError(f"{folder}: unsupported {arch.name} sliding window on layers {layers[0]}..{layers[-1]} "
                                  f"only ({len(layers)} of {num_layers}); a window must cover all layers or none")
    layers = tuple(i for i, w in enumerate(windowed) if w)
    if not layers or int(window) >= int(config["max_position_embeddings"]):
        return {}
    return {"sliding_window": int(window), "window_layers": None if len(layers) == num_layers else layers}


def _rotary_dim(config: dict, head_dim: int, where: str) -> int | None:
    """The leading channels of each head RoPE turns (transformers' partial_rotary_factor), None for all of them.
    GroupQueryAttention needs its cos/sin tables a multiple of 8 wide."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial is None or partial == 1:
        return None
    dim = int(head_dim * partial) if isinstance(partial, (int, float)) and 0 < partial < 1 else 0
    if dim == 0 or dim % 16:
        raise CheckpointError(f"{where}: unsupported partial_rotary_factor {partial!r} with head_dim {head_dim} "
                              "(ONNX Runtime's rotary needs the turned part a multiple of 16 wide)")
    return dim


def _variant(config: dict, arch: Architecture, hidden: int, layers: int, head_dim: int, where: str) -> dict:
    """The Geometry fields of arch's block variant, from transformers' config keys."""
    numbers: dict = {
        "embedding_multiplier": hidden ** 0.5 if arch.embedding_scale_sqrt_hidden
        else float(config.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
        "logit_multiplier": 1 / float(config.get("logits_scaling", 1.0) or 1.0),
    }
    if "attention_multiplier" in config:  # Granite
        numbers["attention_scale"] = float(config["attention_multiplier"])
    scalar = config.get("query_pre_attn_scalar")  # Gemma: the scale is this to the -1/2, not head_dim's
    if scalar is not None and float(scalar) != head_dim:
        numbers["attention_scale"] = float(scalar) ** -0.5
    if arch.nope_period:
        flags = config.get("no_rope_layers")  # SmolLM3: 1 where the layer uses RoPE
        interval = int(config.get("no_rope_layer_interval") or arch.nope_period)
        numbers["nope_layers"] = (tuple(i for i, f in enumerate(flags) if not f) if flags
                                  else tuple(i for i in range(layers) if (i + 1) % interval == 0))
    if arch.swa_period:
        local = rope.hf_rope(config, head_dim, where, "sliding_attention")[0] if _per_layer_rope(config) \
            else config.get("rope_local_base_freq", arch.default_rope_local_theta)
        numbers["rope_local_theta"] = float(local)
    return numbers


def _per_layer_rope(config: dict) -> bool:
    """transformers 5 writes one rope_parameters set per layer type for models that have two (Gemma 3)."""
    params = config.get("rope_parameters")
    return isinstance(params, dict) and isinstance(params.get("full_attention"), dict)


def geometry_from_config(config: dict, folder: Path, has_lm_head: bool) -> Geometry:
    """Geometry from a transformers config dict; has_lm_head: whether lm_head.weight is stored."""
    arch = _architecture(config, folder)
    _check_supported_options(config, arch, folder)
    where = f"{folder}/config.json"
    try:
        hidden, heads, layers = (int(config[k]) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers"))
        head_dim = int(config.get("head_dim") or hidden // heads)  # Mistral configs may write head_dim: null
        rotary_dim = _rotary_dim(config, head_dim, where)
        layer_type = "full_attention" if arch.swa_period and _per_layer_rope(config) else None
        rope_theta, rope_factors, attention = rope.hf_rope(config, rotary_dim or head_dim, where, layer_type)
        geometry = Geometry(
            architecture=arch.name,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            context_length=int(config["max_position_embeddings"]),
            rope_theta=rope_theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            # A folder without lm_head.weight can only mean the embedding is reused, whatever the config says.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) or not has_lm_head,
            attention_bias=arch.qkv_bias,
            rope_freq_factors=rope_factors,
            rope_attention_factor=attention,
            rotary_dim=rotary_dim,
            **_sliding_window(config, arch, layers, folder),
            **_variant(config, arch, hidden, layers, head_dim, where),
        )
        if arch.moe is not None:  # a Mixture of Experts' intermediate_size is its experts'
            geometry = Geometry(**(geometry.model_dump() | experts.hf_fields(config, arch, where)))
    except KeyError as e:
        raise CheckpointError(f"{where}: missing required key {e.args[0]!r}") from e
    except CheckpointError:  # a refusal that already says what is wrong (a RoPE type, a split window)
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:  # "hidden_size": null, "32", 0 heads
        raise CheckpointError(f"{where}: a size is not a usable number ({e})") from e
    return geometry


# ---- safetensors -> float32 arrays ------------------------------------------------------------------

def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json when present, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names missing shard(s) {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return files


def source_sha256(files: list[Path], config: dict) -> str:
    """sha256 over config.json's content (canonical JSON) and the weight files', in sorted file-name order.

    The config is part of the model as a GGUF's metadata is of its file (two folders with the same weights
    and another rope_theta are two models, and `eval --reference` must not take one for the other); the
    tokenizer files are not. Shard boundaries are not hashed; shard names are fixed by the index.
    """
    h = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for path in sorted(files, key=lambda p: p.name):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors JSON header and the file offset where tensor data starts.

    The format is an 8-byte little-endian header length, that many bytes of JSON, then the data;
    each tensor's `data_offsets` are relative to the start of the data.
    """
    with open(path, "rb") as f:
        try:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, MAX_HEADER_BYTES)))
        except (struct.error, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    return header, 8 + n


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: shift the 16 stored bits up and reinterpret."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _read_bf16(path: Path, entry: dict, data_start: int) -> np.ndarray:
    """One BF16 tensor from its raw bytes (safetensors' numpy backend cannot make a bfloat16 array)."""
    begin, end = entry["data_offsets"]
    bits = np.fromfile(path, dtype="<u2", count=(end - begin) // 2, offset=data_start + begin)
    return bf16_to_f32(bits).reshape(entry["shape"])


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as float32 (F32, F16 and BF16 are accepted)."""
    header, data_start = read_header(path)
    try:
        return _tensors(path, header, data_start)
    except (SafetensorError, KeyError, TypeError, ValueError) as e:  # truncated data, a header that lies
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _tensors(path: Path, header: dict, data_start: int) -> dict[str, np.ndarray]:
    tensors = {}
    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            dtype = header[name]["dtype"]
            if dtype == "BF16":
                tensors[name] = _read_bf16(path, header[name], data_start)
            elif dtype in ("F32", "F16"):
                tensors[name] = f.get_tensor(name).astype(np.float32)
            else:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype} "
                                      "(supported: F32, F16, BF16)")
    return {name: finite(w, name, path) for name, w in tensors.items()}


def _internal_form(tensors: dict[str, np.ndarray], g: Geometry, folder: Path) -> dict[str, np.ndarray]:
    """transformers' tensors in the internal form (quantize.architectures): fused tensors split, experts stacked,
    and norm weights holding the factor the model multiplies by."""
    arch = by_name(g.architecture)
    out = {}
    for name, w in experts.stack_hf_experts(tensors, arch, g.num_experts, str(folder)).items():
        if name.endswith("qkv_proj.weight"):
            q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
            parts = np.split(w, [q, q + kv], axis=0)
            out |= {name.replace("qkv_proj", x): p for x, p in zip(("q_proj", "k_proj", "v_proj"), parts)}
        elif name.endswith("gate_up_proj.weight"):
            gate, up = np.split(w, 2, axis=0)
            out |= {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}
        elif arch.hf_norm_offset and name.endswith("norm.weight"):
            out[name] = w + np.float32(arch.hf_norm_offset)
        else:
            out[name] = w
    return out


def _select_weights(tensors: dict[str, np.ndarray], geometry: Geometry, folder: Path) -> dict[str, np.ndarray]:
    """Keep the tensors the geometry expects; any other tensor is a model we would run wrongly."""
    expected = expected_weight_shapes(geometry)
    unexpected = [n for n in tensors if n not in expected and not n.endswith(IGNORED_SUFFIXES)
                  and not (n == "lm_head.weight" and geometry.tie_word_embeddings)]
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5])
        raise CheckpointError(f"{folder}: unexpected tensors for {geometry.architecture}: {shown}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    head, embedding = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if (geometry.tie_word_embeddings and head is not None and embedding is not None
            and not np.array_equal(head, embedding)):
        # transformers 4 used the embedding, 5 the stored head: a model that runs differently in each
        raise CheckpointError(f"{folder}: config.json ties the embeddings but lm_head.weight differs from "
                              "model.embed_tokens.weight; set tie_word_embeddings to match the weights")
    return {n: np.ascontiguousarray(w) for n, w in tensors.items() if n in expected}


def load(folder: Path) -> Checkpoint:
    """A Hugging Face folder as a Checkpoint; CheckpointError naming anything unsupported or missing."""
    folder = Path(folder)
    config = read_config(folder)
    files = safetensors_files(folder)
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors |= read_tensors(path)
    geometry = geometry_from_config(config, folder, has_lm_head="lm_head.weight" in tensors)
    return Checkpoint(
        geometry=geometry,
        weights=_select_weights(_internal_form(tensors, geometry, folder), geometry, folder),
        tokenizer=tokenizer_from_hf_folder(folder),
        source_sha256=source_sha256(files, config),
        source_name=folder.name,
    )


# ---- Checkpoint -> folder ---------------------------------------------------------------------------

WRITTEN = ("llama", "mistral", "qwen2", "gemma3")  # the architectures save_hf can write


def _hf_architecture(g: Geometry) -> str:
    """The transformers class that computes what g describes (biases need Qwen2, a window Mistral)."""
    if g.architecture not in WRITTEN:
        raise CheckpointError(f"a {g.architecture} checkpoint cannot be written as a Hugging Face folder "
                              f"(save_hf writes {', '.join(WRITTEN)})")
    _check_writable(g)
    if g.architecture == "gemma3":
        return "Gemma3ForCausalLM"
    if g.architecture == "qwen2" or g.attention_bias:
        return "Qwen2ForCausalLM"
    if g.architecture == "mistral" or g.sliding_window is not None:
        return "MistralForCausalLM"
    return "LlamaForCausalLM"


def _check_writable(g: Geometry) -> None:
    """Refuse a geometry whose numbers the written config.json could not carry: transformers' class for the
    architecture would compute another model."""
    gemma = g.architecture == "gemma3"
    fixed = {
        "nope_layers": (g.nope_layers, ()),
        "rotary_dim": (g.rotary_dim, None),
        "rope_attention_factor": (g.rope_attention_factor, 1.0),
        "residual_multiplier": (g.residual_multiplier, 1.0),
        "logit_multiplier": (g.logit_multiplier, 1.0),
        # Gemma multiplies the embedding by sqrt(hidden_size), the others by nothing
        "embedding_multiplier": (g.embedding_multiplier, g.hidden_size ** 0.5 if gemma else 1.0),
    }
    if not gemma:  # Gemma's query_pre_attn_scalar carries the scale; the others use 1/sqrt(head_dim)
        fixed |= {"attention_scale": (g.attention_scale, None), "rope_local_theta": (g.rope_local_theta, None)}
        if g.window_layers is not None:
            fixed["window_layers"] = (g.window_layers, None)
    wrong = [f"{k}={v!r}" for k, (v, want) in fixed.items()
             if not (v == want or (isinstance(v, float) and isinstance(want, float) and np.isclose(v, want)))]
    if wrong:
        raise CheckpointError(f"a {g.architecture} checkpoint with {', '.join(wrong)} cannot be written as a "
                              "Hugging Face folder (its transformers class has no such setting)")


def _rope_scaling(g: Geometry) -> dict | None:
    """RoPE scaling in transformers' terms. Divisors read from a GGUF's rope_freqs do not say which parameters
    made them (unless they are all one factor: linear scaling), so such a model cannot be written out."""
    factors = g.rope_freq_factors
    if factors is None:
        return None
    if len(set(factors)) == 1:
        return {"rope_type": "linear", "factor": factors[0]}
    raise CheckpointError("RoPE frequency factors (a Llama 3 rope_freqs) cannot be written as a config.json")


def _gemma3_keys(g: Geometry) -> dict:
    """Gemma3TextConfig's keys: which layers are windowed (layer_types), the windowed layers' RoPE base, the
    attention scale as query_pre_attn_scalar (scale = scalar ** -0.5), GELU-tanh, no soft-capping."""
    from quantize.blocks import windowed

    scale = g.attention_scale
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": g.sliding_window,
        "layer_types": ["sliding_attention" if windowed(g, i) else "full_attention" for i in range(g.num_layers)],
        "rope_local_base_freq": g.rope_local_theta if g.rope_local_theta is not None else g.rope_theta,
        "query_pre_attn_scalar": g.head_dim if scale is None else 1 / scale ** 2,
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def config_for(ckpt: Checkpoint, dtype: str) -> dict:
    """config.json for ckpt, in the keys transformers (and onnxruntime-genai's builder) read."""
    g, tok = ckpt.geometry, ckpt.tokenizer
    arch = _hf_architecture(g)
    config = {
        "architectures": [arch],
        "model_type": {"Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                       "Gemma3ForCausalLM": "gemma3_text"}.get(arch, "llama"),
        "vocab_size": g.vocab_size,
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "max_position_embeddings": g.context_length,
        "rope_theta": g.rope_theta,
        "rope_scaling": _rope_scaling(g),
        "rms_norm_eps": g.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": g.tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_ids[0] if tok.eos_token_ids else None,
    }
    if arch == "Gemma3ForCausalLM":
        del config["hidden_act"]  # Gemma's is hidden_activation
        config |= _gemma3_keys(g)
    elif arch == "LlamaForCausalLM":
        config |= {"attention_bias": False, "mlp_bias": False}
    elif arch == "MistralForCausalLM":
        config["sliding_window"] = g.sliding_window
    else:  # Qwen2: a window, when there is one, covers every layer (max_window_layers=0)
        config |= {"use_sliding_window": g.sliding_window is not None, "sliding_window": g.sliding_window,
                   "max_window_layers": 0 if g.sliding_window is not None else g.num_layers}
    return config


def hf_form(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as transformers stores them: the inverse of _internal_form (norm weights minus
    the architecture's hf_norm_offset: Gemma computes x * (1 + w))."""
    offset = np.float32(by_name(ckpt.geometry.architecture).hf_norm_offset)
    names = expected_weight_shapes(ckpt.geometry)
    return {n: ckpt.weights[n] - offset if offset and n.endswith("norm.weight") else ckpt.weights[n] for n in names}


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.id_to_token(token_id)


def tokenizer_files(ckpt: Checkpoint) -> dict[str, dict]:
    """tokenizer_config.json and generation_config.json contents for ckpt's tokenizer."""
    tok = ckpt.tokenizer
    tokenizer = Tokenizer.from_str(tok.tokenizer_json)
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    # add_bos_token is recorded for our own loader (tokenizer_from_hf_folder); the tokenizer.json is written
    # unchanged, so a generic PreTrainedTokenizerFast that ignores the flag adds no BOS by itself.
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token_text(tokenizer, tok.bos_token_id),
        "eos_token": _token_text(tokenizer, eos),
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": False,
        "model_max_length": ckpt.geometry.context_length,
        "chat_template": tok.chat_template,
    }
    generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids)}
    return {"tokenizer_config.json": tokenizer_config, "generation_config.json": generation}


def _write_folder(ckpt: Checkpoint, folder: Path, dtype: str) -> None:
    np_dtype = SAVE_DTYPES[dtype]
    config = config_for(ckpt, dtype)  # first: an architecture we cannot write is refused before any file
    save_file({n: np.ascontiguousarray(w, dtype=np_dtype) for n, w in hf_form(ckpt).items()},
              folder / "model.safetensors", metadata={"format": "pt"})  # transformers refuses safetensors files without format=pt
    (folder / "tokenizer.json").write_text(ckpt.tokenizer.tokenizer_json, encoding="utf-8")
    files = {"config.json": config, **tokenizer_files(ckpt)}
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_hf(ckpt: Checkpoint, folder: Path, dtype: str = "float32") -> Path:
    """Write ckpt as a Hugging Face folder, replacing any folder already there; returns folder.

    Everything is written to a temporary sibling directory first and renamed into place, so a crash
    never leaves a half-written folder under the final name.
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: {', '.join(SAVE_DTYPES)})")
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _write_folder(ckpt, tmp, dtype)
        durable.replace_tree(tmp, folder, folder.with_name(f".{folder.name}.old-{os.getpid()}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


if __name__ == "__main__":
    from quantize.checkpoint import load_checkpoint

    print(save_hf(load_checkpoint(Path(sys.argv[1])), Path(sys.argv[2])))
