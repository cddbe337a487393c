"""What LoRA adapters cost at decode: a plain bundle against an adapter-ready one, without and with an adapter.

Three variants of one model, all through agent.engine.runner's ModelRunner (the engine's runner) at batch 1:
- plain: `edge-quantize build GGUF --precision int4`
- ready: the same with `--lora-targets q,k,v,o,gate,up,down --max-lora-rank 16`, no adapter bound (the rank-0
  branches run and add zeros)
- ready + rank R: a random PEFT adapter of rank R on all seven projections (written here, converted by
  quantize.adapter.convert), its tensors bound for every step
Each round prefills the same prompt and decodes the same token ids in each variant, one after the other (the
order rotating), so the machine's noise falls on all alike; a variant's time is the median over rounds of its
mean time per decode step, and its cost the median over rounds of its time over plain's in the same round. Bundles are built once into --work (a few minutes each on 2 cores: GPTQ).

Run: .venv/bin/python bench/lora.py [--model smollm2-135m-instruct] [--rank 8] [--rounds 7] [--tokens 64]
     [--threads 2] [--work ~/.cache/edge-llm/bench/lora]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent import wire  # noqa: E402
from agent.engine.bundle import open_bundle  # noqa: E402
from agent.engine.runner import ModelRunner, open_runner  # noqa: E402
from quantize.adapter import AdapterRunner, convert, target_shapes  # noqa: E402
from quantize.peft import TARGET_MODULES, read_peft  # noqa: E402

ALL_TARGETS = ",".join(wire.LORA_TARGETS)
PROMPT_TOKENS = 128


def build(source: Path, out: Path, name: str, *flags: str) -> Path:
    if not (out / wire.MANIFEST).is_file():
        subprocess.run([sys.executable, "-m", "quantize.cli", "build", str(source), "--precision", "int4", "--no-eval",
                        "--name", name, "--out", str(out), *flags], check=True, cwd=REPO)
    return out


def random_peft(folder: Path, g: wire.Geometry, rank: int, targets: list[str], seed: int = 0) -> Path:
    """A PEFT LoRA folder of the given rank on the targets of every layer, B non-zero (trained-like)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(g.num_layers):
        for target, (out, inp) in target_shapes(g).items():
            if target not in targets:
                continue
            key = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[target]}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, inp)) / inp ** 0.5).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((out, rank))).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": sorted(TARGET_MODULES[t].split(".")[1] for t in targets)}))
    return folder


def decode_ms(runner: ModelRunner, prompt: list[int], steps: list[int]) -> tuple[float, float]:
    """Mean (wall, process CPU) milliseconds per one-token decode step after a prefill of prompt. CPU time counts
    every thread of this process: on a box shared with other work it moves less than wall time does."""
    n = len(prompt)
    cache = runner.new_cache(1, n + len(steps))
    runner.forward(np.array([prompt]), np.array([n - 1]), np.array([n]), np.array([[n - 1]]), cache)
    t0, c0 = time.perf_counter(), time.process_time()
    for k, token in enumerate(steps):
        runner.forward(np.array([[token]]), np.array([n + k]), np.array([1]), np.zeros((1, 1), np.int64), cache)
    return (time.perf_counter() - t0) * 1000 / len(steps), (time.process_time() - c0) * 1000 / len(steps)


def all_logits(runner: ModelRunner, ids: list[int]) -> np.ndarray:
    n = len(ids)
    return runner.forward(np.array([ids]), np.array([n - 1]), np.array([n]), np.arange(n)[None],
                          runner.new_cache(1, n))


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 1e6


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default=ALL_TARGETS, help="the adapter-ready bundle's targets, and the adapter's")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin", action="store_true", help="ONNX Runtime's workers spin between kernels (the engine's "
                                                       "spin_wait, which it turns on on an idle machine)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "edge-llm" / "bench" / "lora")
    args = ap.parse_args(argv)
    from quantize.fetch import fetch

    source = fetch(args.model)
    plain = open_bundle(build(source, args.work / "int4-plain", args.model))
    targets = args.targets.split(",")
    tag = "" if args.targets == ALL_TARGETS else "-" + "".join(targets)  # int4-lora16, int4-lora16-qv, ...
    ready = open_bundle(build(source, args.work / f"int4-lora16{tag}", args.model, "--lora-targets", args.targets,
                              "--max-lora-rank", "16"))
    adapter_dir = args.work / f"adapter-r{args.rank}{tag}"
    if not (adapter_dir / wire.ADAPTER_MANIFEST).is_file():
        peft = read_peft(random_peft(args.work / f"peft-r{args.rank}{tag}", ready.config, args.rank, targets))
        convert(peft, ready, adapter_dir, name=f"random-r{args.rank}", threads=args.threads, force=True)
    runners = {"plain": open_runner(plain, args.threads, args.spin),
               "ready, no adapter": open_runner(ready, args.threads, args.spin),
               f"ready + rank {args.rank}": AdapterRunner(ready, adapter_dir / wire.ADAPTER_FILE, args.threads,
                                                                 args.spin)}
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, ready.config.vocab_size, PROMPT_TOKENS).tolist()
    steps = rng.integers(0, ready.config.vocab_size, args.tokens).tolist()
    for r in runners.values():
        decode_ms(r, prompt[:16], steps[:8])  # warm-up
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runners}
    names = list(runners)
    for i in range(args.rounds):
        for k in names[i % 3:] + names[:i % 3]:  # each variant first in a third of the rounds
            times[k].append(decode_ms(runners[k], prompt, steps))
    same = np.array_equal(*(all_logits(r, prompt).view(np.uint32) for r in list(runners.values())[:2]))
    print(table(times, plain, ready, adapter_dir, args))
    print(f"\nready without an adapter = plain, logits of the {PROMPT_TOKENS}-token prompt bit for bit: {same}")


def table(times: dict[str, list[tuple[float, float]]], plain, ready, adapter_dir: Path, args) -> str:
    """Times are medians over rounds; "vs plain" is the median of each round's ratio to plain's time in the same
    round, which cancels what other processes did to the machine between rounds."""
    lines = [f"{args.model}, int4, batch 1, {args.threads} threads ({'spinning' if args.spin else 'sleeping'} "
             f"workers), {PROMPT_TOKENS}-token prompt then {args.tokens} decode steps, median of {args.rounds} "
             "interleaved rounds",
             f"targets {args.targets}; bundles: plain {folder_mb(plain.path):.1f} MB, adapter-ready (max rank 16) "
             f"{folder_mb(ready.path):.1f} MB; the rank-{args.rank} adapter {folder_mb(adapter_dir):.2f} MB",
             "", "| variant | ms / token | tokens/s | vs plain (range over rounds) | CPU ms / token | CPU vs plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for k, v in times.items():
        wall, cpu = statistics.median(t for t, _ in v), statistics.median(c for _, c in v)
        ratios = [(t / p - 1) * 100 for (t, _), (p, _) in zip(v, times["plain"])]
        cpu_ratio = statistics.median((c / p - 1) * 100 for (_, c), (_, p) in zip(v, times["plain"]))
        lines.append(f"| {k} | {wall:.2f} | {1000 / wall:.1f} | {statistics.median(ratios):+.1f}% "
                     f"({min(ratios):+.0f}% .. {max(ratios):+.0f}%) | {cpu:.2f} | {cpu_ratio:+.1f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
