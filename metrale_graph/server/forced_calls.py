"""A forced reply's calls as they come: under tool_choice "required" or a named function the reply is held to
tool_choice.forced_call_schema's JSON (vLLM's convention), and `ForcedCallParser` reads it, as tool_parsers' parsers
read the model's own call format, into CallStart / CallArguments events (reply.py), streamed as vLLM streams a forced
call: a named function's call starts with the reply and its arguments are the reply's text; under "required" a call
starts once its name is whole and its parameters' text goes out as it comes.

A reply cut by max_tokens keeps the calls it began, their arguments closed into valid JSON (`JsonPrefix`: the text up
to the last point that closing brackets and quotes complete, then those), as a call cut under "auto" is closed with
the parameters it has: a client that parses a cut call's arguments (the openai client's Responses helpers parse every
function call of a strict tool) reads JSON. A reply cut before its first call began is content. `forced_calls` reads
a whole reply at once (the reference the parser is tested against).
"""

from __future__ import annotations

import json

from .tool_parsers import CallArguments, CallStart, ContentDelta
from .tool_protocol import NAMED

NO_ARGUMENTS = "{}"  # a call cut before its arguments began


def forced_calls(text: str, tool_choice) -> list[tuple[str, str]]:
    """The calls, (name, arguments JSON text), of a whole reply sampled under forced_call_schema(tools, tool_choice)
    (ValueError if the text does not follow it)."""
    value = json.loads(text)
    if isinstance(tool_choice, NAMED):
        if not isinstance(value, dict):
            raise ValueError(f"a forced call's arguments must be a JSON object, got {type(value).__name__}")
        return [(tool_choice.function.name, json.dumps(value, ensure_ascii=False))]
    if not (isinstance(value, list) and value and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                      and isinstance(c.get("parameters"), dict) for c in value)):
        raise ValueError("a reply under tool_choice 'required' must be a non-empty JSON array of "
                         "{'name': ..., 'parameters': {...}}")
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


class JsonPrefix:
    """One JSON value's text as it comes, and how a cut of it is completed: the first `safe` characters are a prefix
    that appending `closer` makes valid JSON (a value string closed, the open arrays and objects closed). A member
    whose value has not begun (a key, the comma before the next member), a number or literal not yet whole and an
    escape not yet whole are not counted until they are, so a completed cut leaves them out. `done` once whole."""

    def __init__(self):
        self.n = self.safe = 0  # characters taken; of them, the completable prefix
        self.closer: str | None = None  # what completes the first `safe` characters (None: nothing yet)
        self.done = False
        self._stack: list[str] = []  # the closing bracket of each open array or object, innermost last
        self._expect = "value"  # what comes next in the innermost container: "value", "key", "colon", "comma"
        self._empty = False  # the innermost container has no member yet (closing it is valid)
        self._string: str | None = None  # "key" or "value" while inside a string
        self._escape = 0  # 1 after a backslash; 2 to 5 inside \uXXXX, 2 + the digits read
        self._literal = ""  # a number, true, false or null being read (its end is the next character's)

    def feed(self, c: str) -> bool:
        """Take the value's next character; False when it is not the value's (it follows the whole value)."""
        if self.done:
            return False
        if self._literal:
            if c not in ",:]} \t\r\n":
                self._literal += c
                self.n += 1
                return True
            self._value_ended()
            self._mark()
            if self.done:
                return False
        self.n += 1
        if self._string is not None:
            if self._escape == 1:
                self._escape = 2 if c == "u" else 0
            elif self._escape:
                self._escape = 0 if self._escape == 5 else self._escape + 1
            elif c == "\\":
                self._escape = 1
            elif c == '"':
                key, self._string = self._string == "key", None
                if key:
                    self._expect = "colon"
                else:
                    self._value_ended()
        elif c == '"':
            self._string, self._empty = ("key" if self._expect == "key" else "value"), False
        elif c in "{[":
            self._stack.append("}" if c == "{" else "]")
            self._expect, self._empty = ("key" if c == "{" else "value"), True
        elif c in "}]":
            self._stack.pop()
            self._empty = False
            self._value_ended()
        elif c == ":":
            self._expect = "value"
        elif c == ",":
            self._expect, self._empty = ("key" if self._stack[-1] == "}" else "value"), False
        elif not c.isspace():
            self._literal, self._empty = c, False
        self._mark()
        return True

    def finish(self) -> tuple[int, str | None]:
        """(safe, closer) of the text taken, a number or literal at its end counted if it is whole."""
        if self._literal:
            try:
                json.loads(self._literal)
            except ValueError:
                pass
            else:
                self._value_ended()
                self._mark()
        return self.safe, self.closer

    def _value_ended(self) -> None:
        self._literal = ""
        if self._stack:
            self._expect = "comma"
        else:
            self.done = True

    def _mark(self) -> None:
        closer = self._closer()
        if closer is not None:
            self.safe, self.closer = self.n, closer

    def _closer(self) -> str | None:
        brackets = "".join(reversed(self._stack))
        if self.done:
            return ""
        if self._string is not None:
            return '"' + brackets if self._string == "value" and not self._escape else None
        if self._literal:
            return None
        if self._expect == "comma" or (self._stack and self._empty and self._expect in ("key", "value")):
            return brackets
        return None


class ForcedCallParser:
    """A reply's content under a forced tool_choice as events, as the text comes (the module's docstring)."""

    def __init__(self, tool_choice):
        self.tool_choice = tool_choice
        self._array = None if isinstance(tool_choice, NAMED) else _ForcedArray()
        self._arguments: _Arguments | None = None  # a named function's (its call begun with the reply's first text)

    @property
    def calls(self) -> int:
        """The calls the reply has begun so far."""
        if self._array is not None:
            return len(self._array.names)
        return 0 if self._arguments is None else 1

    def feed(self, text: str) -> list:
        if self._array is not None:
            return self._array.feed(text)
        if not text:
            return []
        start = []
        if self._arguments is None:
            self._arguments = _Arguments(0)
            start = [CallStart(0, self.tool_choice.function.name)]
        return start + self._arguments.feed(text)

    def finish(self) -> list:
        if self._array is not None:
            return self._array.finish()
        return [] if self._arguments is None else self._arguments.finish()


class _Arguments:
    """One call's arguments text as it comes (a JsonPrefix's), sent as far as it is completable; closed at the end."""

    def __init__(self, index: int):
        self.index, self.value, self.text, self._sent = index, JsonPrefix(), "", 0

    def feed(self, text: str) -> list:
        """Take `text` (the value's characters first; the rest, after the value's end, is not taken) and give the
        arguments not sent yet."""
        taken = 0
        while taken < len(text) and self.value.feed(text[taken]):
            taken += 1
        self.text += text[:taken]
        return self._piece(self.value.safe, "")

    def finish(self) -> list:
        safe, closer = self.value.finish()
        if closer is None:  # (nothing of the value completable: no arguments)
            return [] if self._sent else [CallArguments(self.index, NO_ARGUMENTS)]
        return self._piece(safe, closer)

    def _piece(self, safe: int, closer: str) -> list:
        piece, self._sent = self.text[self._sent:safe] + closer, safe
        return [CallArguments(self.index, piece)] if piece else []


class _ForcedArray:
    """The calls of a reply held to forced_call_schema's array under "required", scanned as its text comes: the
    array's nesting and strings followed character by character, at depth 2 (a call's object) its keys and its
    "name" string (the call's CallStart once whole); its "parameters" value, from its first character, read by an
    _Arguments until it is whole (sent once the name is known)."""

    def __init__(self):
        self.text, self.names = "", []  # the reply so far; each begun call's name
        self._depth, self._in_string, self._escaped = 0, False, False
        self._string_start = None  # a string at depth 2 (a key or the name) being read: where it began
        self._key_next = False  # at depth 2, the next string is a key
        self._key = None  # the current call's key whose value is being read
        self._name = None
        self._arguments: _Arguments | None = None  # the current call's parameters, from their first character
        self._held: list = []  # their events while the name is not known

    def feed(self, text: str) -> list:
        events, at = [], len(self.text)
        self.text += text
        while at < len(self.text):
            c = self.text[at]
            if (self._arguments is None and not self._in_string and self._depth == 2 and self._key == "parameters"
                    and not (c.isspace() or c == ":")):  # the parameters' value begins
                self._arguments = _Arguments(len(self.names) - 1 if self._name is not None else len(self.names))
            if self._arguments is not None and not self._arguments.value.done:
                before = len(self._arguments.text)
                events += self._sent(self._arguments.feed(self.text[at:]))
                at += len(self._arguments.text) - before
                if not self._arguments.value.done:
                    break
                continue
            events += self._step(at, c)
            at += 1
        return events

    def finish(self) -> list:
        if not self.names:
            return [ContentDelta(self.text)] if self.text else []
        if self._arguments is None:  # (cut after the name, before the parameters began: none)
            return [CallArguments(len(self.names) - 1, NO_ARGUMENTS)] if self._name is not None else []
        return self._sent(self._arguments.finish()) if not self._arguments.value.done else []

    def _sent(self, events: list) -> list:
        """The parameters' events, held until the call's name is known."""
        if self._name is None:
            self._held += events
            return []
        return events

    def _step(self, i: int, c: str) -> list:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self._string_start is not None:
                    return self._string_read(json.loads(self.text[self._string_start:i + 1]))
            return []
        if c == '"':
            self._in_string, self._string_start = True, i if self._depth == 2 else None
        elif c in "{[":
            self._depth += 1
            if self._depth == 2:  # a call's object begins
                self._key_next, self._key, self._name, self._arguments, self._held = True, None, None, None, []
        elif c in "}]":
            self._depth -= 1
        elif c == "," and self._depth == 2:
            self._key_next = True
        return []

    def _string_read(self, value: str) -> list:
        if self._key_next:
            self._key, self._key_next = value, False
            return []
        if self._key != "name" or self._name is not None:
            return []
        self._name = value
        self.names.append(value)
        held, self._held = self._held, []
        return [CallStart(len(self.names) - 1, value), *held]
