"""Constrained decoding: compile a request's structure (JSON schema, regex, choice, Lark grammar) with llguidance
and keep, per constrained sequence, the matcher that says which tokens may come next (the only llguidance import).

`Grammars` belongs to an engine: the model's llguidance tokenizer (built once from the bundle's tokenizer.json,
with the model's real end ids) and a bounded cache of compiled grammars keyed by the structure's hash. A
compiled grammar is a fresh `LLMatcher`; each sequence gets a deep copy (microseconds), so compilation (up to
hundreds of milliseconds for a large schema) happens once per distinct structure, on the submitting thread,
never in the engine's step. A structure that does not compile is a `GrammarError` naming the request field.

`Constraint` is one sequence's matcher and the cost it adds. The sampler asks `allows(token)` first (the fast
path) and `legal_mask()` only when the drawn token is illegal; the step then `accept`s each token it appends.
End ids are legal exactly where the grammar accepts. A matcher in error, or a state with no legal token, is a
`ConstraintError`: the engine ends that request, not the step.

Example:
    grammars = Grammars(bundle.tokenizer_json, config.vocab_size, config.eos_token_ids)
    constraint = grammars.constraint(Structure(kind="regex", text="[0-9]+", param="structured_outputs.regex"))
"""
from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance
import numpy as np

from agent.engine.sampling_params import Structure

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept (each a few hundred kB to a few MB of lexer state)
# JSON output without free whitespace: a small model given "any whitespace here" can emit newlines until
# max_tokens. ", " and ": " are what models (and Python's json.dumps) write. A schema's own "x-guidance"
# options override these (llguidance applies defaults, then x-guidance).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A structure that llguidance refuses (invalid schema, unsupported keyword, bad regex or grammar)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ConstraintError(RuntimeError):
    """A constrained sequence that cannot go on: its matcher failed or no token is legal (a dead end)."""


def _grammar_text(structure: Structure) -> str:
    """llguidance's grammar definition for the structure; ValueError when the text is not what its kind needs."""
    if structure.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, defaults=JSON_DEFAULTS)
    if structure.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(structure.text, defaults=JSON_DEFAULTS)
    if structure.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structure.text)
    if structure.kind == "choice":
        return llguidance.grammar_from("choice", structure.text)
    return llguidance.LLMatcher.grammar_from_lark(structure.text)


class Grammars:
    """The engine's llguidance tokenizer and compiled-grammar cache; any thread may call constraint()."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Sequence[int]):
        self._tokenizer_json = tokenizer_json  # read at the first constrained request: ~0.2 s and its tables
        self._tokenizer: llguidance.LLTokenizer | None = None  # are not paid by an agent that never needs them
        self.vocab_size, self.eos_ids = vocab_size, frozenset(eos_ids)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # LRU: key -> unused matcher
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                # n_vocab: the model's logits width, which may exceed the tokenizer's (padding ids never legal);
                # eos_token: the model's real end ids (SmolLM2's <|im_end|> is 2, tokenizer.json's eos 0)
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                         eos_token=sorted(self.eos_ids))
            return self._tokenizer

    def constraint(self, structure: Structure) -> Constraint:
        """A fresh matcher for one sequence; GrammarError (naming structure.param) when it does not compile."""
        return Constraint(self._compile(structure).deep_copy(), self.vocab_size, self.eos_ids)

    def _compile(self, structure: Structure) -> llguidance.LLMatcher:
        key = hashlib.sha256(f"{structure.kind}\0{structure.text}".encode()).hexdigest()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        try:
            grammar = _grammar_text(structure)
        except ValueError as e:
            raise GrammarError(f"{structure.param}: {e}", structure.param) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)  # releases the GIL while compiling
        if matcher.is_error():
            raise GrammarError(f"{structure.param}: {_first_line(matcher.get_error())}", structure.param)
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher


def _first_line(error: str) -> str:
    """llguidance's message without the parser-state dump that follows it."""
    return error.strip().split("\n<state>")[0].strip() or "the grammar is invalid"


class Constraint:
    """One sequence's matcher (engine thread only once submitted), with the time spent in it and the masks built."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int]):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self._bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # one bit per token id
        self.time_s = 0.0  # in allows / legal_mask / accept: what the structure costs this request
        self.num_masks = 0  # full masks computed (fast-path misses)

    def allows(self, token: int) -> bool:
        """Whether token may come next: an end id only where the grammar accepts."""
        t0 = time.perf_counter()
        try:
            if token in self.eos_ids:
                return self.matcher.is_accepting()
            return self.matcher.validate_tokens([token]) == 1
        finally:
            self.time_s += time.perf_counter() - t0

    def legal_mask(self) -> np.ndarray:
        """bool [vocab_size]: the tokens that may come next; ConstraintError when there are none."""
        t0 = time.perf_counter()
        self._bitmask[:] = 0
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        # bit i of word w is token 32 * w + i (llguidance's layout: little-endian words, low bit first)
        legal = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        self.num_masks += 1
        self.time_s += time.perf_counter() - t0
        if self.matcher.is_error():
            raise ConstraintError(f"structured output failed: {_first_line(self.matcher.get_error())}")
        if not legal.any():
            raise ConstraintError("structured output failed: the grammar allows no next token (a dead end)")
        return legal

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to limit tokens the grammar allows as the only continuation (a key name, closing brackets): they
        can go through the model together, as an accepted draft does."""
        t0 = time.perf_counter()
        forced = self.matcher.compute_ff_tokens()[:max(limit, 0)]
        self.time_s += time.perf_counter() - t0
        return [t for t in itertools.takewhile(lambda t: t not in self.eos_ids, forced)]

    def legal_prefix(self, draft: list[int]) -> list[int]:
        """The part of a draft the grammar allows from here, cut before an end id (one ends the request)."""
        t0 = time.perf_counter()
        draft = list(itertools.takewhile(lambda t: t not in self.eos_ids, draft))
        legal = draft[:self.matcher.validate_tokens(draft)] if draft else []
        self.time_s += time.perf_counter() - t0
        return legal

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accept()s (verification tried them; the step appends what it keeps)."""
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise ConstraintError(f"structured output failed: {_first_line(self.matcher.get_error())}")

    def accept(self, token: int) -> None:
        """Advance past an appended token (one allows() said was legal)."""
        if token in self.eos_ids:
            return  # the sequence ends here; the matcher is not used again
        t0 = time.perf_counter()
        ok = self.matcher.consume_token(token)
        self.time_s += time.perf_counter() - t0
        if not ok:
            raise ConstraintError(f"structured output failed: {_first_line(self.matcher.get_error())}")
