"""OpenAI's `logprobs` objects, built from the engine's log-probability entries (agent.engine.logprobs).

Chat (OpenAI API reference, chat.completion `choices[].logprobs`): {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}, the same object on each stream chunk with
the entries of that chunk's tokens. Legacy completions: {"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}, whose top entries also hold the chosen token ("up to logprobs+1 elements"). A token's
`bytes` are the UTF-8 bytes it stands for and its `token` those bytes decoded, a partial character as U+FFFD (as
vLLM does; the bytes stay exact): joined, the tokens are the text wherever every token is whole characters.
Nothing here does I/O.
"""
from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from agent.engine.logprobs import LogprobEntry


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class TextLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # characters of the completion text before each token


def token_text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")


def _top(token: bytes, logprob: float) -> TopLogprob:
    return TopLogprob(token=token_text(token), logprob=logprob, bytes=list(token))


def chat_logprobs(entries: Sequence[LogprobEntry] | None) -> ChatLogprobs | None:
    """The chat object for these entries; None (JSON null) when the request did not ask."""
    if entries is None:
        return None
    return ChatLogprobs(content=[TokenLogprob(**_top(e.token, e.logprob).model_dump(),
                                              top_logprobs=[_top(t, v) for t, v in e.top]) for e in entries])


def text_logprobs(entries: Sequence[LogprobEntry] | None, offset: int = 0) -> TextLogprobs | None:
    """The legacy object for these entries (None when the request did not ask); offset: characters of text before
    the first of them (a stream's earlier chunks)."""
    if entries is None:
        return None
    tokens = [token_text(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [{token_text(t): v for t, v in e.top} | {token_text(e.token): e.logprob} for e in entries]
    return TextLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries], top_logprobs=top,
                        text_offset=offsets)
