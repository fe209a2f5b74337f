"""The wire format: OpenAI's request and response bodies as pydantic models, and server-sent events.

Requests mirror OpenAI's `/v1/completions` and `/v1/chat/completions` (the fields this server
runs; a field OpenAI or vLLM has that the engine cannot honour, such as `logprobs`, `echo` or
`repetition_penalty`, is refused by name when it is set, never silently ignored), plus vLLM's
extensions `top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids` and the chat template's
arguments (`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`). Values are
strict JSON types (`true` is not 1, "5" is not 5). Responses carry what OpenAI's do, `usage` always (a stream:
in its last event when `stream_options.include_usage`), with `prompt_tokens_details.cached_tokens`; a chat
reply's `tool_calls` and vLLM's `reasoning_content` (in a stream: `delta.tool_calls`, `delta.reasoning_content`).

A stream is `data: {chunk}\\n\\n` events ending in `data: [DONE]\\n\\n`; an error after the stream
started is one `data: {"error": {...}}` event before `[DONE]` (the openai client raises it).
"""

from __future__ import annotations

import json
import time
import uuid
from json.encoder import encode_basestring  # (C) a str as JSON, non-ASCII kept: json.dumps(s, ensure_ascii=False)
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_serializer,
                      model_validator)

from ..sampling import SEED_RANGE

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Prompt = Union[StrictStr, TokenIds, Annotated[list[StrictStr], Field(min_length=1)],
               Annotated[list[TokenIds], Field(min_length=1)]]
Stop = Union[StrictStr, list[StrictStr], None]
FinishReason = Literal["stop", "length", "tool_calls"]

MAX_N = 128  # choices of one request (each runs as its own engine request)


def _none(value) -> bool:
    return value is None


def now() -> int:
    return int(time.time())


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# Fields of OpenAI's API and vLLM's extensions that the engine cannot honour, with the values that ask for
# nothing (sent by clients that fill in every field): any other value is refused by name (unsupported()).
# Identity, not equality, for the booleans: `logprobs: 0` asks for logprobs (OpenAI's completions: of the
# sampled tokens), though 0 == False.
NEUTRAL = {
    "logprobs": (None,),  # completions'; chat's is a boolean, False too (ChatCompletionRequest.neutral)
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "min_p": (None, 0), "repetition_penalty": (None, 1), "length_penalty": (None, 1), "min_tokens": (None, 0),
    "use_beam_search": (None, False), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "logits_processors": (None,), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
}


def is_neutral(value, neutral: tuple) -> bool:
    if isinstance(value, bool) or any(isinstance(n, bool) for n in neutral):
        return any(value is n for n in neutral)
    return value in neutral


class SamplingFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share. OpenAI's fields first, then vLLM's extensions.
    `top_k` -1 or 0: off (vLLM's and transformers' conventions). Values are taken as JSON types them (strict:
    `true` is no integer, "5" no number). Unknown fields are ignored, as OpenAI and vLLM do (clients send
    fields of newer API versions); known ones this server cannot honour (NEUTRAL) are refused when set."""
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None  # None: the served model (OpenAI requires it; vLLM does not)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: StrictFloat = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: Annotated[StrictInt, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])] | None = None
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: StrictInt = Field(0, ge=-1)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    # fields the engine cannot honour (NEUTRAL): refused unless neutral
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    length_penalty: Any = None
    min_tokens: Any = None
    use_beam_search: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def neutral(self) -> dict:
        """NEUTRAL of this request's kind of body."""
        return NEUTRAL

    def unsupported(self) -> str | None:
        """The name of the first field set to something this server cannot do, or None."""
        for name, neutral in self.neutral().items():
            if not is_neutral(getattr(self, name), neutral):
                return name
        return None

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        """(field, value) of the request's own limit on new tokens, or None when it set none (a default)."""
        return None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default; None: up to the context
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        if "max_tokens" in self.model_fields_set and self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


# OpenAI's roles (a chat template may drop a message of any other silently, as Qwen's do)
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: handed to the chat template as they are

    role: Role
    content: Union[StrictStr, list[TextPart], None] = None

    @model_validator(mode="after")
    def _content_given(self):
        """Only an assistant's message may leave out its content (OpenAI's rule: one that made tool calls)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content (a string or a list of text parts)")
        return self

    def template_dict(self) -> dict:
        """The message as a chat template reads it: content parts joined into one string; OpenAI's
        `developer` role as `system` (OpenAI treats them alike; chat templates such as Qwen's know only the
        latter); a tool call's `function.arguments` sent as a JSON string (OpenAI's wire format) parsed into
        the mapping templates iterate (as vLLM does; one that is not a JSON object stays a string)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        extra = dict(self.model_extra or {})
        if isinstance(extra.get("tool_calls"), list):
            extra["tool_calls"] = [_parsed_arguments(call) for call in extra["tool_calls"]]
        role = "system" if self.role == "developer" else self.role
        return {**extra, "role": role, "content": content or ""}


def _parsed_arguments(call):
    """A tool call with its function's `arguments` JSON string parsed, if it is a JSON object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("arguments"), str)):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# tools: OpenAI's function tools and tool_choice (the checks that span fields: tool_choice.py) ----------------
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # handed to the chat template as it is

    # OpenAI's letters, digits, '_' and '-' (and '.', which MCP's tool names use): what Qwen's `<function=NAME>`
    # can hold
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments' object
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: up to the context
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    top_logprobs: Any = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: Any = None  # refused when false (NEUTRAL): a reply may hold several calls
    functions: Any = None  # OpenAI's deprecated forms of tools and tool_choice: refused (NEUTRAL)
    function_call: Any = None
    response_format: Any = None
    # vLLM's chat template arguments (chat_template_kwargs: the template's own variables, e.g. Qwen3's
    # enable_thinking)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def neutral(self) -> dict:
        return {"top_logprobs": (None, 0), "parallel_tool_calls": (None, True), "functions": (None, []),
                "function_call": (None, "none"), "response_format": (None, {"type": "text"}), **NEUTRAL,
                "logprobs": (None, False)}  # chat's logprobs is a boolean

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        if self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None


# responses ---------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)  # return_token_ids (vLLM's extension)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_none)


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


class DeltaToolCall(SetFieldsOnly):
    index: int  # the call's place among the choice's calls
    id: str | None = None  # these two in a call's first delta
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(SetFieldsOnly):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: a reply of tool calls (or reasoning) only
    reasoning_content: str | None = None  # the reasoning parser's (vLLM's field, null as vLLM sends it)
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_none)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_none)  # the last chunk's, with include_usage


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

    def completion(self, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> str:
        """event(CompletionResponse(..., choices=[CompletionChoice(index, text, finish_reason, token_ids)]))."""
        return f'{self._head}{index},"text":{encode_basestring(text)},{_choice_end(finish_reason, token_ids)}'

    def chat(self, index: int, content: str | None, finish_reason: str | None,
             token_ids: list[int] | None = None) -> str:
        """event(ChatChunk(..., choices=[ChatChunkChoice(index, DeltaMessage(content=content), finish_reason,
        token_ids)]))."""
        delta = "{}" if content is None else f'{{"content":{encode_basestring(content)}}}'
        return f'{self._head}{index},"delta":{delta},{_choice_end(finish_reason, token_ids)}'


def _choice_end(finish_reason: str | None, token_ids: list[int] | None) -> str:
    """A streamed choice's last fields (logprobs, finish_reason, token_ids when given) and the event's end."""
    ids = "" if token_ids is None else f',"token_ids":[{",".join(map(str, token_ids))}]'
    return f'"logprobs":null,"finish_reason":{_FINISH[finish_reason]}{ids}}}]}}\n\n'
