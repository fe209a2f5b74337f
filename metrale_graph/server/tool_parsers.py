"""Tool calls in Qwen's formats (`--tool-call-parser qwen3_xml | qwen3_json`): a reply's text (its content,
after reasoning.py took the reasoning out) into content and calls, whole or as the text streams.

    parser = PARSERS["qwen3_xml"](functions)       # functions: {name: its parameters' JSON schema}
    events = parser.feed(delta)                    # per text delta: ContentDelta, CallStart, CallArguments
    events = parser.finish()                       # the end of the reply: what was held back, an open call closed

Qwen3.5 / Qwen3.6 (and Qwen3-Coder) write a call as XML, one value per parameter, the value as text:

    <tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>

and a value becomes the JSON type its parameter's schema asks for (`typed_value`: integer, number, boolean,
object and array through JSON, a string as written, the newline that frames it dropped). Older Qwen templates
(Qwen2.5, Qwen3) ask for JSON: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Text that only looks like a call stays content: a `<tool_call>` not followed by `<function=NAME>` (XML) or by
one JSON object with a "name" and object "arguments" (JSON), or naming a function the request did not send. An XML
call may lack its opening `<tool_call>` (as vLLM's qwen3_coder parser reads it): a bare `<function=NAME>` counts
when NAME is offered and its next tag is a `<parameter=` or its `</function>`.
An XML call counts from its `<function=NAME>` on: it is streamed from there (the name at once, then the
arguments a parameter at a time, '{"city": "Paris"', ', "days": 3', '}'), and what follows inside it that is
not a parameter is dropped; a reply that ends inside a call (max_tokens) closes it with the parameters it
has. A JSON call is held back whole until its `</tool_call>`. Whitespace around calls is dropped at the content's
start and end (the template's framing); between text before and after calls it is kept: the longest run of it the
model wrote there (the first of equal ones), so that "foo\\n<tool_call>...</tool_call>\\n\\nbar" is "foo\\n\\nbar",
not "foobar". A parameter named twice keeps its first value. A value ends at its last `</parameter>`
before the next tag (or the reply's end): one that holds the text `</parameter>` stays whole.
Events joined equal the whole text's, however the text was cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from .tags import partial_tag_len, trailing_space_len
from .tool_values import typed_value

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
NEXT_TAGS = (PARAMETER_START, FUNCTION_END, CALL_END)  # what may follow a parameter's `</parameter>`
TEXT, HEADER, NAME, BODY, PARAMETER, AFTER_FUNCTION, JSON_BLOCK = ("text", "header", "name", "body", "parameter",
                                                                   "after", "json")


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place among the reply's calls, from 0
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


class ToolCallParser:
    """The content and the calls of one reply, from its text deltas in order. `functions` maps each function the
    request offers to its parameters' JSON schema ({} for none). Not thread-safe (one per reply)."""
    OPENINGS = (CALL_START,)  # the tags a candidate call begins with in text

    def __init__(self, functions: Mapping[str, Mapping]):
        self.functions = functions
        self.calls = 0  # calls started
        self._state = TEXT
        self._held = ""  # text received and not yet given out or consumed
        self._trim_start = False  # the whitespace that follows a call is held (the gap, or dropped at the end)
        self._reopen = ""  # a candidate call's opening (and the whitespace before it): content if it is none
        self._space = ""  # the whitespace before the candidate call
        self._after = ""  # the whitespace after the last call, so far
        self._gap = ""  # the longest whitespace around the calls since the last content: before the next content
        self._said = False  # content given: a gap before more content is kept

    def feed(self, text: str) -> list:
        self._held += text
        return self._drain(final=False)

    def finish(self) -> list:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list:
        out: list = []
        while self._step(final, out):
            pass
        return out

    def _step(self, final: bool, out: list) -> bool:
        """One move of the state machine; False when it waits for more text (or the reply has ended)."""
        if self._state == TEXT:
            return self._text(final, out)
        return self._call(final, out)

    def _call(self, final: bool, out: list) -> bool:
        raise NotImplementedError

    def _text(self, final: bool, out: list) -> bool:
        if self._trim_start:
            text = self._held.lstrip()
            self._after += self._held[:len(self._held) - len(text)]
            self._held = text
            if not text:
                return False
            self._trim_start, self._gap, self._after = False, _longest(self._gap, self._after), ""
        found = [(i, tag) for tag in self.OPENINGS for i in [self._held.find(tag)] if i >= 0]
        if found:  # a candidate: the whitespace before it goes with it until it proves to be a call
            start, tag = min(found)
            before = self._held[:start]
            text = before.rstrip()
            self._content(text, out)
            self._space = before[len(text):]
            self._reopen = self._space + tag
            self._held, self._state = self._held[start + len(tag):], self._opened_state(tag)
            return True
        if final:
            self._content(self._held.rstrip() if self.calls else self._held, out)
            self._held = ""
            return False
        body = self._held[:len(self._held) - partial_tag_len(self._held, *self.OPENINGS)]
        keep = len(body) - trailing_space_len(body)  # may be the whitespace before a call
        if keep:
            self._content(self._held[:keep], out)
            self._held = self._held[keep:]
        return False

    def _content(self, text: str, out: list) -> None:
        """`text` as content (none if empty), after the whitespace around the calls before it where content came
        before them."""
        if text:
            out.append(ContentDelta(self._gap + text if self._said else text))
            self._gap, self._said = "", True

    def _opened_state(self, tag: str) -> str:
        raise NotImplementedError

    def _not_a_call(self, out: list) -> bool:
        """The candidate after `<tool_call>` is no call: its opening is content, and the text after it is read
        again as text (it may hold the next candidate)."""
        self._content(self._reopen, out)
        self._state, self._reopen = TEXT, ""
        return True

    def _start_call(self, name: str, out: list) -> None:
        out.append(CallStart(self.calls, name))
        self.calls += 1
        self._reopen, self._gap = "", _longest(self._gap, self._space)

    def _call_ended(self) -> None:
        self._state, self._trim_start = TEXT, True


class Qwen3XmlToolParser(ToolCallParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`; also
    without its `<tool_call>` (models drop it at times; vLLM's qwen3_coder parser reads such calls): a bare
    `<function=NAME>` of an offered function followed by a `<parameter=` or its `</function>` (so that prose
    naming one stays content)."""
    OPENINGS = (CALL_START, FUNCTION_START)

    def __init__(self, functions: Mapping[str, Mapping]):
        super().__init__(functions)
        self._name, self._key, self._given, self._bare = "", "", set(), False

    def _opened_state(self, tag: str) -> str:
        self._bare = tag == FUNCTION_START
        return NAME if self._bare else HEADER

    def _call(self, final: bool, out: list) -> bool:
        if self._state == HEADER:
            return self._header(final, out)
        if self._state == NAME:
            return self._function_name(final, out)
        if self._state == BODY:
            return self._body(final, out)
        if self._state == PARAMETER:
            return self._parameter(final, out)
        return self._after_function(final, out)

    def _header(self, final: bool, out: list) -> bool:
        text = self._held.lstrip()
        if text.startswith(FUNCTION_START):  # (its text joins the opening: content if this is no call)
            self._reopen += self._held[:len(self._held) - len(text)] + FUNCTION_START
            self._held, self._state = text[len(FUNCTION_START):], NAME
            return True
        if not final and FUNCTION_START.startswith(text):
            return False
        return self._not_a_call(out)

    def _function_name(self, final: bool, out: list) -> bool:
        """After `<function=`: the name, up to `>`, of an offered function (a bare one's next tag a parameter or
        the function's end), else no call."""
        end = self._held.find(">")
        name = self._held[:end if end >= 0 else len(self._held)]
        if end < 0 and not final and not any(c in name for c in "<\n"):
            return False  # the name goes on
        if end < 0 or name not in self.functions:
            return self._not_a_call(out)
        if self._bare:
            after = self._held[end + 1:].lstrip()
            if not any(after.startswith(tag) for tag in (PARAMETER_START, FUNCTION_END)):
                if not final and any(tag.startswith(after) for tag in (PARAMETER_START, FUNCTION_END)):
                    return False  # its next tag is still to come
                return self._not_a_call(out)
        self._start_call(name, out)
        self._name, self._given = name, set()
        self._held, self._state = self._held[end + 1:], BODY
        return True

    def _body(self, final: bool, out: list) -> bool:
        text = self._held.lstrip()
        if text.startswith(PARAMETER_START):
            end = text.find(">")
            if end < 0 and not final:
                return False
            if end >= 0:
                self._key, self._held, self._state = text[len(PARAMETER_START):end], text[end + 1:], PARAMETER
                return True
        elif text.startswith(FUNCTION_END):
            self._held, self._state = text[len(FUNCTION_END):], AFTER_FUNCTION
            return True
        elif text.startswith(CALL_END):  # no </function>: the call ends all the same
            self._held = text[len(CALL_END):]
            return self._close(out)
        elif not final and any(tag.startswith(text) for tag in (PARAMETER_START, FUNCTION_END, CALL_END)):
            self._held = text
            return False
        if final:
            self._held = ""
            return self._close(out)
        skip = text.find("<", 1)  # not a parameter: dropped, up to the next tag
        self._held = text[skip:] if skip >= 0 else ""
        return skip >= 0

    def _parameter(self, final: bool, out: list) -> bool:
        end = self._value_end(final)
        if end is None:
            return False
        value = self._held[:end] if end >= 0 else self._held
        self._held = self._held[end + len(PARAMETER_END):] if end >= 0 else ""
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if self._key not in self._given:
            parameters = self.functions[self._name]
            schema = (parameters.get("properties") or {}).get(self._key)
            value = json.dumps(typed_value(value, schema, parameters), ensure_ascii=False)
            piece = f"{', ' if self._given else '{'}{json.dumps(self._key, ensure_ascii=False)}: {value}"
            out.append(CallArguments(self.calls - 1, piece))
            self._given.add(self._key)
        self._state = BODY
        return True

    def _value_end(self, final: bool) -> int | None:
        """Where the open parameter's value ends: at its last `</parameter>` before the next tag (or the reply's end),
        so that a value holding the text `</parameter>` (a custom tool's input, an XML file) stays whole; -1: none (the
        reply ended inside the value). None: wait for more text (the next tag whole: streamed or not, the same end)."""
        end = self._held.find(PARAMETER_END)
        while end >= 0:
            rest = end + len(PARAMETER_END)
            later = self._held.find(PARAMETER_END, rest)
            tag = min((i for t in NEXT_TAGS if (i := self._held.find(t, rest)) >= 0), default=-1)
            if later < 0 or 0 <= tag < later:
                return end if tag >= 0 or final else None
            end = later
        return -1 if final else None

    def _after_function(self, final: bool, out: list) -> bool:
        text = self._held.lstrip()
        if text.startswith(CALL_END):
            self._held = text[len(CALL_END):]
        elif not final and CALL_END.startswith(text):
            return False
        return self._close(out)  # (no </tool_call>: the call ends at </function>)

    def _close(self, out: list) -> bool:
        out.append(CallArguments(self.calls - 1, "}" if self._given else "{}"))
        self._call_ended()
        return True


class Qwen3JsonToolParser(ToolCallParser):
    """`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>` (Qwen2.5's and Qwen3's hermes form)."""

    def _opened_state(self, tag: str) -> str:
        return JSON_BLOCK

    def _call(self, final: bool, out: list) -> bool:
        end = self._held.find(CALL_END)
        if end < 0 and not final:
            return False
        call = json_call(self._held[:end] if end >= 0 else self._held, self.functions)
        if call is None:
            return self._not_a_call(out)
        self._start_call(call[0], out)
        out.append(CallArguments(self.calls - 1, call[1]))
        self._held = self._held[end + len(CALL_END):] if end >= 0 else ""
        self._call_ended()
        return True


def json_call(text: str, functions: Mapping[str, Mapping]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one JSON call {"name": ..., "arguments": {...}} (or "parameters"; the
    arguments may be a JSON string of an object), or None if `text` is no call of one of `functions`."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in functions:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _longest(first: str, second: str) -> str:
    return second if len(second) > len(first) else first


PARSERS = {"qwen3_xml": Qwen3XmlToolParser, "qwen3_json": Qwen3JsonToolParser}


def parser_of_template(template: str | None) -> str | None:
    """The format a chat template asks for: "qwen3_xml" when it shows `<function=` calls, "qwen3_json" when it
    shows `<tool_call>` blocks without them, else None."""
    if not template or CALL_START not in template:
        return None
    return "qwen3_xml" if FUNCTION_START in template else "qwen3_json"
