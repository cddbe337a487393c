"""RoPE's inverse frequencies and the scalings that divide them, read the same way from GGUF and from Hugging Face.

llama.cpp and transformers both express a supported scaling as one divisor per frequency of the plain
frequencies theta^(-2i/d): linear scaling divides every frequency by `factor` (positions over factor);
Llama 3's keeps the high frequencies, divides the low ones by `factor` and blends in between; Phi-3's
LongRoPE gives the divisors outright and scales cos and sin. llama.cpp's converter stores divisors as
tensors of a GGUF; a Hugging Face config gives them or the parameters they are computed from. Any other
scaling (YaRN, dynamic NTK) changes more than the frequencies and is refused: a model built without it would
run, and be wrong past a few hundred tokens.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from quantize.checkpoint import CheckpointError

Factors = tuple[float, ...] | None  # one divisor per frequency (head_dim / 2), None: plain RoPE


def inv_freq(theta: float, head_dim: int, factors: Factors = None) -> np.ndarray:
    """[head_dim / 2] float64 inverse frequencies, divided by the scaling's factors."""
    freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return freq if factors is None else freq / np.asarray(factors, np.float64)


def llama3_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_context: float) -> tuple[float, ...]:
    """Llama 3.1's divisors (transformers' `_compute_llama3_parameters`, llama.cpp's `rope_freqs`)."""
    wavelen = 2 * math.pi / inv_freq(theta, head_dim)
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisors = np.where(wavelen > low_wavelen, factor, np.where(wavelen < high_wavelen, 1.0,
                                                                1 / ((1 - smooth) / factor + smooth)))
    return tuple(float(d) for d in divisors)


def longrope(short: Sequence[float], long: Sequence[float], original_context: int, context: int,
             attention_factor: float | None, half: int, where: str) -> tuple[Factors, float]:
    """Phi-3's LongRoPE as llama.cpp applies it: one set of divisors for the whole graph, the long ones when its
    context exceeds the original (transformers switches per sequence length, which a KV cache cannot), and
    cos/sin scaled by the attention factor (by default sqrt(1 + ln(scale) / ln(original)))."""
    factors = long if context > original_context else short
    if len(factors) != half or not all(isinstance(f, (int, float)) and f > 0 for f in factors):
        raise CheckpointError(f"{where}: LongRoPE needs {half} positive factors per set")
    if attention_factor is None:
        scale = context / original_context
        attention_factor = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original_context))
    return tuple(float(f) for f in factors), float(attention_factor)


def hf_rope(config: dict, head_dim: int, where: str,
            layer_type: str | None = None) -> tuple[float, Factors, float]:
    """(rope_theta, factors) of a transformers config.json: v4 writes `rope_theta` and `rope_scaling`, v5 one
    `rope_parameters` object holding both, or one per layer_type for models with two (Gemma 3). head_dim is
    the width RoPE turns. The third value scales cos and sin (LongRoPE's attention factor, else 1)."""
    params = config.get("rope_parameters")
    if layer_type is not None and isinstance(params, dict):
        params = params.get(layer_type)
    if params is None:
        params = config.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{where}: unsupported rope parameters {params!r} (one set for every layer is "
                              "supported)")
    try:
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            return theta, None, 1.0
        if kind == "linear":
            return theta, (float(params["factor"]),) * (head_dim // 2), 1.0
        if kind == "llama3":
            return theta, llama3_factors(theta, head_dim, float(params["factor"]), float(params["low_freq_factor"]),
                                         float(params["high_freq_factor"]),
                                         float(params["original_max_position_embeddings"])), 1.0
        if kind == "longrope":
            original = int(params.get("original_max_position_embeddings")
                           or config["original_max_position_embeddings"])
            return theta, *longrope(params["short_factor"], params["long_factor"], original,
                                    int(config["max_position_embeddings"]), params.get("attention_factor"),
                                    head_dim // 2, where)
    except KeyError as e:
        raise CheckpointError(f"{where}: rope_type {kind!r} without {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: rope parameters are not usable numbers ({e})") from e
    raise CheckpointError(f"{where}: unsupported rope_type {kind!r} (supported: default, linear, llama3, longrope)")


def gguf_factors(scaling_type: str, scaling_factor: float, rope_freqs: np.ndarray | None, head_dim: int,
                 where: str) -> Factors:
    """Divisors from a GGUF's `rope.scaling.type` / `.factor` and its `rope_freqs` tensor (both may apply)."""
    divisors = np.ones(head_dim // 2)
    if rope_freqs is not None:
        if rope_freqs.size != head_dim // 2 or not np.all(np.isfinite(rope_freqs)) or np.any(rope_freqs <= 0):
            raise CheckpointError(f"{where}: rope_freqs must hold {head_dim // 2} positive factors")
        divisors = divisors * rope_freqs.reshape(-1)
    if scaling_type == "linear":
        if not scaling_factor > 0:
            raise CheckpointError(f"{where}: rope.scaling.factor {scaling_factor!r} is not a positive number")
        divisors = divisors * scaling_factor
    elif scaling_type != "none":
        raise CheckpointError(f"{where}: unsupported rope.scaling.type {scaling_type!r} (supported: none, linear, "
                              "and Llama 3's rope_freqs)")
    return None if np.all(divisors == 1) else tuple(float(d) for d in divisors)
