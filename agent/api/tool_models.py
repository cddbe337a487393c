"""OpenAI's tool-calling wire shapes: the tools a chat request offers, its tool_choice, the tool calls of an assistant
message in the history, and the tool_calls of a response or of a stream's deltas (OpenAI API reference, Chat
Completions). Validated at the boundary like the rest of agent.api.openai_models; nothing here does I/O.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # OpenAI's limit on `tools`
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
# OpenAI: "Omitting parameters defines a function with an empty parameter list"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class _Request(BaseModel):
    # as agent.api.openai_models' requests: strict JSON types, unknown fields refused
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # OpenAI's strict mode; here the arguments always follow the schema

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    """{"type": "function", "function": {"name": ...}}: call exactly this function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _HistoryPart(BaseModel):
    # inside a message: SDKs add their own fields, which are ignored (as agent.api.openai_models.ChatMessage)
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class CalledFunction(_HistoryPart):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class MessageToolCall(_HistoryPart):
    """A tool call of an assistant message in the history (what a response's message.tool_calls held)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# ---- responses --------------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionCall(_Response):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    """One fragment of a streamed tool call: its first carries id, type and name; later ones argument pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
