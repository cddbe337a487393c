"""Admission under the shipped configuration: 16 chat requests at once with chat's default max_tokens (1024),
answers ending at EOS, the agent's default 1,024 MB budget (systemd/agent.toml). How many run at once, how long
they wait for their first token, the aggregate tokens/s, and the process's peak RSS against its budget; the
same again under a budget small enough that requests must wait and be preempted.

A request that reserved KV for its whole max_tokens needed a slot of prompt + 1,024 tokens, which this budget
has few of; one admitted by the tokens it holds starts in a small slot and moves up (or is preempted) only
if it grows. `--compare REV` measures the same workload on another commit (a temporary git worktree), each
in a fresh process, interleaved.

Run: .venv/bin/python bench/admission.py [--runs 3] [--budgets 1024,420] [--compare REV] [--write-docs]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from benchdocs import replace_section  # noqa: E402
from tps import CACHE, build_artifacts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOPICS = ["rivers", "birds", "stars", "bread", "trains", "music", "rain", "chess", "tea", "bees", "maps", "snow",
          "clocks", "ships", "paper", "glass"]


def worker(repo: Path, bundle: Path, budget_mb: int) -> dict:
    """One measurement with the agent package of `repo`; runs in its own process."""
    sys.path.insert(0, str(repo))
    import numpy as np
    from agent.engine.bundle import open_bundle
    from agent.config import EngineConfig
    from agent.engine.engine import Engine
    from agent.process import peak_rss_bytes
    from agent.engine.sampling_params import SamplingParams

    engine = Engine(open_bundle(bundle), EngineConfig(threads=2, memory_budget_mb=budget_mb))
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": f"Write a short paragraph about {t}."}]) for t in TOPICS]
    engine.start()
    t0 = time.perf_counter()
    handles = [engine.submit(p, SamplingParams(max_tokens=1024, temperature=0.0)) for p in prompts]
    most = 0
    while not all(h.seq.is_finished for h in handles):
        most = max(most, engine.num_running)
        time.sleep(0.005)
    results = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    engine.stop()
    tokens = sum(r.figures.completion_tokens for r in results)
    failed = [r.figures.finish_reason for r in results if r.figures.finish_reason not in ("stop", "length")]
    assert not failed, f"requests failed: {failed}"
    return {"budget_mb": budget_mb, "peak_rss_mb": peak_rss_bytes() / 2**20,  # since the engine started (it resets)
            "classes": " + ".join(f"{p.num_slots}x{p.capacity}" for p in engine.kv.classes),
            "max_running": most, "tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": float(np.median([r.figures.ttft_ms for r in results])),
            "ttft_max_ms": max(r.figures.ttft_ms for r in results),
            "preemptions": sum(r.figures.preemptions for r in results)}


def measure(repo: Path, bundle: Path, budget_mb: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(repo), "--bundle", str(bundle), "--budget-mb", str(budget_mb)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def table(rows: list[tuple[str, list[dict]]]) -> str:
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    lines = ["| agent | budget MB | KV slots (count x tokens) | most running at once | TTFT p50 ms | TTFT max ms | "
             "aggregate tok/s | preemptions | peak RSS MB (max) |", "|---|--:|---|--:|--:|--:|--:|--:|--:|"]
    for label, runs in rows:
        lines.append(f"| {label} | {runs[0]['budget_mb']} | {runs[0]['classes']} | {med(runs, 'max_running'):.0f} | "
                     f"{med(runs, 'ttft_p50_ms'):.0f} | {med(runs, 'ttft_max_ms'):.0f} | {med(runs, 'tokens_per_s'):.1f} | "
                     f"{med(runs, 'preemptions'):.0f} | {max(r['peak_rss_mb'] for r in runs):.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budgets", default="1024,420", help="memory_budget_mb values, comma-separated")
    ap.add_argument("--budget-mb", type=int, help=argparse.SUPPRESS)  # the worker's one budget
    ap.add_argument("--compare", help="another commit to measure the same way")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--bundle", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.bundle, a.budget_mb)))
        return 0
    from quantize.fetch import fetch

    bundle = build_artifacts(fetch("smollm2-135m-instruct"), threads=2, rebuild=False)["ours-int4"]
    repos = {f"this checkout ({git('rev-parse', '--short', 'HEAD')})": REPO}
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        if a.compare:
            other = Path(tmp) / "compare"
            git("worktree", "add", "--detach", str(other), a.compare)
            repos[f"{a.compare}"] = other
        try:
            budgets = [int(b) for b in a.budgets.split(",")]
            rows = {(label, b): [] for b in budgets for label in repos}
            for _ in range(a.runs):  # interleaved: the shared machine's drift falls on all alike
                for (label, b), runs in rows.items():
                    runs.append(measure(repos[label], bundle, b))
        finally:
            if a.compare:
                git("worktree", "remove", "--force", str(other))
    report = table([(label, runs) for (label, _), runs in rows.items()])
    print(report)
    if a.write_docs:
        title = "## Admission (bench/admission.py)"
        cmd = f"`.venv/bin/python bench/admission.py --runs {a.runs}" + (f" --compare {a.compare}" if a.compare else "")
        replace_section(title, f"{title}\n\nCommand: {cmd} --write-docs`, "
                        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, our INT4 bundle, 2 threads, "
                        f"memory_budget_mb {a.budgets}, the engine's other defaults (the model's 8,192-token context). "
                        f"16 chat requests submitted at once (\"Write a short paragraph about X.\"), greedy, chat's "
                        f"default max_tokens 1,024, each ending at EOS or the limit; medians of {a.runs} runs, each a "
                        f"fresh process. Peak RSS is the process's VmHWM from the engine's start to the end (the largest of the runs); "
                        f"every request must end with stop or length.\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
