"""What LoRA adapters cost at decode: a plain bundle against an adapter-ready one, without and with an adapter.

Three variants of one model, all through agent.engine.runner's ModelRunner (the engine's runner) at batch 1:
- plain: `edge-quantize build GGUF --precision int4`
- ready: the same with `--lora-targets q,k,v,o,gate,up,down --max-lora-rank 16`, no adapter bound (the rank-0
  branches run and add zeros)
- ready + rank R: a random PEFT adapter of rank R on all seven projections (written here, converted by
  quantize.adapter.convert), its tensors bound for every step
Each round prefills the same prompt and decodes the same token ids in each variant, one after the other (the
order rotating), so the machine's noise falls on all alike; a variant's time is the median over rounds of its
mean time per decode step, and its cost the median over rounds of its time over plain's in the same round. Bundles are built once into --work (a few minutes each on 2 cores: GPTQ; --source-quant keeps the GGUF's own
blocks instead: seconds).

Then a batch of 4 through the engine (agent.engine.engine: its scheduler groups a step's rows by adapter, one
call per adapter present): plain; ready with no adapter; all four on one adapter; two on each of two adapters.
Decode tokens/s: tokens the four decode together per wall second once every prompt is in, median over
interleaved rounds. Last, the
peak RSS of a process serving the ready bundle with 0, 1 and 2 adapters loaded (each used by a request), each
in a fresh process: what one more adapter costs.

Run: .venv/bin/python bench/lora.py [--model smollm2-135m-instruct] [--rank 8] [--rounds 7] [--tokens 64]
     [--threads 2] [--source-quant] [--work ~/.cache/edge-llm/bench/lora] [--memory-budget-mb 1024] [--write-docs]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: benchdocs

from agent import wire  # noqa: E402
from agent.engine.bundle import open_bundle  # noqa: E402
from agent.engine.runner import ModelRunner, open_runner  # noqa: E402
from quantize.adapter import AdapterRunner, convert, target_shapes  # noqa: E402
from quantize.peft import TARGET_MODULES, read_peft  # noqa: E402
from benchdocs import machine, replace_section, stamp  # noqa: E402

ALL_TARGETS = ",".join(wire.LORA_TARGETS)
PROMPT_TOKENS = 128
DEFAULT_MODEL = "smollm2-135m-instruct"
TITLE = "## LoRA adapters: decode cost and memory (bench/lora.py)"  # SmolLM2's; other models' add --model NAME
GOAL = ("Goal (issue #39): an adapter-ready bundle with a rank-8 adapter on all seven projections decodes at most 10% "
        "slower than the plain bundle at batch 1.")


BATCH = 4
BATCH_VARIANTS = {  # name -> (bundle, the adapter of each of the BATCH requests)
    "plain": ("plain", [None] * BATCH),
    "ready, no adapter": ("ready", [None] * BATCH),
    "ready, 4 x adapter 1": ("ready", ["a1"] * BATCH),
    "ready, 2 x adapter 1 + 2 x adapter 2": ("ready", ["a1", "a2", "a1", "a2"]),
}


def build(source: Path, out: Path, name: str, *flags: str) -> Path:
    if not (out / wire.MANIFEST).is_file():
        subprocess.run([sys.executable, "-m", "quantize.cli", "build", str(source), "--precision", "int4", "--no-eval",
                        "--name", name, "--out", str(out), *flags], check=True, cwd=REPO)
    return out


def batch_tokens_per_s(engine, prompts: list[list[int]], adapters: list[str | None], tokens: int) -> float:
    """The BATCH requests submitted together and stepped to the end: tokens decoded per wall second once every
    prompt is in (all four decoding together)."""
    from agent.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    handles = [engine.submit(p, params, adapter=a) for p, a in zip(prompts, adapters)]
    while not all(h.seq.output_ids for h in handles):
        engine.step()
    before, t0 = sum(len(h.seq.output_ids) for h in handles), time.perf_counter()
    while not all(h.seq.is_finished for h in handles):
        engine.step()
    return (sum(len(h.seq.output_ids) for h in handles) - before) / (time.perf_counter() - t0)


def engine_config(args):
    from agent.config import EngineConfig

    return EngineConfig(threads=args.threads, spin_wait=args.spin, memory_budget_mb=args.memory_budget_mb,
                        prefix_cache_fraction=0.0)


def batch_table(plain, ready, adapters: dict[str, Path], args) -> str:
    from agent.engine.engine import Engine

    engines = {"plain": Engine(plain, engine_config(args)), "ready": Engine(ready, engine_config(args), adapters=adapters)}
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, ready.config.vocab_size, 32).tolist() for _ in range(BATCH)]
    names, speeds = list(BATCH_VARIANTS), {k: [] for k in BATCH_VARIANTS}
    for name in names:  # warm-up
        bundle, rows = BATCH_VARIANTS[name]
        batch_tokens_per_s(engines[bundle], prompts, rows, 4)
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            bundle, rows = BATCH_VARIANTS[name]
            speeds[name].append(batch_tokens_per_s(engines[bundle], prompts, rows, args.tokens))
    lines = [f"\nbatch of {BATCH} through the engine, 32-token prompts then {args.tokens} tokens each, median of "
             f"{args.rounds} interleaved rounds", "", "| batch | decode tokens/s (all 4) | vs plain |", "|---|---:|---:|"]
    for name, v in speeds.items():
        ratio = statistics.median((s / p - 1) * 100 for s, p in zip(v, speeds["plain"]))
        lines.append(f"| {name} | {statistics.median(v):.1f} | {ratio:+.1f}% |")
    return "\n".join(lines)


def rss_child(ready_path: Path, adapters: dict[str, Path], args) -> None:
    """In a fresh process: serve the ready bundle with these adapters, one short request on each (and one on the
    base), and print the peak RSS in bytes."""
    from agent.engine.engine import Engine
    from agent.engine.sampling_params import SamplingParams
    from agent.process import peak_rss_bytes

    engine = Engine(open_bundle(ready_path), engine_config(args), adapters=adapters)
    for adapter in [None, *adapters]:
        engine.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        adapter)
    print(peak_rss_bytes())


def rss_table(ready, adapters: dict[str, Path], args) -> str:
    peaks = []
    for k in range(len(adapters) + 1):
        pairs = [f"{n}={p}" for n, p in list(adapters.items())[:k]]
        out = subprocess.run([sys.executable, __file__, "--rss-child", str(ready.path), *pairs,
                              "--threads", str(args.threads), "--memory-budget-mb", str(args.memory_budget_mb)],
                             check=True, capture_output=True, text=True, cwd=REPO)
        peaks.append(int(out.stdout.split()[-1]))
    lines = ["\npeak RSS serving the ready bundle (a fresh process each, one request per adapter)", "",
             "| adapters loaded | peak RSS MB | vs none |", "|---:|---:|---:|"]
    lines += [f"| {k} | {p / 2**20:.1f} | {(p - peaks[0]) / 2**20:+.1f} MB |" for k, p in enumerate(peaks)]
    return "\n".join(lines)


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
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a model edge-quantize fetch knows (default: %(default)s)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default=ALL_TARGETS, help="the adapter-ready bundle's targets, and the adapter's")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spin", action="store_true", help="ONNX Runtime's workers spin between kernels (the engine's "
                                                       "spin_wait, which it turns on on an idle machine)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "edge-llm" / "bench" / "lora")
    ap.add_argument("--source-quant", action="store_true", help="build with the GGUF's own Q4 blocks "
                                                                "(--keep-source-quant): seconds, not GPTQ's minutes")
    ap.add_argument("--memory-budget-mb", type=int, default=1024, help="the engines' budget in the batch and RSS "
                                                                        "runs (default: %(default)s)")
    ap.add_argument("--write-docs", action="store_true", help=f"write the tables into docs/benchmarks.md ({TITLE}; "
                                                               "default: print only)")
    ap.add_argument("--rss-child", nargs="+", default=None, help=argparse.SUPPRESS)  # BUNDLE [NAME=DIR ...]
    args = ap.parse_args(argv)
    if args.rss_child:
        return rss_child(Path(args.rss_child[0]), dict(p.split("=", 1) for p in args.rss_child[1:]), args)
    from quantize.fetch import fetch

    source = fetch(args.model)
    if args.model != DEFAULT_MODEL:  # SmolLM2's builds keep the folder they were made in
        args.work = args.work / args.model
    quick = ("--keep-source-quant",) if args.source_quant else ()
    kind = "int4-src" if args.source_quant else "int4"
    plain = open_bundle(build(source, args.work / f"{kind}-plain", args.model, *quick))
    targets = args.targets.split(",")
    tag = "" if args.targets == ALL_TARGETS else "-" + "".join(targets)  # int4-lora16, int4-lora16-qv, ...
    ready = open_bundle(build(source, args.work / f"{kind}-lora16{tag}", args.model, "--lora-targets", args.targets,
                              "--max-lora-rank", "16", *quick))
    adapters = {}
    for n, seed in ((1, 0), (2, 1)):
        adapters[f"a{n}"] = adapter_dir = args.work / f"{kind}-adapter{'' if seed == 0 else n}-r{args.rank}{tag}"
        if not (adapter_dir / wire.ADAPTER_MANIFEST).is_file():
            peft = read_peft(random_peft(args.work / f"peft{n}-r{args.rank}{tag}", ready.config, args.rank, targets,
                                         seed))
            convert(peft, ready, adapter_dir, name=f"random{n}-r{args.rank}", threads=args.threads, force=True)
    adapter_dir = adapters["a1"]
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
    parts = [table(times, plain, ready, adapter_dir, args),
             f"Ready without an adapter = plain, logits of the {PROMPT_TOKENS}-token prompt bit for bit: {same}."]
    print("\n\n".join(parts), flush=True)
    del runners
    parts.append(batch_table(plain, ready, adapters, args))
    print("\n" + parts[-1], flush=True)
    parts.append(rss_table(ready, adapters, args))
    print("\n" + parts[-1])
    if args.write_docs:
        command = " ".join([".venv/bin/python bench/lora.py", *argv])
        title = TITLE if args.model == DEFAULT_MODEL else f"{TITLE[:-1]} --model {args.model})"
        replace_section(title, f"{title}\n\n{GOAL}\n\nCommand: `{command}`\nRun: {stamp()}. Machine: {machine()}."
                               "\n\n" + "\n\n".join(parts) + "\n")


def table(times: dict[str, list[tuple[float, float]]], plain, ready, adapter_dir: Path, args) -> str:
    """Times are medians over rounds; "vs plain" is the median of each round's ratio to plain's time in the same
    round, which cancels what other processes did to the machine between rounds."""
    lines = [f"{args.model}, int4{' (source blocks)' if args.source_quant else ''}, batch 1, {args.threads} threads ({'spinning' if args.spin else 'sleeping'} "
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
