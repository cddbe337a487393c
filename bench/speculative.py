"""Speculative decoding benchmark: batch-1 decode tokens/s with and without prompt lookup and a draft
model, on a repeat-heavy and an open workload, on the bundled SmolLM2; llama.cpp's prompt-lookup
decoding on the same prompts (peer venv) where it is installed.

Run: .venv/bin/python bench/speculative.py [--runs 5] [--tokens 128] [--write-docs]
     .venv/bin/python bench/speculative.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b  (bench/spec_pair.py)
Bundles are built (or reused) under ~/.cache/edge-llm/bench by bench/tps.py's builders.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from benchdocs import replace_section  # noqa: E402
from tps import build_artifacts  # noqa: E402

from agent.engine.bundle import open_bundle  # noqa: E402
from agent.config import EngineConfig  # noqa: E402
from agent.engine.engine import Engine  # noqa: E402
from agent.engine.sampling_params import SamplingParams  # noqa: E402
from quantize.fetch import fetch  # noqa: E402

PEER_PYTHON = Path(__file__).parent.parent / ".venv-peers" / "bin" / "python"


# Repeat-heavy: work over a ~500-token passage whose answer quotes it; open: free chat. Several prompts per
# workload, so one prompt's luck does not decide the figure. Each repeat-heavy answer is started with the
# first words of what it quotes (a client prefilling the reply): asked plainly, this 135M model mostly
# answers with a text of its own, often one that repeats itself, and prompt lookup then measured that loop
# (INT4 1.76-1.85x until 2026-12-06) rather than quoting.
REPEAT_ASKS = [("Copy the first paragraph of the text above.", 0),  # (ask, the sentence the answer starts at)
               ("Quote the passage above from its fifth sentence on, exactly.", 4),
               ("Quote the last three sentences of the passage above.", -3)]
OPEN_ASKS = ["Write a short story about a dragon who learns to bake.",
             "Explain how a refrigerator works, for a ten-year-old.",
             "Give me a packing list for a week of hiking, with a reason for each item."]
PASSAGE_WORDS = 380  # ~500 tokens
ANSWER_START_WORDS = 8


def passage_sentences() -> list[str]:
    """The first whole sentences of eval_en.txt that reach PASSAGE_WORDS words."""
    text = resources.files("quantize").joinpath("data/eval_en.txt").read_text()
    sentences, words = [], 0
    for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        sentences.append(sentence)
        words += len(sentence.split())
        if words >= PASSAGE_WORDS:
            return sentences
    raise SystemExit("eval_en.txt is shorter than the benchmark's passage")


def workloads(engine: Engine) -> dict[str, list[list[int]]]:
    sentences = passage_sentences()
    passage = " ".join(sentences)
    tok = engine.tokenizer

    def chat(content: str, answer_start: str = "") -> list[int]:
        return tok.encode(tok.render_chat([{"role": "user", "content": content}]) + answer_start)

    return {"repeat-heavy": [chat(passage + "\n\n" + ask, " ".join(sentences[at].split()[:ANSWER_START_WORDS]))
                             for ask, at in REPEAT_ASKS],
            "open": [chat(ask) for ask in OPEN_ASKS]}


def run(engine: Engine, prompts: list[list[int]], mode: str, tokens: int) -> dict:
    """Decode tokens/s over all prompts together (tokens after the first / their time), drafts and accepts.
    EOS ends a request as it would for a user: greedy output is the same with or without speculation."""
    decoded = seconds = drafted = accepted = 0.0
    for ids in prompts:
        f = engine.generate(ids, SamplingParams(max_tokens=tokens, temperature=0, speculative=mode)).figures
        if f.completion_tokens > 1 and f.decode_tokens_per_s > 0:
            decoded += f.completion_tokens - 1
            seconds += (f.completion_tokens - 1) / f.decode_tokens_per_s
        drafted += f.drafted_tokens
        accepted += f.accepted_tokens
    return {"tps": decoded / seconds, "drafted": drafted, "accepted": accepted}


def measure(engine: Engine, prompts: list[list[int]], modes: list[str], tokens: int, runs: int) -> dict[str, dict]:
    """Per mode: median tokens/s, the median of its per-run ratio to the first mode (plain) and the
    acceptance. Modes are interleaved within each run, so that a shared machine's load drifts over all
    of them alike instead of over whichever ran last."""
    for mode in modes:
        run(engine, prompts, mode, 16)  # warm-up
    rs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(runs):
        for mode in modes:
            rs[mode].append(run(engine, prompts, mode, tokens))
    out = {}
    for mode, results in rs.items():
        drafted = sum(r["drafted"] for r in results)
        out[mode] = {"tps": statistics.median(r["tps"] for r in results),
                     "ratio": statistics.median(r["tps"] / b["tps"] for r, b in zip(results, rs[modes[0]])),
                     "acceptance": sum(r["accepted"] for r in results) / drafted if drafted else None}
    return out


LLAMA_WORKER = """
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
# n_batch = n_ctx: llama-cpp-python keeps logits for n_batch rows only, and its lookup decoding writes past
# them once a prompt is longer than n_batch (ValueError: could not broadcast ...).
model, ids, tokens, runs, lookup = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
llm = Llama(model_path=model, n_ctx=2048, n_threads=2, n_batch=2048, verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None)
out = []
for _ in range(runs + 1):
    llm.reset()
    t_first = None
    n = 0
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        if tok == llm.token_eos():
            break
        n += 1
        if n >= tokens:
            break
    out.append((n - 1, (n - 1) / (now - t_first)))
print(json.dumps(sorted(out[1:], key=lambda r: r[1])[len(out[1:]) // 2]))
"""


def llamacpp(model: Path, prompts: list[list[int]], tokens: int, runs: int, lookup: bool) -> float | None:
    """llama.cpp's decode tokens/s over the prompts (the median run of each, time-weighted), or None."""
    if not PEER_PYTHON.exists():
        return None
    total_tokens = total_s = 0.0
    for ids in prompts:
        r = subprocess.run([str(PEER_PYTHON), "-c", LLAMA_WORKER, str(model), json.dumps(ids), str(tokens), str(runs),
                            "1" if lookup else "0"], capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            return None
        n, tps = json.loads(r.stdout)
        total_tokens += n
        total_s += n / tps
    return total_tokens / total_s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--target", help="a draft/target pair instead (bench/spec_pair.py), e.g. qwen2.5-coder-1.5b")
    ap.add_argument("--draft", help="the pair's draft model, e.g. qwen2.5-coder-0.5b")
    args = ap.parse_args()
    if args.target or args.draft:
        import spec_pair

        return spec_pair.main(args)
    paths = build_artifacts(fetch("smollm2-135m-instruct"), 2, rebuild=False)
    cfg = EngineConfig(threads=2, memory_budget_mb=4096, max_context=2048, speculative_max_batch=1)
    rows = []
    for target, draft in (("ours-int4", None), ("ours-int8", "ours-int4")):
        engine = Engine(open_bundle(paths[target]), cfg, draft=open_bundle(paths[draft]) if draft else None)
        for name, prompts in workloads(engine).items():
            ms = measure(engine, prompts, ["off", "ngram"] + (["draft"] if draft else []), args.tokens, args.runs)
            labels = {"off": "plain", "ngram": "prompt lookup", "draft": f"draft ({draft})"}
            rows += [(target, name, labels[mode], m["tps"], m["ratio"], m["acceptance"]) for mode, m in ms.items()]
            if target == "ours-int4":
                plain = llamacpp(paths["q4_0.gguf"], prompts, args.tokens, args.runs, lookup=False)
                lookup = llamacpp(paths["q4_0.gguf"], prompts, args.tokens, args.runs, lookup=True)
                if plain and lookup:
                    rows.append(("llama.cpp Q4_0", name, "plain", plain, 1.0, None))
                    rows.append(("llama.cpp Q4_0", name, "prompt lookup", lookup, lookup / plain, None))
        del engine
    header = "| model | workload | decoding | decode tok/s | x plain | acceptance |\n|---|---|---|--:|--:|--:|"
    lines = [f"| {t} | {w} | {m} | {tps:.1f} | {x:.2f} | {'' if a is None else f'{a:.0%}'} |"
             for t, w, m, tps, x, a in rows]
    report = "\n".join([header, *lines])
    print(report)
    if args.write_docs:
        write_docs(report, args)
    return 0


def write_docs(report: str, args) -> None:
    title = "## Speculative decoding (bench/speculative.py)"
    section = (f"{title}\n\nCommand: `.venv/bin/python bench/speculative.py --runs {args.runs} --tokens {args.tokens} "
               f"--write-docs`, {time.strftime('%Y-%m-%d')}, 2 threads, greedy, batch 1, {args.tokens} tokens, "
               f"median of {args.runs} runs (the modes interleaved within each run; x plain is the median of the per-run "
               "ratios). Goal: >= 1.6x on repeat-heavy with prompt lookup, >= 0.95x on open.\n\n"
               "Workloads (three prompts each, tokens/s over all three): repeat-heavy asks to quote a ~500-token "
               "passage (its first paragraph, from its fifth sentence on, its last three sentences), each answer "
               f"started with the first {ANSWER_START_WORDS} words it quotes (asked plainly, this 135M model mostly "
               "answers with a text of its own); "
               "open is free chat (a story, an explanation, a packing list). Requests end at EOS or the token limit. "
               "Acceptance is accepted / drafted tokens. On INT4/INT8 bundles a k+1-row verification is not "
               "bit-identical to one-row decoding (MatMulNBits with int8 activations), so a greedy output can "
               "diverge at a near-tie and the two columns may decode slightly different texts; exactness is tested "
               "on fp32 bundles. llama.cpp's rows are llama-cpp-python's `LlamaPromptLookupDecoding` "
               "(num_pred_tokens=10), whose drafting runs in Python.\n\n"
               f"{report}\n")
    replace_section(title, section)


if __name__ == "__main__":
    sys.exit(main())
