"""A chat request's `tools` and `tool_choice`: the checks that span fields, what the chat template gets, the
functions a reply's calls are parsed against, and the schema that would enforce a call.

    request = tool_request(body.tools, body.tool_choice, tool_format)   # 400 APIError for what is wrong
    request.template_tools     # the `tools` apply_chat_template renders (None: none)
    request.functions          # {name: parameters' JSON schema} for the reply's parser (None: no parsing)

tool_choice (OpenAI's): "auto" (the default with tools) lets the model choose; "none" (the default without)
means no call: the tools are not rendered into the prompt and the reply is not parsed for calls; "required"
and a named function ({"type": "function", "function": {"name": ...}}) need the reply held to a call while
it is sampled. That is what `forced_call_schema` is for: the JSON schema a structured-output backend will
hold the reply to (vLLM's convention: a forced reply is JSON, read back with `forced_calls`, not in the
model's own format). The engine has no such backend yet, so those two choices are refused (400
`unsupported_parameter`) after the checks that any server would make.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from .errors import bad_request
from .protocol import NamedToolChoice, Tool


@dataclass(frozen=True)
class ToolRequest:
    template_tools: list[dict] | None
    functions: dict[str, Mapping] | None
    choice: object = None  # the effective tool_choice: "none", "auto", "required" or a NamedToolChoice


def tool_request(tools: list[Tool] | None, tool_choice, tool_format: str | None) -> ToolRequest:
    """The checked tools of a request (400 naming the field: two functions of one name, a tool_choice naming
    a function the request does not offer or asking for a call without tools, tools on a server that cannot
    read its model's calls, a forced call, which the engine cannot enforce yet)."""
    tools = tools or []
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad_request(f"tools: the function name {twice[0]!r} is given more than once: names must be unique",
                          param="tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        offered = ", ".join(map(repr, names)) or "none"
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                          f"request's tools (offered: {offered})", param="tool_choice")
    if choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools: the request has none", param="tool_choice")
    if choice == "none" or not tools:
        return ToolRequest(None, None, choice)
    if tool_format is None:
        raise bad_request("tools: this server cannot read tool calls in its model's chat template (neither of "
                          "Qwen's formats): start metrale-serve with --tool-call-parser qwen3_xml or qwen3_json",
                          param="tools")
    if choice == "required" or isinstance(choice, NamedToolChoice):
        forced_call_schema(tools, choice)  # (what the structured-output backend will take, once there is one)
        what = "'required'" if choice == "required" else f"a named function ({choice.function.name!r})"
        raise bad_request(f"tool_choice {what} is not supported by this server yet: it needs structured output "
                          "(sampling held to a schema), which the engine does not have; use 'auto' or 'none'",
                          param="tool_choice", code="unsupported_parameter")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    return ToolRequest(template_tools, {t.function.name: t.function.parameters or {} for t in tools}, choice)


def forced_call_schema(tools: list[Tool], tool_choice) -> dict:
    """The JSON schema of a reply held to tool_choice "required" (a non-empty array of {"name": a function,
    "parameters": its arguments}) or to a named function (that function's arguments object). The hook for
    the structured-output backend: the engine samples the reply under this schema and `forced_calls` reads
    the calls out of its text."""
    def parameters(tool: Tool) -> dict:
        return tool.function.parameters or {"type": "object"}

    if isinstance(tool_choice, NamedToolChoice):
        return parameters(next(t for t in tools if t.function.name == tool_choice.function.name))
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} forces no call")
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                "parameters": parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def forced_calls(text: str, tool_choice) -> list[tuple[str, str]]:
    """The calls, (name, arguments JSON text), of a reply sampled under forced_call_schema(tools, tool_choice)
    (ValueError if the text does not follow it: the backend failed)."""
    value = json.loads(text)
    if isinstance(tool_choice, NamedToolChoice):
        if not isinstance(value, dict):
            raise ValueError(f"a forced call's arguments must be a JSON object, got {type(value).__name__}")
        return [(tool_choice.function.name, json.dumps(value, ensure_ascii=False))]
    if not (isinstance(value, list) and value and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                      and isinstance(c.get("parameters"), dict) for c in value)):
        raise ValueError("a reply under tool_choice 'required' must be a non-empty JSON array of "
                         "{'name': ..., 'parameters': {...}}")
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
