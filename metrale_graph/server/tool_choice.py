"""A chat request's `tools` and `tool_choice`: the checks that span fields, what the chat template gets, the
functions a reply's calls are parsed against, and the schema that enforces a forced call.

    request = tool_request(body.tools, body.tool_choice, tool_format)   # 400 APIError for what is wrong
    request.template_tools     # the `tools` apply_chat_template renders (None: none)
    request.functions          # {name: parameters' JSON schema} for the reply's parser (None: no parsing)
    request.forced             # the JSON schema a forced reply is held to (None: no call forced)
    request.calls_tag(reasoning, answer)   # under "auto": the structural tag of a strict tool's calls, or of the
                                           # response_format's JSON (`answer`) or calls

tool_choice (OpenAI's): "auto" (the default with tools) lets the model choose; "none" (the default without)
means no call: the tools are not rendered into the prompt and the reply is not parsed for calls; "required"
and a named function ({"type": "function", "function": {"name": ...}}) hold the reply to a call while it is
sampled: structured output (server/structured.py) under `forced_call_schema`, vLLM's convention: a forced
reply is JSON (for "required" an array of {"name", "parameters"}, for a named function its arguments object),
not the model's own call format, read back by forced_calls.ForcedCallParser into the reply's calls. The tools are
still rendered into the prompt, so the model knows them. OpenAI's `allowed_tools` ({"mode": "auto" | "required", "tools":
[...]}) is its mode over those functions, every tool still rendered (as OpenAI keeps them, for the prompt cache):
"required" a forced call of one of them, "auto" a reply held to a structural tag whose calls can only be theirs.

A function's `strict: true` (OpenAI's: its arguments follow its schema) under "auto" holds the reply to an xgrammar
structural tag in the model's own call format (vLLM's way, through xgrammar's builtin tags: `qwen_3_5` for the XML
calls, `qwen_3` for the JSON ones): text is free until a call begins, and a call's name is an offered function's and
its arguments follow that function's schema (every function's but those that say `strict: false`, once one is
strict), the reasoning before the reply's text left free. A request that also asks for JSON with OpenAI's format
(`response_format` or the Responses API's `text.format`) is held to that JSON or calls alone (at least one, one a line,
no text around them), as OpenAI holds a reply with tools to its format only where it makes no call: an `or` of the
JSON's grammar (grammar.json_format) and xgrammar's tag for calls the reply must make, the strict functions'
arguments held to their schemas and the others' free. vLLM's own fields (`structured_outputs`, `guided_*`) hold the
whole reply, which then makes no call (server/structured.py).

A custom tool (tool_protocol.CustomTool) is rendered, parsed and forced as the function it stands for (one string
parameter, `input`; `request.custom` names them, for the reply's custom calls). One whose format is a grammar
(`request.held`) holds its input to it through the structural tag above (custom_tools.py), under "auto" as a strict
function, and under "required" or its name by that tag too (`request.required`: calls alone, in the model's format,
parsed by its parser), since the forced JSON cannot hold a grammar.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from ..structured import StructuredOutputError, check_enforceable
from .custom_tools import check_formats, held_inputs, hold_inputs
from .errors import bad_request
from .tool_protocol import NAMED, AllowedToolsChoice, Tool


# the arguments of a function sent without `parameters`: OpenAI's "empty parameter list", so a forced call is {} (a
# bare {"type": "object"} would let the model invent keys without end)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


# the whitespace a strict call's grammar allows between its tags and around a value that is not free text (Qwen's
# format writes one newline there): unbounded, a model can spend its tokens on it
MAX_WHITESPACE = 2


# the newlines a reply held to its answer's JSON or calls may begin with (Qwen's "</think>\n\n" writes them after the
# reasoning; the reasoning parser drops them from the content)
LEADING_NEWLINES = {"type": "regex", "pattern": "\n{0,2}"}


@dataclass(frozen=True)
class ToolRequest:
    template_tools: list[dict] | None
    functions: dict[str, Mapping] | None
    choice: object = None  # the effective tool_choice: "none", "auto", "required" (allowed_tools: its mode) or a
    # named tool (tool_protocol.NAMED)
    forced: dict | None = None  # forced_call_schema's, for "required" and a named tool
    calls: tuple[str, bool] | None = None  # under "auto" (or `required`): (the model's call format, parallel calls)
    strict: bool = False  # under "auto" (or `required`), a function is strict
    allowed: tuple[str, ...] | None = None  # under "auto", allowed_tools' functions where they are not all the tools
    custom: frozenset[str] = frozenset()  # the custom tools: their calls' input is the reply's (custom_tools.py)
    held: dict[str, dict] = field(default_factory=dict)  # the custom tools a grammar holds: {name: its format}
    required: bool = False  # a forced call held by calls_tag (a held custom tool's), not by `forced`'s JSON

    def calls_tag(self, reasoning: str, answer: dict | None = None) -> dict | None:
        """The structural tag a reply under "auto" is held to (None: none, the reply free), its calls in the model's
        format (module docstring): with a strict function, free text and calls whose arguments follow the schemas;
        with `answer` (a structural tag's format of the JSON the request's response_format asks for), that JSON or
        calls alone, at least one (the strict functions' arguments held to their schemas, any others' free); with
        `required`, calls alone (of the `allowed` tools). A held custom tool's input follows its grammar in each.
        `reasoning`: xgrammar's reasoning mode before the text ("disabled": the tag starts after the reasoning,
        "auto": it may open with a `<think>` block)."""
        if self.calls is None or not (self.strict or answer is not None or self.allowed is not None or self.held):
            return None
        from ..grammar import _xgrammar

        tool_format, parallel = self.calls
        key = {"qwen3_xml": "qwen_3_5", "qwen3_json": "qwen_3"}[tool_format]
        tools = [t for t in self.template_tools if self.allowed is None or t["function"]["name"] in self.allowed]
        if not self.strict:
            tools = [{**t, "function": {**t["function"], "strict": False}} for t in tools]
        must = answer is not None or self.required  # calls the reply must make
        tag = _xgrammar().get_model_structural_tag(key, tools=tools, tool_choice="required" if must else "auto",
                                                   reasoning=reasoning, parallel_tool_calls=parallel,
                                                   max_whitespace_cnt=MAX_WHITESPACE).model_dump(mode="json")
        tag["format"] = hold_inputs(tag["format"], self.held)
        if not must:
            return tag
        # xgrammar's tag for calls the reply must make: [the reasoning block, when it may come,] then the calls, which
        # may have text between and after them: held to calls alone, one a line (as Qwen's templates write them)
        fmt = tag["format"]
        prefix, calls = (None, fmt) if reasoning == "disabled" else fmt["elements"]
        if calls.get("type") != "triggered_tags" or not calls.get("at_least_one"):
            raise ValueError(f"xgrammar's {key} tag for required calls is not the one expected: {calls.get('type')}")
        calls = {"type": "tags_with_separator", "tags": calls["tags"], "separator": "\n", "at_least_one": True,
                 "stop_after_first": not parallel}
        reply = {"type": "sequence", "elements": [LEADING_NEWLINES, calls if answer is None else
                                                  {"type": "or", "elements": [answer, calls]}]}
        tag["format"] = reply if prefix is None else {"type": "sequence", "elements": [prefix, reply]}
        return tag


def tool_request(tools: list | None, tool_choice, tool_format: str | None,
                 parallel_tool_calls: bool | None = None) -> ToolRequest:
    """The checked tools of a request (400 naming the field: two tools of one name, a custom tool's grammar that does
    not parse, a tool_choice naming a tool the request does not offer (or as a tool of the other type) or asking for a
    call without tools, tools left to the model on a server that cannot read its model's calls, a grammar it cannot
    hold). parallel_tool_calls false: a forced reply makes one call."""
    tools = tools or []
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    twice = sorted(n for n, count in Counter(names).items() if count > 1)  # (not names.count per name: n squared)
    if twice:
        raise bad_request(f"tools: the tool name {twice[0]!r} is given more than once: names must be unique",
                          param="tools")
    check_formats(tools)
    kinds = {t.function.name: t.type for t in tools}
    chosen = [choice] if isinstance(choice, NAMED) else \
        choice.allowed_tools.tools if isinstance(choice, AllowedToolsChoice) else []
    for named in chosen:
        name = named.function.name
        if name not in kinds:
            offered = ", ".join(map(repr, names)) or "none"
            raise bad_request(f"tool_choice names the {named.type} {name!r}, which is not among the request's tools "
                              f"(offered: {offered})", param="tool_choice")
        if kinds[name] != named.type:
            raise bad_request(f"tool_choice names {name!r} as a {named.type} tool, and the request's {name!r} is a "
                              f"{kinds[name]} tool: choose it with type {kinds[name]!r}", param="tool_choice")
    allowed = None
    if isinstance(choice, AllowedToolsChoice):  # its mode over its functions (all the tools still rendered)
        allowed, choice = {t.function.name for t in chosen}, choice.allowed_tools.mode
    if choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools: the request has none", param="tool_choice")
    if choice == "none" or not tools:
        return ToolRequest(None, None, choice)
    template_tools, custom = rendered(tools), frozenset(t.function.name for t in tools if t.type == "custom")
    restricted = allowed is not None and len(allowed) < len(tools)
    tools = [t for t in tools if allowed is None or t.function.name in allowed]  # those the reply may call
    parallel = parallel_tool_calls is not False
    if choice == "required" or isinstance(choice, NAMED):
        callable_ = [t for t in tools if t.function.name == choice.function.name] if isinstance(choice, NAMED) else tools
        held = held_inputs(callable_, tool_format)
        if not held:  # (read back as JSON: any chat template will do)
            return ToolRequest(template_tools, None, choice, forced_call_schema(tools, choice, parallel=parallel),
                               custom=custom)
        # a custom tool's grammar, which JSON cannot hold: calls in the model's format, held by calls_tag
        calls = (tool_format, parallel and not isinstance(choice, NAMED))
        return ToolRequest(template_tools, _functions(callable_), choice, calls=calls, strict=_strict(callable_, forced=True),
                           allowed=tuple(sorted(_functions(callable_))), custom=custom, held=held, required=True)
    if tool_format is None:
        raise bad_request("tools: this server cannot read tool calls in its model's chat template (neither of "
                          "Qwen's formats): start metrale-serve with --tool-call-parser qwen3_xml or qwen3_json, "
                          "or force the call (tool_choice 'required' or a named function)", param="tools")
    calls, allowed = (tool_format, parallel), tuple(sorted(allowed)) if restricted else None
    return ToolRequest(template_tools, _functions(tools), choice, calls=calls, strict=_strict(tools), allowed=allowed,
                       custom=custom, held=held_inputs(tools, tool_format))


def _functions(tools: list) -> dict[str, Mapping]:
    """{name: its parameters' JSON schema} of the functions `tools` stand for, for the reply's parser."""
    return {t.function.name: t.function.parameters or {} for t in tools}


def _strict(tools: list, forced: bool = False) -> bool:
    """Whether a function of `tools` is strict, or all are as a `forced` call's (their schemas then checked: 400 naming
    what cannot be enforced)."""
    if not forced and not any(t.function.strict for t in tools):
        return False
    for t in tools:
        if t.function.strict is not False and t.function.parameters is not None:
            try:
                check_enforceable(t.function.parameters)
            except StructuredOutputError as e:
                raise bad_request(f"tools: the strict function {t.function.name!r}: {e.detail}", param="tools") from None
    return True


def rendered(tools: list) -> list[dict]:
    """The tools as the chat template gets them (apply_chat_template's `tools`): OpenAI's function tools as sent, a
    custom tool as the function it stands for (tool_protocol.CustomDefinition.function)."""
    return [t.model_dump(exclude_none=True) if isinstance(t, Tool) else
            {"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def forced_call_schema(tools: list, tool_choice, parallel: bool = True) -> dict:
    """The JSON schema of a reply held to tool_choice "required" (a non-empty array of {"name": a function,
    "parameters": its arguments}, at most one unless `parallel`) or to a named function (that function's
    arguments object): the engine samples the reply under it and forced_calls.py reads the calls out of its
    text."""
    def parameters(tool) -> dict:
        return tool.function.parameters or NO_PARAMETERS

    if isinstance(tool_choice, NAMED):
        return parameters(next(t for t in tools if t.function.name == tool_choice.function.name))
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} forces no call")
    # a function's parameters whose references point into its own schema ("#/$defs/City", pydantic's nested
    # models; "#" itself, a recursive one) would resolve against the array's root: such a schema moves under the
    # root's $defs, its references rewritten to point there
    moved = {f"tool_{i}": _referring(parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)
             if _refers_to_its_root(parameters(t))}
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t.function.name]},
        "parameters": {"$ref": f"#/$defs/tool_{i}"} if f"tool_{i}" in moved else parameters(t)},
        "required": ["name", "parameters"]} for i, t in enumerate(tools)]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls},
            **({"$defs": moved} if moved else {})}


_LITERALS = ("enum", "const", "default", "examples")  # values, not schemas: a "$ref" in them is no reference
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # {name: schema}


def _refers_to_its_root(schema) -> bool:
    """Whether a JSON schema holds a "$ref" within the document ("#", "#/$defs/...")."""
    return _referring(schema, "") is not schema


def _referring(schema, root: str):
    """`schema` with its references within the document ("#...") pointing into it at `root` instead: a copy, or
    `schema` itself when it has none."""
    if isinstance(schema, list):
        items = [_referring(v, root) for v in schema]
        return schema if all(a is b for a, b in zip(items, schema)) else items
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = root + v[1:]
        elif k in _NAMED and isinstance(v, dict):
            named = {name: _referring(sub, root) for name, sub in v.items()}
            out[k] = v if all(named[n] is v[n] for n in v) else named
        else:
            out[k] = v if k in _LITERALS else _referring(v, root)
    return schema if all(out[k] is schema[k] for k in schema) else out
