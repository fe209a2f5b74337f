"""Custom (freeform) tools (OpenAI's `{"type": "custom"}`; tool_protocol.py has their wire format): a call's input held
to the tool's format while it is sampled, and calls read back as custom calls.

    check_formats(tools)                       # 400 naming the tool: a grammar that does not parse
    held = held_inputs(tools, tool_format)     # {name: the structural tag format its input is held to}; 400s
    fmt = hold_inputs(fmt, held)               # xgrammar's tag of the model's calls, the custom tools' input held
    text = custom_input(arguments)             # a call's input, out of the JSON text of its arguments
    inputs = CustomInputs(names)               # a stream's: a custom call's input once its arguments are whole

The model calls a custom tool as the function it stands for (tool_protocol.CustomDefinition.function: one string
parameter, `input`), in its own call format: in Qwen's XML, `<tool_call>\\n<function=NAME>\\n<parameter=input>\\nTEXT
\\n</parameter>\\n</function>\\n</tool_call>`, TEXT the input as written. A tool whose format is a grammar (Lark's, or a
regular expression) holds TEXT to it through the structural tag of the reply's calls (tool_choice.ToolRequest.calls_tag,
xgrammar's builtin tag of the model's format with the tool's tag replaced: its begin up to `<parameter=input>\\n`, the
grammar, its end from `\\n</parameter>`), under tool_choice "auto", "required" and the tool named: the JSON a forced
call is otherwise held to (tool_choice.forced_call_schema) cannot hold a grammar, whose text is not JSON's escaped
string. Qwen's JSON calls (qwen3_json) write the input as a JSON string, which a grammar cannot hold either: a grammar
there is a 400 naming the tool, never left free. A tool of format "text" (or none) is any string, as a function's.
"""

from __future__ import annotations

import functools
import json

from ..structured import StructuredOutputError
from .errors import bad_request
from .tool_parsers import FUNCTION_START, CALL_START, PARAMETER_END, PARAMETER_START, CallArguments, CallStart
from .tool_protocol import INPUT, CustomTool

# what xgrammar's structural tag calls each syntax's format (an empty regular expression, which matches the empty text
# alone and which xgrammar's regex format refuses, as that empty text)
SYNTAXES = {"lark": lambda text: {"type": "grammar", "grammar": text, "syntax": "lark"},
            "regex": lambda text: {"type": "regex", "pattern": text} if text else {"type": "const_string", "value": ""}}


def check_formats(tools: list) -> None:
    """400 naming the tool whose grammar does not parse (xgrammar's reason)."""
    for tool in tools:
        grammar = tool.custom.format.grammar if isinstance(tool, CustomTool) and tool.custom.format else None
        if grammar is not None:
            try:
                _parsed(*grammar)
            except StructuredOutputError as e:
                raise bad_request(f"tools: the custom tool {tool.custom.name!r}: {e.detail}", param="tools") from None


@functools.lru_cache(maxsize=64)
def _parsed(syntax: str, definition: str) -> None:
    """StructuredOutputError unless xgrammar parses `definition` (cached: clients send the same tools every turn)."""
    from ..grammar import _reason, _xgrammar

    xgr = _xgrammar()
    try:
        if syntax == "lark":
            xgr.Grammar.from_lark(definition)
        else:
            xgr.Grammar.from_regex(definition)
    except (RuntimeError, ValueError) as e:
        what = "Lark grammar" if syntax == "lark" else "regular expression"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = first if first.startswith("Lark error") else _reason(e)  # (where in the grammar: its line and column)
        raise StructuredOutputError(f"its {what} does not compile: {why}") from None


def held_inputs(tools: list, tool_format: str | None) -> dict[str, dict]:
    """{name: the structural tag format of its input} of the custom tools in `tools` whose format is a grammar (checked:
    check_formats); 400 naming the first when the model's calls cannot hold it (`tool_format` not Qwen's XML)."""
    held = {t.custom.name: SYNTAXES[t.custom.format.syntax](t.custom.format.definition) for t in tools
            if isinstance(t, CustomTool) and t.custom.format is not None and t.custom.format.grammar is not None}
    if held and tool_format != "qwen3_xml":
        name = next(iter(held))
        how = ("writes its calls as JSON, whose strings a grammar cannot hold" if tool_format == "qwen3_json" else
               "cannot read its model's calls")
        raise bad_request(f"tools: the custom tool {name!r} holds its input to a grammar, which this server can do only "
                          f"in calls in Qwen's XML format (--tool-call-parser qwen3_xml): its model {how}; send the "
                          'tool with format {"type": "text"}', param="tools")
    return held


def hold_inputs(fmt, held: dict[str, dict]):
    """`fmt` (a structural tag's format, xgrammar's tag of calls in Qwen's XML format) with the tag of each tool of
    `held` replaced by one whose input is held to its format: a copy."""
    if isinstance(fmt, list):
        return [hold_inputs(f, held) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    if fmt.get("type") == "tag" and isinstance(fmt.get("begin"), str):
        for name, content in held.items():
            if fmt["begin"] == f"{CALL_START}\n{FUNCTION_START}{name}>\n":
                return {**fmt, "begin": f"{fmt['begin']}{PARAMETER_START}{INPUT}>\n", "content": content,
                        "end": f"\n{PARAMETER_END}{fmt['end']}"}
    return {k: hold_inputs(v, held) for k, v in fmt.items()}


def custom_input(arguments: str) -> str:
    """The input of a custom tool's call whose arguments are `arguments` (JSON text): its `input` string; "" for no
    arguments; else the text as it is (a call that gave other parameters: nothing of it is lost)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(INPUT), str):
        return value[INPUT]
    return "" if value == {} else arguments


class CustomInputs:
    """A streamed reply's custom calls: their arguments' pieces (CallArguments) held until they are whole, then the
    call's input (custom_input). `names`: the request's custom tools."""

    def __init__(self, names):
        self.names, self._open = names, {}  # the custom calls' indices: their arguments' pieces so far

    def start(self, event: CallStart) -> bool:
        """Whether the call `event` starts is a custom tool's."""
        if event.name in self.names:
            self._open[event.index] = []
        return event.name in self.names

    def holds(self, event: CallArguments) -> bool:
        return event.index in self._open

    def feed(self, event: CallArguments) -> str | None:
        """The call's input once its arguments are a whole JSON object (None: not yet)."""
        pieces = self._open[event.index]
        pieces.append(event.text)
        try:
            json.loads("".join(pieces))
        except ValueError:
            return None
        del self._open[event.index]
        return custom_input("".join(pieces))
