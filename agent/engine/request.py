"""A request's stream between the engine and its submitter: the events it yields (TextDelta, then one
Finished), the handle the submitter holds, and RequestError with the checks that refuse a request up front.

The engine thread writes a stream (add_token, finish); any thread iterates its events or cancels it.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass, field

from agent.engine.logprobs import LogprobEntry, TokenLogprobs, with_bytes
from agent.engine.sampling_params import SamplingParams
from agent.engine.sequence import FinishReason, Sequence
from agent.engine.tokenizer import IncrementalDetokenizer
from agent.wire import RequestFigures


class RequestError(ValueError):
    """A request the engine refuses up front; `code` follows OpenAI's error codes."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None,
                 refused: "Finished | None" = None):
        super().__init__(message)
        self.code, self.param = code, param  # param: the request field at fault, when it is not the prompt
        self.refused = refused  # a request turned away for load: its figures, for telemetry like a shed one's


def check_request(prompt_ids: list[int], params: SamplingParams, max_prompt_tokens: int, context_tokens: int,
                  vocab_size: int, has_draft: bool) -> None:
    """RequestError for a request this model cannot serve as asked, whatever the load: an empty or too long
    prompt (context_tokens: the largest slot), a logit_bias outside the vocabulary, a draft model it lacks."""
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    if len(prompt_ids) > max_prompt_tokens:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context holds "
                           f"{context_tokens} (prompt plus at least one generated token)",
                           "context_length_exceeded")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise RequestError(f"logit_bias: token id {max(params.logit_bias)} is outside this model's vocabulary "
                           f"[0, {vocab_size})", "invalid_value", param="logit_bias")
    if params.speculative == "draft" and not has_draft:
        raise RequestError("speculative='draft' needs the agent to run with a draft model (--draft-model)",
                           param="speculative")


# an engine error message's prefix -> Finished.error_code
ERROR_CODES = {"overloaded": "overloaded", "unavailable": "unavailable", "structured output": "structured_output"}


@dataclass(frozen=True)
class TextDelta:
    text: str
    # a request that asks for log-probabilities: the entries of the tokens whose text starts in this delta (or, in
    # the last delta, of those whose text never appeared: a stop string's, a special token's), in order
    logprobs: tuple[LogprobEntry, ...] = ()


@dataclass(frozen=True)
class Finished:
    text: str  # the whole completion
    token_ids: list[int]
    figures: RequestFigures
    error: str | None = None  # set when figures.finish_reason == "error"
    # "overloaded" (no capacity within the queue's wait), "unavailable" (the engine stopped first),
    # "structured_output" (the grammar reached a dead end: agent.engine.constraint.ConstraintError) or "internal"
    error_code: str | None = None
    token_times: list[float] = field(default_factory=list)  # perf_counter() of each generated token (Sequence's)
    # structured output: whether the request was constrained, the time its matcher took (checks, masks and
    # advances) and the full masks computed (draws the grammar refused)
    constrained: bool = False
    constraint_s: float = 0.0
    constraint_masks: int = 0
    constraint_forced: int = 0  # of the completion tokens, those the grammar forced (run several in one step)
    # one entry per generated token but the EOS that ended the output (as OpenAI and vLLM give), when the request
    # asked for log-probabilities (SamplingParams.logprobs); None when it did not
    logprobs: list[LogprobEntry] | None = None
    adapter: str | None = None  # the LoRA adapter it ran with, as its manifest's NAME@VERSION; None: the base


class RequestHandle:
    """The submitter's side of a request: iterate its events; cancel() from any thread."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer | None = None,
                 token_bytes: list[bytes] | None = None):
        self.seq = seq
        self.events: queue.Queue = queue.Queue()
        self.text_parts: list[str] = []  # written by the engine thread only
        self.detok = detok  # the engine thread's, set when it takes the request in
        self.token_bytes = token_bytes  # each token id's bytes: set when the request asks for log-probabilities
        self.logprobs: list[LogprobEntry] = []  # the engine thread's; logprobs[num_sent:] wait for their text
        self.num_sent = 0
        self.adapter: str | None = None  # Finished.adapter, set by the engine that takes it

    def cancel(self) -> None:
        self.seq.cancelled = True

    def __iter__(self):
        while True:
            ev = self.events.get()
            yield ev
            if isinstance(ev, Finished):
                return

    def result(self) -> Finished:
        *_, last = iter(self)
        return last

    # ---- the engine thread's side ----
    def add_token(self, token: int, is_eos: bool, logprobs: TokenLogprobs | None = None) -> bool:
        """Stream a generated token's text (an EOS token has none) and log-probabilities; returns whether a stop
        string ended it."""
        if logprobs is not None and not is_eos:
            self.logprobs.append(with_bytes(logprobs, self.token_bytes))
        delta = "" if is_eos else self.detok.add(token)
        if delta:
            self._emit(delta)
        return self.detok.stopped

    def finish(self) -> None:
        """The last events: text held back that turned out not to be a stop string, then Finished."""
        seq = self.seq
        tail = self.detok.flush()
        if tail or self.num_sent < len(self.logprobs):
            self._emit(tail)
        code = None
        if seq.finish_reason is FinishReason.ERROR:
            code = next((c for prefix, c in ERROR_CODES.items() if (seq.error or "").startswith(prefix)), "internal")
        c = seq.constraint
        self.events.put(Finished("".join(self.text_parts), list(seq.output_ids), seq.figures(), seq.error, code,
                                 list(seq.token_times), c is not None, c.time_s if c else 0.0,
                                 c.num_masks if c else 0, seq.forced_tokens,
                                 self.logprobs if seq.params.logprobs is not None else None, self.adapter))

    def _emit(self, text: str) -> None:
        self.text_parts.append(text)
        entries, self.num_sent = tuple(self.logprobs[self.num_sent:]), len(self.logprobs)
        self.events.put(TextDelta(text, entries))
