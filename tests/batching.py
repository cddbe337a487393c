"""Running greedy requests through an engine together, driven step by step in the test's own thread."""
from __future__ import annotations

from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run_together(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list:
    """Submit every prompt at once (greedy), step the engine until all finish; their Finished results."""
    handles = [engine.submit(p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts]
    while any(not h.seq.is_finished for h in handles):
        engine.step()
    return [h.result() for h in handles]
