"""One request's answer in OpenAI's shapes: the whole response, or its stream's chunks, built from engine events.

A `ChatReplies` or `TextReplies` belongs to one request and may keep state across its events (a stream's tool
calls are cut into fragments as their text arrives). `sse_event` writes one chunk as a server-sent event.
Nothing here does I/O.

Example:
    replies = ChatReplies(Reply("chatcmpl-1", 0, "m", "v1", include_usage=False))
    chunks = [*replies.opening(), *replies.delta(TextDelta("Hi")), *replies.end(finished)]
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel

from agent.api import openai_models as om
from agent.api.tool_calls import Syntax, ToolCallStream, parse_reply, tool_calls
from agent.api.logprobs import ChatLogprobs, TextLogprobs, chat_logprobs, text_logprobs
from agent.engine.request import Finished, TextDelta


@dataclass(frozen=True)
class Reply:
    """Identity shared by a response and every chunk of its stream."""

    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool

    def common(self) -> dict:
        return dict(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint)


class ChatReplies:
    """chat.completion and chat.completion.chunk objects for one request; with a tool syntax, its reply is read
    as text and tool calls (agent.api.tool_calls)."""

    def __init__(self, reply: Reply, tool_syntax: Syntax | None = None):
        self.reply, self.tool_syntax = reply, tool_syntax
        self.tool_stream = ToolCallStream(tool_syntax) if tool_syntax else None

    def response(self, fin: Finished) -> om.ChatCompletion:
        message, finish = om.AssistantMessage(content=fin.text), fin.figures.finish_reason
        if self.tool_syntax is not None:
            view = parse_reply(fin.text, self.tool_syntax)
            calls = tool_calls(view)
            if calls:  # OpenAI: content null beside calls unless the model also wrote text
                message, finish = om.AssistantMessage(content=view.content or None, tool_calls=calls), "tool_calls"
            elif not view.calls:
                message = om.AssistantMessage(content=view.content)
        choice = om.ChatChoice(message=message, finish_reason=finish, logprobs=chat_logprobs(fin.logprobs))
        return om.ChatCompletion(**self.reply.common(), choices=[choice], usage=om.Usage.of(fin.figures),
                                 timings=fin.figures)

    def opening(self) -> list[om.ChatCompletionChunk]:
        # OpenAI's first chunk carries the role and empty content.
        return [self._chunk(om.ChatDelta(role="assistant", content=""))]

    def delta(self, event: TextDelta) -> list[om.ChatCompletionChunk]:
        logprobs = chat_logprobs(event.logprobs or None)
        if self.tool_stream is None:
            return [self._chunk(om.ChatDelta(content=event.text), logprobs=logprobs)]
        content, calls = self.tool_stream.push(event.text)
        if not (content or calls or logprobs):
            return []
        return [self._chunk(om.ChatDelta(content=content or None, tool_calls=calls or None), logprobs=logprobs)]

    def end(self, fin: Finished) -> list[om.ChatCompletionChunk]:
        last = self._chunk(om.ChatDelta(), fin)
        usage = om.ChatCompletionChunk(**self.reply.common(), choices=[], usage=om.Usage.of(fin.figures))
        return [last, usage] if self.reply.include_usage else [last]

    def _chunk(self, delta: om.ChatDelta, fin: Finished | None = None,
               logprobs: ChatLogprobs | None = None) -> om.ChatCompletionChunk:
        finish = fin.figures.finish_reason if fin else None
        if finish == "stop" and self.tool_stream is not None and self.tool_stream.has_calls:
            finish = "tool_calls"
        choice = om.ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)
        return om.ChatCompletionChunk(**self.reply.common(), choices=[choice], timings=fin.figures if fin else None)


class TextReplies:
    """text_completion objects (OpenAI uses one name for responses and chunks) for one request."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.text_offset = 0  # characters of the stream's tokens so far (logprobs' text_offset)

    def response(self, fin: Finished) -> om.TextCompletion:
        choice = om.TextChoice(text=fin.text, finish_reason=fin.figures.finish_reason,
                               logprobs=text_logprobs(fin.logprobs))
        return om.TextCompletion(**self.reply.common(), choices=[choice], usage=om.Usage.of(fin.figures),
                                 timings=fin.figures)

    def opening(self) -> list[om.TextCompletion]:
        return []

    def delta(self, event: TextDelta) -> list[om.TextCompletion]:
        logprobs = text_logprobs(event.logprobs or None, self.text_offset)
        if logprobs is not None:
            self.text_offset += sum(len(t) for t in logprobs.tokens)
        return [self._chunk(event.text, logprobs=logprobs)]

    def end(self, fin: Finished) -> list[om.TextCompletion]:
        last = self._chunk("", fin)
        usage = om.TextCompletion(**self.reply.common(), choices=[], usage=om.Usage.of(fin.figures))
        return [last, usage] if self.reply.include_usage else [last]

    def _chunk(self, text: str, fin: Finished | None = None, logprobs: TextLogprobs | None = None) -> om.TextCompletion:
        choice = om.TextChoice(text=text, finish_reason=fin.figures.finish_reason if fin else None, logprobs=logprobs)
        return om.TextCompletion(**self.reply.common(), choices=[choice], timings=fin.figures if fin else None)


Replies = ChatReplies | TextReplies


def sse_event(chunk: BaseModel, include_usage: bool) -> bytes:
    """One `data:` event. OpenAI: with include_usage every chunk has "usage" (null but the last); chat deltas
    carry only the keys they set; `timings` appears on the chunk that finishes the choice."""
    body = chunk.model_dump(mode="json")
    for choice in body["choices"]:
        if "delta" in choice:
            choice["delta"] = _without_nulls(choice["delta"])
    if not include_usage and body["usage"] is None:
        del body["usage"]
    if body["timings"] is None:
        del body["timings"]
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _without_nulls(value):
    """A delta's keys that are set, at every level (a tool call's later fragments carry no id or name)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
