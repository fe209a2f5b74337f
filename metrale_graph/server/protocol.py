"""The wire format: OpenAI's request and response bodies as pydantic models, and server-sent events.

Requests mirror OpenAI's `/v1/completions` and `/v1/chat/completions` (the fields this server
runs; a field OpenAI has that the engine cannot honour, such as `logprobs` or `echo`, is refused by
name when it is set, never silently ignored), plus vLLM's extensions `top_k`, `stop_token_ids`,
`ignore_eos` and `return_token_ids`. Responses carry what OpenAI's do, `usage` always (a stream:
in its last event when `stream_options.include_usage`), with `prompt_tokens_details.cached_tokens`.

A stream is `data: {chunk}\\n\\n` events ending in `data: [DONE]\\n\\n`; an error after the stream
started is one `data: {"error": {...}}` event before `[DONE]` (the openai client raises it).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_serializer

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Prompt = Union[StrictStr, TokenIds, Annotated[list[StrictStr], Field(min_length=1)],
               Annotated[list[TokenIds], Field(min_length=1)]]
Stop = Union[StrictStr, list[StrictStr], None]
FinishReason = Literal["stop", "length"]

MAX_N = 128  # choices of one request (each runs as its own engine request)


def _none(value) -> bool:
    return value is None


def now() -> int:
    return int(time.time())


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share. OpenAI's fields first, then vLLM's extensions.
    `top_k` -1 or 0: off (vLLM's and transformers' conventions). Unknown fields are ignored, as OpenAI
    and vLLM do (clients send fields of newer API versions)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model (OpenAI requires it; vLLM does not)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields the engine cannot honour: refused when set (unsupported())
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def unsupported(self) -> str | None:
        """The name of the first field set to something this server cannot do, or None."""
        for name, off in (("logprobs", (None, False, 0)), ("presence_penalty", (0,)), ("frequency_penalty", (0,)),
                          ("logit_bias", (None, {}))):
            if getattr(self, name) not in off:
                return name
        return None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default; None: up to the context
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: handed to the chat template as they are

    role: StrictStr
    content: Union[StrictStr, list[TextPart], None] = None

    def template_dict(self) -> dict:
        """The message as a chat template reads it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: Any = None

    def unsupported(self) -> str | None:
        for name in ("top_logprobs", "tools", "response_format"):
            if getattr(self, name):
                return name
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        return super().unsupported()

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):  # a delta holds only what it changes
        return {k: v for k, v in handler(self).items() if v is not None}


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
