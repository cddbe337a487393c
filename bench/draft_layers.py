"""Fewer draft layers: what skipping middle layers of the Qwen2.5-Coder-0.5B draft does to its acceptance and
to the 1.5B's decode speed with speculation, against the whole draft (bench/spec_pair.py's pair and prompts).

Each draft is the 0.5B GGUF with some of its middle layers left out (the residual stream passes them by),
built like bench/speculative.py's draft: INT4 round-to-nearest, its head over the first DRAFT_HEAD ids. The
target is bench/speculative.py's INT4 1.5B. For each draft: batch-1 greedy decode tokens/s of the 1.5B with
speculation against plain decoding (interleaved, median of --runs), and the acceptance, on the code and open
chat prompts.

Run: .venv/bin/python bench/draft_layers.py [--skip 0,4,8] [--tokens 96] [--runs 1] [--write-docs]
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import numpy as np
from benchdocs import machine, replace_section, stamp
from benchmodels import BENCH_CACHE
from spec_pair import DRAFT_HEAD, PAIRS, WORKLOADS, bundles, chat_ids, measure_ours

from agent.config import EngineConfig
from agent.engine.bundle import open_bundle
from agent.engine.engine import Engine
from quantize.checkpoint import Checkpoint, load_checkpoint
from quantize.fetch import fetch
from quantize.package import build_bundle
from quantize.precision import QuantSpec

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


def skipped_layers(num_layers: int, skip: int) -> list[int]:
    """skip layers spread evenly over the middle half (the first and last quarters carry the most)."""
    if skip == 0:
        return []
    lo, hi = num_layers // 4, num_layers - num_layers // 4
    return sorted({int(round(x)) for x in np.linspace(lo, hi - 1, skip)})


def without_layers(ckpt: Checkpoint, drop: list[int]) -> Checkpoint:
    """The checkpoint with the layers in drop removed and the rest renumbered in order."""
    keep = [i for i in range(ckpt.geometry.num_layers) if i not in drop]
    new_index = {old: new for new, old in enumerate(keep)}
    weights = {}
    for name, w in ckpt.weights.items():
        m = LAYER.fullmatch(name)
        if m is None:
            weights[name] = w
        elif int(m.group(1)) in new_index:
            weights[f"model.layers.{new_index[int(m.group(1))]}.{m.group(2)}"] = w
    g = ckpt.geometry.model_copy(update={"num_layers": len(keep)})
    return dataclasses.replace(ckpt, geometry=g, weights=weights, source_blocks={})


def draft_bundle(ckpt: Checkpoint, drop: list[int]) -> Path:
    out = BENCH_CACHE / "spec-pair" / f"qwen2.5-coder-0.5b-int4-h{DRAFT_HEAD // 1024}k-skip{'-'.join(map(str, drop))}"
    if not (out / "manifest.json").exists():
        print(f"building {out.name} ...", flush=True)
        build_bundle(without_layers(ckpt, drop), QuantSpec(precision="int4", method="rtn", head_vocab=DRAFT_HEAD),
                     out, name="draft", force=True, progress=lambda s: None)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip", default="0,4,8", help="how many middle layers each draft leaves out")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    _, _, target, full_draft = bundles(*PAIRS[TARGET, DRAFT])
    ckpt = load_checkpoint(fetch(PAIRS[TARGET, DRAFT][1]))
    n = ckpt.geometry.num_layers
    drafts = [(s, skipped_layers(n, s)) for s in map(int, args.skip.split(","))]
    paths = {s: full_draft if not drop else draft_bundle(ckpt, drop) for s, drop in drafts}
    del ckpt
    rows = []
    cfg = EngineConfig(threads=2, memory_budget_mb=8192, max_context=2048)
    for skip, drop in drafts:
        engine = Engine(open_bundle(target), cfg, draft=open_bundle(paths[skip]))
        for workload in ("code", "open chat"):
            prompts = [chat_ids(engine, t) for t in WORKLOADS[workload]]
            m = measure_ours(engine, prompts, "greedy", 1, args.tokens, args.runs)
            rows.append((f"{n - len(drop)} of {n}" + (f" (without {', '.join(map(str, drop))})" if drop else ""),
                         workload, m))
            print(f"  {rows[-1][0]}, {workload}: {m['draft']:.1f} vs {m['plain']:.1f} tok/s, "
                  f"{m['ratio']:.2f}x, acceptance {m['acceptance']:.0%}", flush=True)
        engine.stop()
        del engine
    lines = ["| draft layers | workload | plain tok/s | draft tok/s | x plain | acceptance |",
             "|---|---|--:|--:|--:|--:|"]
    lines += [f"| {d} | {w} | {m['plain']:.1f} | {m['draft']:.1f} | {m['ratio']:.2f} | {m['acceptance']:.0%} |"
              for d, w, m in rows]
    table = "\n".join(lines)
    print(table)
    print(f"took {(time.time() - t0) / 60:.1f} min")
    if args.write_docs:
        body = (f"Command: `.venv/bin/python bench/draft_layers.py --skip {args.skip} --tokens {args.tokens} "
                f"--runs {args.runs} --write-docs`, {stamp()}. {machine()}. The 1.5B INT4 target of "
                f"bench/speculative.py with drafts of the 0.5B (INT4 round-to-nearest, head over the first "
                f"{DRAFT_HEAD} ids) that leave out middle layers; batch 1, greedy, {args.tokens} tokens a request, "
                f"median of {args.runs} run(s).\n\n{table}\n")
        title = "## Speculative decoding: fewer draft layers (bench/draft_layers.py)"
        replace_section(title, f"{title}\n\n{body}")
        print("wrote docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
