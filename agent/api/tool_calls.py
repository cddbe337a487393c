"""Tool calling on top of constrained decoding: how a chat request's tools reach the model's prompt, the grammar its
reply is held to, and how that reply becomes OpenAI's tool_calls, whole or as a stream of fragments.

Two call syntaxes, chosen per model from its chat template:
- "hermes": the template lists `tools` itself and shows calls as `<tool_call>\\n{"name": ..., "arguments": ...}
  \\n</tool_call>` (Qwen 2.5, Qwen3, Hermes). The template renders tools, calls and tool results natively.
- "generic": any other template (SmolLM2's knows no tools). A system block lists the tools and asks for one JSON
  object, `{"tool_call": {"name", "arguments"}}`, `{"tool_calls": [...]}` (parallel calls) or `{"response": "..."}`
  (a text answer, when tool_choice is "auto"); calls and results in the history are rendered in that same form.
Either way each call is the JSON object {"name": <a tool's name>, "arguments": <its parameters schema>}, keys in
that order, with ", " and ": " separators (constraint.JSON_DEFAULTS), so parsing the reply is exact: no regex
scraping of free text. "required" and a named choice constrain from the first token; "auto" also lets the
reply be text (hermes: text that does not start with "<"; generic: the "response" object).

Example:
    plan = tool_plan(req, tokenizer.chat_template_source)        # None: no tools in play
    ids = tokenizer.encode_chat(plan.messages(req.template_messages()), tools=plan.template_tools())
    reply = parse_reply(finished_text, plan.syntax)              # .content, .calls
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from agent.api import openai_models as om
from pydantic import ValidationError

from agent.api.tool_models import FunctionCall, FunctionCallDelta, NamedToolChoice, Tool, ToolCall, ToolCallDelta
from agent.engine.constraint import JSON_DEFAULTS
from agent.engine.sampling_params import Structure

Syntax = Literal["hermes", "generic"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>\n", "\n</tool_call>"
GENERIC_CALL, GENERIC_CALLS, GENERIC_TEXT = '{"tool_call": ', '{"tool_calls": [', '{"response": "'
_CALL_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


def template_syntax(template_source: str) -> Syntax:
    """hermes when the template shows calls in <tool_call> tags and prints `tools` itself."""
    return "hermes" if "<tool_call>" in template_source and "tools" in template_source else "generic"


# ---- the plan: what the request asks, for this model --------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    syntax: Syntax
    tools: tuple[Tool, ...]  # offered to the model: all of them, or the named one (empty: tool_choice "none")
    required: bool  # a call must come ("required" or a named function); else text is allowed too
    parallel: bool
    # hermes: the grammar's <tool_call> and </tool_call>, by token id where they are added tokens (llguidance
    # reads every added token as a special one, which a string in the grammar never matches)
    tags: tuple[str, str] = ('"<tool_call>"', '"</tool_call>"')

    def template_tools(self) -> list[dict] | None:
        """tools for the template (hermes lists them itself); None otherwise."""
        if self.syntax != "hermes" or not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def messages(self, messages: list[dict]) -> list[dict]:
        """The history as the template takes it: hermes as is; generic with calls and results as JSON text and
        the tools listed in a system block."""
        if self.syntax == "hermes":
            return messages
        rendered = _generic_history(messages)
        if not self.tools:
            return rendered
        block = _generic_instructions(self.tools, self.required, self.parallel)
        if rendered and rendered[0]["role"] == "system":
            return [{**rendered[0], "content": f"{rendered[0]['content']}\n\n{block}"}, *rendered[1:]]
        return [{"role": "system", "content": block}, *rendered]

    def structure(self) -> Structure | None:
        """The grammar the reply is held to; None when no tool may be called."""
        if not self.tools:
            return None
        calls = [_call_schema(t) for t in self.tools]
        one_call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.syntax == "hermes":
            kind, text = "grammar", _hermes_grammar(one_call, self.required, self.parallel, self.tags)
        else:
            kind, text = "json_schema", json.dumps(_generic_schema(one_call, self.required, self.parallel))
        try:
            return Structure(kind=kind, text=text, param="tools")
        except ValidationError as e:  # its size
            raise om.FieldError(e.errors(include_url=False)[0]["msg"].removeprefix("Value error, "), "tools") from None


def tool_plan(req: om.ChatCompletionRequest, template_source: str,
              added_token_id: Callable[[str], int | None] = lambda text: None) -> ToolPlan | None:
    """The request's tool plan (None when it has no tools and its history no calls); FieldError for a
    tool_choice that names no offered tool, or tools beside response_format. added_token_id: the model's added
    tokens (TextTokenizer.added_token_id)."""
    tools, choice = tuple(req.tools or ()), req.tool_choice
    if choice is not None and not tools and choice != "none":
        raise om.FieldError("tool_choice needs tools to choose from", "tool_choice")
    if not tools and not any(m.role == "tool" or m.tool_calls for m in req.messages):
        return None
    if isinstance(choice, NamedToolChoice):
        tools = tuple(t for t in tools if t.function.name == choice.function.name)
        if not tools:
            offered = ", ".join(repr(t.function.name) for t in req.tools)
            raise om.FieldError(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                f"the tools ({offered})", "tool_choice")
    elif choice == "none":
        tools = ()
    if tools and (req.response_format is not None and req.response_format.type != "text"
                  or req.structured_outputs is not None):
        raise om.FieldError("tools and a response format cannot be combined (set tool_choice to \"none\" or drop "
                            "response_format / structured_outputs)", "tools")
    required = choice == "required" or isinstance(choice, NamedToolChoice)
    tags = tuple(f"<[{i}]>" if (i := added_token_id(tag)) is not None else json.dumps(tag)
                 for tag in ("<tool_call>", "</tool_call>"))
    return ToolPlan(template_syntax(template_source), tools, required, req.parallel_tool_calls is not False, tags)


def _call_schema(tool: Tool) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters_schema}}


def _hermes_grammar(one_call: dict, required: bool, parallel: bool, tags: tuple[str, str]) -> str:
    # TEXT may not start with "<" (or blank): a reply that opens a tag is a call and held to its syntax
    body = json.dumps({**one_call, "x-guidance": JSON_DEFAULTS})
    # a newline may end the reply: the model writes one before its end token
    calls = 'call ("\\n" call)* "\\n"?' if parallel else 'call "\\n"?'
    start = "start: calls" if required else "start: TEXT | calls\nTEXT: /[^<\\s](.|\\n)*/"
    return f'{start}\ncalls: {calls}\ncall: {tags[0]} "\\n" body "\\n" {tags[1]}\nbody: %json {body}'



def _generic_schema(one_call: dict, required: bool, parallel: bool) -> dict:
    def envelope(key: str, value: dict) -> dict:
        return {"type": "object", "additionalProperties": False, "required": [key], "properties": {key: value}}

    shapes = [envelope("tool_call", one_call)]
    if parallel:
        shapes.append(envelope("tool_calls", {"type": "array", "minItems": 1, "items": one_call}))
    if not required:
        shapes.append(envelope("response", {"type": "string"}))
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def _generic_instructions(tools: tuple[Tool, ...], required: bool, parallel: bool) -> str:
    listed = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                   "parameters": t.function.parameters_schema}, ensure_ascii=False) for t in tools)
    lines = ["You can call these tools (each with a JSON schema of its arguments):", listed, "",
             'To call a tool, reply with only this JSON object: {"tool_call": {"name": "<tool name>", '
             '"arguments": {<the arguments>}}}']
    if parallel:
        lines.append('To call several tools at once: {"tool_calls": [{"name": ..., "arguments": ...}, ...]}')
    if not required:
        lines.append('To answer without calling a tool: {"response": "<your answer>"}')
    return "\n".join(lines)


def _generic_history(messages: list[dict]) -> list[dict]:
    """Calls as the JSON the model was asked for; tool results as user messages (templates that know no tools
    know no "tool" role)."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", [])}
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            envelope = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
            out.append({"role": "assistant", "content": json.dumps(envelope, ensure_ascii=False)})
        elif m["role"] == "tool":
            result = {"name": names.get(m["tool_call_id"], ""), "content": m["content"]}
            out.append({"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)})
        else:
            out.append(m)
    return out


# ---- reading the reply -----------------------------------------------------------------------------------------
@dataclass
class CallView:
    name: str | None  # None until the whole name has arrived
    arguments: str  # the arguments' JSON text so far
    complete: bool


@dataclass
class ReplyView:
    """What a reply (or the part of it generated so far) says: text content and calls."""

    content: str = ""
    calls: list[CallView] = field(default_factory=list)


def parse_reply(text: str, syntax: Syntax) -> ReplyView:
    """The reply read in its syntax; a prefix of a reply reads as far as it goes (undecided text reads as
    nothing yet)."""
    return _parse_hermes(text) if syntax == "hermes" else _parse_generic(text)


def _parse_hermes(text: str) -> ReplyView:
    if HERMES_OPEN.startswith(text):
        return ReplyView()  # "" or part of the opening tag: a call or not, still undecided
    if not text.startswith(HERMES_OPEN):
        return ReplyView(content=text)
    view, pos = ReplyView(), 0
    while text.startswith(HERMES_OPEN, pos):
        call, pos = _parse_call(text, pos + len(HERMES_OPEN))
        view.calls.append(call)
        if not call.complete or not text.startswith(HERMES_CLOSE, pos):
            break
        pos += len(HERMES_CLOSE) + text.startswith("\n", pos + len(HERMES_CLOSE))
    return view


def _parse_generic(text: str) -> ReplyView:
    if any(head.startswith(text) for head in (GENERIC_CALL, GENERIC_CALLS, GENERIC_TEXT)):
        return ReplyView()
    if text.startswith(GENERIC_TEXT):
        return ReplyView(content=_partial_json_string(text[len(GENERIC_TEXT):]))
    if text.startswith(GENERIC_CALL):
        return ReplyView(calls=[_parse_call(text, len(GENERIC_CALL))[0]])
    if not text.startswith(GENERIC_CALLS):
        return ReplyView(content=text)  # not held to the envelope (no grammar): shown as it is
    view, pos = ReplyView(), len(GENERIC_CALLS)
    while True:
        call, pos = _parse_call(text, pos)
        view.calls.append(call)
        if not call.complete or not text.startswith(", ", pos):
            return view
        pos += 2


def _parse_call(text: str, pos: int) -> tuple[CallView, int]:
    """The call object at pos and the index after it."""
    head = _CALL_HEAD.match(text, pos)
    if head is None:
        return CallView(None, "", False), len(text)
    name, start = json.loads(f'"{head[1]}"'), head.end()
    end = _json_value_end(text, start)
    if end is None:
        return CallView(name, text[start:], False), len(text)
    complete = text.startswith("}", end)
    return CallView(name, text[start:end], complete), end + complete


def _json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array starting at text[start], or None if it is not finished."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = c == "\\", c != '"'
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _partial_json_string(raw: str) -> str:
    """The decoded text of a JSON string's body so far: up to its closing quote if that has come, else up to the
    last whole character (an escape, or a surrogate pair, not finished yet is held back)."""
    i = whole = 0
    while i < len(raw) and raw[i] != '"':
        if raw[i] != "\\":
            i += 1
        elif raw.startswith("\\u", i):
            high = re.fullmatch(r"[dD][89abAB][0-9a-fA-F]{2}", raw[i + 2:i + 6]) is not None
            if i + (12 if high else 6) > len(raw):
                break
            i += 12 if high else 6
        elif i + 2 > len(raw):
            break
        else:
            i += 2
        whole = i
    try:
        return json.loads(f'"{raw[:whole]}"')
    except ValueError:  # not held to a grammar (cannot happen under one): shown as it is
        return raw[:whole]


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_calls(view: ReplyView) -> list[ToolCall] | None:
    """The reply's calls in OpenAI's shape; None when it has none or one is unfinished (cut by max_tokens)."""
    if not view.calls or not all(c.complete for c in view.calls):
        return None
    return [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in view.calls]


class ToolCallStream:
    """A streamed reply's text in, OpenAI's deltas out: content as it is decided, each call's id and name once its
    name is whole, then its arguments piece by piece."""

    def __init__(self, syntax: Syntax):
        self.syntax, self.text = syntax, ""
        self.sent_content = 0
        self.sent_calls: list[int] = []  # per call started: argument characters sent

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and the call fragments that text adds (one fragment per call)."""
        self.text += text
        view = parse_reply(self.text, self.syntax)
        content, self.sent_content = view.content[self.sent_content:], max(self.sent_content, len(view.content))
        deltas = []
        for i, call in enumerate(view.calls):
            if call.name is None:
                break
            new = i == len(self.sent_calls)
            if new:
                self.sent_calls.append(0)
            pieces, self.sent_calls[i] = call.arguments[self.sent_calls[i]:], len(call.arguments)
            if new:
                deltas.append(ToolCallDelta(index=i, id=call_id(), type="function",
                                            function=FunctionCallDelta(name=call.name, arguments=pieces)))
            elif pieces:
                deltas.append(ToolCallDelta(index=i, function=FunctionCallDelta(arguments=pieces)))
        return content, deltas

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_calls)
