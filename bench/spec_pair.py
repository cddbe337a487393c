"""Draft-model speculation on a real pair of one family: Qwen2.5-Coder-1.5B-Instruct verifying the drafts of
Qwen2.5-Coder-0.5B-Instruct, against plain decoding of the 1.5B and against llama.cpp's draft-model
speculation on the same two GGUF files (llama-cpp-python in the peer venv).

Both of ours are INT4 bundles built by round-to-nearest (the build's method does not change a step's cost);
the draft's head covers the first DRAFT_HEAD ids (`edge-quantize build --head-vocab`), which makes a draft
token cheaper and costs acceptance only where the target picks a rarer id. Decode tokens/s are measured at
batch 1 (tokens after the first over their time, summed over the prompts) and at batch 4 (all completion
tokens over the batch's wall time, prefill included alike in both columns), greedy and sampled (temperature
0.8, top-k 40, top-p 0.95, min-p 0.05: llama-cpp-python's defaults, for both engines). Requests end at EOS or
the token limit; the modes are interleaved within each run.

Run: .venv/bin/python bench/speculative.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
     [--tokens 64] [--runs 1] [--write-docs]
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchdocs import replace_section
from benchmodels import BENCH_CACHE, PEER_PYTHON

from agent.config import EngineConfig
from agent.engine.bundle import open_bundle
from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams
from quantize.fetch import fetch

PAIRS = {("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"): ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")}
DRAFT_HEAD = 32768
LLAMA_DRAFT_K = 4  # llama-cpp-python drafts a fixed number of tokens a step
SAMPLING = {"greedy": dict(temperature=0.0),
            "sampled": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)}
SNIPPET = '''def merge_intervals(intervals):
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


def parse_line(line, sep=","):
    fields = [f.strip() for f in line.split(sep)]
    name, age, city = fields[0], int(fields[1]), fields[2]
    return {"name": name, "age": age, "city": city}
'''
WORKLOADS = {
    "code": ["Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
             "Write a Python class for a fixed-size ring buffer with push, pop and __len__."],
    "open chat": ["Explain how a refrigerator works, for a ten-year-old.",
                  "Give me three tips for writing a good commit message, with a reason for each."],
    "repeat-heavy": [f"Add a one-line docstring to each function below and return the whole code.\n\n{SNIPPET}",
                     f"Rename the variable `result` to `merged` in the code below and return the whole code.\n\n"
                     f"{SNIPPET}"],
}


def bundles(target_name: str, draft_name: str) -> tuple[Path, Path, Path, Path]:
    """(target GGUF, draft GGUF, target bundle, draft bundle), built once under the bench cache."""
    target_src, draft_src = fetch(target_name), fetch(draft_name)
    cache = BENCH_CACHE / "spec-pair"
    target, draft = cache / f"{target_name}-int4", cache / f"{draft_name}-int4-h{DRAFT_HEAD // 1024}k"
    for src, out, extra in ((target_src, target, []), (draft_src, draft, ["--head-vocab", str(DRAFT_HEAD)])):
        if not (out / "manifest.json").exists():
            print(f"building {out.name} ...", flush=True)
            subprocess.run([sys.executable, "-m", "quantize.cli", "build", str(src), "--out", str(out),
                            "--precision", "int4", "--method", "rtn", "--no-eval", "--force", *extra], check=True)
    return target_src, draft_src, target, draft


def chat_ids(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat([{"role": "user", "content": text}]))


def ours(engine: Engine, prompts: list[list[int]], mode: str, sampling: str, batch: int, tokens: int) -> dict:
    """Decode tokens/s of one pass over the prompts, and the drafts and accepts it made."""
    params = [SamplingParams(max_tokens=tokens, speculative=mode, seed=i, **SAMPLING[sampling])
              for i in range(len(prompts))]
    if batch == 1:
        figures = [engine.generate(p, s).figures for p, s in zip(prompts, params)]
        decoded = sum(f.completion_tokens - 1 for f in figures if f.decode_tokens_per_s > 0)
        seconds = sum((f.completion_tokens - 1) / f.decode_tokens_per_s for f in figures if f.decode_tokens_per_s > 0)
    else:
        t0 = time.perf_counter()
        handles = [engine.submit(p, s) for p, s in zip(prompts, params)]
        while any(not h.seq.is_finished for h in handles):
            engine.step()
        seconds = time.perf_counter() - t0
        figures = [h.result().figures for h in handles]
        decoded = sum(f.completion_tokens for f in figures)
    return {"tps": decoded / seconds, "drafted": sum(f.drafted_tokens for f in figures),
            "accepted": sum(f.accepted_tokens for f in figures)}


def measure_ours(engine: Engine, prompts: list[list[int]], sampling: str, batch: int, tokens: int,
                 runs: int) -> dict[str, dict]:
    """plain and draft: median tokens/s, the median per-run ratio of draft to plain, and the acceptance."""
    rs: dict[str, list[dict]] = {"off": [], "draft": []}
    for _ in range(runs):
        for mode in rs:
            rs[mode].append(ours(engine, prompts, mode, sampling, batch, tokens))
    drafted = sum(r["drafted"] for r in rs["draft"])
    return {"plain": statistics.median(r["tps"] for r in rs["off"]),
            "draft": statistics.median(r["tps"] for r in rs["draft"]),
            "ratio": statistics.median(d["tps"] / p["tps"] for d, p in zip(rs["draft"], rs["off"])),
            "acceptance": sum(r["accepted"] for r in rs["draft"]) / drafted if drafted else None}


LLAMA_WORKER = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaDraftModel

target, draft, prompts, tokens, k, sampling = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), \\
    int(sys.argv[5]), json.loads(sys.argv[6])


class ModelDraft(LlamaDraftModel):
    # greedy drafts from a second model, its cache kept over the common prefix of what it saw before
    def __init__(self, path):
        self.llm = Llama(model_path=path, n_ctx=1024, n_threads=2, n_batch=1024, verbose=False)

    def __call__(self, input_ids, **kwargs):
        llm, ids = self.llm, input_ids.tolist()
        have = llm.input_ids[:llm.n_tokens].tolist()
        n = 0
        while n < min(len(have), len(ids) - 1) and have[n] == ids[n]:
            n += 1
        llm.n_tokens = n
        llm.eval(ids[n:])
        out = []
        while True:
            out.append(llm.sample(top_k=1, temp=0.0))
            if len(out) == k:
                return np.array(out, dtype=np.intc)
            llm.eval(out[-1:])


results = {}
for mode in ("plain", "draft"):
    llm = Llama(model_path=target, n_ctx=1024, n_threads=2, n_batch=1024, verbose=False, seed=0,
                draft_model=ModelDraft(draft) if mode == "draft" else None)
    decoded = seconds = 0.0
    for ids in prompts:
        t_first, n = None, 0
        for tok in llm.generate(ids, reset=True, **sampling):
            now = time.perf_counter()
            t_first = t_first or now
            if tok == llm.token_eos():
                break
            n += 1
            if n >= tokens:
                break
        if n > 1:
            decoded, seconds = decoded + n - 1, seconds + now - t_first
    results[mode] = decoded / seconds
    del llm
print(json.dumps(results))
"""


def llamacpp(target: Path, draft: Path, prompts: list[list[int]], sampling: str, tokens: int) -> dict | None:
    """llama.cpp's batch-1 decode tokens/s over the prompts, plain and with the draft model, or None."""
    if not PEER_PYTHON.exists():
        return None
    args = dict(top_k=1, temp=0.0) if sampling == "greedy" else {
        "temp": SAMPLING[sampling]["temperature"], **{k: v for k, v in SAMPLING[sampling].items() if k != "temperature"}}
    r = subprocess.run([str(PEER_PYTHON), "-c", LLAMA_WORKER, str(target), str(draft), json.dumps(prompts),
                        str(tokens), str(LLAMA_DRAFT_K), json.dumps(args)], capture_output=True, text=True,
                       timeout=3600)
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(args) -> int:
    names = PAIRS.get((args.target, args.draft))
    if names is None:
        raise SystemExit(f"no pair {args.target} / {args.draft}; known: {', '.join('/'.join(p) for p in PAIRS)}")
    target_src, draft_src, target, draft = bundles(*names)
    # speculative_max_batch stays the default: the batch-4 rows measure what a busy engine does as shipped
    cfg = EngineConfig(threads=2, memory_budget_mb=8192, max_context=2048)
    engine = Engine(open_bundle(target), cfg, draft=open_bundle(draft))
    rows = []
    for workload, texts in WORKLOADS.items():
        prompts = [chat_ids(engine, t) for t in texts]
        for sampling in SAMPLING:
            for batch in (1, 4):
                batch_prompts = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
                m = measure_ours(engine, batch_prompts, sampling, batch, args.tokens, args.runs)
                rows.append(("ours INT4", workload, sampling, batch, m["plain"], m["draft"], m["ratio"], m["acceptance"]))
                print(rows[-1], flush=True)
            peer = llamacpp(target_src, draft_src, prompts, sampling, args.tokens)
            if peer:
                rows.append(("llama.cpp Q4_K_M", workload, sampling, 1, peer["plain"], peer["draft"],
                             peer["draft"] / peer["plain"], None))
                print(rows[-1], flush=True)
    report = table(rows)
    print(report)
    if args.write_docs:
        write_docs(report, args)
    return 0


def table(rows: list[tuple]) -> str:
    lines = ["| engine | workload | sampling | batch | plain tok/s | draft tok/s | x plain | acceptance |",
             "|---|---|---|--:|--:|--:|--:|--:|"]
    lines += [f"| {e} | {w} | {s} | {b} | {p:.1f} | {d:.1f} | {x:.2f} | {'' if a is None else f'{a:.0%}'} |"
              for e, w, s, b, p, d, x, a in rows]
    return "\n".join(lines)


def write_docs(report: str, args) -> None:
    title = "## Speculative decoding with a draft model: Qwen2.5-Coder 1.5B / 0.5B (bench/speculative.py --target)"
    section = (f"{title}\n\nCommand: `.venv/bin/python bench/speculative.py --target {args.target} --draft {args.draft} "
               f"--tokens {args.tokens} --runs {args.runs} --write-docs`, {time.strftime('%Y-%m-%d %H:%M')} UTC, "
               f"2 threads, {args.tokens} tokens a request, median of {args.runs} run(s). Ours: INT4 round-to-nearest "
               f"bundles, the draft's head over the first {DRAFT_HEAD} ids; batch 1 is decode tokens/s, batch 4 "
               "completion tokens over the batch's wall time, where the engine drafts only while at most "
               f"speculative_max_batch ({EngineConfig().speculative_max_batch}, the default) sequences decode. llama.cpp: llama-cpp-python with a second `Llama` as "
               f"its draft model ({LLAMA_DRAFT_K} greedy tokens a step), the same Q4_K_M files, batch 1. "
               "x plain compares each engine with its own plain decoding. Goals: >= 1.5x plain on code and open "
               "chat at batch 1, greedy and sampled; >= 0.95x at batch 4; ahead of llama.cpp's speculation.\n\n"
               f"{report}\n")
    replace_section(title, section)
