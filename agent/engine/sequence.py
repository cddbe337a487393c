"""One request's state: its tokens, its place in the KV pool, its clock, and its explicit status.

Status moves WAITING -> PREFILLING -> DECODING -> FINISHED, and only through the named transitions
below (a preempted sequence goes back to WAITING and recomputes its tokens later).
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from agent.engine.sampling_params import SamplingParams
from agent.engine.speculative import DraftLength, LookupLength
from agent.wire import RequestFigures

if TYPE_CHECKING:  # the matcher is handed in by the engine; this module imports without llguidance
    from agent.engine.constraint import Constraint

_ids = itertools.count()


def delivery_gaps_s(token_times: list[float]) -> np.ndarray:
    """Inter-token latency as a client feels it: the gaps between the steps that delivered tokens. Tokens
    accepted together by speculative verification arrive at once, so they make one gap, not several of ~0
    (which would report an ITL p50 of 0.01 ms while the client waits 16-20 ms between bursts). Token times
    are non-decreasing, and a step's tokens share its time."""
    return np.diff(np.unique(np.asarray(token_times, dtype=np.float64)))


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    rng: np.random.Generator
    max_total_tokens: int  # prompt + completion limit (at most the largest slot)
    seq_id: int = field(default_factory=lambda: next(_ids))
    priority: int = 0  # lower first; FCFS within a priority
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why a request ended with FinishReason.ERROR (e.g. "overloaded: ...")
    num_computed: int = 0  # tokens whose KV is in the slot
    cancelled: bool = False
    preemptions: int = 0
    cached_prompt_tokens: int = 0
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float | None = None
    t_prefill_start: float | None = None
    t_first: float | None = None
    # perf_counter() of each generated token; the tokens of one step (accepted drafts) share that step's time
    token_times: list[float] = field(default_factory=list)
    kv_bytes: int = 0
    draft_length: DraftLength | LookupLength = field(default_factory=DraftLength)
    draft_rng: np.random.Generator | None = None  # a draft model's draws for this sampled request, spawned from rng
    draft_behind: bool = False  # it decoded in a batch too large to draft: it decodes plain from then on
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0  # tokens the grammar forced, verified together in multi-token steps
    constraint: Constraint | None = None  # set when params.structure is: the matcher its tokens must pass
    adapter: str | None = None  # the LoRA adapter (Engine.adapters' name) every step of it runs with; None: the base

    # ---- derived ----
    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next sample (the prompt's rest, or 1)."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    # ---- transitions ----
    def admit(self) -> None:
        assert self.status is Status.WAITING
        self.status = Status.PREFILLING
        if self.t_admit is None:
            self.t_admit = time.perf_counter()
        if self.t_prefill_start is None:
            self.t_prefill_start = time.perf_counter()

    def start_decoding(self) -> None:
        assert self.status is Status.PREFILLING
        self.status = Status.DECODING

    def preempt(self) -> None:
        """Drop the KV (recompute later), keep the tokens generated so far."""
        assert self.status in (Status.PREFILLING, Status.DECODING)
        self.status, self.num_computed = Status.WAITING, 0
        self.preemptions += 1

    def append_token(self, token: int, now: float) -> None:
        """now: when the step that produced it ended (one time for every token a step accepted)."""
        if self.t_first is None:
            self.t_first = now
        self.token_times.append(now)
        self.output_ids.append(token)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error

    # ---- figures ----
    def figures(self) -> RequestFigures:
        end = self.token_times[-1] if self.token_times else time.perf_counter()
        ms = lambda a, b: 1000.0 * (b - a) if a is not None and b is not None else 0.0  # noqa: E731
        gaps = delivery_gaps_s(self.token_times)
        itl = gaps * 1000.0 if len(gaps) else np.zeros(1)
        n_out = len(self.output_ids)
        decode_s = (self.token_times[-1] - self.t_first) if n_out > 1 else 0.0
        computed_prompt = len(self.prompt_ids) - self.cached_prompt_tokens
        prefill_s = (self.t_first - self.t_prefill_start) if self.t_first and self.t_prefill_start else 0.0
        return RequestFigures(
            prompt_tokens=len(self.prompt_ids), completion_tokens=n_out,
            cached_prompt_tokens=self.cached_prompt_tokens,
            # never admitted (shed, cancelled or refused while waiting): its whole wait, so that queue time
            # reads highest, not lowest, when the device is saturated
            queue_ms=ms(self.t_submit, end if self.t_admit is None else self.t_admit),
            ttft_ms=ms(self.t_submit, self.t_first),
            prefill_tokens_per_s=computed_prompt / prefill_s if prefill_s > 0 else 0.0,
            decode_tokens_per_s=(n_out - 1) / decode_s if decode_s > 0 else 0.0,
            itl_p50_ms=float(np.percentile(itl, 50)), itl_p95_ms=float(np.percentile(itl, 95)),
            e2e_ms=ms(self.t_submit, end), kv_bytes=self.kv_bytes,
            finish_reason=(self.finish_reason or FinishReason.ERROR).value, preemptions=self.preemptions,
            drafted_tokens=self.drafted_tokens, accepted_tokens=self.accepted_tokens,
            constrained=self.constraint is not None,
            constraint_ms=1000.0 * self.constraint.time_s if self.constraint is not None else 0.0)
