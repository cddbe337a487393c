"""How one request wants its tokens chosen: the OpenAI-style sampling knobs, validated once at the API boundary.

`SamplingParams` is frozen wire data; `agent.engine.sampler` reads it to pick each token and the engine reads
`max_tokens`, `stop` and `ignore_eos` to decide when a sequence is finished. Every rejected value is
reported with its field name and the range it must lie in, so an API client can fix its request.
"""
from __future__ import annotations

import math
import re
from functools import cached_property
from typing import Annotated, Literal

import numpy as np

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      model_validator)

MAX_STOP_STRINGS = 4  # the OpenAI API's limit ("up to 4 sequences")
MAX_STOP_CHARS = 1000  # ours: a 1 MB stop string was accepted, kept for the whole request and scanned per token
_SEED_MIN, _SEED_MAX = -(1 << 63), 1 << 64  # int64 or uint64: what a C client may send; see make_rng


def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    """Human-readable range: '>= 1', '> 0', 'in [0, 1]', 'in (0, 1]'."""
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def _in_range(lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
              note: str = "") -> AfterValidator:
    """A validator that rejects values outside the range (and NaN or infinity), naming field and range."""
    allowed = _interval(lo, hi, lo_open, hi_open) + (f" ({note})" if note else "")

    def check(value: float, info: ValidationInfo) -> float:
        ok = math.isfinite(value) and (value > lo if lo_open else value >= lo)
        if hi is not None:
            ok = ok and (value < hi if hi_open else value <= hi)
        if not ok:
            raise ValueError(f"{info.field_name} must be {allowed}, got {value!r}")
        return value

    return AfterValidator(check)


def _as_list(value: object) -> object:
    # OpenAI's `stop` is "string or array": a lone string is a list of one.
    return [value] if isinstance(value, str) else value


def _check_stop(stop: list[str]) -> list[str]:
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must be non-empty (1 or more characters)")
    if any(len(s) > MAX_STOP_CHARS for s in stop):  # each is kept, and checked at every token, while it runs
        raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters long")
    return stop


def _check_seed(seed: int | None) -> int | None:
    if seed is not None and not _SEED_MIN <= seed < _SEED_MAX:
        raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
    return seed


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 1024  # a bound on the work one request adds to every step
_TOKEN_ID = re.compile(r"-?[0-9]+", re.ASCII)  # negative ids get their own error below


def _token_id_keys(value: object) -> object:
    # OpenAI's logit_bias maps token ids written as JSON object keys (strings) to biases
    if not isinstance(value, dict):
        return value
    ids = {}
    for k in value:
        # ASCII digits only: int() also takes "1_0", " 7", "٣" and 5,000-digit strings, and str.isdigit()
        # passes keys that int() refuses ("²"), which must be a 400, not a 500
        text = k if isinstance(k, str) else str(k)
        if not (_TOKEN_ID.fullmatch(text) and len(text) <= 12):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        if int(text) in ids:  # "5" and "05": which bias was meant?
            raise ValueError(f"logit_bias names token {int(text)} twice")
        ids[int(text)] = value[k]
    return ids


def _check_logit_bias(bias: dict[int, float]) -> dict[int, float]:
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    for token, b in bias.items():
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids (>= 0), got {token}")
        if not (math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {token}")
    return bias


MAX_LOGPROBS = 20  # top entries per token: OpenAI's chat limit, and vLLM's default cap


def _check_logprobs(n: int | None) -> int | None:
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (top entries per token), got {n}")
    return n


MAX_STRUCTURE_CHARS = 256 * 1024  # a schema, regex or grammar: bounds what compiling one request may cost
StructureKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class Structure(BaseModel):
    """What a constrained request's output must match (agent.engine.constraint compiles it).

    text: the JSON schema (JSON text), the regex (Rust regex syntax, matched whole), the choices (a JSON list of
    strings) or the Lark grammar (llguidance's dialect); "" for json_object. param: the request field it came
    from, which a refusal names.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: StructureKind
    text: str = ""
    param: str

    @model_validator(mode="after")
    def _bounded(self) -> "Structure":
        if len(self.text) > MAX_STRUCTURE_CHARS:
            raise ValueError(f"{self.param} is {len(self.text)} characters long; at most {MAX_STRUCTURE_CHARS} "
                             "are accepted")
        return self


class SamplingParams(BaseModel):
    """Sampling settings of one request; defaults match the OpenAI API (temperature 1, nothing filtered)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: Annotated[int, _in_range(1)] = 256
    temperature: Annotated[float, _in_range(0, note="0 = greedy")] = 1.0
    top_p: Annotated[float, _in_range(0, 1, lo_open=True)] = 1.0
    # -1 is vLLM's "off", which clients written for vLLM send
    top_k: Annotated[int, BeforeValidator(lambda v: 0 if v == -1 else v), _in_range(0, note="0 or -1 = off")] = 0
    min_p: Annotated[float, _in_range(0, 1)] = 0.0
    # vLLM semantics over prompt + output tokens: positive logits divided, negative ones multiplied.
    repetition_penalty: Annotated[float, _in_range(0, lo_open=True, note="1 = off")] = 1.0
    # OpenAI semantics over output tokens only: logit -= count * frequency + (count > 0) * presence.
    presence_penalty: Annotated[float, _in_range(-2, 2)] = 0.0
    frequency_penalty: Annotated[float, _in_range(-2, 2)] = 0.0
    seed: Annotated[int | None, AfterValidator(_check_seed)] = None
    stop: Annotated[list[str], BeforeValidator(_as_list), AfterValidator(_check_stop)] = Field(default_factory=list)
    # Speculative decoding for this request: None follows the engine's config; "off", "ngram" (prompt lookup)
    # or "draft" (a smaller draft model, when the engine has one). Output distribution is unchanged.
    speculative: Literal["off", "ngram", "draft"] | None = None
    ignore_eos: bool = False  # keep generating through EOS until max_tokens (benchmarks); the engine's rule
    # OpenAI's logit_bias, added to the logits before the penalties (vLLM's order) and any sampling or argmax
    logit_bias: Annotated[dict[int, float], BeforeValidator(_token_id_keys), AfterValidator(_check_logit_bias)] = \
        Field(default_factory=dict)
    # constrained decoding: only tokens that keep the output matching this structure are drawn
    structure: Structure | None = None
    # log-probabilities of the generated tokens (agent.engine.logprobs), with this many of the most probable
    # tokens at each position; None: not computed at all
    logprobs: Annotated[int | None, AfterValidator(_check_logprobs)] = None

    @model_validator(mode="after")
    def _eos_needed(self) -> "SamplingParams":
        # a grammar ends its output with an end id; running on past it would leave the grammar
        if self.structure is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output (the grammar decides where "
                             "the output ends)")
        return self

    @property
    def is_greedy(self) -> bool:
        # vLLM's rule: a temperature this small is greedy in all but float rounding, and dividing logits by
        # it overflows (1e-50 made every probability 0 and the draw fail)
        return self.temperature < 1e-5

    @cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids, biases), built once per request rather than at every step."""
        return (np.fromiter(self.logit_bias, np.int64, len(self.logit_bias)),
                np.fromiter(self.logit_bias.values(), np.float32, len(self.logit_bias)))

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or a penalty applies (the sampler then works on a copy of the row)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0 or bool(self.logit_bias))
