"""Mixture of Experts speed: SmolLM2 split into 8 experts (tests/expert_split.py), top-k = 1, 2, 4 of them per
token, against the dense INT4 bundle of the same total size, at 1 and 4 streams.

The split slices each dense MLP's 1,536 neurons into 8 experts of 192 with a random (seeded, learned-free)
router choosing k of them: the model no longer computes SmolLM2 (only k = 8 does), so this is a speed proxy
and says nothing of a real MoE's quality. Every layer's attention, the embedding and the lm_head stay dense;
only the MLP reads k / 8 of its weights per decoded token. All bundles are INT4, round to nearest (QMoE experts
and MatMulNBits projections in blocks of 64), without evaluation; they are built once into --work in a child
process (so this process's peak RSS, by which each engine sizes its KV cache, is the engines' own).

Each round submits `streams` requests of a --prompt-token random prompt and --tokens greedy tokens to each
variant's engine (agent.engine.engine, loaded once), the variants in rotating order so that the machine's noise
falls on all alike (their ONNX Runtime workers sleep between kernels, so an idle one takes no core). Decode is a
stream's tokens/s after its first token (the engine's own figure), TTFT the time from submission to the first
token; both medians over rounds and streams. "active" is the share of the dense
model's parameters one token reads (quantize.checkpoint.parameter_counts), and "at the active ratio" the speed-up
decode would show if it followed that share alone; the goal in issue #40 is top-2 of 8 decoding at >= 1.6x the
dense model.

Run: .venv/bin/python bench/moe.py [--topk 1,2,4] [--streams 1,4] [--runs 3] [--tokens 64] [--prompt-tokens 128]
     [--threads 2] [--work ~/.cache/edge-llm/bench/moe] [--write-docs]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: benchdocs

from agent import wire  # noqa: E402
from agent.config import EngineConfig  # noqa: E402
from agent.engine.bundle import Bundle, open_bundle  # noqa: E402
from agent.engine.engine import Engine  # noqa: E402
from agent.engine.sampling_params import SamplingParams  # noqa: E402
from benchdocs import replace_section  # noqa: E402
from quantize.checkpoint import parameter_counts  # noqa: E402

MODEL = "smollm2-135m-instruct"
EXPERTS = 8
DENSE = "dense"
TITLE = "## Mixture of Experts (bench/moe.py)"
GREEDY = dict(temperature=0.0, ignore_eos=True)
GOAL_SPEEDUP = 1.6  # issue #40: top-2 of 8 against the dense model, decode at one stream


def variant_dir(work: Path, k: int | None) -> Path:
    return work / (DENSE if k is None else f"split{EXPERTS}x{k}")


def build_missing(work: Path, topks: list[int]) -> None:
    """Build the dense INT4 bundle and each top-k split not yet in work (run in a child process)."""
    sys.path.append(str(REPO / "tests"))  # after the repository: tests/quantize must not pass for the package
    from expert_split import split_experts
    from quantize.checkpoint import load_checkpoint
    from quantize.fetch import fetch
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    ckpt = load_checkpoint(fetch(MODEL))
    spec = QuantSpec(precision="int4", method="rtn")
    for k in [None, *topks]:
        out = variant_dir(work, k)
        if not (out / wire.MANIFEST).is_file():
            source = ckpt if k is None else split_experts(ckpt, EXPERTS, k)
            build_bundle(source, spec, out, name=MODEL if k is None else f"smollm2-{EXPERTS}x{k}", force=True)


def measure(engine: Engine, streams: int, args, seed: int) -> list[tuple[float, float]]:
    """(TTFT ms, decode tokens/s) of each of `streams` requests submitted together."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, 40000, args.prompt_tokens).tolist() for _ in range(streams)]
    handles = [engine.submit(p, SamplingParams(max_tokens=args.tokens, **GREEDY)) for p in prompts]
    figures = [h.result().figures for h in handles]
    return [(f.ttft_ms, f.decode_tokens_per_s) for f in figures]


def run(bundles: dict[str, Bundle], args) -> dict[tuple[str, int], list[tuple[float, float]]]:
    engines = {}
    for name, b in bundles.items():
        # sleeping workers: an idle variant's spinning threads would take cores from the one being measured
        engines[name] = Engine(b, EngineConfig(threads=args.threads, memory_budget_mb=4096, max_context=1024,
                                               spin_wait=False))
        engines[name].start()
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for e in engines.values():
            measure(e, 1, args, seed=999)  # warm-up
        names = list(engines)
        for streams in args.streams:
            for r in range(args.runs):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    results.setdefault((name, streams), []).extend(measure(engines[name], streams, args, seed=r))
    finally:
        for e in engines.values():
            e.stop()
    return results


def active_share(b: Bundle, dense_active: int) -> float:
    p = b.manifest.parameters
    return (p.active if p is not None else parameter_counts(b.config)[1]) / dense_active


def table(bundles: dict[str, Bundle], results, args) -> str:
    dense_active = parameter_counts(bundles[DENSE].config)[1]
    lines = ["| model | active | streams | decode tokens/s | vs dense | at the active ratio | TTFT ms | vs dense |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for streams in args.streams:
        base_tps = statistics.median(s for _, s in results[DENSE, streams])
        base_ttft = statistics.median(t for t, _ in results[DENSE, streams])
        for name, b in bundles.items():
            tps = statistics.median(s for _, s in results[name, streams])
            ttft = statistics.median(t for t, _ in results[name, streams])
            share = active_share(b, dense_active)
            lines.append(f"| {name} | {share:.0%} | {streams} | {tps:.1f} | {tps / base_tps:.2f}x | {1 / share:.2f}x | "
                         f"{ttft:.0f} | {ttft / base_ttft:.2f}x |")
    if f"top-2 of {EXPERTS}" in bundles and 1 in args.streams:
        speedup = (statistics.median(s for _, s in results[f"top-2 of {EXPERTS}", 1])
                   / statistics.median(s for _, s in results[DENSE, 1]))
        lines.append(f"\nGoal (issue #40): top-2 of {EXPERTS} decodes >= {GOAL_SPEEDUP}x the dense model at one "
                     f"stream: {speedup:.2f}x, {'met' if speedup >= GOAL_SPEEDUP else 'not met'}.")
    return "\n".join(lines)


def machine() -> str:
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, onnxruntime {onnxruntime.__version__}"


def write_docs(report: str, argv: list[str], minutes: float) -> None:
    command = " ".join([".venv/bin/python bench/moe.py", *argv])
    section = (f"{TITLE}\n\nSmolLM2-135M's MLPs split into {EXPERTS} experts (tests/expert_split.py) with a random, "
               "learned-free router choosing k of them per token: a speed proxy only (it computes SmolLM2 only at "
               "k = 8), against the dense INT4 bundle of the same total size. All INT4 round to nearest, blocks of "
               "64; agent.engine.engine, greedy, random prompts. Decode: a stream's tokens/s after its first token; "
               "TTFT: submission to first token; medians over rounds and streams; sleeping ONNX Runtime workers. "
               "Active: the share of the dense model's parameters one token reads (attention, embedding and lm_head "
               "stay dense).\n\n"
               f"Command: `{command}`\nDate: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: "
               f"{machine()}. The run took {minutes:.1f} min.\n\n{report}\n")
    replace_section(TITLE, section)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topk", default="1,2,4", help="experts per token of the splits, comma-separated")
    ap.add_argument("--streams", default="1,4", help="concurrent streams, comma-separated")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per stream")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "edge-llm" / "bench" / "moe")
    ap.add_argument("--write-docs", action="store_true", help=f"write the table into docs/benchmarks.md ({TITLE})")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)  # the child that builds
    args = ap.parse_args(argv)
    topks = [int(k) for k in args.topk.split(",")]
    args.streams = [int(s) for s in args.streams.split(",")]
    if not all(0 < k <= EXPERTS for k in topks) or not all(s > 0 for s in args.streams):
        ap.error(f"--topk takes 1..{EXPERTS}, --streams positive counts")
    if args.build_only:
        return build_missing(args.work, topks)
    started = time.monotonic()
    if not all((variant_dir(args.work, k) / wire.MANIFEST).is_file() for k in [None, *topks]):
        subprocess.run([sys.executable, __file__, "--build-only", "--topk", args.topk, "--work", str(args.work)],
                       check=True)
    bundles = {DENSE: open_bundle(variant_dir(args.work, None))}
    bundles |= {f"top-{k} of {EXPERTS}": open_bundle(variant_dir(args.work, k)) for k in topks}
    report = (f"{MODEL}, INT4, {args.threads} threads, {args.prompt_tokens}-token prompts, {args.tokens} tokens a "
              f"stream, median of {args.runs} rounds (a learned-free router: a speed proxy)\n\n"
              + table(bundles, run(bundles, args), args))
    print(report)
    if args.write_docs:
        write_docs(report, argv, (time.monotonic() - started) / 60)


if __name__ == "__main__":
    main(sys.argv[1:])
