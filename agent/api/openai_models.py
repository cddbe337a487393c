"""The OpenAI-compatible wire shapes of the local API: requests validated at the boundary, responses built here.

Requests follow the OpenAI API reference for /v1/chat/completions and /v1/completions (strict JSON types,
n = 1 only, an unknown field is an error, except inside a message: SDKs add their own fields to the replies
that apps append to the history) plus vLLM's extension names: top_k, min_p, repetition_penalty,
ignore_eos, priority and structured_outputs (json / regex / choice / Lark grammar; OpenAI's response_format
takes json_object and json_schema). OpenAI parameters this server does not implement (echo,
...) are accepted at the values that mean "off", which clients such as LangChain send on every
call, and refused by name otherwise. Sampling ranges are checked once, by `SamplingParams`; this module only maps
fields onto it. Responses mirror OpenAI's objects and add `timings` (as llama.cpp's server does) carrying
the engine's `RequestFigures`. Nothing here does I/O.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from agent.api.logprobs import ChatLogprobs, TextLogprobs
from agent.api.tool_models import MAX_TOOLS, MessageToolCall, Tool, ToolCall, ToolCallDelta, ToolChoice
from agent.engine.sampling_params import MAX_LOGPROBS, SamplingParams, Structure
from agent.wire import RequestFigures

# OpenAI's default for /v1/completions ("max_tokens ... Defaults to 16"); chat has no limit but the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)  # vLLM's `priority`: lower is served first


class FieldError(ValueError):
    """A request field whose value the server cannot use; `param` names it as OpenAI's error body does."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- requests ---------------------------------------------------------------------------------------
class _Request(BaseModel):
    # strict: JSON types as the OpenAI API documents them ("1" is not a number, 1.0 is not an integer).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False  # OpenAI: one extra chunk before [DONE] with usage and no choices


class TextPart(_Request):
    type: Literal["text"]  # image and audio parts are refused: this is a text model
    text: str


MAX_SHOWN_CHARS = 60  # a refused value is shown up to this many characters, then "…"


def _cut(text: str) -> str:
    """text, cut with an ellipsis when long: a cut without one read as the whole value."""
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS - 1] + "…"


def _unsupported(field: str, value) -> str:
    """What is refused, named: an object (or a list of them) by its "type", as OpenAI's response_format, tools,
    tool_choice and prediction carry one; any other value shown as JSON. "response_format type 'json_schema'"
    tells a LangChain user what to change; the schema's first 60 characters did not."""
    items = value if isinstance(value, list) else [value]
    kinds = list(dict.fromkeys(i.get("type") for i in items if isinstance(i, dict)))
    if items and all(isinstance(i, dict) for i in items) and all(isinstance(k, str) for k in kinds):
        named = _cut(" or ".join(repr(k) for k in kinds))
        return f"{field} type {named}" if isinstance(value, dict) else f"{field} of type {named}"
    return _cut(json.dumps(value))


def _off(*values) -> Any:
    """A parameter accepted only as null or one of `values` (what it is when the feature is off)."""
    def check(v, info: ValidationInfo):
        if v is None or any(type(v) is type(d) and v == d for d in values):
            return None
        allowed = " or ".join(["null", *(json.dumps(d) for d in values)])
        raise ValueError(f"{_unsupported(info.field_name, v)} is not supported by this server (only {allowed})")
    return Annotated[Any, AfterValidator(check)]


class ChatMessage(_Request):
    # Unknown keys are ignored, as vLLM and llama.cpp's server do: an SDK's reply appended to the history as it
    # comes (openai's message.model_dump(), litellm's message) carries the SDK's own fields, and every
    # multi-turn chat through them would get 400 (`refusal`, `provider_specific_fields`).
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null only in an assistant message that calls tools
    name: str | None = None  # the participant's name, as OpenAI has it; passed to templates that print it
    # an assistant reply's fields as OpenAI returns them, nullable; what would need audio is refused
    refusal: str | None = None  # a reply that refused; its content is what the template shows
    annotations: _off([]) = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: _off() = None
    audio: _off() = None
    # others' extensions whose meaning would be lost if they were ignored: Ollama's images, vLLM's prefix
    images: _off([]) = None
    prefix: _off(False) = None

    @model_validator(mode="before")
    @classmethod
    def _refusal_as_content(cls, data):
        # OpenAI returns a refusal as "content": null and "refusal": "..."; appended to the history as it comes,
        # the template shows what was said
        if (isinstance(data, dict) and data.get("role") == "assistant" and data.get("content") is None
                and isinstance(data.get("refusal"), str)):
            return {**data, "content": data["refusal"]}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        # one clear message instead of pydantic's one per branch of the union
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
            other = [k for k in kinds if k != "text"]
            if other:
                raise ValueError(f"only text content parts are supported by this text model (got {other[0]!r})")
        elif content is not None and not isinstance(content, str):
            raise ValueError("content must be a string or a list of text parts")
        return content

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to {self.role!r} ones")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs the tool_call_id it answers, and only a tool message has one")
        return self

    def as_template_message(self) -> dict:
        # OpenAI: "developer" messages replace "system" ones for newer models; templates only know "system".
        role = "system" if self.role == "developer" else self.role
        # parts joined by a newline as vLLM does: "".join ran "Describe:" and "the cat" into one word's tokens
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        message = {"role": role, "content": text} | ({"name": self.name} if self.name is not None else {})
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # as transformers' templates take them: the arguments as an object, not JSON text
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise FieldError(f"the arguments of a tool call are not valid JSON: {e}", "tool_calls") from None


# ---- structured output -------------------------------------------------------------------------------
MAX_CHOICES = 256  # structured_outputs.choice: strings offered


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema: {"name", "description", "schema", "strict"}."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for the name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # absent: any JSON object
    # OpenAI's strict mode guarantees the schema is followed; here every schema is, strict or not
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", ...}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema ({\"name\", \"schema\", \"strict\"}) goes with type "
                             "'json_schema', and only with it")
        return self


class StructuredOutputs(_Request):
    """vLLM's structured_outputs extension: exactly one of json (a schema), regex, choice, grammar (Lark), or
    json_object: true."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar or json_object "
                             f"(got {', '.join(g.rstrip('_') for g in given) or 'none'})")
        return self

    def structure(self) -> Structure:
        if self.json_ is not None:
            param = "structured_outputs.json"
            return _structure("json_schema", _schema_text(self.json_, param), param)
        if self.regex is not None:
            return _structure("regex", self.regex, "structured_outputs.regex")
        if self.choice is not None:
            if any(c == "" for c in self.choice):
                raise FieldError("structured_outputs.choice: the choices must be non-empty strings",
                                 "structured_outputs.choice")
            return _structure("choice", json.dumps(self.choice), "structured_outputs.choice")
        if self.grammar is not None:
            return _structure("grammar", self.grammar, "structured_outputs.grammar")
        return _structure("json_object", "", "structured_outputs.json_object")


def _structure(kind: str, text: str, param: str) -> Structure:
    try:
        return Structure(kind=kind, text=text, param=param)
    except ValidationError as e:  # its size
        raise FieldError(e.errors(include_url=False)[0]["msg"].removeprefix("Value error, "), param) from None


def _schema_text(schema: dict | str, param: str) -> str:
    """A JSON schema as JSON text; FieldError when a string is not a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise FieldError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise FieldError(f"{param} must be a JSON schema (a JSON object)", param)
    return json.dumps(schema)


def response_structure(fmt: ResponseFormat | None, outputs: StructuredOutputs | None) -> Structure | None:
    """The structure a request asks for (None: free text); FieldError for both at once or one too large."""
    if fmt is not None and fmt.type != "text" and outputs is not None:
        raise FieldError("send response_format or structured_outputs, not both", "structured_outputs")
    if outputs is not None:
        return outputs.structure()
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
        return _structure("json_object", "", "response_format")
    param = "response_format.json_schema.schema"
    return _structure("json_schema", _schema_text(fmt.json_schema.schema_, param), param)


class SamplingRequest(_Request):
    """Fields both endpoints share; ranges are SamplingParams' (one definition)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # OpenAI documents these as nullable: null means the default
    n: Annotated[int, BeforeValidator(lambda v: 1 if v is None else v)] = 1
    stream: Annotated[bool, BeforeValidator(lambda v: False if v is None else v)] = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)  # an end-user id, for OpenAI compatibility; not used
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    # vLLM's extension names
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    priority: int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    # ours: speculative decoding for this request ("off", "ngram" prompt lookup, "draft" model)
    speculative: Literal["off", "ngram", "draft"] | None = None
    # logprobs is declared per endpoint (chat: a bool with top_logprobs; completions: the count)
    response_format: ResponseFormat | None = None  # OpenAI's structured output
    structured_outputs: StructuredOutputs | None = None  # vLLM's: regex, choice, Lark grammar, json
    store: _off(False) = None
    service_tier: _off("auto", "default") = None
    functions: _off([]) = None  # tools' older names
    function_call: _off("none", "auto") = None
    modalities: _off(["text"]) = None
    prediction: _off() = None
    audio: _off() = None
    metadata: dict[str, str] | None = None  # tags for OpenAI's stored completions: nothing is stored here

    # field validators rather than one for the model, so that the error's `param` names the field
    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {n}")
        return n

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")  # as the OpenAI API says
        return options

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: the top entries per token, None when log-probabilities are off."""
        return None

    def sampling_params(self, default_max_tokens: int, defaults: dict | None = None,
                        structure: Structure | None = None) -> SamplingParams:
        """The engine's SamplingParams; FieldError naming the field when a value is out of range.

        defaults: values for the fields the request leaves out (the device's set_config sampling defaults);
        structure: the output's structure when something other than response_format sets it (tools)."""
        fields = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k",
                  "min_p", "repetition_penalty", "ignore_eos", "speculative", "logit_bias")
        defaults = dict(defaults or {})
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = defaults.pop("max_tokens", default_max_tokens)
        defaults.pop("max_tokens", None)
        given = defaults | {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
        structure = structure or response_structure(self.response_format, self.structured_outputs)
        try:
            return SamplingParams(max_tokens=max_tokens, structure=structure, logprobs=self.requested_logprobs(),
                                  **given)
        except ValidationError as e:
            raise FieldError(*describe_validation_error(e)) from None


MAX_MESSAGES = 10_000  # ours: 4 MB of one-letter messages (123,000 of them), parsed and rendered, took a 350 MB
# agent to 778 MB before the prompt was refused as too long; refused at parsing, 338 MB. (A
# check before the messages are validated costs more: the list is built as Python dicts first, 384 MB.)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # OpenAI: "none" without tools, "auto" with them
    parallel_tool_calls: bool | None = None  # OpenAI: true (several calls in one reply)
    logprobs: bool | None = None  # the chosen tokens' log-probabilities (agent.api.logprobs)
    top_logprobs: int | None = None  # and the most probable tokens at each position: 0..20, with logprobs true

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) != len(names):
            repeated = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tools: function names must be unique ({repeated!r} repeats)")
        return tools

    @field_validator("top_logprobs")
    @classmethod
    def _top_with_logprobs(cls, n: int | None, info: ValidationInfo) -> int | None:
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {n}")
        # OpenAI: "logprobs must be set to true if this parameter is used"; 0 (off) is what LangChain sends
        if n and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return n

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("max_completion_tokens")
    @classmethod
    def _same_as_max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        max_tokens = info.data.get("max_tokens")
        if value is not None and max_tokens is not None and value != max_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        messages = []
        for i, m in enumerate(self.messages):
            try:
                messages.append(m.as_template_message())
            except FieldError as e:
                raise FieldError(f"messages[{i}].{e}", f"messages.{i}.{e.param}") from None
        return messages


class CompletionRequest(SamplingRequest):
    # OpenAI also allows a batch of prompts; with n = 1 only, a list must hold exactly one.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: _off(False) = None
    suffix: _off("") = None
    best_of: _off(1) = None
    tools: _off([]) = None  # chat's
    tool_choice: _off("none") = None
    parallel_tool_calls: _off(True, False) = None

    # legacy: the chosen tokens' log-probabilities and this many most probable ones (OpenAI allows 5, vLLM 20)
    logprobs: int | None = None
    top_logprobs: _off(0) = None  # chat's name; this endpoint's count is `logprobs`

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, n: int | None) -> int | None:
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (the most probable tokens listed), got {n}")
        return n

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_text_or_ids(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise FieldError(f"prompt: send one prompt per request (got {len(self.prompt)})", "prompt")
            return self.prompt[0]  # a batch of one: a text, or a list of token ids
        return self.prompt


def describe_validation_error(e: ValidationError, model: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """(message, param) for the first problem, worded for an API client: what was wrong, what is allowed."""
    err = e.errors(include_url=False)[0]
    param = ".".join(str(x) for x in err["loc"]) or None
    if err["type"] == "json_invalid":
        return f"the request body is not valid JSON: {err['msg']}", None
    if err["type"] == "extra_forbidden":
        allowed = f"; allowed: {', '.join(sorted(model.model_fields))}" if model and len(err["loc"]) == 1 else ""
        return f"unknown field {param!r}{allowed}", param
    if err["type"] == "model_type" and not err["loc"]:
        return "the request body must be a JSON object", None
    more = f" (and {e.error_count() - 1} more problem(s))" if e.error_count() > 1 else ""
    msg = err["msg"].removeprefix("Value error, ")
    if param is None:
        return msg + more, param
    # a message that names its field (SamplingParams', "response_format type ...") gets the path to it in front
    path, _, field = param.rpartition(".")
    if msg.startswith(field):
        return (f"{path}.{msg}" if path else msg) + more, param
    return f"{param}: {msg}" + more, param


# ---- responses --------------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, f: RequestFigures) -> "Usage":
        return cls(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                   total_tokens=f.prompt_tokens + f.completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=f.cached_prompt_tokens))


FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the reply is tool calls only (OpenAI)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class TextChoice(_Response):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: TextLogprobs | None = None


class _Completion(_Response):
    id: str
    created: int  # Unix seconds
    model: str
    system_fingerprint: str  # the bundle version: OpenAI's "backend configuration" fingerprint
    usage: Usage | None = None
    timings: RequestFigures | None = None  # extension, as llama.cpp's server names it


class ChatCompletion(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class TextCompletion(_Completion):
    # OpenAI uses the same object name for whole completions and their stream chunks.
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "edge"
    version: str  # extension: the bundle version (an adapter's: its own)
    precision: str  # extension: e.g. "int4"
    parent: str | None = None  # extension, as vLLM's for a LoRA module: the base model an adapter "BASE:NAME" runs on


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(_Response):
    status: Literal["loading", "ready", "draining", "failed", "engine_stopped"]
    model: str
    version: str
