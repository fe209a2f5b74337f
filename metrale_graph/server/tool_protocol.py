"""The wire format of a chat request's tools (protocol.py holds the rest of the request): OpenAI's function tools and
`tool_choice` as pydantic models. The checks that span fields, and what each choice does, are tool_choice.py's.

tool_choice is "none", "auto", "required", a named function ({"type": "function", "function": {"name": ...}}), or
OpenAI's `allowed_tools` ({"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type":
"function", "function": {"name": ...}}, ...]}}: the calls held to a subset of the tools, all of them still in the
prompt; pydantic-ai sends it for a ToolOrOutput or a list of tool names).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # handed to the chat template as it is

    # OpenAI's letters, digits, '_' and '-' (and '.', which MCP's tool names use): what Qwen's `<function=NAME>`
    # can hold
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments' object
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(BaseModel):
    """OpenAI's allowed tools: the functions a reply may call (mode "auto") or must call one or more of ("required")."""
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1)]

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]


class AllowedToolsChoice(BaseModel):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice, AllowedToolsChoice]
