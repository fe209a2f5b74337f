"""The wire format's replies: OpenAI's response bodies as pydantic models (usage, logprobs, a completion's and
a chat's choices, a stream's chunks and deltas, the model list, an error), and the server-sent events that
carry a stream. protocol.py holds the requests; the module docstring there says what a reply carries.

A stream is `data: {chunk}\\n\\n` events ending in `data: [DONE]\\n\\n`; an error after the stream
started is one `data: {"error": {...}}` event before `[DONE]` (the openai client raises it).
"""

from __future__ import annotations

import json
import time
import uuid
from json.encoder import encode_basestring  # (C) a str as JSON, non-ASCII kept: json.dumps(s, ensure_ascii=False)
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

FinishReason = Literal["stop", "length", "tool_calls"]


def _none(value) -> bool:
    return value is None


def now() -> int:
    return int(time.time())


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# responses ---------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the new tokens inside the replies' reasoning blocks (chat.reasoning_tokens)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # a chat's on a server with a reasoning parser (OpenAI's field; vLLM's too, there): left out elsewhere
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=_none)

    def with_reasoning(self, reasoning_tokens: int) -> "Usage":
        return self.model_copy(update={"completion_tokens_details": CompletionTokensDetails(
            reasoning_tokens=reasoning_tokens)})

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# logprobs (server/logprobs.py fills them) -------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs of a completion: per token its string, its logprob (None for a prompt's first
    token), its top N as {token string: logprob} with its own entry added, and where its string begins in the
    text (the token strings' lengths summed, as vLLM does)."""
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token string's UTF-8 (vLLM's: U+FFFD's bytes for a partial character)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob, in prompt_logprobs: {token id: PromptLogprob} per prompt position (None for the first)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


# vLLM's stop_reason: the stop string or the stop_token_ids token that ended a choice (null: an eos, a length)
StopReason = int | str | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)  # return_token_ids (vLLM's extension)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_none)
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_none)  # vLLM's extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_none)  # None only in a stream's chunks


class SetFieldsOnly(BaseModel):
    """A model whose JSON leaves out its None fields: a delta holds only what it changes."""

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(SetFieldsOnly):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # the next piece of the arguments' JSON text


class DeltaCustomCall(SetFieldsOnly):
    name: str | None = None  # in a call's first delta
    input: str | None = None  # "" in its first delta, then its input (custom_tools.CustomInputs)


class DeltaToolCall(SetFieldsOnly):
    index: int  # the call's place among the choice's calls
    id: str | None = None  # these two in a call's first delta
    type: Literal["function", "custom"] | None = None
    function: DeltaFunctionCall | None = None
    custom: DeltaCustomCall | None = None  # a custom tool's call (OpenAI's shape; the openai client keeps it as a dict)


class DeltaMessage(SetFieldsOnly):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text under vLLM's newer name
    tool_calls: list[DeltaToolCall] | None = None


class RoleDelta(BaseModel):
    """A chat stream's first delta of a choice: the role, and the content the whole reply's starts as (its null
    written out, as OpenAI's first delta of a reply of calls has it)."""
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class CustomCall(BaseModel):
    name: str
    input: str


class CustomToolCall(BaseModel):
    """A custom tool's call (tool_protocol.CustomTool): its input, the text the tool takes."""
    id: str
    type: Literal["custom"] = "custom"
    custom: CustomCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: a reply of tool calls (or reasoning) only
    reasoning_content: str | None = None  # the reasoning parser's (vLLM's field, null as vLLM sends it)
    reasoning: str | None = None  # the same, under the name vLLM renamed it to (clients read either)
    tool_calls: list[ToolCall | CustomToolCall] | None = Field(None, exclude_if=_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_none)  # vLLM's extension (one prompt)
    # return_token_ids: the rendered messages' tokens, here and not per choice (vLLM's place: a chat has one prompt)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage | RoleDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_none)  # the last chunk's, with include_usage
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_none)  # the first chunk's, with prompt_logprobs
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_none)  # the first chunk's, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "metrale-graph"
    max_model_len: int  # the engine's max_context (prompt + new tokens), as vLLM reports it
    vocab_size: int  # token ids a prompt may hold: [0, vocab_size)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo


# server-sent events --------------------------------------------------------------------------------
DONE = "data: [DONE]\n\n"


def event(body: BaseModel) -> str:
    """One server-sent event holding `body` as JSON."""
    return f"data: {body.model_dump_json()}\n\n"


_FINISH = {None: "null", "stop": '"stop"', "length": '"length"', "tool_calls": '"tool_calls"'}  # encoded


class StreamChunks:
    """The per-output events of one stream (a completion's or a chat's), the JSON of the same models that
    event() writes, from a template: the fields that stay (id, object, created, model) are encoded once,
    so an output costs one encoding of its text (a server streams one event per request per step;
    pydantic models per event were a large part of the server's time per token)."""

    def __init__(self, obj: str, rid: str, created: int, model: str):
        head = json.dumps({"id": rid, "object": obj, "created": created, "model": model}, ensure_ascii=False,
                          separators=(",", ":"))
        self._head = f'data: {head[:-1]},"choices":[{{"index":'

    def completion(self, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                   logprobs: BaseModel | None = None, stop_reason: int | str | None = None) -> str:
        """event(CompletionResponse(..., choices=[CompletionChoice(index, text, logprobs, finish_reason,
        stop_reason, token_ids)]))."""
        end = _choice_end(finish_reason, token_ids, logprobs, stop_reason)
        return f'{self._head}{index},"text":{encode_basestring(text)},{end}'

    def chat(self, index: int, content: str | None, finish_reason: str | None,
             token_ids: list[int] | None = None, logprobs: BaseModel | None = None,
             stop_reason: int | str | None = None) -> str:
        """event(ChatChunk(..., choices=[ChatChunkChoice(index, DeltaMessage(content=content), logprobs,
        finish_reason, token_ids)]))."""
        delta = "{}" if content is None else f'{{"content":{encode_basestring(content)}}}'
        return f'{self._head}{index},"delta":{delta},{_choice_end(finish_reason, token_ids, logprobs, stop_reason)}'


def with_usage(sse: str, usage: Usage | None) -> str:
    """The server-sent event `sse` (one JSON object: event()'s or StreamChunks') with `usage` added as its last
    field (None: null, as OpenAI's chunks before the usage chunk have it)."""
    assert sse.startswith("data: {") and sse.endswith("}\n\n"), sse
    return f'{sse[:-3]},"usage":{"null" if usage is None else usage.model_dump_json()}}}\n\n'


def _choice_end(finish_reason: str | None, token_ids: list[int] | None, logprobs: BaseModel | None = None,
                stop_reason: int | str | None = None) -> str:
    """A streamed choice's last fields (logprobs, finish_reason, stop_reason, token_ids when given) and the event's
    end."""
    ids = "" if token_ids is None else f',"token_ids":[{",".join(map(str, token_ids))}]'
    encoded = "null" if logprobs is None else logprobs.model_dump_json()
    stop = ("null" if stop_reason is None else encode_basestring(stop_reason) if isinstance(stop_reason, str)
            else str(int(stop_reason)))
    return f'"logprobs":{encoded},"finish_reason":{_FINISH[finish_reason]},"stop_reason":{stop}{ids}}}]}}\n\n'
