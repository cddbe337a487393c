"""Convert a PEFT LoRA adapter for one adapter-ready base bundle: check that it fits, write its tensors in ONNX
Runtime's adapter format under the graph's LoRA input names, and measure it on the base.

    PEFT folder ─ read_peft ─ check_fit(base) ─ fused_tensors ─ adapter.onnx_adapter ─┬─ golden (base + adapter)
                                                                                     └─ quality vs fp32 W + sBA
    → adapter_manifest.json, all in a temporary folder renamed into place

Each fused projection's inputs (agent.wire.lora_a / lora_b) hold its targets side by side: A = [A_q^T A_k^T
A_v^T] [in, r_q + r_k + r_v], and B block-diagonal, target t's rows holding s_t B_t^T in t's output columns,
so that x A B = sum_t s_t x A_t^T B_t^T lands in each target's columns and adds exact zeros elsewhere. The
adapter is never merged into the base's (quantized) weights.

Run: edge-quantize adapter PEFT_DIR --base BUNDLE --out ADAPTER_DIR [--source CHECKPOINT]
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from agent import durable, wire
from agent.engine.bundle import Bundle, file_sha256
from agent.engine.runner import ModelRunner, read_adapter, write_adapter
from quantize.checkpoint import Checkpoint
from quantize.evaluate import compare, greedy
from quantize.package import write_graph
from quantize.peft import TARGET_MODULES, AdapterError, PeftAdapter
from quantize.precision import QuantSpec


def target_shapes(c: wire.Geometry) -> dict[wire.LoraTarget, tuple[int, int]]:
    """Each target's weight shape [out, in], as PEFT's A [r, in] and B [out, r] must match it."""
    q, kv, h, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (inter, h), "up": (inter, h),
            "down": (h, inter)}


def check_fit(peft: PeftAdapter, bundle: Bundle) -> None:
    """AdapterError naming the first way the adapter does not fit the bundle: no LoRA branches, a target without
    one, a rank over the bundle's maximum, a layer it lacks, or shapes of another model."""
    m, c = bundle.manifest, bundle.config
    label = f"{m.name}@{m.version}"
    if m.lora is None:
        raise AdapterError(f"{label} takes no adapters: build it with edge-quantize build --lora-targets")
    if missing := [t for t in peft.ranks if t not in m.lora.targets]:
        raise AdapterError(f"the adapter changes {', '.join(missing)}, which {label} has no LoRA branch for "
                           f"(it takes {', '.join(m.lora.targets)})")
    shapes = target_shapes(c)
    for p in peft.pairs:
        where = f"layer {p.layer} {TARGET_MODULES[p.target]}"
        if p.rank > m.lora.max_rank:
            raise AdapterError(f"{where}: rank {p.rank} is over {label}'s maximum of {m.lora.max_rank}")
        if p.layer >= c.num_layers:
            raise AdapterError(f"{where}: {label} has layers 0-{c.num_layers - 1} (an adapter for another model)")
        out, inp = shapes[p.target]
        if p.a.shape[1] != inp or p.b.shape[0] != out:
            raise AdapterError(f"{where}: A [r, in] and B [out, r] are {list(p.a.shape)} and {list(p.b.shape)}, "
                               f"but {label}'s projection is [out {out}, in {inp}] (an adapter for another model)")


def fused_tensors(peft: PeftAdapter, c: wire.Geometry, base: wire.LoraCapacity) -> dict[str, np.ndarray]:
    """Every LoRA input of the base's graph by name, A [in, R] and B [R, out] per (layer, fused projection): the
    adapter's where it has pairs, rank 0 (zeros of the defaults' shapes) where it has none. An adapter then names
    every input its base has, so binding one in place of another leaves nothing of the other bound."""
    shapes = target_shapes(c)
    tensors: dict[str, np.ndarray] = {}
    projections = {wire.LORA_PROJECTION_OF[t] for t in base.targets}
    for layer in range(c.num_layers):
        for proj, (_, targets) in wire.LORA_PROJECTIONS.items():
            if proj not in projections:
                continue
            pairs = [p for p in peft.pairs if p.layer == layer and p.target in targets]
            offsets = dict(zip(targets, np.cumsum([0] + [shapes[t][0] for t in targets]).tolist()))
            b = np.zeros((sum(p.rank for p in pairs), sum(shapes[t][0] for t in targets)), np.float32)
            row = 0
            for p in pairs:  # target t: rows [row, row + r_t), its own output columns
                col = offsets[p.target]
                b[row:row + p.rank, col:col + p.b.shape[0]] = (p.scale * p.b.astype(np.float64)).T
                row += p.rank
            k_in = shapes[targets[0]][1]  # a fused projection's targets read one input
            a = np.concatenate([np.zeros((k_in, 0), np.float32)] + [p.a.T for p in pairs], axis=1)
            tensors[wire.lora_a(layer, proj)] = np.ascontiguousarray(a, np.float32)
            tensors[wire.lora_b(layer, proj)] = b
    return tensors


def merged(ckpt: Checkpoint, peft: PeftAdapter) -> Checkpoint:
    """ckpt with W + scale * B A in every adapted projection (a new weights dict; ckpt is left as it was)."""
    weights = dict(ckpt.weights)
    for p in peft.pairs:
        key = f"model.layers.{p.layer}.{TARGET_MODULES[p.target]}.weight"
        weights[key] = weights[key] + p.delta()
    return Checkpoint(ckpt.geometry, weights, ckpt.tokenizer, ckpt.source_sha256, ckpt.source_name,
                      ckpt.source_blocks)


class AdapterRunner(ModelRunner):
    """A runner whose every step runs with one adapter: its tensors are bound in place of the graph's rank-0 LoRA
    inputs on each binding the runner makes (inputs it does not name keep their zero defaults)."""

    def __init__(self, bundle: Bundle, adapter_file: Path, threads: int | None = None, spin_wait: bool = False):
        self.adapter = read_adapter(adapter_file)
        c = bundle.config
        super().__init__(bundle.graph(), c.num_layers, c.num_kv_heads, c.head_dim, threads, spin_wait)

    def _bind_cache(self, binding, cache):
        for name, value in self.adapter.items():
            binding.bind_ortvalue_input(name, value)
        return super()._bind_cache(binding, cache)


def golden(runner: ModelRunner, base: wire.Manifest) -> wire.Golden:
    """The adapter's greedy continuation of the base's smoke prompt, as long as the base's own."""
    g = base.golden
    return wire.Golden(prompt=g.prompt, prompt_ids=g.prompt_ids,
                       continuation_ids=greedy(runner, g.prompt_ids, len(g.continuation_ids)))


def check_source(ckpt: Checkpoint, base: wire.Manifest) -> None:
    if ckpt.source_sha256 != base.source_sha256:
        raise AdapterError(f"--source {ckpt.source_name} is not the checkpoint {base.name}@{base.version} was built "
                           f"from ({base.source_name})")


def quality(runner: ModelRunner, ckpt: Checkpoint, peft: PeftAdapter, bundle: Bundle, ids: list[int], text: str,
            work: Path, threads: int | None) -> wire.Quality:
    """The base bundle with the adapter against the fp32 model with the adapter merged, built in work."""
    work.mkdir()
    write_graph(merged(ckpt, peft), QuantSpec(), work)
    c = bundle.config
    reference = ModelRunner(work / wire.GRAPH, c.num_layers, c.num_kv_heads, c.head_dim, threads)
    return compare(runner, reference, ids, text, c.context_length, c.bos_token_id if c.add_bos_token else None)


def check_destination(out: Path, force: bool) -> None:
    """An existing out is replaced only with force, and only if it is an adapter folder or an empty one."""
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise AdapterError(f"{out} already exists (use --force to replace it)")
    if out.is_symlink() or not out.is_dir() or not ((out / wire.ADAPTER_MANIFEST).is_file() or not any(out.iterdir())):
        raise AdapterError(f"{out} exists and is not an adapter folder: --force replaces only an adapter (or an "
                           f"empty folder); choose another --out")


def convert(peft: PeftAdapter, bundle: Bundle, out: Path, *, name: str, source: Checkpoint | None = None,
            eval_ids: list[int] | None = None, eval_text: str = "", threads: int | None = None, force: bool = False,
            progress: Callable[[str], None] = print) -> wire.AdapterManifest:
    """Write the adapter folder at out (adapter file + manifest), measured on bundle; see the module docstring."""
    check_fit(peft, bundle)
    check_destination(out, force)
    if source is not None:
        check_source(source, bundle.manifest)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_adapter(tmp / wire.ADAPTER_FILE, fused_tensors(peft, bundle.config, bundle.manifest.lora))
        runner = AdapterRunner(bundle, tmp / wire.ADAPTER_FILE, threads)
        progress("recording the golden greedy continuation with the adapter active")
        gold = golden(runner, bundle.manifest)
        q = None
        if source is not None and eval_ids:
            progress(f"evaluating base + adapter against the fp32 model with the adapter merged, {len(eval_ids)} tokens")
            q = quality(runner, source, peft, bundle, eval_ids, eval_text, tmp.with_name(tmp.name + "-ref"), threads)
        del runner
        manifest = _manifest(peft, bundle.manifest, name, tmp, gold, q)
        (tmp / wire.ADAPTER_MANIFEST).write_text(manifest.model_dump_json(indent=2))
        for p in tmp.iterdir():
            p.chmod(0o644)
        if out.exists() or out.is_symlink():
            check_destination(out, force)  # again: it may have appeared while the adapter was measured
        durable.replace_tree(tmp, out, out.with_name(f".{out.name}.old-{os.getpid()}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.with_name(tmp.name + "-ref"), ignore_errors=True)
    return manifest


def _manifest(peft: PeftAdapter, base: wire.Manifest, name: str, folder: Path, gold: wire.Golden,
              q: wire.Quality | None) -> wire.AdapterManifest:
    files = {p.name: wire.FileEntry(sha256=file_sha256(p), size_bytes=p.stat().st_size)
             for p in sorted(folder.iterdir()) if p.name != wire.ADAPTER_MANIFEST}
    digest = hashlib.sha256(json.dumps({k: v.sha256 for k, v in files.items()}, sort_keys=True).encode()).hexdigest()
    ranks = peft.ranks
    return wire.AdapterManifest(
        name=name, version=f"r{max(ranks.values())}-{digest[:8]}", base_name=base.name, base_version=base.version,
        rank=max(ranks.values()), ranks=ranks, layers=sorted({p.layer for p in peft.pairs}),
        source_sha256=peft.source_sha256, source_name=peft.source_name,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), files=files, golden=gold,
        quality=q)
