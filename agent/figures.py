"""Which requests a percentile of their figures counts, and the percentile itself: one definition for the
agent's own summary (agent.link.telemetry) and the fleet's queries and rollups, so that a device and the fleet
report the same p50 of the same requests."""
from __future__ import annotations


# Which requests a percentile of these figures counts (the agent's summary and the fleet's queries): one that
# produced no token has no time to first token (its ttft_ms is 0: shed, cancelled or failed first), one with
# fewer than 2 tokens no decode speed. Counting those zeros made an overloaded device look faster.
def has_ttft(completion_tokens: int) -> bool:
    return completion_tokens >= 1


def has_decode_speed(completion_tokens: int) -> bool:
    return completion_tokens >= 2


def ttft_samples(rows) -> list[float]:
    return [r["ttft_ms"] for r in rows if has_ttft(r["completion_tokens"])]


def decode_speed_samples(rows) -> list[float]:
    return [r["decode_tokens_per_s"] for r in rows if has_decode_speed(r["completion_tokens"])]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolating linearly between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
