"""Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) into per-projection low-rank pairs.

PEFT stores, for each adapted nn.Linear W [out, in] of the base model, lora_A.weight [r, in] and lora_B.weight
[out, r] under `base_model.model.<module>.lora_A.weight`; the layer computes x W^T + scale * x A^T B^T with
scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), r and alpha overridable per module by
rank_pattern / alpha_pattern. Module names are transformers', which are the checkpoint's internal names
(quantize.architectures) for every architecture whose projections are not fused.

Only plain LoRA on the seven decoder projections is read: DoRA, trained biases, modules_to_save (full
weights), embedding or lm_head LoRA are refused by name, never dropped.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent import wire
from agent.engine.bundle import file_sha256
from agent.wire import LoraTarget
from quantize.checkpoint import CheckpointError
from quantize.hf import read_tensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# transformers' module name (after model.layers.{i}.) -> our LoRA target
MODULE_TARGETS: dict[str, LoraTarget] = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
}
TARGET_MODULES = {t: m for m, t in MODULE_TARGETS.items()}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name after lora_A in some saves)
KEY = re.compile(r"base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.(?P<short>[\w.]+?))"
                 r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight")


class AdapterError(ValueError):
    """An adapter we cannot read or that does not fit its base: the message names what differs."""


@dataclass(frozen=True)
class LoraPair:
    """One adapted projection: its delta is scale * b @ a, [out, in] like the weight it adds to."""

    layer: int
    target: LoraTarget
    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> np.ndarray:
        return (self.scale * (self.b.astype(np.float64) @ self.a.astype(np.float64))).astype(np.float32)


@dataclass(frozen=True)
class PeftAdapter:
    pairs: list[LoraPair]  # sorted by (layer, target order)
    source_sha256: str  # of the weights file
    source_name: str  # the folder's name

    @property
    def ranks(self) -> dict[LoraTarget, int]:
        ranks: dict[LoraTarget, int] = {}
        for p in self.pairs:
            ranks[p.target] = max(ranks.get(p.target, 0), p.rank)
        return {t: ranks[t] for t in wire.LORA_TARGETS if t in ranks}


def read_peft(folder: Path) -> PeftAdapter:
    """The folder's LoRA pairs, checked against its config; AdapterError naming what cannot be read."""
    folder = Path(folder)
    config = _read_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE} (a PEFT LoRA folder holds it beside {CONFIG_FILE})")
    try:
        tensors = read_tensors(weights)
    except CheckpointError as e:
        raise AdapterError(str(e)) from None
    pairs = [_pair(module, layer, a, b, config, weights) for (module, layer), (a, b) in _group(tensors, weights).items()]
    if not pairs:
        raise AdapterError(f"{weights}: no LoRA tensors")
    pairs.sort(key=lambda p: (p.layer, wire.LORA_TARGETS.index(p.target)))
    return PeftAdapter(pairs, file_sha256(weights), folder.resolve().name)


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    _check_config(config, path)
    return config


def _check_config(config: dict, path: Path) -> None:
    """Refuse what PEFT would compute differently from y += scale * x A^T B^T on the seven projections.
    fan_in_fan_out is accepted: it says how the base stores W (GPT-2's Conv1D), not how A and B are stored."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config['peft_type']!r} is not supported (only LORA)")
    for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)), ("modules_to_save", (None, []))):
        if config.get(key) not in allowed:
            raise AdapterError(f"{path}: {key} = {config[key]!r} is not supported (only plain LoRA on the "
                               f"projections: {', '.join(MODULE_TARGETS)})")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: r must be a positive integer and lora_alpha a number (r={r!r}, "
                           f"lora_alpha={alpha!r})")
    modules = config.get("target_modules")
    if isinstance(modules, list):
        known = {m.rsplit(".", 1)[-1] for m in MODULE_TARGETS}
        if unknown := [m for m in modules if str(m).rsplit(".", 1)[-1] not in known]:
            raise AdapterError(f"{path}: target_modules {', '.join(map(str, unknown))} are not projections an "
                               f"adapter can change here ({', '.join(sorted(known))})")


def _group(tensors: dict[str, np.ndarray], where: Path) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """(module, layer) -> (lora_A [r, in], lora_B [out, r]), every tensor accounted for."""
    halves: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for key, w in tensors.items():
        m = KEY.fullmatch(key)
        if m is None or m["short"] not in MODULE_TARGETS:
            raise AdapterError(f"{where}: tensor {key} is not a LoRA A or B of a decoder projection "
                               f"({', '.join(MODULE_TARGETS)})")
        halves.setdefault((m["module"], int(m["layer"])), {})[m["ab"]] = w
    for (module, _), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: {module} has lora_{''.join(ab)} but no lora_{'B' if 'A' in ab else 'A'}")
        if ab["A"].ndim != 2 or ab["B"].ndim != 2 or ab["A"].shape[0] != ab["B"].shape[1]:
            raise AdapterError(f"{where}: {module}: lora_A {list(ab['A'].shape)} and lora_B {list(ab['B'].shape)} "
                               "are not [r, in] and [out, r]")
    return {k: (ab["A"], ab["B"]) for k, ab in halves.items()}


def pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module's name as a regex of its
    trailing dotted components (so "q_proj" and "layers.3.self_attn.q_proj" both name layer 3's q)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _pair(module: str, layer: int, a: np.ndarray, b: np.ndarray, config: dict, where: Path) -> LoraPair:
    short = module.split(".", 3)[3]
    rank = pattern_value(config.get("rank_pattern"), module, config["r"])
    if a.shape[0] != rank:
        raise AdapterError(f"{where}: {module} has rank {a.shape[0]} but {CONFIG_FILE} gives it r={rank}")
    alpha = pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraPair(layer, MODULE_TARGETS[short], a, b, float(scale))
