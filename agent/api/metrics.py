"""Prometheus metrics of the serving agent, exposed by the API at GET /metrics (the only prometheus_client import).

Names follow vLLM's (`vllm:` becomes `edge:`) where they mean the same, so its dashboards carry over:
counters of finished requests by finish reason and of prompt / generation tokens, of constrained requests and
the time their grammar matchers took (`edge:structured_*`), histograms of time to
first token, inter-token latency, end-to-end latency and queue time, and gauges read from the engine at
scrape time (running and waiting requests, KV-cache usage). Each server owns its own registry, so two
servers in one process (tests) never share counts.

Example:
    metrics = Metrics(); metrics.bind_engine(engine)
    metrics.observe_finished(finished.figures, token_times_s)
    body, content_type = metrics.render()
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agent.engine.sequence import delivery_gaps_s
from agent.wire import RequestFigures

# vLLM's bucket edges (seconds), so that histograms from both can be compared bucket for bucket.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0)
# Per-request decode speed on a CPU-only device: a few to a few hundred tokens/s.
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)


class EngineGauges(Protocol):
    """What the gauges read from the engine (agent.engine.engine.Engine has these)."""

    num_running: int
    num_waiting: int

    def kv_utilization(self) -> float: ...


class StructureCost(Protocol):
    """What a finished request's structured output cost (agent.engine.request.Finished has these)."""

    constrained: bool
    constraint_s: float
    constraint_masks: int
    constraint_forced: int


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.request_success = Counter("edge:request_success", "Finished requests, by finish reason.",
                                       ["finish_reason"], registry=r)
        self.request_errors = Counter("edge:request_errors", "Requests answered with an HTTP error, by error code.",
                                      ["code"], registry=r)
        self.prompt_tokens = Counter("edge:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.spec_drafted = Counter("edge:spec_decode_num_draft_tokens", "Speculative draft tokens proposed.",
                                    registry=r)
        self.spec_accepted = Counter("edge:spec_decode_num_accepted_tokens",
                                     "Speculative draft tokens the model accepted (acceptance rate = accepted / "
                                     "drafted).", registry=r)
        self.generation_tokens = Counter("edge:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.prefix_cache_queries = Counter("edge:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter("edge:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                         registry=r)
        self.ttft = Histogram("edge:time_to_first_token_seconds", "Submission to first token (queue included).",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("edge:inter_token_latency_seconds", "Time between consecutive deliveries of generated tokens (a speculative step's tokens arrive at once).",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("edge:e2e_request_latency_seconds", "Submission to last token.",
                             buckets=REQUEST_BUCKETS_S, registry=r)
        self.queue_time = Histogram("edge:request_queue_time_seconds", "Submission to admission into the batch.",
                                    buckets=REQUEST_BUCKETS_S, registry=r)
        self.decode_tokens_per_s = Histogram("edge:request_decode_tokens_per_second",
                                             "Decode speed of each request (tokens after the first / their time).",
                                             buckets=TOKENS_PER_S_BUCKETS, registry=r)
        self.structured_requests = Counter("edge:structured_requests",
                                           "Finished requests whose output was constrained (response_format, "
                                           "structured_outputs).", registry=r)
        self.structured_seconds = Counter("edge:structured_mask_seconds",
                                          "Time constrained requests spent in their grammar matcher (token checks, "
                                          "masks, advances); / generation tokens of them = cost per token.",
                                          registry=r)
        self.structured_masks = Counter("edge:structured_masks",
                                        "Full token masks computed (a drawn token the grammar refused).", registry=r)
        self.structured_tokens = Counter("edge:structured_generation_tokens",
                                         "Generated tokens of constrained requests.", registry=r)
        self.structured_forced = Counter("edge:structured_forced_tokens",
                                         "Generated tokens the grammar forced (run through the model several in "
                                         "one step).", registry=r)
        self._prefix_query_tokens = self._prefix_hit_tokens = 0  # mirrors of the counters, for the rate
        self._prefix_lock = threading.Lock()
        self._gauges(r)

    def _gauges(self, r: CollectorRegistry) -> None:
        self.num_running = Gauge("edge:num_requests_running", "Requests in the batch (prefilling or decoding).",
                                 registry=r)
        self.num_waiting = Gauge("edge:num_requests_waiting", "Requests waiting for a KV slot.", registry=r)
        self.kv_usage = Gauge("edge:kv_cache_usage_perc", "KV-cache usage as a fraction (1 = full), as vLLM's.",
                              registry=r)
        hit_rate = Gauge("edge:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up.",
                         registry=r)
        hit_rate.set_function(self._prefix_hit_rate)
        self.telemetry_dropped = Gauge("edge:telemetry_dropped_records",
                                       "Telemetry records lost for good (disk cap or full disk), lifetime.",
                                       registry=r)

    def bind_telemetry(self, dropped_total: Callable[[], int]) -> None:
        self.telemetry_dropped.set_function(dropped_total)

    def bind_engine(self, engine: EngineGauges) -> None:
        """Read the engine's gauges at each scrape (cheap reads of its counters)."""
        self.num_running.set_function(lambda: engine.num_running)
        self.num_waiting.set_function(lambda: engine.num_waiting)
        self.kv_usage.set_function(engine.kv_utilization)

    def _prefix_hit_rate(self) -> float:
        return self._prefix_hit_tokens / self._prefix_query_tokens if self._prefix_query_tokens else 0.0

    def observe_finished(self, f: RequestFigures, token_times_s: Sequence[float] = (),
                         structure: StructureCost | None = None) -> None:
        """Count one finished request; token_times_s are its tokens' monotonic times, for inter-token latency;
        structure: what its constraint cost, if it had one."""
        self.request_success.labels(finish_reason=f.finish_reason).inc()
        if structure is not None and structure.constrained:
            self.structured_requests.inc()
            self.structured_seconds.inc(structure.constraint_s)
            self.structured_masks.inc(structure.constraint_masks)
            self.structured_tokens.inc(f.completion_tokens)
            self.structured_forced.inc(structure.constraint_forced)
        self.prompt_tokens.inc(f.prompt_tokens)
        self.generation_tokens.inc(f.completion_tokens)
        self.spec_drafted.inc(f.drafted_tokens)
        self.spec_accepted.inc(f.accepted_tokens)
        self.prefix_cache_queries.inc(f.prompt_tokens)
        self.prefix_cache_hits.inc(f.cached_prompt_tokens)
        with self._prefix_lock:  # requests finish on their own threads
            self._prefix_query_tokens += f.prompt_tokens
            self._prefix_hit_tokens += f.cached_prompt_tokens
        self.queue_time.observe(f.queue_ms / 1000)
        if f.completion_tokens:
            self.ttft.observe(f.ttft_ms / 1000)
            self.e2e.observe(f.e2e_ms / 1000)
        if f.decode_tokens_per_s > 0:
            self.decode_tokens_per_s.observe(f.decode_tokens_per_s)
        for gap in delivery_gaps_s(list(token_times_s)):
            self.itl.observe(float(gap))

    def observe_error(self, code: str) -> None:
        self.request_errors.labels(code=code).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
