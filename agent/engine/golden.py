"""The golden health check's measurement: a bundle's greedy continuation of its manifest's golden prompt and
its decode speed on this device, run on a fresh runner. An update (agent.updates.jobs) compares the ids with
the manifest's golden continuation and the speed with its floor before the new model may serve.
"""
from __future__ import annotations

import time

import numpy as np

from agent.engine.bundle import Bundle
from agent.engine.runner import open_runner


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
