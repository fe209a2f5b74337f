"""The Responses API's wire format (POST /v1/responses, responses_api.py): its request as a pydantic model (its input
items and the chat messages they become: responses_api_items.py; its output items, the response object and the
stream's events: responses_api_output.py).

The request is OpenAI's, as vLLM serves it: `input` a string (one user message) or a list of items (messages of
role user / system / developer / assistant with string or input_text / output_text / refusal parts; a past reply's
`function_call` and `custom_tool_call` items and the `function_call_output` / `custom_tool_call_output` items
answering them; its `reasoning` items, whose text goes back to the template as the assistant's reasoning, as vLLM reads
them), `instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, function and custom
(freeform: tool_protocol.py) `tools` in their flat shape, `tool_choice` (a function or custom tool by name too),
`parallel_tool_calls`, `text.format` (structured output: server/structured.py), `reasoning.effort` (the chat
template's `reasoning_effort`, as vLLM passes it), vLLM's `chat_template_kwargs` (the template's own variables, as chat's:
they win over reasoning.effort's), `reasoning.summary` (the reasoning item's summary: its text, no
summarizer), `metadata` (echoed), and the sampling fields the chat endpoint
takes from vLLM (`top_k`, `seed`, `stop`, `repetition_penalty`, ...), `store` and `previous_response_id` (the
server's response store: responses_store.py), `include` ("message.output_text.logprobs", with `top_logprobs`; and
"reasoning.encrypted_content", which asks for nothing here: a reasoning item carries its text), `truncation` ("auto":
a conversation too long for the context loses its oldest items, responses_truncation.py). What this server does not
run (`background`, `conversation`, `item_reference` items, other `include` values, a prompt template, hosted tools,
`text.verbosity`) is refused by name (400), never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, StrictStr, field_validator,
                      model_validator)

from .nulls import NullIsDefault
from .protocol import NEUTRAL, ChatMessage, JsonSchemaFormat, NumLogprobs, ResponseFormat, SamplingFields
from .responses_api_items import _ITEM, InputItem, MessageItem, as_items, chat_messages, check_items
from .tool_protocol import (AllowedTools, AllowedToolsChoice, CustomDefinition, CustomTool, FunctionDefinition,
                            FunctionName, NamedCustomChoice, NamedToolChoice, Parameters, Tool, choice_check)


# tools and text formats ------------------------------------------------------------------------------------
class FunctionTool(NullIsDefault):
    """A function tool in the Responses API's flat shape; `function_tool` is chat's shape of it."""
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: Parameters | None = None
    strict: StrictBool | None = None

    def chat_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition.model_validate(self.model_dump(exclude={"type"})))


class CustomToolFlat(CustomDefinition):
    """A custom tool in the Responses API's flat shape ({"type": "custom", "name", "description", "format"}: Codex's
    apply_patch); `chat_tool` is chat's shape of it."""
    type: Literal["custom"]

    def chat_tool(self) -> CustomTool:
        return CustomTool(type="custom", custom=CustomDefinition.model_validate(self.model_dump(exclude={"type"})))


class FunctionChoice(NullIsDefault):
    type: Literal["function"]
    name: StrictStr

    def chat_choice(self) -> NamedToolChoice:
        return NamedToolChoice(type="function", function=FunctionName(name=self.name))


class CustomChoice(NullIsDefault):
    type: Literal["custom"]
    name: StrictStr

    def chat_choice(self) -> NamedCustomChoice:
        return NamedCustomChoice(type="custom", custom=FunctionName(name=self.name))


class FlatAllowedTools(NullIsDefault):
    """The Responses API's allowed tools, flat: {"type": "allowed_tools", "mode", "tools": [{"type": "function" |
    "custom", "name"}, ...]} (chat's AllowedToolsChoice)."""
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[Annotated[Union[FunctionChoice, CustomChoice], Field(discriminator="type")]], Field(min_length=1)]

    def chat_choice(self) -> AllowedToolsChoice:
        tools = [t.chat_choice() for t in self.tools]
        return AllowedToolsChoice(type="allowed_tools", allowed_tools=AllowedTools(mode=self.mode, tools=tools))


FLAT_CHOICES = {"function": (FunctionChoice, '{"type": "function", "name": ...}'),
                "custom": (CustomChoice, '{"type": "custom", "name": ...}'),
                "allowed_tools": (FlatAllowedTools, '{"type": "allowed_tools", "mode": "auto" | "required", "tools": '
                                                    '[{"type": "function", "name": ...}, ...]}')}


class TextFormat(NullIsDefault):
    """text.format: "text" (none), "json_object", or "json_schema" with its `name` and `schema` at this level."""
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs its name and its schema: {\"type\": \"json_schema\", "
                             "\"name\": ..., \"schema\": {...}}")
        return self


class TextConfig(NullIsDefault):
    format: TextFormat | None = None
    verbosity: Any = None  # refused unless null or "medium" (RESPONSES_NEUTRAL: the replies have one verbosity)


class ReasoningConfig(NullIsDefault):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # a summary asked for: the reasoning item's summary is its text (no summarizer: responses_api_output.py)
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (summary's older name)


# the Responses API's fields this server does not run, and the values that ask for nothing
RESPONSES_NEUTRAL = {
    "background": (None, False), "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
    "n": (1,), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),  # (truncation cuts a conversation)
    # OpenAI's stream options: obfuscation (random padding of the deltas) off, as every stream here is (null: unset)
    "stream_options": (None, {}, {"include_obfuscation": False}, {"include_obfuscation": None}),
    "text.verbosity": (None, "medium"),
    "return_token_ids": (False,), "return_tokens_as_token_ids": (None, False), "logprobs": (None, False),
}

OUTPUT_LOGPROBS = "message.output_text.logprobs"
# `include` values taken: the output text's logprobs; the reasoning's encrypted content, which this server never
# writes (a reasoning item carries its text in `content`, and sent back it reaches the template: nothing to encrypt)
INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content")


def check_include(value):
    for name in value or ():
        if name not in INCLUDABLE:
            raise ValueError(f"{name!r} is not supported by this server (it takes {', '.join(map(repr, INCLUDABLE))})")
    return value


class ResponsesRequest(SamplingFields):
    input: Union[StrictStr, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # None: up to the context
    tools: list[Annotated[Union[FunctionTool, CustomToolFlat], Field(discriminator="type")]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, CustomChoice, FlatAllowedTools, None] = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None  # None: true, the API's default (stored while the server has a store)
    previous_response_id: StrictStr | None = None
    include: list[StrictStr] | None = None
    top_logprobs: NumLogprobs | None = None  # with include's OUTPUT_LOGPROBS: each position's top N
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    # "auto": a conversation too long for the context loses its oldest items (responses_truncation.py)
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Any = None
    logprobs: Any = None  # (chat's field, refused: include asks for logprobs here)
    stream_options: Any = None  # (the Responses API's: include_obfuscation, taken when false: RESPONSES_NEUTRAL)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's own variables (Qwen3's enable_thinking)
    # the stored conversation before `input` (previous_response_id's items, responses_store.py), set by the endpoint
    _history: list = PrivateAttr(default_factory=list)
    _kept: list | None = PrivateAttr(default=None)  # truncation "auto": the conversation's items the prompt keeps

    _input_items = field_validator("input", mode="before")(check_items)
    _tool_choice = field_validator("tool_choice", mode="before")(choice_check(FLAT_CHOICES))
    _include = field_validator("include")(check_include)

    def neutral(self) -> dict:
        return {**RESPONSES_NEUTRAL, **NEUTRAL}

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        return None if self.max_output_tokens is None else ("max_output_tokens", self.max_output_tokens)

    def conflict(self) -> tuple[str, str] | None:
        if self.top_logprobs and self.output_logprobs is None:
            return "top_logprobs", f"top_logprobs needs include: [{OUTPUT_LOGPROBS!r}] (the output text's logprobs)"
        return None

    @property
    def output_logprobs(self) -> int | None:
        """The top N of each new token's logprobs the output text carries (include's OUTPUT_LOGPROBS), else None."""
        return (self.top_logprobs or 0) if OUTPUT_LOGPROBS in (self.include or ()) else None

    def follow(self, history: list) -> None:
        """Run after `history` (the stored conversation of previous_response_id: input items, validated here)."""
        self._history = [_ITEM.validate_python(item) for item in history]

    def conversation_items(self) -> list:
        """The items the request runs on: the stored conversation, then `input`."""
        return [*self._history, *as_items(self.input)]

    def keep(self, items: list) -> None:
        """Run on `items` (a truncated conversation: responses_truncation.py) instead of the whole conversation."""
        self._kept = list(items)

    def formats(self) -> list[tuple[str, ResponseFormat]]:
        """text.format as a response_format (none under a forced call, as chat's: server/structured.py; instructor's
        RESPONSES_TOOLS sends both)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return super().formats()
        schema = None if fmt.type == "json_object" else JsonSchemaFormat(name=fmt.name, schema=fmt.schema_)
        return [*super().formats(), ("text", ResponseFormat(type=fmt.type, json_schema=schema))]

    # a chat's fields (chat.start_chat reads them) ----------------------------------------------------------
    @property
    def messages(self) -> list[ChatMessage]:
        return chat_messages(self.instructions, self.conversation_items() if self._kept is None else self._kept)

    @property
    def continue_final_message(self) -> bool:
        """A last item that is an assistant's message still in progress goes on (vLLM's partial replies)."""
        last = None if isinstance(self.input, str) else self.input[-1]
        return isinstance(last, MessageItem) and last.role == "assistant" and last.status in ("in_progress",
                                                                                                 "incomplete")

    @property
    def add_generation_prompt(self) -> bool:
        return not self.continue_final_message

    @property
    def template_kwargs(self) -> dict | None:
        """The chat template's own variables: chat_template_kwargs, and reasoning.effort as `reasoning_effort` unless
        they set it (chat's way: ChatCompletionRequest.template_kwargs)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": effort, **(self.chat_template_kwargs or {})}

    @property
    def reasoning_summary(self) -> bool:
        """Whether reasoning.summary (or its older name generate_summary) asks for the reasoning's summary."""
        r = self.reasoning
        return r is not None and (r.summary or r.generate_summary) is not None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def chat_tools(self) -> list[Tool | CustomTool] | None:
        return None if self.tools is None else [t.chat_tool() for t in self.tools]

    @property
    def chat_tool_choice(self):
        choice = self.tool_choice
        return choice.chat_choice() if isinstance(choice, (FlatAllowedTools, FunctionChoice, CustomChoice)) else choice

