"""The wire format of a chat request's tools (protocol.py holds the rest of the request): OpenAI's function tools and
`tool_choice` as pydantic models. The checks that span fields, and what each choice does, are tool_choice.py's.

tool_choice is "none", "auto", "required", a named function ({"type": "function", "function": {"name": ...}}), or
OpenAI's `allowed_tools` ({"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type":
"function", "function": {"name": ...}}, ...]}}: the calls held to a subset of the tools, all of them still in the
prompt; pydantic-ai sends it for a ToolOrOutput or a list of tool names). A value of neither shape is a 400 saying
which shapes are taken (choice_check: the Responses API's flat shape sent here is named as not this endpoint's).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, ValidationError


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


def choice_check(shapes: dict[str, tuple[type[BaseModel], str]]):
    """A before-validator of a tool_choice whose object forms are `shapes` ({type: (model, its shape written out)}): a
    value none of them takes is a ValueError saying what the choices are, or what the object of its type lacks
    (pydantic's own error for the union named only its first member, "Input should be 'none', 'auto' or 'required'",
    even for an object of the other endpoint's shape: the Responses API's flat {"type": "function", "name": ...} sent
    to chat completions, or chat's to the Responses API)."""
    def check(value):
        if value is None or isinstance(value, BaseModel) or (isinstance(value, str) and value in CHOICES):
            return value
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in shapes:
            forms = ", ".join(map(repr, CHOICES)) + ", " + " or ".join(shape for _, shape in shapes.values())
            raise ValueError(f"expected {forms}")
        model, shape = shapes[kind]
        try:
            return model.model_validate(value)
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(map(str, error["loc"]))
            why = f" ({where}: {error['msg']})" if where else ""
            raise ValueError(f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} choice is {shape}{why}") from None
    return check


CHOICES = ("none", "auto", "required")
CHAT_CHOICES = {"function": (NamedToolChoice, '{"type": "function", "function": {"name": ...}}'),
                "allowed_tools": (AllowedToolsChoice, '{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | '
                                                      '"required", "tools": [{"type": "function", "function": '
                                                      '{"name": ...}}, ...]}}')}
ToolChoice = Annotated[Union[Literal["none", "auto", "required"], NamedToolChoice, AllowedToolsChoice],
                       BeforeValidator(choice_check(CHAT_CHOICES))]
