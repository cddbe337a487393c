"""Serving several clients at once: aggregate decode tokens/s at 1, 2, 4 and 8 streams, prefix-cache
warm vs cold TTFT, and the inter-token latency of running streams while a 2,000-token prompt arrives,
with and without chunked prefill. The bundled SmolLM2 INT4 bundle, 2 threads, greedy, in one process;
the peers (ONNX Runtime GenAI's static batch, llama.cpp's parallel sequences) in the peer venv.

Run: .venv/bin/python bench/concurrency.py [--runs 3] [--write-docs]
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

sys.path.insert(0, str(Path(__file__).parent))

from benchdocs import replace_section  # noqa: E402
from tps import CACHE, PEER_PYTHON, build_artifacts, build_ours, prompt_ids_file  # noqa: E402

from agent.engine.bundle import open_bundle  # noqa: E402
from agent.config import EngineConfig  # noqa: E402
from agent.engine import engine as engine_module  # noqa: E402
from agent.engine.engine import Engine  # noqa: E402
from agent.engine.runner import open_runner  # noqa: E402
from agent.engine.sampling_params import SamplingParams  # noqa: E402
from quantize.fetch import fetch  # noqa: E402
from quantize.evaluate import chunked_logits, log_softmax  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
STREAMS = (1, 2, 4, 8)


def engine(bundle, memory_budget_mb: int = 2048, **kw) -> Engine:
    e = Engine(bundle, EngineConfig(threads=2, memory_budget_mb=memory_budget_mb, max_context=4096, **kw))
    e.start()
    return e


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, length).tolist() for _ in range(n)]


def aggregate(e: Engine, streams: int, seed: int) -> tuple[float, list[float]]:
    """(aggregate completion tokens/s over the wall time, per-stream decode tokens/s) of one round."""
    ps = prompts(streams, 128, seed=seed)
    t0 = time.perf_counter()
    hs = [e.submit(p, SamplingParams(max_tokens=128, **GREEDY)) for p in ps]
    results = [h.result() for h in hs]
    wall = time.perf_counter() - t0
    return sum(x.figures.completion_tokens for x in results) / wall, [x.figures.decode_tokens_per_s for x in results]


# ONNX Runtime GenAI's static batch: all streams' prompts (128 random tokens each, as ours) appended at once,
# 128 greedy steps; completion tokens over the wall time from the first append, as `aggregate` counts ours.
GENAI_BATCH = """
import json, sys, time
import numpy as np
import onnxruntime_genai as og
model, streams, runs, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
config = og.Config(model)
config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": 2}}}}))
m = og.Model(config)
out = []
for r in range(runs + 1):  # the first is a warm-up
    prompts = np.random.default_rng(seed + r - 1 if r else 1000).integers(100, 40000, (streams, 128)).astype(np.int32)
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=264, do_sample=False, batch_size=streams)
    gen = og.Generator(m, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompts)
    for _ in range(128):
        gen.generate_next_token()
    out.append(streams * 128 / (time.perf_counter() - t0))
print(json.dumps(sorted(out[1:])[len(out[1:]) // 2]))
"""


# llama.cpp with one sequence per stream in one context, as llama-server's parallel slots run them, through
# llama-cpp-python's low-level API (its high-level Llama runs one sequence): all prompts in one llama_decode
# (logits at each prompt's last token), then one batch of a token per stream a step, greedy; counted as above.
LLAMA_PARALLEL = """
import json, sys, time, ctypes
import numpy as np
import llama_cpp as L
model, streams, runs, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
L.llama_backend_init()
mp = L.llama_model_default_params()
m = L.llama_model_load_from_file(model.encode(), mp)
vocab = L.llama_model_get_vocab(m)
n_vocab = L.llama_vocab_n_tokens(vocab)
cp = L.llama_context_default_params()
cp.n_ctx = streams * 256 + 64
cp.n_batch = cp.n_ubatch = max(512, streams * 128)
cp.n_seq_max = streams
cp.n_threads = cp.n_threads_batch = 2
ctx = L.llama_init_from_model(m, cp)
batch = L.llama_batch_init(streams * 128, 0, streams)
def fill(entries):  # (token, pos, seq, wants_logits)
    batch.n_tokens = len(entries)
    for i, (t, p, s, lg) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
        batch.seq_id[i][0] = s
        batch.logits[i] = lg
def argmax(i):
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
out = []
for r in range(runs + 1):  # the first is a warm-up
    prompts = np.random.default_rng(seed + r - 1 if r else 1000).integers(100, 40000, (streams, 128)).tolist()
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    t0 = time.perf_counter()
    fill([(t, p, s, p == 127) for s in range(streams) for p, t in enumerate(prompts[s])])
    assert L.llama_decode(ctx, batch) == 0
    last = [argmax(s * 128 + 127) for s in range(streams)]
    for step in range(127):  # 128 tokens a stream: the first came from the prefill
        fill([(last[s], 128 + step, s, True) for s in range(streams)])
        assert L.llama_decode(ctx, batch) == 0
        last = [argmax(s) for s in range(streams)]
    out.append(streams * 128 / (time.perf_counter() - t0))
print(json.dumps(sorted(out[1:])[len(out[1:]) // 2]))
"""


def peer_figure(script: str, model: Path, streams: int, runs: int, seed: int = 0) -> float | None:
    """Run a peer worker in the peer venv; its last stdout line is the aggregate tokens/s (None if unavailable)."""
    if not PEER_PYTHON.exists():
        return None
    r = subprocess.run([str(PEER_PYTHON), "-c", script, str(model), str(streams), str(runs), str(seed)],
                       capture_output=True, text=True, timeout=1200)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def ttft_cold_warm(bundle, runs: int) -> tuple[float, float]:
    e = engine(bundle)
    system = prompts(1, 400, seed=99)[0]
    cold, warm = [], []
    for r in range(runs):
        system_r = [t + r for t in system]  # a new system prompt each run: the first request is cold
        cold.append(e.generate(system_r + [11, 12, 13], SamplingParams(max_tokens=1, **GREEDY)).figures.ttft_ms)
        warm.append(e.generate(system_r + [21, 22, 23, 24], SamplingParams(max_tokens=1, **GREEDY)).figures.ttft_ms)
    e.stop()
    return statistics.median(cold), statistics.median(warm)


def itl_with_long_prompt(bundle, chunk: int) -> tuple[float, float]:
    """(p95, max) inter-token latency (ms) of 4 running streams over the window in which a 2,000-token
    prompt is prefilled (gaps that overlap the window, so one long stall counts)."""
    e = engine(bundle, prefill_chunk_tokens=chunk, prefix_cache_fraction=0.0)
    hs = [e.submit(p, SamplingParams(max_tokens=400, **GREEDY)) for p in prompts(4, 64, seed=7)]
    time.sleep(1.0)  # the four are decoding
    t0 = time.perf_counter()
    long = e.submit(prompts(1, 2000, seed=8)[0], SamplingParams(max_tokens=1, **GREEDY))
    figures = long.result().figures
    if figures.queue_ms > 100:  # it waited for a slot: the window would not show the prefill's stall
        raise SystemExit(f"the 2,000-token prompt waited {figures.queue_ms:.0f} ms for a KV slot; raise the budget")
    t1 = t0 + figures.ttft_ms / 1000
    results = [h.result() for h in hs]
    e.stop()
    gaps = []
    for r in results:
        times = np.array(r.token_times)
        overlapping = (times[1:] >= t0) & (times[:-1] <= t1)  # gap (a, b) overlaps [t0, t1]
        gaps += list(np.diff(times)[overlapping] * 1000)
    return (float(np.percentile(gaps, 95)), float(max(gaps))) if gaps else (float("nan"), float("nan"))


# Quality as the batch runs: which precision serves concurrency best depends on what a batch does to the
# logits too (MatMulNBits' 4-bit kernel takes another path for several rows than for one), so every logit row
# the engine samples from is scored against the fp32 graph on the same tokens.
QUALITY_STREAMS = (1, 4, 8)


def fp32_bundle(source: Path) -> Path:
    path = CACHE / "ours-fp32"
    if not path.exists():
        print("building ours-fp32 ...", flush=True)
        build_ours(source, path, "--precision", "fp32")
    return path


def batch_quality(bundle, reference, slices: list[list[int]], streams: int, **kw) -> tuple[float, float, float]:
    """(mean KL(fp32 || engine), p99 KL, top-1 agreement) over every token of 128-token greedy completions of
    `slices`, run `streams` at a time (every row of the table scores the same prompts)."""
    # the budget is not under test here: this process also holds the fp32 graph and the recorded logits
    e = engine(bundle, memory_budget_mb=16384, speculative_max_batch=1, prefix_cache_fraction=0.0, **kw)
    rows: dict[int, list[np.ndarray]] = {}
    sample = e.steps._sample

    def recording(seq, logits):  # the row the engine samples each token from, as the batch ran it
        rows.setdefault(seq.seq_id, []).append(np.array(logits, np.float32))
        return sample(seq, logits)

    e.steps._sample = recording
    outputs = []
    for i in range(0, len(slices), streams):
        handles = [e.submit(p, SamplingParams(max_tokens=128, **GREEDY)) for p in slices[i:i + streams]]
        outputs += [(p, h.result().token_ids, h.seq.seq_id) for p, h in zip(slices[i:i + streams], handles)]
    e.stop()
    e.close()
    kls, agree = [], 0
    for prompt, out, seq_id in outputs:
        full = prompt + out[:-1]  # logits at position p-1+j predict out[j]
        ref = np.concatenate([lp for _, lp in chunked_logits(reference, full)])[len(prompt) - 1:]
        lp = log_softmax(np.stack(rows.pop(seq_id)))
        kls.append((np.exp(ref) * (ref - lp)).sum(-1))
        agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
    kl = np.concatenate(kls)
    return float(kl.mean()), float(np.percentile(kl, 99)), agree / len(kl)


def quality_table(paths: dict[str, Path], source: Path) -> list[str]:
    text_ids = np.load(prompt_ids_file(source)).tolist()
    slices = [text_ids[i:i + 128] for i in range(0, 128 * max(QUALITY_STREAMS), 128)]
    if len(slices[-1]) < 128:
        raise SystemExit(f"eval_en.txt has {len(text_ids)} tokens; the quality pass needs {128 * len(slices)}")
    reference = open_runner(open_bundle(fp32_bundle(source)), 2)
    lines = ["| bundle | streams | mean KL | p99 KL | top-1 % |", "|---|--:|--:|--:|--:|"]
    for label, artifact, kw in (("INT4 (default)", "ours-int4", {}), ("INT4, int8 KV cache", "ours-int4",
                                                                       dict(kv_dtype="int8")),
                                ("INT8", "ours-int8", {})):
        bundle = open_bundle(paths[artifact])
        for n in QUALITY_STREAMS:
            mean, p99, top1 = batch_quality(bundle, reference, slices, n, **kw)
            lines.append(f"| {label} | {n} | {mean:.4f} | {p99:.4f} | {top1:.1%} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    paths = build_artifacts(fetch("smollm2-135m-instruct"), 2, rebuild=False)
    bundle = open_bundle(paths["ours-int4"])
    lines = ["| streams | ours: aggregate tok/s | x 1 stream | per-stream decode tok/s (median) | ours, sleeping threads | "
             "ours, int8 KV cache | ours INT8 | GenAI static batch | ours / GenAI | int8 KV / GenAI | "
             "llama.cpp Q4_0 parallel | ours / llama.cpp |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    # ours: the default (spin_wait "auto": spins when it finds the box idle at start), sleeping threads, int8 KV
    configs = {"auto": {}, "sleep": dict(spin_wait=False), "int8kv": dict(kv_dtype="int8")}
    engine_module.SPIN_RECHECK_S = float("inf")  # engines take turns here: a re-measurement would see the others
    engines = {label: engine(bundle, speculative_max_batch=1, **kw) for label, kw in configs.items()}
    engines["int8"] = engine(open_bundle(paths["ours-int8"]), speculative_max_batch=1)  # the other precision
    peers = {"genai": (GENAI_BATCH, "genai-int4"), "llama": (LLAMA_PARALLEL, "q4_0.gguf")}
    totals: dict[tuple[str, int], list[float]] = {}
    per_stream: dict[int, list[float]] = {}
    for r in range(args.runs):  # rounds interleave every engine and peer, so the host's drift falls on all alike
        for n in STREAMS:
            for label, e in engines.items():
                total, per = aggregate(e, n, seed=r)
                totals.setdefault((label, n), []).append(total)
                per_stream.setdefault(n, []).extend(per if label == "auto" else [])
            for label, (script, artifact) in peers.items():
                figure = peer_figure(script, paths[artifact], n, 1, seed=r)
                totals.setdefault((label, n), []).extend([figure] if figure else [])
        print(f"round {r + 1}/{args.runs} done", flush=True)
    spinning = engines["auto"].runner.spinning
    for e in engines.values():
        e.stop()
    del engines, e  # free their weights and KV: a later engine sizes its KV from this process's RSS
    med = {k: statistics.median(v) if v else 0.0 for k, v in totals.items()}
    ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
    for n in STREAMS:
        agg = med["auto", n]
        lines.append(f"| {n} | {agg:.1f} | {agg / med['auto', 1]:.2f} | {statistics.median(per_stream[n]):.1f} | "
                     f"{med['sleep', n]:.1f} | {med['int8kv', n]:.1f} | {med['int8', n]:.1f} | {med['genai', n]:.1f} | "
                     f"{ratio(agg, med['genai', n])} | {ratio(med['int8kv', n], med['genai', n])} | "
                     f"{med['llama', n]:.1f} | {ratio(agg, med['llama', n])} |")
    lines += ["", f"Ours: spin_wait \"auto\" (the default) chose {'spinning' if spinning else 'sleeping'} threads. "
              f"Each figure is the median of {args.runs} rounds; a round runs every engine and peer once at each "
              "stream count, in turn."]
    cold, warm = ttft_cold_warm(bundle, args.runs)
    lines += ["", "| 400-token cached system prompt | TTFT ms |", "|---|--:|", f"| cold | {cold:.1f} |",
              f"| warm (prefix cache) | {warm:.1f} ({warm / cold:.0%} of cold) |"]
    lines += ["", "| 4 streams while a 2,000-token prompt arrives | ITL p95 ms | ITL max ms |", "|---|--:|--:|"]
    for label, chunk in (("chunked prefill, 64 tokens a step", 64), ("chunked prefill, 128 tokens a step (the default)", 128),
                         ("no chunking (one 2,048-token step)", 2048)):
        p95, worst = itl_with_long_prompt(bundle, chunk)
        lines.append(f"| {label} | {p95:.1f} | {worst:.1f} |")
    # last: the fp32 graph it loads would count against the budgets of engines made after it
    lines += ["", "Quality as the batch runs: KL(fp32 || ours) and top-1 agreement with our fp32 graph over every "
              f"generated token of {max(QUALITY_STREAMS)} prompts (consecutive 128-token slices of eval_en.txt), "
              "128 greedy tokens each, run `streams` at a time, each scored on the tokens it produced.", ""]
    lines += quality_table(paths, fetch("smollm2-135m-instruct"))
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        write_docs(report, args)
    return 0


def write_docs(report: str, args) -> None:
    title = "## Concurrency (bench/concurrency.py)"
    section = (f"{title}\n\nCommand: `.venv/bin/python bench/concurrency.py --runs {args.runs} --write-docs`, "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, our INT4 bundle, 2 threads, greedy, 128-token "
               "prompts and 128 tokens a stream, shared 2-core machine. Aggregate = completion tokens / wall time from "
               "submission (prefill included). Peer: ONNX Runtime GenAI's static batch (its int4 builder, "
               "spinning threads: its default), and llama.cpp Q4_0 of the same fp32 weights with one sequence "
               "per stream in one context (llama-cpp-python's low-level batch API, as llama-server's parallel "
               "slots), same prompts and lengths.\n\n" + report + "\n")
    replace_section(title, section)


if __name__ == "__main__":
    sys.exit(main())
