"""Decode speed, time to first token and peak memory: our engine against ONNX Runtime GenAI and llama.cpp.

All engines run one benchmark model (bench/benchmodels.py: the bundled SmolLM2-135M-Instruct by default, or
`--model qwen2.5-0.5b` / `qwen2.5-1.5b` / `gemma3-270m`), greedy, with the same token ids (the start of quantize/data/eval_en.txt
as llama.cpp tokenizes it) and the same thread count, side by side in one run:
- ours: bundles built by `edge-quantize build GGUF --precision ... --out DIR`, run through agent.engine.engine
  (for the 0.5B-class models, bench/quality.py's cached bundles of the same specs: each GPTQ build runs once);
- ONNX Runtime GenAI: its own model builder (`-p int4 -e cpu`) from the HF folder quantize.hf.save_hf writes;
- llama.cpp (llama-cpp-python): the source GGUF, and Q4_0 quantized from an F32 GGUF of the same weights.
Every measurement is a fresh subprocess (so peak RSS is one engine's) that warms up with a short request,
then measures one of: TTFT and decode speed for 128 tokens after a 128-token prompt; TTFT of a 512-token
prompt; peak RSS (VmHWM, reset after imports) after an 896-token prompt plus 128 tokens (a 1,024-token
context). Every engine gets a 1,024-token context. Runs are interleaved across engines so that the
machine's noise falls on all of them alike; each figure is the median over runs. The floor is how fast
decode could go if every weight byte were read once per token at this machine's memory bandwidth
(numpy copy of a 512 MB array, STREAM convention: bytes read + written per second).

Peer engines run in the peer venv (bench/setup_peers) by this same file in worker mode, which imports only
the standard library, numpy and the peer package. Built artifacts are cached in ~/.cache/edge-llm/bench (a
subfolder per model but SmolLM2).

Run: .venv/bin/python bench/tps.py [--model smollm2-135m] [--runs 5] [--threads 2] [--write-docs] [--rebuild]
     # SmolLM2: ~5 min on 2 cores, plus ~3 min to build the artifacts once; the 0.5B-class models take longer
"""
from __future__ import annotations


import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: benchdocs, benchmodels
from benchdocs import replace_section  # noqa: E402
from benchmodels import DEFAULT, MODELS, BenchModel, token_ids  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CACHE = MODELS[DEFAULT].cache  # SmolLM2's artifacts, which the other benchmarks build on
DOCS = REPO / "docs" / "benchmarks.md"
PRODUCT_PYTHON = REPO / ".venv" / "bin" / "python"
PEER_PYTHON = REPO / ".venv-peers" / "bin" / "python"
PEER_QUANTIZE = Path(__file__).resolve().parent / "_peers_llamacpp.py"
MB = 1 << 20

CONTEXT_TOKENS = 1024  # every engine's context; the RSS measurement fills it
DECODE_PROMPT_TOKENS, DECODE_TOKENS = 128, 128
LONG_PROMPT_TOKENS = 512
RSS_PROMPT_TOKENS = CONTEXT_TOKENS - DECODE_TOKENS
WARMUP_PROMPT_TOKENS, WARMUP_TOKENS = 8, 4


@dataclass(frozen=True)
class Measurement:
    name: str
    prompt_tokens: int
    max_tokens: int


MEASUREMENTS = [Measurement("decode", DECODE_PROMPT_TOKENS, DECODE_TOKENS),
                Measurement("ttft512", LONG_PROMPT_TOKENS, 1),
                Measurement("rss", RSS_PROMPT_TOKENS, DECODE_TOKENS)]


@dataclass(frozen=True)
class Engine:
    label: str
    kind: str  # worker kind: a key of WORKERS
    artifact: str  # cache entry name (see build_artifacts)
    is_reference: bool = False  # the row every ratio is taken against: ours INT4


FAST_LABEL = "ours INT4 fast (--lm-head int4, int8 KV cache)"
SMOLLM2_ENGINES = [
    Engine("ours INT4 (default: GPTQ b64, spin_wait auto)", "ours", "ours-int4", is_reference=True),
    Engine("ours INT4, sleeping threads (spin_wait=False)", "ours-sleep", "ours-int4"),
    Engine("ours INT4, int8 KV cache", "ours-kv8", "ours-int4"),
    # opt-in, not the default: mean KL 0.158 + the int8 cache's ~0.002 against the default's 0.134, a 108 MB bundle
    Engine(FAST_LABEL, "ours-kv8", "ours-int4-h4"),
    Engine("ours INT8", "ours", "ours-int8"),
    Engine("ours Q4_1 kept (--keep-source-quant)", "ours", "ours-q4_1-src"),
    Engine("ORT GenAI int4 (its builder)", "genai", "genai-int4"),
    Engine("llama.cpp Q4_1 (source GGUF)", "llamacpp", "source.gguf"),
    Engine("llama.cpp Q4_0", "llamacpp", "q4_0.gguf"),
]
# The 0.5B-class models: the default bundles and the rows their goals name (each engine costs a measurement
# of three fresh processes per run)
LARGE_ENGINES = [  # ours INT4 is the model's recipe (quantize/recipes.py)
    Engine("ours INT4 (default: the model's recipe, spin_wait auto)", "ours", "ours-int4", is_reference=True),
    Engine("ours INT4, int8 KV cache", "ours-kv8", "ours-int4"),
    Engine("ours INT8", "ours", "ours-int8"),
    Engine("ORT GenAI int4 (its builder)", "genai", "genai-int4"),
    Engine("llama.cpp Q4_K_M (source GGUF)", "llamacpp", "source.gguf"),
    Engine("llama.cpp Q4_0", "llamacpp", "q4_0.gguf"),
]


@dataclass(frozen=True)
class Goal:
    text: str
    measurement: str  # a Measurement name
    key: str  # a worker result key
    peer: str  # an Engine label; "llama.cpp (smaller of its rows)": the smallest llama.cpp figure
    bound: float  # ours / peer must be >= bound (higher_is_better) or <= bound
    higher_is_better: bool


SMALLEST_LLAMACPP = "llama.cpp (smaller of its rows)"
SMOLLM2_GOALS = [
    Goal("INT4 decode >= 1.2x GenAI int4", "decode", "decode_tokens_per_s", "ORT GenAI int4 (its builder)", 1.2, True),
    Goal("INT4 TTFT-512 <= llama.cpp Q4_0", "ttft512", "ttft_ms", "llama.cpp Q4_0", 1.0, False),
    Goal("INT4 peak RSS @1024 <= llama.cpp (smaller of its rows)", "rss", "peak_rss_mb", SMALLEST_LLAMACPP, 1.0, False),
]
LARGE_GOALS = [
    Goal("INT4 decode >= 1.0x GenAI int4", "decode", "decode_tokens_per_s", "ORT GenAI int4 (its builder)", 1.0, True),
    Goal("INT4 decode >= 1.2x llama.cpp Q4_K_M", "decode", "decode_tokens_per_s", "llama.cpp Q4_K_M (source GGUF)",
         1.2, True),
    Goal("INT4 TTFT-512 <= 0.8x llama.cpp Q4_0", "ttft512", "ttft_ms", "llama.cpp Q4_0", 0.8, False),
    Goal("INT4 peak RSS @1024 <= llama.cpp Q4_K_M", "rss", "peak_rss_mb", "llama.cpp Q4_K_M (source GGUF)", 1.0, False),
]
# (ours INT8 is left out for the 0.5B: at EngineConfig's default memory_budget_mb its 735 MB bundle leaves the
# KV cache 512 tokens, and the engine refuses the 512-token prompt: "this model's context holds 512". The
# 1.5B keeps every row: its BenchModel.memory_budget_mb is what its INT8 bundle needs.)
ENGINES = {DEFAULT: SMOLLM2_ENGINES, "gemma3-270m": LARGE_ENGINES,
           "qwen2.5-0.5b": [*LARGE_ENGINES[:2], *LARGE_ENGINES[3:]], "qwen2.5-1.5b": LARGE_ENGINES}
GOALS = {DEFAULT: SMOLLM2_GOALS, "qwen2.5-0.5b": LARGE_GOALS, "gemma3-270m": LARGE_GOALS,
         "qwen2.5-1.5b": LARGE_GOALS}


# ---- workers: one measurement in this process, result as the last stdout line --------------------------

def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def timed_tokens(token_times: list[float], t0: float) -> dict:
    """TTFT from t0; decode tokens/s over the tokens after the first, and their median inter-token latency
    (which a burst of load from other processes moves less than it moves the mean)."""
    n = len(token_times)
    decode_s = token_times[-1] - token_times[0]
    return {"ttft_ms": (token_times[0] - t0) * 1e3,
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "itl_p50_ms": float(np.median(np.diff(token_times))) * 1e3 if n > 1 else 0.0}


def run_ours(model: str, ids: list[int], max_tokens: int, threads: int, spin_wait: bool | str = "auto",
             kv_dtype: str = "fp32", memory_budget_mb: int | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from agent.engine.bundle import open_bundle
    from agent.config import EngineConfig
    from agent.engine.engine import Engine as OurEngine
    from agent.engine.sampling_params import SamplingParams

    reset_peak_rss()
    bundle = open_bundle(Path(model))
    budget = {} if memory_budget_mb is None else {"memory_budget_mb": memory_budget_mb}
    engine = OurEngine(bundle, EngineConfig(threads=threads, max_context=CONTEXT_TOKENS, spin_wait=spin_wait,
                                            kv_dtype=kv_dtype, **budget))
    greedy = dict(temperature=0.0, ignore_eos=True)
    engine.generate(list(range(100, 100 + WARMUP_PROMPT_TOKENS)), SamplingParams(max_tokens=WARMUP_TOKENS, **greedy))
    f = engine.generate(ids, SamplingParams(max_tokens=max_tokens, **greedy)).figures
    assert f.completion_tokens == max_tokens, f
    return {"ttft_ms": f.ttft_ms, "decode_tokens_per_s": f.decode_tokens_per_s, "itl_p50_ms": f.itl_p50_ms,
            "spinning": engine.runner.spinning}


def run_genai(model: str, ids: list[int], max_tokens: int, threads: int) -> dict:
    import onnxruntime_genai as og

    reset_peak_rss()
    config = og.Config(model)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    m = og.Model(config)

    def generate(prompt: list[int], n: int) -> dict:
        params = og.GeneratorParams(m)
        params.set_search_options(max_length=CONTEXT_TOKENS, do_sample=False)
        gen = og.Generator(m, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)
        times = []
        for _ in range(n):
            gen.generate_next_token()
            gen.get_next_tokens()
            times.append(time.perf_counter())
        return timed_tokens(times, t0)

    generate(list(range(100, 100 + WARMUP_PROMPT_TOKENS)), WARMUP_TOKENS)
    return generate(ids, max_tokens)


def run_llamacpp(model: str, ids: list[int], max_tokens: int, threads: int) -> dict:
    import llama_cpp

    reset_peak_rss()
    llm = llama_cpp.Llama(model, n_ctx=CONTEXT_TOKENS, n_threads=threads, n_threads_batch=threads, verbose=False)

    def generate(prompt: list[int], n: int) -> dict:
        llm.reset()  # no prefix reuse from the warm-up
        t0 = time.perf_counter()
        times = []
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy; never stops on EOS
            times.append(time.perf_counter())
            if len(times) == n:
                break
        return timed_tokens(times, t0)

    generate(list(range(100, 100 + WARMUP_PROMPT_TOKENS)), WARMUP_TOKENS)
    return generate(ids, max_tokens)


WORKERS = {"ours": run_ours, "ours-sleep": lambda *a, **k: run_ours(*a, spin_wait=False, **k),
           "ours-kv8": lambda *a, **k: run_ours(*a, kv_dtype="int8", **k), "genai": run_genai, "llamacpp": run_llamacpp}


def worker(kind: str, model: str, ids_path: str, prompt_tokens: int, max_tokens: int, threads: int,
           memory_budget_mb: int | None) -> None:
    ids = np.load(ids_path)[:prompt_tokens].tolist()
    assert len(ids) == prompt_tokens, f"{ids_path} has only {len(ids)} ids"
    budget = {} if memory_budget_mb is None else {"memory_budget_mb": memory_budget_mb}  # ours only
    result = WORKERS[kind](model, ids, max_tokens, threads, **budget)
    result["peak_rss_mb"] = status_kb("VmHWM") / 1024
    print(json.dumps(result))


# ---- artifacts (cached) ---------------------------------------------------------------------------------

def run_logged(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {shlex.join(cmd)}\n{log.read_text()[-3000:]}")


def build_ours(source: Path, out: Path, *flags: str) -> None:
    cmd = [str(PRODUCT_PYTHON), "-m", "quantize.cli", "build", str(source), "--out", str(out), "--no-eval", *flags]
    run_logged(cmd, out.with_name(out.name + ".log"))


def flat_rope_for_genai(hf: Path) -> None:
    """onnxruntime-genai 0.18's builder indexes config.rope_parameters["rope_type"] and reads
    config.rope_local_base_freq, but transformers 5 turns a Gemma 3 config into one rope_parameters set per layer
    type and keeps no rope_local_base_freq (the builder fails with KeyError: 'rope_type'). Give it both forms:
    transformers reads the per-type sets, the builder the flat keys it copies to the top level. A peer's quirk,
    so it is patched here and not written by save_hf."""
    path = hf / "config.json"
    config = json.loads(path.read_text())
    glob, local = config["rope_theta"], config["rope_local_base_freq"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": glob, "rope_local_base_freq": local,
                                 "full_attention": {"rope_type": "default", "rope_theta": glob},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    path.write_text(json.dumps(config, indent=2))


def build_genai(model: BenchModel, source: Path, out: Path) -> None:
    """save_hf's folder -> onnxruntime_genai.models.builder int4 cpu (in the peer venv)."""
    from quantize.checkpoint import load_checkpoint
    from quantize.hf import save_hf

    ckpt = load_checkpoint(source)
    hf = save_hf(ckpt, model.cache / "hf-f32")
    del ckpt
    if json.loads((hf / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]:
        flat_rope_for_genai(hf)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    run_logged([str(PEER_PYTHON), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
                *model.genai_args, "-c", str(model.cache / "genai-cache")], out.with_name(out.name + ".log"))
    tmp.rename(out)
    shutil.rmtree(hf)
    shutil.rmtree(model.cache / "genai-cache", ignore_errors=True)


def build_q4_0(model: BenchModel, source: Path, out: Path, threads: int) -> None:
    """An F32 GGUF of the same weights (bench/quality.py's writer) quantized by llama_model_quantize."""
    from quality import write_f32_gguf
    from quantize.checkpoint import load_checkpoint

    f32 = write_f32_gguf(load_checkpoint(source), source, model.cache / "f32.gguf")
    run_logged([str(PEER_PYTHON), str(PEER_QUANTIZE), "quantize", str(f32), str(out), "Q4_0", "--threads", str(threads)],
               out.with_name(out.name + ".log"))
    f32.unlink()


def quality_bundle(model: BenchModel, source: Path, config: str, threads: int) -> Callable[[Path], None]:
    """A builder that makes (or finds) bench/quality.py's cached bundle for one of its configs (by goal, "int4"
    or "int8": the `edge-quantize build --precision ...` defaults, or by label) and links the artifact path to it."""
    def build(path: Path) -> None:
        from quality import CONFIGS_BY_MODEL, build as quality_build, mapped
        from quantize.checkpoint import load_checkpoint

        ckpt = mapped(load_checkpoint(source), model.cache / "quality")  # as bench/quality.py builds: see mapped
        # resolved: a default row is the model's recipe, as bench/quality.py builds it
        cfg = next(c for c in CONFIGS_BY_MODEL[model.name] if config in (c.goal, c.label)).resolved(ckpt.geometry)
        calib = (REPO / "quantize" / "data" / "calib_en.txt").read_text()
        bundle, note = quality_build(ckpt, cfg, model.cache / "quality", calib, threads, f"{model.name}-bench")
        print(f"  {path.name} -> {bundle.path.name} ({note})", flush=True)
        path.symlink_to(bundle.path)
    return build


def builders(model: BenchModel, source: Path, threads: int) -> dict[str, Callable[[Path], None]]:
    """Artifact name -> how to build it at a path."""
    common = {"genai-int4": lambda p: build_genai(model, source, p),
              "q4_0.gguf": lambda p: build_q4_0(model, source, p, threads)}
    if not model.is_default:
        return {"ours-int4": quality_bundle(model, source, "int4", threads),
                "ours-int8": quality_bundle(model, source, "int8", threads), **common}
    return {
        "ours-int4": lambda p: build_ours(source, p, "--precision", "int4"),
        "ours-int8": lambda p: build_ours(source, p, "--precision", "int8"),
        "ours-int4-h4": lambda p: build_ours(source, p, "--precision", "int4", "--lm-head", "int4"),
        "ours-q4_1-src": lambda p: build_ours(source, p, "--precision", "int4", "--keep-source-quant"),
        **common,
    }


def build_artifacts(source: Path, threads: int, rebuild: bool, model: BenchModel = MODELS[DEFAULT]) -> dict[str, Path]:
    cache = model.cache
    cache.mkdir(parents=True, exist_ok=True)
    paths = {"source.gguf": source}
    for name, build in builders(model, source, threads).items():
        path = cache / name
        # a bundle cached before edge-quantize wrote int8 KV cache graphs lacks one: build it again
        stale = name.startswith("ours-") and path.exists() and not (path / "model.int8kv.onnx").exists()
        if (rebuild or stale) and (path.exists() or path.is_symlink()):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if not path.exists():
            t0 = time.monotonic()
            print(f"building {name} ...", flush=True)
            build(path)
            print(f"  {name}: {time.monotonic() - t0:.0f} s", flush=True)
        paths[name] = path
    return paths


def prompt_ids_file(source: Path, model: BenchModel = MODELS[DEFAULT]) -> Path:
    path = model.cache / "prompt_ids.npy"
    if not path.exists():
        token_ids(source, REPO / "quantize" / "data" / "eval_en.txt", path)
    n = len(np.load(path))
    if n < max(m.prompt_tokens for m in MEASUREMENTS):
        raise SystemExit(f"eval_en.txt has {n} tokens; the benchmark needs {RSS_PROMPT_TOKENS}")
    return path


# ---- weights read per decode token, memory bandwidth -----------------------------------------------------

def weight_bytes(path: Path) -> int:
    """Bytes of weights a decode step reads: every weight once (the tied embedding/lm_head is one tensor
    that the lm_head reads whole; the embedding lookup's single row is negligible)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.name.startswith("model.onnx"))
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def memory_bandwidth_bytes_per_s(threads: int, size_bytes: int = 512 * MB, repeats: int = 5) -> float:
    """Best of `repeats` copies of a large float64 array, split over `threads` threads (numpy releases the
    GIL while copying); bytes read + written per second."""
    src = np.ones(size_bytes // 8)
    dst = np.empty_like(src)
    step = len(src) // threads
    best = float("inf")
    for _ in range(repeats):
        parts = [threading.Thread(target=np.copyto, args=(dst[i * step:(i + 1) * step], src[i * step:(i + 1) * step]))
                 for i in range(threads)]
        t0 = time.perf_counter()
        for t in parts:
            t.start()
        for t in parts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return 2 * step * threads * 8 / best


# ---- orchestration ---------------------------------------------------------------------------------------

@dataclass
class Row:
    engine: Engine
    weight_bytes: int
    samples: dict[str, list[dict]] = field(default_factory=dict)  # measurement name -> worker results

    def median(self, measurement: str, key: str) -> float:
        return statistics.median(r[key] for r in self.samples[measurement])


def measure(engine: Engine, path: Path, m: Measurement, ids_path: Path, threads: int,
            memory_budget_mb: int | None = None) -> dict:
    ours = engine.kind.startswith("ours")
    python = PRODUCT_PYTHON if ours else PEER_PYTHON
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", engine.kind, "--artifact", str(path),
           "--ids", str(ids_path), "--prompt-tokens", str(m.prompt_tokens), "--max-tokens", str(m.max_tokens),
           "--threads", str(threads)]
    if ours and memory_budget_mb is not None:
        cmd += ["--memory-budget-mb", str(memory_budget_mb)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"worker failed ({p.returncode}): {shlex.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_all(rows: list[Row], paths: dict[str, Path], ids_path: Path, runs: int, threads: int,
            memory_budget_mb: int | None = None) -> None:
    for run in range(runs):
        t0 = time.monotonic()
        for m in MEASUREMENTS:
            for row in rows:
                result = measure(row.engine, paths[row.engine.artifact], m, ids_path, threads, memory_budget_mb)
                row.samples.setdefault(m.name, []).append(result)
        print(f"run {run + 1}/{runs}: {time.monotonic() - t0:.0f} s", flush=True)


def table(rows: list[Row], bandwidth: float) -> str:
    ref = next(r for r in rows if r.engine.is_reference)
    lines = ["| engine | weights MB | decode tok/s | 1000 / ITL p50 | floor tok/s | % of floor | TTFT-128 ms | "
             "TTFT-512 ms | peak RSS MB @1024 |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        decode = r.median("decode", "decode_tokens_per_s")
        floor = bandwidth / r.weight_bytes
        lines.append(f"| {r.engine.label} | {r.weight_bytes / 1e6:.1f} | {decode:.1f} | "
                     f"{1000 / r.median('decode', 'itl_p50_ms'):.1f} | {floor:.0f} | "
                     f"{100 * decode / floor:.0f} | {r.median('decode', 'ttft_ms'):.1f} | "
                     f"{r.median('ttft512', 'ttft_ms'):.1f} | {r.median('rss', 'peak_rss_mb'):.0f} |")
    lines += ["", f"Ratios, {ref.engine.label} / peer (decode: higher is better; TTFT and RSS: lower is better):", "",
              "| peer | decode | 1000 / ITL p50 | TTFT-128 | TTFT-512 | peak RSS |", "|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        if r.engine.kind.startswith("ours"):
            continue
        ratio = lambda m, k: ref.median(m, k) / r.median(m, k)  # noqa: E731
        lines.append(f"| {r.engine.label} | {ratio('decode', 'decode_tokens_per_s'):.2f} | "
                     f"{r.median('decode', 'itl_p50_ms') / ref.median('decode', 'itl_p50_ms'):.2f} | "
                     f"{ratio('decode', 'ttft_ms'):.2f} | {ratio('ttft512', 'ttft_ms'):.2f} | "
                     f"{ratio('rss', 'peak_rss_mb'):.2f} |")
    spun = [s.get("spinning", False) for m in ref.samples.values() for s in m]
    lines += ["", f"{ref.engine.label}: spin_wait \"auto\" measured an idle box and spun in {sum(spun)} of "
              f"{len(spun)} measurements."]
    return "\n".join(lines)


def goals(rows: list[Row], model_goals: list[Goal]) -> str:
    """The issue's goals, each with its measured ratio (ours INT4 / peer) and whether it is met."""
    ref = next(r for r in rows if r.engine.is_reference)
    by_label = {r.engine.label: r for r in rows}
    lines = []
    for goal in model_goals:
        if goal.peer == SMALLEST_LLAMACPP:
            peer = min(r.median(goal.measurement, goal.key) for r in rows if r.engine.kind == "llamacpp")
        else:
            peer = by_label[goal.peer].median(goal.measurement, goal.key)
        x = ref.median(goal.measurement, goal.key) / peer
        ok = x >= goal.bound if goal.higher_is_better else x <= goal.bound
        lines.append(f"- {goal.text}: {x:.2f} ({'met' if ok else 'NOT met'})")
    fast = by_label.get(FAST_LABEL)
    if fast is not None:  # what an operator can trade quality for; the goals are the default's
        genai = by_label["ORT GenAI int4 (its builder)"]
        llama_rss = min(r.median("rss", "peak_rss_mb") for r in rows if r.engine.kind == "llamacpp")
        x = fast.median("decode", "decode_tokens_per_s") / genai.median("decode", "decode_tokens_per_s")
        lines.append(f"- (opt-in, not the goal) {FAST_LABEL} decode / GenAI int4: {x:.2f}; its peak RSS @1024 / "
                     f"llama.cpp: {fast.median('rss', 'peak_rss_mb') / llama_rss:.2f}")
    return "\n".join(lines)


def versions() -> str:
    peer = subprocess.run([str(PEER_PYTHON), "-c", "import importlib.metadata as m; print(m.version('llama-cpp-python'), "
                           "m.version('onnxruntime-genai'))"], capture_output=True, text=True).stdout.split()
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{cpu}, {os.cpu_count()} cores, shared machine; Python {platform.python_version()}, onnxruntime "
            f"{onnxruntime.__version__}, llama-cpp-python {peer[0]}, onnxruntime-genai {peer[1]}")


def docs_section(model: BenchModel, source: Path, report: str, command: str, when: str, machine: str, runs: int,
                 threads: int, minutes: float) -> str:
    what = f"The bundled {model.title}" if model.is_default else f"{model.title} (`{source.name}`)"
    budget = "" if model.memory_budget_mb is None else (
        f" Ours run with memory_budget_mb={model.memory_budget_mb} (EngineConfig's default, 1024 MB, is less than "
        "this model's weights and runtime need); the KV cache's pages come on use, so the budget adds nothing to "
        "peak RSS.")
    return f"""{model.docs_title("Decode speed", "bench/tps.py")}

{what}, greedy, {threads} threads, every engine with a {CONTEXT_TOKENS}-token context
and the same token ids. Decode is tokens/s over {DECODE_TOKENS} tokens after a {DECODE_PROMPT_TOKENS}-token prompt
(after the first token); TTFT-n is prompt submission to first token for an n-token prompt; peak RSS is
VmHWM (reset after imports) after a {RSS_PROMPT_TOKENS}-token prompt and {DECODE_TOKENS} tokens. Each
measurement is a fresh process, each figure the median of {runs} runs interleaved across engines. The floor
is memory bandwidth (numpy copy, bytes read + written per second) divided by the weight bytes one decode
token reads. Ours run through agent.engine.engine (scheduler, sampler, detokenizer included); GenAI through its
Generator; llama.cpp through llama-cpp-python's `Llama.generate`.{budget}

Command: `{command}`
Date: {when}. Machine: {machine}. The run took {minutes:.1f} min.

{report}
"""


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default=DEFAULT, help="The benchmark model (bench/benchmodels.py).")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-docs", action="store_true", help=f"Write the table into {DOCS.relative_to(REPO)}.")
    p.add_argument("--rebuild", action="store_true", help="Rebuild the model's cached artifacts (~/.cache/edge-llm/bench).")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for name in ("--artifact", "--ids"):
        p.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--prompt-tokens", "--max-tokens", "--memory-budget-mb"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.artifact, a.ids, a.prompt_tokens, a.max_tokens, a.threads, a.memory_budget_mb)
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run `bash bench/setup_peers` first")
    sys.path.insert(0, str(REPO))
    t0 = time.monotonic()
    model = MODELS[a.model]
    source = model.source()
    paths = build_artifacts(source, a.threads, a.rebuild, model)
    ids_path = prompt_ids_file(source, model)
    rows = [Row(e, weight_bytes(paths[e.artifact])) for e in ENGINES[model.name]]
    bandwidth = memory_bandwidth_bytes_per_s(a.threads)
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (numpy copy, {a.threads} threads)", flush=True)
    run_all(rows, paths, ids_path, a.runs, a.threads, model.memory_budget_mb)
    raw = {r.engine.label: r.samples for r in rows}
    (model.cache / "last_run.json").write_text(json.dumps(raw, indent=1))  # every worker's result, to look into noise
    bandwidth = max(bandwidth, memory_bandwidth_bytes_per_s(a.threads))  # again after the runs: noise only lowers it
    report = (table(rows, bandwidth) + "\n\nGoals:\n" + goals(rows, GOALS[model.name])
              + f"\n\nMemory bandwidth: {bandwidth / 1e9:.1f} GB/s (best numpy copy of 512 MB, {a.threads} threads).")
    minutes = (time.monotonic() - t0) / 60
    print("\n" + report + f"\n\ntook {minutes:.1f} min")
    if a.write_docs:
        command = (".venv/bin/python bench/tps.py " + shlex.join(argv)).strip()
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        replace_section(model.docs_title("Decode speed", "bench/tps.py"), docs_section(
            model, source, report, command, when, versions(), a.runs, a.threads, minutes))
        print(f"wrote {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
