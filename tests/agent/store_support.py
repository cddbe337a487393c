"""What the telemetry-store tests share: a request record with chosen figures. Used by test_store*.py and
test_telemetry_reader.py, next to it in tests/agent (on sys.path through tests/agent/conftest.py)."""
from __future__ import annotations

from agent.wire import RequestFigures, RequestRecord


def figures(ttft_ms: float = 100.0, tps: float = 20.0, reason: str = "stop", tokens: int = 16) -> RequestFigures:
    return RequestFigures(prompt_tokens=8, completion_tokens=tokens, queue_ms=1.0, ttft_ms=ttft_ms,
                          prefill_tokens_per_s=400.0, decode_tokens_per_s=tps, itl_p50_ms=50.0, itl_p95_ms=60.0,
                          e2e_ms=ttft_ms + 800, kv_bytes=1 << 20, finish_reason=reason)


def request(model="smollm2", version="int4-aaaa", **kw) -> RequestRecord:
    return RequestRecord(model=model, version=version, figures=figures(**kw))
