"""The Responses API's input items (responses_api_protocol.py holds the request): messages, a past reply's
`function_call`, `custom_tool_call` and `reasoning` items, the `function_call_output` and `custom_tool_call_output`
items answering calls, checked item by item so that a 400 names the item and what is wrong with it, and joined into the
chat messages a template renders. A custom tool's call is the call of the function it stands for (its arguments
{"input": ...}: tool_protocol.CustomDefinition.function), its output a `tool` message, as a function's.
"""

from __future__ import annotations

import json

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, StrictStr, Tag, TypeAdapter, ValidationError, model_validator

from .errors import pydantic_message, short
from .nulls import NullIsDefault
from .protocol import ChatMessage
from .tool_protocol import INPUT


class InputText(NullIsDefault):
    type: Literal["input_text", "output_text", "text"]  # (a past reply's output_text parts sent back)
    text: StrictStr


class RefusalText(NullIsDefault):
    type: Literal["refusal"]
    refusal: StrictStr

    @property
    def text(self) -> str:
        return self.refusal


Part = Annotated[Union[InputText, RefusalText], Field(discriminator="type")]


class MessageItem(NullIsDefault):
    type: Literal["message"] = "message"
    id: StrictStr | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[StrictStr, list[Part]]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(NullIsDefault):
    """A call a past reply made (its output item sent back)."""
    type: Literal["function_call"]
    id: StrictStr | None = None
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # JSON text of an object


class FunctionCallOutputItem(NullIsDefault):
    """The result of a call, for the model to read: a `tool` message."""
    type: Literal["function_call_output"]
    id: StrictStr | None = None
    call_id: StrictStr
    output: Union[StrictStr, list[InputText]]


class CustomToolCallItem(FunctionCallItem):
    """A custom tool's call a past reply made: a function call whose arguments are {"input": its input} (`arguments`,
    set from `input` and never written out)."""
    type: Literal["custom_tool_call"]
    input: StrictStr
    arguments: StrictStr | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _arguments(self):
        self.arguments = json.dumps({INPUT: self.input}, ensure_ascii=False)
        return self


class CustomToolCallOutputItem(FunctionCallOutputItem):
    """The result of a custom tool's call: a `tool` message, as a function's."""
    type: Literal["custom_tool_call_output"]


class ReasoningText(NullIsDefault):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(NullIsDefault):
    """A past reply's reasoning: its content's text (else its summary's), as vLLM reads it."""
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # (this server writes none, so can read none)

    @property
    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


def _item_type(value) -> str:
    """An item's type: a message's may be left out, or null (OpenAI's easy input message)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "message" if kind is None else kind


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[CustomToolCallItem, Tag("custom_tool_call")],
                            Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
              "reasoning")
PART_TYPES = ("input_text", "output_text", "text", "refusal")
_ITEM = TypeAdapter(InputItem)


def check_items(value):
    """`input` checked item by item before pydantic reads it, so that a 400 names the item and what is wrong with
    it (pydantic's own errors for a union of a string and a list begin with "not a string")."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("expected a string or a non-empty list of items")
    for i, item in enumerate(value):
        kind = _item_type(item)
        if kind not in ITEM_TYPES:
            raise ValueError(f"item {i} is of type {kind!r}, which this server does not take (it takes "
                             f"{', '.join(ITEM_TYPES)}; no item_reference: previous_response_id carries a stored "
                             "conversation)")
        content = item.get("content") if isinstance(item, dict) and kind == "message" else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in PART_TYPES:
                raise ValueError(f"item {i}: content part {j} is of type {part_type!r}: this server reads text "
                                 f"parts ({', '.join(PART_TYPES)})")
        try:
            _ITEM.validate_python(item)
        except ValidationError as e:
            raise ValueError(_item_error(i, kind, item, e.errors())) from None
    return value


# what an item's field of several forms takes (pydantic's errors name each form: "content.str", "output.list[...]")
ITEM_FORMS = {"content": "a string or a list of text parts (input_text, output_text, refusal)",
              "output": "a string or a list of input_text parts"}


def _item_error(i: int, kind: str, item, errors: list) -> str:
    """The message of item i's first error, with the value it is about (validation_error would quote the start of the
    whole input instead)."""
    error = errors[0]
    loc = [str(x) for x in error["loc"][1:]]  # (after the item's type)
    if loc and loc[0] in ITEM_FORMS and sum(1 for e in errors if e["loc"][1:2] == error["loc"][1:2]) > 1:
        value = item.get(loc[0]) if isinstance(item, dict) else item
        return f"item {i} ({kind}) {loc[0]}: expected {ITEM_FORMS[loc[0]]} (got {short(value)})"
    where = ".".join(loc)
    got = f" (got {short(error['input'])})" if error.get("type") != "missing" else ""
    return f"item {i} ({kind}){' ' + where if where else ''}: {pydantic_message(error)}{got}"


def as_items(items: str | list) -> list:
    """`input` as a list of items (a string: one user message)."""
    return [MessageItem(role="user", content=items)] if isinstance(items, str) else list(items)


def chat_messages(instructions: str | None, items: str | list) -> list[ChatMessage]:
    """The chat messages of `instructions` and `input`: the instructions as a system message, a string as a user
    message; a past reply's reasoning, message and function calls joined into one assistant message (in the order
    they come, as vLLM joins them: an assistant message takes the reasoning and the calls that follow it until
    another message)."""
    messages, _ = joined_messages(instructions, as_items(items))
    return [ChatMessage.model_validate(m) for m in messages]


def joined_messages(instructions: str | None, items: list) -> tuple[list[dict], list[bool]]:
    """chat_messages' messages as dicts, and per item whether it begins a message of its own (False: it joins the
    assistant message before it, as a past reply's function call joins its reasoning)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    starts = []
    for item in items:
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        count = len(messages)
        if isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if last is None:
                messages.append(last := {"role": "assistant", "content": None})
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, ReasoningItem):
            if last is None or "reasoning" in last or last.get("content") is not None or "tool_calls" in last:
                messages.append({"role": "assistant", "content": None, "reasoning": item.text})
            else:
                last["reasoning"] = item.text
        elif item.role == "assistant" and last is not None and last.get("content") is None and "tool_calls" not in last:
            last["content"] = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
        else:
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        starts.append(len(messages) > count)
    return messages, starts
