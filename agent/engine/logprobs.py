"""Log-probabilities of generated tokens (OpenAI's `logprobs` / `top_logprobs`), and the bytes each token stands for.

`token_logprobs` reads the distribution a token was drawn from: the logits after logit_bias and the penalties,
restricted to the grammar's legal tokens for a constrained request, divided by the temperature. Greedy requests
(temperature 0) have no such distribution, so theirs is the one at temperature 1 after the same processing: the
chosen token is then its most probable one. top-k, top-p and min-p are not applied: they would give -inf to all
but a few tokens, which a client asking for the top 20 could not tell from banned ones. Pure numpy: it runs only
for the requests that ask (SamplingParams.logprobs not None), one row at a time, so other requests' steps cost
nothing more.

`token_byte_table` gives each token id the UTF-8 bytes it decodes to: byte-level BPE (GPT-2's printable alphabet
mapped back to bytes), SentencePiece ("▁" as a space, `<0xNN>` byte-fallback tokens as that byte), added and
special tokens as their text.

Example:
    x = apply_penalties(logits, params, prompt_ids, output_ids)
    entry = token_logprobs(x, token, params)  # entry.logprob, entry.top_ids, entry.top_logprobs
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from agent.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # handed one by agent.engine.tokenizer; the sampler imports this module without it
    from tokenizers import Tokenizer

# OpenAI: "-9999.0 is used to signify that the token is very unlikely"; JSON has no -inf (a banned or illegal token)
MIN_LOGPROB = -9999.0
_F32 = np.finfo(np.float32)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the most probable tokens at its position (most probable first)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class LogprobEntry:
    """TokenLogprobs with the tokens as the bytes they stand for: what travels to the API with the text."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


def token_logprobs(x: np.ndarray, token: int, params: SamplingParams, legal: np.ndarray | None = None) -> TokenLogprobs:
    """token's log-probability under x [V] (logits after bias and penalties), and the top params.logprobs entries.

    legal: bool [V], a constrained request's legal tokens at this position (the others get probability 0).
    """
    assert params.logprobs is not None
    # greedy: the distribution at temperature 1 (module docstring); x itself when nothing changes it (no copy)
    z = x
    if not params.is_greedy and params.temperature != 1:
        with np.errstate(over="ignore"):  # to +-inf: handled below
            z = np.multiply(x, np.float32(1 / params.temperature), dtype=np.float32)
    if legal is not None:
        z = np.where(legal, z, np.float32(-np.inf))
    top = float(z.max())
    if not math.isfinite(top):  # a +inf logit (a penalty's overflow): float32's largest, as the sampler treats it
        z = np.clip(z, _F32.min, _F32.max)
        top = float(z.max())
    with np.errstate(over="ignore"):  # float32's lowest minus its largest: -inf, probability 0
        e = np.subtract(z, top, dtype=np.float32)
    np.exp(e, out=e)
    log_total = top + float(np.log(e.sum()))  # logsumexp(z); float32 pairwise sum: relative error ~1e-6
    n = min(params.logprobs, len(z))
    ids = np.argpartition(z, len(z) - n)[len(z) - n:] if n else np.zeros(0, np.int64)
    ids = ids[np.argsort(-z[ids], kind="stable")]
    logprob = (np.maximum(z[[token, *ids]] - np.float64(log_total), MIN_LOGPROB)).tolist()
    return TokenLogprobs(int(token), logprob[0], tuple(ids.tolist()), tuple(logprob[1:]))


def with_bytes(lp: TokenLogprobs, table: list[bytes]) -> LogprobEntry:
    """lp with its token ids replaced by their bytes (table: token_byte_table's). A model whose logits are wider
    than its tokenizer's vocabulary (padded rows) has ids without text: b""."""
    def text(i: int) -> bytes:
        return table[i] if i < len(table) else b""
    return LogprobEntry(text(lp.token_id), lp.logprob, tuple((text(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)))


def _gpt2_byte_alphabet() -> dict[int, int]:
    """GPT-2's byte-level alphabet read back, as a str.translate table: printable character -> its byte's
    code point (so that translating and encoding as Latin-1 gives the bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = b
        else:
            table[256 + extra] = b
            extra += 1
    return table


def _decoder_kinds(tokenizer: Tokenizer) -> set[str]:
    """The types of a tokenizer's decoder and of the steps of a Sequence decoder (its state is its JSON)."""
    if tokenizer.decoder is None:
        return set()
    decoder = json.loads(tokenizer.decoder.__getstate__())
    return {decoder["type"], *(d["type"] for d in decoder.get("decoders") or [])}


def _byte_level(piece: str, alphabet: dict[int, int]) -> bytes:
    try:
        return piece.translate(alphabet).encode("latin-1")
    except UnicodeEncodeError:  # not spelled in the alphabet: its text
        return piece.encode()


def token_byte_table(tokenizer: Tokenizer) -> list[bytes]:
    """Each token id's bytes [vocab_size]; ~80 ms for a 49k vocabulary."""
    kinds = _decoder_kinds(tokenizer)
    added = {i: t.content.encode() for i, t in tokenizer.get_added_tokens_decoder().items()}
    pieces = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    alphabet = _gpt2_byte_alphabet()
    table = []
    for i, piece in enumerate(pieces):
        if i in added:
            table.append(added[i])
        elif piece is None:
            table.append(b"")
        elif "ByteLevel" in kinds:
            table.append(_byte_level(piece, alphabet))
        elif "ByteFallback" in kinds and (m := _BYTE_TOKEN.fullmatch(piece)):
            table.append(bytes([int(m[1], 16)]))
        elif kinds & {"Metaspace", "Replace"}:
            table.append(piece.replace("\u2581", " ").encode())
        else:  # WordPiece and others: what decoding the token alone gives
            table.append(tokenizer.decode([i], skip_special_tokens=False).encode())
    return table
