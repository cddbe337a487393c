"""Mixture of Experts in a Hugging Face folder: the config keys and expert tensors, in the internal form.

transformers stores each expert's projections apart (`mlp.experts.{e}.gate_proj.weight`, Mixtral's `w1/w3/w2`)
or stacked (Granite-MoE's `input_linear`, gate and up rows in halves); the internal form is stacked, one
[E, I, H] tensor per projection (quantize.architectures). The routing is read from the config as transformers
computes it, and anything ONNX Runtime's MoE kernel cannot compute (dense layers among the MoE ones, clipped
q/k/v, shared experts) is refused naming the key.
"""
from __future__ import annotations

import re

import numpy as np

from quantize.architectures import Architecture
from quantize.checkpoint import CheckpointError

# config key -> the value under which transformers computes what the graph computes
_SUPPORTED_WHEN = {
    "mlp_only_layers": lambda v: not v,  # Qwen3-MoE: dense MLP layers among the MoE ones
    "decoder_sparse_step": lambda v: v in (None, 1),  # Qwen3-MoE: MoE on every n-th layer only
    "clip_qkv": lambda v: v is None,  # OLMoE: q, k and v clamped
    "shared_intermediate_size": lambda v: not v,  # Granite-MoE-shared: an always-on expert
    "num_shared_experts": lambda v: not v,
}


def hf_fields(config: dict, arch: Architecture, where: str) -> dict:
    """The Geometry fields of a Mixture of Experts from its config.json (none for a dense architecture)."""
    if arch.moe is None:
        return {}
    wrong = [f"{k}={config[k]!r}" for k, ok in _SUPPORTED_WHEN.items() if k in config and not ok(config[k])]
    if wrong:
        raise CheckpointError(f"{where}: unsupported Mixture of Experts variant for {arch.name} ({', '.join(wrong)})")
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    per_token = int(config.get("num_experts_per_tok") or 0)
    if not 0 < per_token <= experts:
        raise CheckpointError(f"{where}: a Mixture of Experts needs 0 < num_experts_per_tok ({per_token}) <= "
                              f"num_experts ({experts})")
    renormalize = arch.moe.renormalize
    if renormalize is None:
        renormalize = bool(config.get("norm_topk_prob", False))
    return {"num_experts": experts, "num_experts_per_tok": per_token, "moe_renormalize": renormalize,
            "intermediate_size": int(config.get("moe_intermediate_size") or config["intermediate_size"])}


def _patterns(arch: Architecture) -> list[tuple[re.Pattern, str]]:
    """(regex over a full HF name, capturing the layer and, for a per-expert tensor, the expert; internal name)."""
    out = []
    for hf, internal in arch.moe.hf_names.items():
        body = re.escape(hf).replace(re.escape("{e}"), r"(?P<e>\d+)")
        out.append((re.compile(rf"model\.layers\.(?P<i>\d+)\.{body}"), internal))
    return out


def stack_hf_experts(tensors: dict[str, np.ndarray], arch: Architecture, num_experts: int,
                     where: str) -> dict[str, np.ndarray]:
    """tensors with the MoE ones in internal form: per-expert tensors stacked [E, ...] in expert order, Granite's
    input_linear split into gate and up; every other tensor as it was."""
    if arch.moe is None:
        return tensors
    patterns = _patterns(arch)
    out: dict[str, np.ndarray] = {}
    parts: dict[str, dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
        match = next(((m, internal) for p, internal in patterns if (m := p.fullmatch(name))), None)
        if match is None:
            out[name] = w
            continue
        m, internal = match
        full = f"model.layers.{m['i']}.{internal}"
        if m.groupdict().get("e") is None:
            out[full] = w
        else:
            parts.setdefault(full, {})[int(m["e"])] = w
    for full, by_expert in parts.items():
        if sorted(by_expert) != list(range(num_experts)):
            raise CheckpointError(f"{where}: {full} needs experts 0..{num_experts - 1}, found "
                                  f"{len(by_expert)} (indices {min(by_expert)}..{max(by_expert)})")
        out[full] = np.stack([by_expert[e] for e in range(num_experts)])
    for full in [n for n in out if n.endswith("experts.gate_up_proj.weight")]:
        gate, up = np.split(out.pop(full), 2, axis=1)
        out[full.replace("gate_up_proj", "gate_proj")] = gate
        out[full.replace("gate_up_proj", "up_proj")] = up
    return out
