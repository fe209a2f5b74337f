"""The wire format of a chat request's tools (protocol.py holds the rest of the request): OpenAI's function and custom
tools and `tool_choice` as pydantic models. The checks that span fields, and what each choice does, are tool_choice.py's.

A custom (freeform) tool, {"type": "custom", "custom": {"name", "description", "format"}} (OpenAI's; Codex sends its
apply_patch as one), takes one string, its input, held to its format: {"type": "text"} (or none) any text, {"type":
"grammar", "grammar": {"syntax": "lark" | "regex", "definition"}} (the Responses API's flat shape, syntax and definition
beside type, taken too) text of that grammar. The template gets it as the function it stands for (`CustomTool.function`:
one string parameter `input`, the grammar in its description), so a model's own call format holds its calls;
custom_tools.py holds the input to its format and reads calls back. A past reply's custom call sent back ({"type":
"custom", "id", "custom": {"name", "input"}}) reaches the template as that function's call (`function_form`).

tool_choice is "none", "auto", "required", a named function ({"type": "function", "function": {"name": ...}}), or
OpenAI's `allowed_tools` ({"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type":
"function", "function": {"name": ...}}, ...]}}: the calls held to a subset of the tools, all of them still in the
prompt; pydantic-ai sends it for a ToolOrOutput or a list of tool names). A value of neither shape is a 400 saying
which shapes are taken (choice_check: the Responses API's flat shape sent here is named as not this endpoint's).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr,
                      ValidationError, model_validator)

from .errors import error_path, pydantic_message
from .nulls import NullIsDefault


def _of_an_object(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters: the JSON schema of an object, the arguments by name (OpenAI's rule; a call's
    arguments are a JSON object, and a template writes them one parameter at a time). A schema of another type (a
    string, an array) is refused: its calls' "arguments" would be that JSON value, which no client reads as a call's;
    a schema that does not say its type is taken as it is."""
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(f"a function's parameters are the JSON schema of an object, its arguments by name "
                         f"({{\"type\": \"object\", \"properties\": {{...}}}}), not of type {kind!r}")
    return schema


# a JSON schema of the arguments' object
Parameters = Annotated[dict[str, Any], AfterValidator(_of_an_object)]


class FunctionDefinition(NullIsDefault):
    model_config = ConfigDict(extra="allow")  # handed to the chat template as it is

    # OpenAI's letters, digits, '_' and '-' (and '.', which MCP's tool names use): what Qwen's `<function=NAME>`
    # can hold
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: Parameters | None = None
    strict: StrictBool | None = None


class Tool(NullIsDefault):
    type: Literal["function"]
    function: FunctionDefinition


# the one parameter of the function a custom tool stands for
INPUT = "input"


class CustomFormat(NullIsDefault):
    """A custom tool's input format: "text" (any), or "grammar" of `syntax` (chat's nested grammar: {"definition",
    "syntax"}, or the Responses API's flat fields)."""
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data):
        if isinstance(data, dict) and isinstance(data.get("grammar"), dict):  # chat's shape
            return {**{k: v for k, v in data.items() if k != "grammar"}, **data["grammar"]}
        return data

    @model_validator(mode="after")
    def _grammar_given(self):
        if self.type == "grammar" and (self.syntax is None or self.definition is None):
            raise ValueError('a grammar format is {"type": "grammar", "grammar": {"syntax": "lark" | "regex", '
                             '"definition": ...}}')
        return self

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(syntax, definition) of a grammar format, or None (any text)."""
        return (self.syntax, self.definition) if self.type == "grammar" else None


class CustomDefinition(NullIsDefault):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    format: CustomFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_parameters(cls, data):
        if isinstance(data, dict) and "parameters" in data:
            raise ValueError("a custom tool takes no parameters: its input is one string, held to its format (send a "
                             "function tool for arguments that follow a JSON schema)")
        return data

    def function(self) -> FunctionDefinition:
        """The function this tool stands for in the prompt: one string parameter, `input`, its format described."""
        grammar = self.format.grammar if self.format is not None else None
        what = {"type": "string"}
        if grammar is not None:
            what["description"] = (f"Text of this Lark grammar:\n{grammar[1]}" if grammar[0] == "lark" else
                                   f"Text that matches this regular expression: {grammar[1]}")
        return FunctionDefinition(name=self.name, description=self.description, parameters={
            "type": "object", "properties": {INPUT: what}, "required": [INPUT], "additionalProperties": False})


class CustomTool(NullIsDefault):
    type: Literal["custom"]
    custom: CustomDefinition

    @property
    def function(self) -> FunctionDefinition:
        return self.custom.function()


def function_by_default(value):
    """Chat's tool or named tool choice without a "type" (or with a null one) but with a "function": a function's, as
    vLLM (whose ChatCompletionToolsParam and ChatCompletionNamedToolChoiceParam default type to "function") and
    clients written against it take it."""
    if isinstance(value, dict) and value.get("type") is None and "function" in value:
        return {**value, "type": "function"}
    return value


AnyTool = Annotated[Union[Tool, CustomTool], Field(discriminator="type"), BeforeValidator(function_by_default)]


def function_form(call):
    """A past reply's custom tool call ({"type": "custom", "id", "custom": {"name", "input"}}) as the call of the
    function it stands for, its arguments {"input": ...}; any other call as it is."""
    custom = call.get("custom") if isinstance(call, dict) and call.get("type") == "custom" else None
    if not (isinstance(custom, dict) and isinstance(custom.get("name"), str)):
        return call
    rest = {k: v for k, v in call.items() if k != "custom"}
    return {**rest, "type": "function", "function": {"name": custom["name"], "arguments": {INPUT: custom.get(INPUT, "")}}}


class FunctionName(NullIsDefault):
    name: StrictStr


class NamedToolChoice(NullIsDefault):
    type: Literal["function"]
    function: FunctionName


class NamedCustomChoice(NullIsDefault):
    """A custom tool forced by name ({"type": "custom", "custom": {"name": ...}})."""
    type: Literal["custom"]
    custom: FunctionName

    @property
    def function(self) -> FunctionName:
        return self.custom


NAMED = (NamedToolChoice, NamedCustomChoice)  # a choice of one tool by name


class AllowedTools(NullIsDefault):
    """OpenAI's allowed tools: the tools a reply may call (mode "auto") or must call one or more of ("required")."""
    mode: Literal["auto", "required"]
    tools: Annotated[list[Annotated[Union[NamedToolChoice, NamedCustomChoice], Field(discriminator="type")]],
                     Field(min_length=1)]

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]


class AllowedToolsChoice(NullIsDefault):
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
            where = ".".join(error_path(error, value))
            why = f" ({where}: {pydantic_message(error)})" if where else ""
            raise ValueError(f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} choice is {shape}{why}") from None
    return check


CHOICES = ("none", "auto", "required")
CHAT_CHOICES = {"function": (NamedToolChoice, '{"type": "function", "function": {"name": ...}}'),
                "custom": (NamedCustomChoice, '{"type": "custom", "custom": {"name": ...}}'),
                "allowed_tools": (AllowedToolsChoice, '{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | '
                                                      '"required", "tools": [{"type": "function", "function": '
                                                      '{"name": ...}}, ...]}}')}
ToolChoice = Annotated[Union[Literal["none", "auto", "required"], NamedToolChoice, NamedCustomChoice, AllowedToolsChoice],
                       BeforeValidator(choice_check(CHAT_CHOICES)), BeforeValidator(function_by_default)]
