"""The wire format: OpenAI's request bodies as pydantic models (the response bodies and the server-sent events
are in responses.py).

Requests mirror OpenAI's `/v1/completions` and `/v1/chat/completions` (the fields this server
runs; a field OpenAI or vLLM has that the engine cannot honour, such as beam search, is refused by
name when it is set, never silently ignored), plus vLLM's extensions `top_k`, `stop_token_ids`, `ignore_eos`,
`return_token_ids`, `return_tokens_as_token_ids`, the sampling controls (`min_p`, `repetition_penalty`, `min_tokens`,
`include_stop_str_in_output`, `prompt_logprobs`), structured output (OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: server/structured.py)
and the chat template's arguments
(`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`; OpenAI's `reasoning_effort` and vLLM's
`documents` as template variables, as vLLM passes them). Values are
strict JSON types (`true` is not 1, "5" is not 5). Responses carry what OpenAI's do, `usage` always (a stream:
in its last event when `stream_options.include_usage`), with `prompt_tokens_details.cached_tokens`; a chat
reply's `tool_calls` and vLLM's `reasoning_content` (in a stream: `delta.tool_calls`, `delta.reasoning_content`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from ..logprobs import MAX_LOGPROBS
from ..sampling import MAX_LOGIT_BIAS, MAX_PENALTY, SEED_RANGE
from .nulls import NullIsDefault
from .tool_protocol import AnyTool, ToolChoice, function_form

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Prompt = Union[StrictStr, TokenIds, Annotated[list[StrictStr], Field(min_length=1)],
               Annotated[list[TokenIds], Field(min_length=1)]]
Stop = Union[StrictStr, list[StrictStr], None]
NumLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]  # top tokens per position
Penalty = Annotated[StrictFloat, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
Bias = Annotated[StrictFloat, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]

MAX_N = 128  # choices of one request (each runs as its own engine request)


# every request model is a NullIsDefault (nulls.py): an optional field sent as null takes its default
class StreamOptions(NullIsDefault):
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
    "allowed_token_ids": (None,), "bad_words": (None, []), "logits_processors": (None,),
    "guided_whitespace_pattern": (None,),  # vLLM's: the JSON grammars' whitespace (xgrammar's is fixed here)
    # vLLM's: a scheduling priority (vLLM too refuses one but 0 without its priority scheduler), a salt keeping the
    # request's prefix-cache entries apart from others' (this cache has none), disaggregated prefill's KV transfer,
    # custom extensions' arguments
    "priority": (None, 0), "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None, {}),
    "thinking_token_budget": (None,),  # vLLM's: a reasoning cut by forcing its end token, which the engine cannot
}


def field_value(body, name: str):
    """The value of a request's field by its dotted name (`text.verbosity`), None where a part of it is unset."""
    for part in name.split("."):
        body = getattr(body, part, None)
    return body


def is_neutral(value, neutral: tuple) -> bool:
    if isinstance(value, bool) or any(isinstance(n, bool) for n in neutral):
        return any(value is n for n in neutral)
    return value in neutral


class JsonSchemaFormat(NullIsDefault):
    """response_format's json_schema (OpenAI's): the schema under `schema` (a JSON Schema object)."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(NullIsDefault):
    """OpenAI's, and vLLM's "structural_tag": xgrammar's tag under `format`, or vLLM's older structures and triggers."""
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[StrictStr] | None = None


class StructuredOutputs(NullIsDefault):
    """vLLM's structured_outputs: one of json (a schema, or its JSON text), regex, choice, grammar (xgrammar's
    EBNF, or Lark's), json_object, structural_tag (its JSON text: structured.py); vLLM's switches of its backends,
    taken either way: what they ask for is what this backend does anyway (grammar.py: JSON compact, xgrammar's
    disable_any_whitespace; no property a schema does not define, xgrammar's strict mode, which vLLM's xgrammar
    backend keeps whatever disable_additional_properties says; one backend, nothing to fall back to). vLLM's
    whitespace_pattern is refused unless null."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: StrictStr | None = None
    disable_any_whitespace: StrictBool | None = None
    disable_additional_properties: StrictBool | None = None
    disable_fallback: StrictBool | None = None

    @model_validator(mode="before")
    @classmethod
    def _whitespace_pattern(cls, data):  # (null: unset; any other value an unknown key's 400)
        return {k: v for k, v in data.items() if k != "whitespace_pattern" or v is not None} if isinstance(data, dict) \
            else data


class SamplingFields(NullIsDefault):
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
    # logprobs' token strings as "token_id:N" (RL clients read the ids back from them; null: false)
    return_tokens_as_token_ids: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None  # false: every special token's text kept
    # either value: a decode puts no space between special tokens (transformers' tokenizers add none, whatever the
    # value; vLLM's detokenizer of a fast tokenizer neither), which is what false asks for and what true gives in vLLM
    spaces_between_special_tokens: StrictBool | None = None
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
    # vLLM's: only the prompt's last N tokens (-1: as many as leave room for a new one; state.kept_tokens)
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
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
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None
    priority: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    thinking_token_budget: Any = None

    def neutral(self) -> dict:
        """NEUTRAL of this request's kind of body."""
        return NEUTRAL

    def unsupported(self) -> str | None:
        """The name of the first field set to something this server cannot do, or None."""
        for name, neutral in self.neutral().items():
            if not is_neutral(field_value(self, name), neutral):
                return name
        return None

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        """(field, value) of the request's own limit on new tokens, or None when it set none (a default)."""
        return None

    def conflict(self) -> tuple[str, str] | None:
        """(field, message) of values that are each valid but not together, or None."""
        return None

    def formats(self) -> list[tuple[str, "ResponseFormat"]]:
        """(field, format) of each OpenAI-style output format the request sets (server/structured.py)."""
        return [("response_format", self.response_format)] if self.response_format is not None else []


class CompletionRequest(SamplingFields):
    prompt: Prompt
    # OpenAI's default; None: up to the context; 0: none, with echo (the prompt's logprobs alone)
    max_tokens: StrictInt | None = Field(16, ge=0)
    echo: StrictBool = False  # the prompt before the text (and its tokens' logprobs, with logprobs)
    logprobs: NumLogprobs | None = None  # each token's logprob and the top N (OpenAI's legacy format)
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None  # candidates per prompt, the n best returned
    suffix: StrictStr | None = None

    def unsupported(self) -> str | None:
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
        if self.candidates < self.n:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n}): the n best of best_of are returned"
        if self.candidates > self.n and self.stream:
            return "best_of", "best_of greater than n cannot stream: the best are known only once all have ended"
        return None

    @property
    def candidates(self) -> int:
        """The completions generated per prompt (best_of; unset: n)."""
        return self.n if self.best_of is None else self.best_of

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) and no new token."""
        return self.echo and self.max_tokens == 0


class TextPart(BaseModel):
    """A text part: chat's "text", and the Responses API's "input_text" / "output_text" (clients that build chat
    messages in its shape send them), as vLLM reads them all."""
    type: Literal["text", "input_text", "output_text"]
    text: StrictStr


class RefusalPart(BaseModel):
    """An assistant's refusal in its content parts (OpenAI's assistant messages: text and refusal parts), as a
    client sends a past reply back; its text is the reply's text, as vLLM reads it."""
    type: Literal["refusal"]
    refusal: StrictStr

    @property
    def text(self) -> str:
        return self.refusal


# OpenAI's roles (a chat template may drop a message of any other silently, as Qwen's do)
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(NullIsDefault):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: handed to the chat template as they are

    role: Role
    content: Union[StrictStr, list[Union[TextPart, RefusalPart]], None] = None

    @model_validator(mode="after")
    def _content_given(self):
        """Only an assistant's message may leave out its content (OpenAI's rule: one that made tool calls), or
        hold refusal parts (OpenAI's: only an assistant's content parts may be refusals)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content (a string or a list of text parts)")
        if self.role != "assistant" and isinstance(self.content, list) and any(
                isinstance(part, RefusalPart) for part in self.content):
            raise ValueError(f"a {self.role} message cannot hold a refusal part: only an assistant's can")
        return self

    def template_dict(self) -> dict:
        """The message as a chat template reads it: content parts joined into one string, an assistant's refusal
        (a refusal part, or OpenAI's message-level `refusal` in place of content) as its text, as vLLM reads it;
        OpenAI's `developer` role as `system` (OpenAI treats them alike; chat templates such as Qwen's know only
        the latter); a tool call's `function.arguments` sent as a JSON string (OpenAI's wire format) parsed into
        the mapping templates iterate (as vLLM does; one that is not a JSON object stays a string); a past reply's
        reasoning under either of vLLM's names (`reasoning`, `reasoning_content`) given under both (Qwen's templates
        read `reasoning_content`); a custom tool's call as the call of the function it stands for (function_form); the
        other keys sent as null (`"tool_calls": null`, `"name": null`) left out, as vLLM builds a message of those set
        (a template that iterates `message.tool_calls` when it is defined raised on null)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        refusal = (self.model_extra or {}).get("refusal")
        if not content and self.role == "assistant" and isinstance(refusal, str):
            content = refusal
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        if isinstance(extra.get("tool_calls"), list):
            extra["tool_calls"] = [_parsed_arguments(function_form(call)) for call in extra["tool_calls"]]
        for name, other in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
            if extra.get(name) is not None and extra.get(other) is None:  # vLLM's two names: templates read either
                extra[other] = extra[name]
        role = "system" if self.role == "developer" else self.role
        return {**extra, "role": role, "content": content or ""}


def _parsed_arguments(call):
    """A tool call with its function's `arguments` JSON string parsed, if it is a JSON object; arguments left out,
    null or "" (a call without parameters, as some clients write it) as an empty mapping, as vLLM reads them."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else 0
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {**call, "function": {**function, "arguments": {}}}
    if not isinstance(arguments, str):
        return call
    try:
        arguments = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


# OpenAI's chat fields for what this server's replies cannot be (another verbosity, audio, web search results)
CHAT_NEUTRAL = {"verbosity": (None, "medium"), "modalities": (None, ["text"]), "audio": (None,),
                "web_search_options": (None,)}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: up to the context
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: StrictBool | None = None  # each new token's logprob (and top_logprobs' top N)
    top_logprobs: NumLogprobs | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: Any = None  # false: one call (forced: the schema's; auto: the first, as vLLM: chat.py)
    functions: Any = None  # OpenAI's deprecated forms of tools and tool_choice: refused (NEUTRAL)
    function_call: Any = None
    verbosity: Any = None  # OpenAI's output options this server has not: refused (CHAT_NEUTRAL)
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    # vLLM's that this server does not run, refused (NEUTRAL): a request's own chat template (vLLM too refuses it
    # without --trust-request-chat-template; the reply parsers read the server's template's formats)
    chat_template: Any = None
    echo: StrictBool = False  # vLLM's: the last message's text before the reply's, where the reply goes on with it
    # vLLM's chat template arguments (chat_template_kwargs: the template's own variables, e.g. Qwen3's
    # enable_thinking)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; to the template as its `reasoning_effort` variable (vLLM's way: Qwen's templates do not read it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: to the template as its `documents` (RAG templates read it)
    include_reasoning: StrictBool = True  # vLLM's: false leaves the reasoning out of the reply (its text is parsed out)

    def neutral(self) -> dict:
        # parallel_tool_calls false: one call (a forced tool_choice's schema holds the reply to one, tool_choice.py;
        # under "auto" the calls after the first are dropped, as vLLM does)
        return {"parallel_tool_calls": (None, True, False), "functions": (None, []),
                "function_call": (None, "none"), "chat_template": (None,), **CHAT_NEUTRAL,
                **NEUTRAL}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def template_kwargs(self) -> dict | None:
        """The chat template's own variables: chat_template_kwargs, and reasoning_effort and documents unless they
        set them."""
        fields = {name: value for name in ("reasoning_effort", "documents") if (value := getattr(self, name)) is not None}
        return {**fields, **(self.chat_template_kwargs or {})} if fields else self.chat_template_kwargs

    def conflict(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return None

    @property
    def echoed(self) -> str:
        """vLLM's echo: the last message's text, put before the reply's where the reply is of its role (the message
        continued, or an assistant's followed by the assistant's turn); else ""."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.template_dict()["content"]

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        if self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None
