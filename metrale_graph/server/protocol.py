"""The wire format: OpenAI's request and response bodies as pydantic models, and server-sent events.

Requests mirror OpenAI's `/v1/completions` and `/v1/chat/completions` (the fields this server
runs; a field OpenAI or vLLM has that the engine cannot honour, such as `best_of` or beam search, is refused by
name when it is set, never silently ignored), plus vLLM's extensions `top_k`, `stop_token_ids`, `ignore_eos`,
`return_token_ids`, the sampling controls (`min_p`, `repetition_penalty`, `min_tokens`,
`include_stop_str_in_output`, `prompt_logprobs`), structured output (OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: server/structured.py)
and the chat template's arguments
(`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`). Values are
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

from ..logprobs import MAX_LOGPROBS
from ..sampling import MAX_LOGIT_BIAS, MAX_PENALTY, SEED_RANGE

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Prompt = Union[StrictStr, TokenIds, Annotated[list[StrictStr], Field(min_length=1)],
               Annotated[list[TokenIds], Field(min_length=1)]]
Stop = Union[StrictStr, list[StrictStr], None]
FinishReason = Literal["stop", "length", "tool_calls"]
NumLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]  # top tokens per position
Penalty = Annotated[StrictFloat, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
Bias = Annotated[StrictFloat, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]

MAX_N = 128  # choices of one request (each runs as its own engine request)


def _none(value) -> bool:
    return value is None


def now() -> int:
    return int(time.time())


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: StrictBool = False  # a last event with the usage
    # vLLM's: with include_usage, every event also carries the usage so far (the prompt, the tokens sent)
    continuous_usage_stats: StrictBool = False

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


# Fields of OpenAI's API and vLLM's extensions that the engine cannot honour, with the values that ask for
# nothing (sent by clients that fill in every field): any other value is refused by name (unsupported()).
# Identity, not equality, for the booleans: `use_beam_search: 0` is not False.
NEUTRAL = {
    "length_penalty": (None, 1), "use_beam_search": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "allowed_token_ids": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "logits_processors": (None,),
    "guided_whitespace_pattern": (None,),  # vLLM's: the JSON grammars' whitespace (xgrammar's is fixed here)
}


def is_neutral(value, neutral: tuple) -> bool:
    if isinstance(value, bool) or any(isinstance(n, bool) for n in neutral):
        return any(value is n for n in neutral)
    return value in neutral


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema (OpenAI's): the schema under `schema` (a JSON Schema object)."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of json (a schema, or its JSON text), regex, choice, grammar (xgrammar's
    EBNF), json_object. vLLM's other keys (whitespace_pattern, structural_tag, ...) are refused."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


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
    # sampling controls (metrale_graph/logits_processors.py: vLLM's semantics); null: the default (off).
    # OpenAI's penalties, logit_bias (token ids as JSON object keys); vLLM's min_p, repetition_penalty,
    # min_tokens, include_stop_str_in_output, prompt_logprobs (each prompt token's logprob and the top N)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[StrictStr, Bias] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    include_stop_str_in_output: StrictBool | None = None
    prompt_logprobs: NumLogprobs | None = None
    # structured output (server/structured.py: at most one of them; null or {"type": "text"}: none)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # fields the engine cannot honour (NEUTRAL): refused unless neutral
    length_penalty: Any = None
    use_beam_search: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None

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

    def conflict(self) -> tuple[str, str] | None:
        """(field, message) of values that are each valid but not together, or None."""
        return None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # OpenAI's default; None: up to the context; 0: none, with echo (the prompt's logprobs alone)
    max_tokens: StrictInt | None = Field(16, ge=0)
    echo: StrictBool = False  # the prompt before the text (and its tokens' logprobs, with logprobs)
    logprobs: NumLogprobs | None = None  # each token's logprob and the top N (OpenAI's legacy format)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> str | None:
        if self.best_of not in (None, 1, self.n):
            return "best_of"
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        if "max_tokens" in self.model_fields_set and self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None

    def conflict(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 asks for no new tokens: only with echo (the prompt, and its logprobs)"
        return None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) and no new token."""
        return self.echo and self.max_tokens == 0


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
    logprobs: StrictBool | None = None  # each new token's logprob (and top_logprobs' top N)
    top_logprobs: NumLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: Any = None  # false: one call, under a forced tool_choice only (else refused: NEUTRAL)
    functions: Any = None  # OpenAI's deprecated forms of tools and tool_choice: refused (NEUTRAL)
    function_call: Any = None
    # vLLM's chat template arguments (chat_template_kwargs: the template's own variables, e.g. Qwen3's
    # enable_thinking)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def neutral(self) -> dict:
        # parallel_tool_calls false: one call, which a forced tool_choice's schema holds the reply to (tool_choice.py)
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        return {"parallel_tool_calls": (None, True, False) if forced else (None, True), "functions": (None, []),
                "function_call": (None, "none"), **NEUTRAL}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conflict(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return None

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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
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
    logprobs: ChatLogprobs | None = None
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
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_none)  # vLLM's extension (one prompt)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_none)


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_none)  # the last chunk's, with include_usage
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_none)  # the first chunk's, with prompt_logprobs


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
                   logprobs: BaseModel | None = None) -> str:
        """event(CompletionResponse(..., choices=[CompletionChoice(index, text, logprobs, finish_reason,
        token_ids)]))."""
        end = _choice_end(finish_reason, token_ids, logprobs)
        return f'{self._head}{index},"text":{encode_basestring(text)},{end}'

    def chat(self, index: int, content: str | None, finish_reason: str | None,
             token_ids: list[int] | None = None, logprobs: BaseModel | None = None) -> str:
        """event(ChatChunk(..., choices=[ChatChunkChoice(index, DeltaMessage(content=content), logprobs,
        finish_reason, token_ids)]))."""
        delta = "{}" if content is None else f'{{"content":{encode_basestring(content)}}}'
        return f'{self._head}{index},"delta":{delta},{_choice_end(finish_reason, token_ids, logprobs)}'


def with_usage(sse: str, usage: Usage) -> str:
    """The server-sent event `sse` (one JSON object: event()'s or StreamChunks') with `usage` added as its last
    field."""
    assert sse.startswith("data: {") and sse.endswith("}\n\n"), sse
    return f'{sse[:-3]},"usage":{usage.model_dump_json()}}}\n\n'


def _choice_end(finish_reason: str | None, token_ids: list[int] | None, logprobs: BaseModel | None = None) -> str:
    """A streamed choice's last fields (logprobs, finish_reason, token_ids when given) and the event's end."""
    ids = "" if token_ids is None else f',"token_ids":[{",".join(map(str, token_ids))}]'
    encoded = "null" if logprobs is None else logprobs.model_dump_json()
    return f'"logprobs":{encoded},"finish_reason":{_FINISH[finish_reason]}{ids}}}]}}\n\n'
