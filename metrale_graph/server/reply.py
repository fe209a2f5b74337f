"""The assistant's reply out of the model's text: reasoning (reasoning.py), then content and tool calls
(tool_parsers.py), whole or as the text streams; and which parsers a server runs.

    parsers = ReplyParsers.of(chat_template, tool_call_parser="auto", reasoning_parser="auto")
    reply = parsers.parser(functions, in_reasoning)    # one per choice; functions None: no call parsing
    events = reply.feed(delta) ... + reply.finish()    # ReasoningDelta, ContentDelta, CallStart, CallArguments
    whole = Reply.of(events)                           # reasoning, content, calls

"auto" picks from the chat template's text: the reasoning parser when it holds `</think>`, the tool-call
format from how it shows a call (tool_parsers.parser_of_template).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .reasoning import THINK_END, THINK_START, ReasoningParser
from .tool_parsers import (CALL_END, CALL_START, FUNCTION_END, FUNCTION_START, PARAMETER_END, PARAMETER_START, PARSERS,
                           CallArguments, CallStart, ContentDelta, parser_of_template)

AUTO, NONE = "auto", "none"
REASONING_PARSERS = ("qwen3",)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


class ReplyParser:
    """One reply's text deltas, in order, into events; with neither parser every delta is content."""

    def __init__(self, reasoning: ReasoningParser | None, tools=None, one_call: bool = False):
        self.reasoning, self.tools = reasoning, tools
        self.one_call = one_call  # parallel_tool_calls false: the calls after the first are dropped (as vLLM)

    def feed(self, text: str) -> list:
        if self.reasoning is None:
            return self._content(text, final=False)
        reasoning, content = self.reasoning.feed(text)
        return ([ReasoningDelta(reasoning)] if reasoning else []) + self._content(content, final=False)

    def finish(self) -> list:
        if self.reasoning is None:
            return self._content("", final=True)
        reasoning, content = self.reasoning.finish()
        return ([ReasoningDelta(reasoning)] if reasoning else []) + self._content(content, final=True)

    @property
    def calls(self) -> int:
        """The calls the reply has made so far."""
        return self.tools.calls if self.tools is not None else 0

    def _content(self, text: str, final: bool) -> list:
        if self.tools is None:
            return [ContentDelta(text)] if text else []
        events = self.tools.feed(text) if text else []
        events = events + self.tools.finish() if final else events
        if self.one_call:
            events = [e for e in events if not (isinstance(e, (CallStart, CallArguments)) and e.index > 0)]
        return events


@dataclass
class Reply:
    """A whole reply: reasoning None when there is none (no parser, no block, an empty one); content None when
    empty and the reply has calls or reasoning (OpenAI's null content), else the text ("" when empty); calls
    as (name, arguments JSON text)."""
    reasoning: str | None = None
    content: str | None = ""
    calls: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def of(cls, events: list) -> "Reply":
        reasoning, content, names, arguments = [], [], [], []
        for e in events:
            if isinstance(e, ReasoningDelta):
                reasoning.append(e.text)
            elif isinstance(e, ContentDelta):
                content.append(e.text)
            elif isinstance(e, CallStart):
                names.append(e.name)
                arguments.append([])
            elif isinstance(e, CallArguments):
                arguments[e.index].append(e.text)
        thought, said = "".join(reasoning) or None, "".join(content)
        return cls(thought, said or (None if names or thought is not None else ""),
                   [(name, "".join(parts)) for name, parts in zip(names, arguments)])


@dataclass(frozen=True)
class ReplyParsers:
    """The parsers a server runs on its replies: `tool_format` a key of tool_parsers.PARSERS or None (requests
    with tools are refused), `reasoning` whether `<think>` blocks are split out."""
    tool_format: str | None
    reasoning: bool

    @classmethod
    def of(cls, chat_template: str | None, tool_call_parser: str = AUTO, reasoning_parser: str = AUTO):
        """The parsers for a model whose chat template is `chat_template`; the flags' values: "auto" (from the
        template), "none", or a parser's name (ValueError for another)."""
        if tool_call_parser not in (AUTO, NONE, *PARSERS):
            raise ValueError(f"tool_call_parser: expected auto, none or one of {', '.join(PARSERS)}, got "
                             f"{tool_call_parser!r}")
        if reasoning_parser not in (AUTO, NONE, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser: expected auto, none or one of {', '.join(REASONING_PARSERS)}, "
                             f"got {reasoning_parser!r}")
        tool_format = (parser_of_template(chat_template) if tool_call_parser == AUTO
                       else None if tool_call_parser == NONE else tool_call_parser)
        reasoning = (THINK_END in (chat_template or "") if reasoning_parser == AUTO else reasoning_parser != NONE)
        return cls(tool_format, reasoning)

    def parser(self, functions: Mapping[str, Mapping] | None, in_reasoning: bool, forced=None,
               one_call: bool = False) -> ReplyParser:
        """The parser of one reply: calls of `functions` (None: none parsed), starting inside a reasoning block
        when `in_reasoning` (the prompt opened one); `forced`: the content's parser instead under a forced
        tool_choice (tool_choice.ForcedCallParser: the calls as JSON, not in the model's format); `one_call`
        (parallel_tool_calls false): only the reply's first call is given, the others dropped (as vLLM does)."""
        reasoning = ReasoningParser(in_reasoning) if self.reasoning else None
        tools = PARSERS[self.tool_format](functions) if functions is not None and self.tool_format else None
        return ReplyParser(reasoning, forced if forced is not None else tools, one_call)

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags these parsers read in a reply's text (a tokenizer that marks their tokens special, as Qwen3.5's
        marks `<think>` and `<tool_call>`, would drop them from it: the server keeps those tokens' text)."""
        tools = (CALL_START, CALL_END, FUNCTION_START, FUNCTION_END, PARAMETER_START, PARAMETER_END)
        return (THINK_START, THINK_END) * self.reasoning + tools * (self.tool_format is not None)

    @property
    def plain(self) -> bool:
        """Whether replies are only content (no reasoning parser): without tools, text passes as it is."""
        return not self.reasoning
