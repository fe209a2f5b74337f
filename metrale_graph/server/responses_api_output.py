"""The Responses API's replies (responses_api.py): output items, the response object, and `OutputItems`, which turns a
reply parser's events (reply.py) into output items and the stream events that build them.

A reply is, in order, a reasoning item (where the reply has reasoning), a message item (its text: one output_text
part) and one function_call item per call (call_id `call_...`, arguments the JSON text of an object), as vLLM gives
them; a custom tool's call is a custom_tool_call item (`ctc_...`, its `input` the text the tool takes:
custom_tools.custom_input). A stream sends each item as OpenAI's server does and the openai client reads it:
`response.output_item.added` (the item in progress, empty), `response.content_part.added` (reasoning: a reasoning_text
part, vLLM's way; a message: an output_text part), the deltas (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`), then `.done` events with the whole text
(`response.reasoning_text.done`, `response.output_text.done`, `response.function_call_arguments.done` with the name),
`response.content_part.done` and `response.output_item.done` with the finished item. A custom tool's call sends
`response.output_item.added` (its input ""), then, once its arguments are whole (the model's call format gives its one
parameter whole), `response.custom_tool_call_input.delta` with the input and `response.custom_tool_call_input.done`,
then `response.output_item.done`, as OpenAI's server does. Every event is `event: TYPE` and `data: {"type": TYPE,
"sequence_number": N, ...}`, N counting from 0 over the stream.

With `reasoning.summary` asked for, a reasoning item also has a `summary` of one summary_text part holding the same
text (the server has no summarizer: the summary is the reasoning itself), and its stream also sends the summary's
events, each before its reasoning_text counterpart: `response.reasoning_summary_part.added` (after the item's
`response.output_item.added`), a `response.reasoning_summary_text.delta` per delta, `response.reasoning_summary_text.done`
and `response.reasoning_summary_part.done` (status "incomplete" when the reply was cut inside the reasoning), all with
summary_index 0: what clients that read reasoning only from the summary (LangChain's Responses path) stream.

With include's "message.output_text.logprobs" the output_text part carries `logprobs` ({token, logprob, bytes,
top_logprobs}: the chat endpoint's logprobs.content entries) of the reply's tokens as its text came: the parsers do not
say which token a piece of text came from, so a `response.output_text.delta` carries those of the tokens since the last
delta ({token, logprob, top_logprobs}, the delta event's shape, without bytes; a message's first, those since the
previous message's last: the reasoning's before the first message, a call's before a message after it), tokens that
add no text at the end (the stop token) come in a last delta of empty text, and `response.output_text.done` carries
the message's all. Tokens after the last message's text (its calls) are in none. A whole response reads the reply's
outputs as a stream does (responses_api.py), so its messages carry the same logprobs (vLLM's whole response gives its
one message every token's, which a stream cannot send once a call has closed the message).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, Field
from pydantic_core import to_jsonable_python

from .custom_tools import custom_input
from .reply import ReasoningDelta
from .tool_parsers import CallArguments, CallStart, ContentDelta

Status = Literal["in_progress", "completed", "incomplete"]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class SummaryText(BaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    # the reasoning's text is its content, as vLLM gives it; with reasoning.summary asked for, also its one summary
    # part (no summarizer here: the summary is the reasoning itself)
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: Status


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Status


class OutputCustomToolCall(BaseModel):
    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    status: Status


OutputItem = Union[OutputReasoning, OutputMessage, OutputFunctionCall, OutputCustomToolCall]


class InputTokensDetails(BaseModel):
    """The openai client's (every field required): the prompt tokens restored from the prefix cache; those written to a
    cache billed apart (OpenAI's extended caching), none here: the prefix cache keeps what it computed at no charge."""
    cache_write_tokens: int = 0
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class InputTokenCount(BaseModel):
    """POST /v1/responses/input_tokens' answer (OpenAI's): the input tokens a response to the request would run on."""
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class ResponseObject(BaseModel):
    """OpenAI's response object: the request's settings echoed, the output, the usage."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False  # whether it was stored (responses_store.py)
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"  # as the request asked
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None


class EventWriter:
    """The stream's server-sent events, numbered: `event: TYPE` and its data with "type" and "sequence_number"."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, type_: str, **fields) -> str:
        data = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type_}\ndata: {json.dumps(to_jsonable_python(data), ensure_ascii=False)}\n\n"


class NoEvents(EventWriter):
    """A whole response's writer: its items built as a stream builds them, their events written nowhere."""

    def __call__(self, type_: str, **fields) -> str:
        return ""


@dataclass
class _Open:
    """The output item being built."""
    kind: Literal["reasoning", "message", "function_call", "custom_tool_call"]
    id: str
    index: int  # output_index
    parts: list[str] = field(default_factory=list)  # its text (or arguments) so far
    call_id: str = ""
    name: str = ""
    logprobs: list[dict] = field(default_factory=list)  # a message's output text's logprobs so far


def delta_logprobs(entries: list[dict]) -> list[dict]:
    """Output-text logprobs in the delta and done events' shape: without `bytes`."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


class OutputItems:
    """A reply's output items from its ReplyParser's events, in order, and the stream's events that build them
    (`events`, drained by the stream; a whole response leaves them). `close(status)` ends the open item.
    `logprobs`: None, or the output text's logprobs (dicts of OutputText's shape) not yet in a message, which the
    stream adds to as tokens come: the next text delta takes them. `custom`: the request's custom tools."""

    def __init__(self, write: EventWriter, new_call_id, logprobs: list[dict] | None = None, summary: bool = False,
                 custom: frozenset[str] = frozenset()):
        self.write, self.new_call_id, self.summary, self.custom = write, new_call_id, summary, custom
        self.items: list[OutputItem] = []
        self.events: list[str] = []
        self.logprobs = logprobs
        self._open: _Open | None = None

    def feed(self, reply_events: list) -> None:
        for e in reply_events:
            if isinstance(e, ReasoningDelta) and e.text:
                self._delta("reasoning", e.text, "response.reasoning_text.delta")
            elif isinstance(e, ContentDelta) and e.text:
                self._delta("message", e.text, "response.output_text.delta")
            elif isinstance(e, CallStart):
                self.close()
                kind, prefix = ("custom_tool_call", "ctc") if e.name in self.custom else ("function_call", "fc")
                self._start(_Open(kind, item_id(prefix), len(self.items), call_id=self.new_call_id(), name=e.name))
            elif isinstance(e, CallArguments) and e.text:
                assert self._open is not None and self._open.kind.endswith("call"), "arguments outside a call"
                self._open.parts.append(e.text)
                if self._open.kind == "function_call":  # (a custom call's input: at its end, once whole)
                    self.events.append(self.write("response.function_call_arguments.delta", item_id=self._open.id,
                                                  output_index=self._open.index, delta=e.text))

    def _delta(self, kind: str, text: str, event: str) -> None:
        if self._open is None or self._open.kind != kind:
            self.close()
            self._start(_Open(kind, item_id("rs" if kind == "reasoning" else "msg"), len(self.items)))
        self._open.parts.append(text)
        if kind == "reasoning" and self.summary:
            self.events.append(self.write("response.reasoning_summary_text.delta", item_id=self._open.id,
                                          output_index=self._open.index, summary_index=0, delta=text))
        extra = {}
        if kind == "message":
            taken, self.logprobs = self.logprobs, ([] if self.logprobs is not None else None)
            self._open.logprobs += taken or []
            extra["logprobs"] = delta_logprobs(taken or [])
        self.events.append(self.write(event, item_id=self._open.id, output_index=self._open.index, content_index=0,
                                      delta=text, **extra))

    def flush_logprobs(self) -> None:
        """The logprobs of tokens that added no text after the last delta (the stop token) in a last delta of empty
        text, while a message is open."""
        if self.logprobs and self._open is not None and self._open.kind == "message":
            self._delta("message", "", "response.output_text.delta")

    def _start(self, item: _Open) -> None:
        self._open = item
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            self.events.append(self.write("response.output_item.added", output_index=item.index,
                                          item=OutputReasoning(id=item.id, status="in_progress")))
            if self.summary:
                self.events.append(self.write("response.reasoning_summary_part.added", item_id=item.id,
                                              output_index=item.index, summary_index=0, part=SummaryText(text="")))
            self.events.append(self.write("response.content_part.added", **where, part=ReasoningText(text="")))
        elif item.kind == "message":
            self.events += [self.write("response.output_item.added", output_index=item.index,
                                       item=OutputMessage(id=item.id, status="in_progress", content=[])),
                            self.write("response.content_part.added", **where, part=OutputText(text=""))]
        elif item.kind == "function_call":
            self.events.append(self.write("response.output_item.added", output_index=item.index,
                                          item=OutputFunctionCall(id=item.id, call_id=item.call_id, name=item.name,
                                                                  arguments="", status="in_progress")))
        else:
            self.events.append(self.write("response.output_item.added", output_index=item.index,
                                          item=OutputCustomToolCall(id=item.id, call_id=item.call_id, name=item.name,
                                                                    input="", status="in_progress")))

    def close(self, status: Status = "completed") -> None:
        """End the open item (if any) with `status`: its .done events, the finished item."""
        item, self._open = self._open, None
        if item is None:
            return
        text = "".join(item.parts)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            summary = [SummaryText(text=text)] if self.summary else []
            done = OutputReasoning(id=item.id, summary=summary, content=[ReasoningText(text=text)], status=status)
            if self.summary:  # (a part cut by the reply's end says so, as OpenAI's does)
                cut = {"status": "incomplete"} if status == "incomplete" else {}
                self.events += [self.write("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                                self.write("response.reasoning_summary_part.done", **where, summary_index=0,
                                           part=summary[0], **cut)]
            self.events += [self.write("response.reasoning_text.done", **where, content_index=0, text=text),
                            self.write("response.content_part.done", **where, content_index=0,
                                       part=ReasoningText(text=text))]
        elif item.kind == "message":
            part = OutputText(text=text, logprobs=item.logprobs)
            done = OutputMessage(id=item.id, content=[part], status=status)
            self.events += [self.write("response.output_text.done", **where, content_index=0, text=text,
                                       logprobs=delta_logprobs(item.logprobs)),
                            self.write("response.content_part.done", **where, content_index=0, part=part)]
        elif item.kind == "function_call":
            text = text or "{}"  # (a call of no parameters the parser gave no arguments for)
            done = OutputFunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments=text, status=status)
            self.events.append(self.write("response.function_call_arguments.done", **where, name=item.name,
                                          arguments=text))
        else:
            text = custom_input(text or "{}")
            done = OutputCustomToolCall(id=item.id, call_id=item.call_id, name=item.name, input=text, status=status)
            if text:
                self.events.append(self.write("response.custom_tool_call_input.delta", **where, delta=text))
            self.events.append(self.write("response.custom_tool_call_input.done", **where, input=text))
        self.items.append(done)
        self.events.append(self.write("response.output_item.done", output_index=item.index, item=done))

    def drain(self) -> list[str]:
        events, self.events = self.events, []
        return events
