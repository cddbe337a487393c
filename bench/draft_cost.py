"""What draft-model speculation must pay for, per call: the target's one-row decode step, its verify steps of
k+1 rows, and each draft's one-token step, all after the same past, interleaved round by round so that the
shared machine's drift falls on every figure alike. Each figure is the median over rounds, and every cost is
also given as a fraction of the target's one-row step (the unit speculation's gain is counted in).

With a draft costing c target steps per token, a verify of k+1 rows costing v(k) and each draft token accepted
with probability p, a step emits (1 - p^(k+1)) / (1 - p) tokens for v(k) + k c target steps: the table says
which c and v(k) this machine gives, the acceptance comes from a run (bench/speculative.py, edge-agent generate).

Run: .venv/bin/python bench/draft_cost.py TARGET_BUNDLE DRAFT_BUNDLE [DRAFT_BUNDLE ...] [--past 300] [--rounds 30]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.engine.bundle import open_bundle  # noqa: E402
from agent.engine.runner import open_runner  # noqa: E402

VERIFY_ROWS = (2, 3, 5, 9)  # a verify step of k drafts runs k + 1 rows


def step_timer(bundle: Path, threads: int, past: int) -> Callable[[int], float]:
    """A function that times one call of `rows` new tokens after a `past`-token cache (rewritten each call)."""
    runner = open_runner(open_bundle(bundle), threads)
    context = past + max(VERIFY_ROWS) + 1
    cache = runner.new_cache(1, context)
    runner.forward(np.ones((1, past), np.int64), np.array([past - 1]), np.array([past]), np.array([[past - 1]]), cache)

    def step(rows: int) -> float:
        t0 = time.perf_counter()
        runner.forward(np.ones((1, rows), np.int64), np.array([past + rows - 1]), np.array([rows]),
                       np.array([list(range(rows))]), cache)
        return time.perf_counter() - t0
    return step


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", type=Path)
    p.add_argument("drafts", type=Path, nargs="+")
    p.add_argument("--past", type=int, default=300, help="Tokens already in the cache.")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    target = step_timer(a.target, a.threads, a.past)
    drafts = {d: step_timer(d, a.threads, a.past) for d in a.drafts}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.rounds):
        for rows in (1, *VERIFY_ROWS):
            times.setdefault((f"target {a.target.name}", rows), []).append(target(rows))
        for path, step in drafts.items():
            times.setdefault((f"draft {path.name}", 1), []).append(step(1))
    unit = statistics.median(times[(f"target {a.target.name}", 1)])
    print(f"past {a.past} tokens, {a.threads} threads, median of {a.rounds} interleaved rounds\n")
    print("| model | rows | ms per call | x target step |\n|---|--:|--:|--:|")
    for (label, rows), ts in times.items():
        ms = statistics.median(ts)
        print(f"| {label} | {rows} | {ms * 1000:.1f} | {ms / unit:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
