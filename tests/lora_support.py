"""Random PEFT LoRA adapters as peft's save_pretrained writes them, and adapter-ready tiny bundles with converted
adapters: what tests/quantize/test_lora.py and tests/agent/test_adapters.py build their cases from."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from agent import wire
from agent.engine.bundle import Bundle

ALL = ("q", "k", "v", "o", "gate", "up", "down")
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def shapes(g: wire.Geometry) -> dict[str, tuple[int, int]]:
    q, kv, h, i = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim, g.hidden_size, g.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (i, h), "up": (i, h), "down": (h, i)}


def write_peft(folder: Path, g: wire.Geometry, targets=("q", "v"), r: int = 4, alpha: float = 8, seed: int = 0,
               layers=None, **config) -> Path:
    """A random PEFT LoRA folder as peft's save_pretrained writes one (B non-zero: a trained adapter)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    tensors = {}
    for layer in range(g.num_layers) if layers is None else layers:
        for t in targets:
            module = f"model.layers.{layer}.{MODULES[t]}"
            rank = next((v for k, v in config.get("rank_pattern", {}).items() if module.endswith(k)), r)
            out, inp = shapes(g)[t]
            tensors[f"base_model.model.{module}.lora_A.weight"] = (rng.standard_normal((rank, inp)) / inp ** .5).astype(np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = (0.5 * rng.standard_normal((out, rank))).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": [MODULES[t].split(".")[1] for t in targets],
           "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}} | config
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def bundle_with_adapters(ckpt, root: Path) -> tuple[Bundle, dict[str, Path]]:
    """ckpt's fp32 bundle adapter-ready on every projection at rank 8, and two adapters converted for it: a1 (all
    seven targets) and a2 (q, v, down), both rank 4."""
    from quantize.adapter import convert
    from quantize.lora import LoraSpec
    from quantize.package import build_bundle
    from quantize.peft import read_peft
    from quantize.precision import QuantSpec

    bundle = build_bundle(ckpt, QuantSpec(), root / "fp32-lora", name="tiny", lora=LoraSpec(targets=ALL, max_rank=8),
                          progress=lambda s: None)
    folders = {}
    for name, seed, targets in (("a1", 1, ALL), ("a2", 2, ("q", "v", "down"))):
        peft = read_peft(write_peft(root / f"peft-{name}", ckpt.geometry, targets=targets, r=4, alpha=16, seed=seed))
        convert(peft, bundle, root / name, name=name, progress=lambda s: None)
        folders[name] = root / name
    return bundle, folders


def base_and_other_build(ckpt, root: Path, adapters: dict[str, str]) -> tuple[Bundle, dict[str, Path]]:
    """An adapter-ready fp32 bundle 'tiny' (LoRA on q and v up to rank 8) and adapters for it: adapters maps each
    name to "base", or to "other" for one converted for another build of the same model (int8, as ready), all
    random q,v rank 4, seeded in order. Returns (base, {name: folder}) (tests of adapter rollouts)."""
    from quantize.adapter import convert
    from quantize.lora import LoraSpec
    from quantize.package import build_bundle
    from quantize.peft import read_peft
    from quantize.precision import QuantSpec

    lora = LoraSpec(targets=("q", "v"), max_rank=8)
    builds = {"base": build_bundle(ckpt, QuantSpec(), root / "base", name="tiny", lora=lora, progress=lambda s: None),
              "other": build_bundle(ckpt, QuantSpec(precision="int8", method="rtn", block_size=16, block_sizes={}),
                                    root / "other", name="tiny", lora=lora, progress=lambda s: None)}
    folders = {}
    for seed, (name, build) in enumerate(adapters.items(), start=1):
        peft = read_peft(write_peft(root / f"peft-{name}", ckpt.geometry, targets=("q", "v"), r=4, alpha=16, seed=seed))
        convert(peft, builds[build], root / name, name=name, progress=lambda s: None)
        folders[name] = root / name
    return builds["base"], folders
