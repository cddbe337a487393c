"""The golden health check's measurement: a bundle's greedy continuation of its manifest's golden prompt and
its decode speed on this device, run on a fresh runner (measure_golden), or a prompt's continuation through the
serving engine with a LoRA adapter active (continue_greedy). An update (agent.updates.jobs, adapter_job)
compares the ids with the manifest's golden continuation and the speed with its floor before it may serve.
"""
from __future__ import annotations

import time

import numpy as np

from typing import TYPE_CHECKING

from agent.engine.bundle import Bundle
from agent.engine.runner import open_runner
from agent.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from agent.engine.engine import Engine


def measure_golden(bundle: Bundle, threads: int | None, n_tokens: int) -> tuple[list[int], float]:
    """Greedy continuation of the manifest's golden prompt, and its decode tokens/s, on this device."""
    runner = open_runner(bundle, threads)
    prompt = bundle.manifest.golden.prompt_ids
    cache = runner.new_cache(1, len(prompt) + n_tokens + 1)
    p = len(prompt)
    logits = runner.forward(np.array([prompt]), np.array([p - 1]), np.array([p]), np.array([[p - 1]]), cache)
    out = [int(logits[0, 0].argmax())]
    t0 = time.perf_counter()
    for t in range(p, p + n_tokens - 1):
        logits = runner.forward(np.array([[out[-1]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64), cache)
        out.append(int(logits[0, 0].argmax()))
    return out, (n_tokens - 1) / max(time.perf_counter() - t0, 1e-9)


def continue_greedy(engine: Engine, prompt_ids: list[int], n_tokens: int,
                    adapter: str | None) -> tuple[list[int], float]:
    """n_tokens greedy ids after prompt_ids through the engine (a request like any other, with the adapter the
    engine serves under that name; None: the base), and their decode tokens/s; RuntimeError if it failed."""
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True, speculative="off")
    done = engine.generate(list(prompt_ids), params, adapter=adapter)
    if done.error is not None:
        raise RuntimeError(f"the engine could not run the golden prompt: {done.error}")
    return done.token_ids, done.figures.decode_tokens_per_s
