"""What asking for log-probabilities costs: decode tokens/s of one greedy stream with logprobs off, with the chosen
token's only (0) and with the top 20, on the SmolLM2 INT4 bundle bench/tps.py builds (~/.cache/edge-llm/bench/
ours-int4), 128 tokens after a 128-token prompt as bench/tps.py measures decode. The settings alternate run by run,
so the machine's noise falls on all of them alike; each figure is the median over runs. Then the sampler's own
time per token on a row of this model's logits, which noise from other processes disturbs less.

Run: .venv/bin/python bench/logprobs.py [--runs 5] [--threads 2] [--bundle DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from agent.config import EngineConfig  # noqa: E402
from agent.engine.bundle import open_bundle  # noqa: E402
from agent.engine.engine import Engine  # noqa: E402
from agent.engine.sampler import make_rng, sample_with_logprobs  # noqa: E402
from agent.engine.sampling_params import SamplingParams  # noqa: E402

BUNDLE = Path.home() / ".cache" / "edge-llm" / "bench" / "ours-int4"
PROMPT_TOKENS, DECODE_TOKENS = 128, 128
SETTINGS = {"off": None, "logprobs 0": 0, "top 20": 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bundle", type=Path, default=BUNDLE)
    args = ap.parse_args()
    engine = Engine(open_bundle(args.bundle), EngineConfig(threads=args.threads, max_context=1024,
                                                           speculative="off"))
    text = (REPO / "quantize" / "data" / "eval_en.txt").read_text()
    prompt = engine.tokenizer.encode(text)[:PROMPT_TOKENS]
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    engine.generate(prompt[:8], SamplingParams(max_tokens=4, temperature=0.0, logprobs=20))  # warm-up, token table
    for _ in range(args.runs):
        for name, logprobs in SETTINGS.items():
            params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
            speeds[name].append(engine.generate(prompt, params).figures.decode_tokens_per_s)
    base = statistics.median(speeds["off"])
    print(f"{'logprobs':12} {'decode tok/s (median)':>22} {'vs off':>8}   runs")
    for name, values in speeds.items():
        m = statistics.median(values)
        print(f"{name:12} {m:22.1f} {m / base - 1:+8.1%}   {', '.join(f'{v:.1f}' for v in values)}")
    sampler_cost(engine, prompt)


def sampler_cost(engine: Engine, prompt: list[int], repeats: int = 2000) -> None:
    """Microseconds per token of sample_with_logprobs on the logits after the prompt (median of 5 batches)."""
    n, runner = len(prompt), engine.runner
    row = runner.forward(np.array([prompt]), np.array([n - 1]), np.array([n]), np.array([[n - 1]]),
                         runner.new_cache(1, n + 1))[0, 0]
    print(f"\n{'sampler':24} {'greedy us/token':>16} {'T=0.8 top_p=0.95':>17}")
    for name, logprobs in SETTINGS.items():
        cells = []
        for knobs in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=1)):
            params, rng, batches = SamplingParams(logprobs=logprobs, **knobs), make_rng(1), []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(repeats // 5):
                    sample_with_logprobs(row, params, prompt, [], rng)
                batches.append((time.perf_counter() - t0) / (repeats // 5) * 1e6)
            cells.append(statistics.median(batches))
        print(f"{name:24} {cells[0]:16.0f} {cells[1]:17.0f}")


if __name__ == "__main__":
    main()
