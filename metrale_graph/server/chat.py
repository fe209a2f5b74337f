"""POST /v1/chat/completions: messages through the tokenizer's chat template, the assistant's reply
whole or streamed, its reasoning and tool calls parsed out.

The prompt is `tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)` as token ids
(vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs change its arguments, OpenAI's
reasoning_effort is the template variable of that name as vLLM passes it; the tools are rendered unless tool_choice
is "none": tool_choice.py). A reply is read by the server's parsers (reply.py): `<think>` blocks into
`reasoning_content` and `reasoning` (vLLM's older and newer names for it; from the prompt's open `<think>` when the
template opened one; left out under vLLM's include_reasoning false), and, when the request offers tools, calls in the
template's format into `tool_calls` (ids `call_...`; finish_reason "tool_calls" when a reply that stopped made
one; content None when it holds only calls). A stream sends, per choice, a first delta with the role and the
content the whole reply's starts as: `{"role": "assistant", "content": null}` where the reply is parsed (OpenAI's
first delta of a reply of calls; vLLM sends "", which a client appending the deltas, as the openai client's
stream helper does, turns into an empty text where the whole reply has null), `"content": ""` where it is text as it
is; then a delta per piece as the text comes (`content`, `reasoning_content`, or `tool_calls`: a call's index, id,
type and name first with arguments "", then its arguments in pieces), the last one with the finish reason ("stop":
a stop token or string; "length": max_tokens or the context; "tool_calls"; with `"content": ""` where the reply
showed nothing, as the whole one's content is then ""), then the usage chunk with stream_options.include_usage (every
chunk before it with "usage": null then, as OpenAI's),
then `data: [DONE]`. vLLM's `echo` puts the last message's text before the reply's content where the reply goes
on with it (continue_final_message, or an assistant's message
followed by the assistant's turn): a stream sends it as each choice's second delta.

Structured output (`response_format`, `structured_outputs`, `guided_*`; server/structured.py) holds the reply
to its grammar (from after `</think>` when the reply starts inside a reasoning block). tool_choice "required"
or a named function holds it to the calls' JSON (tool_choice.py), read back into `tool_calls` as it comes (a
stream sends each call's name once whole, then its arguments in pieces).

`logprobs: true` (with `top_logprobs: N`) gives each new token's logprob in `logprobs.content`
(server/logprobs.py; streamed, with the first delta of the output that sends its text); vLLM's
`prompt_logprobs: N` gives the response's `prompt_logprobs` (streamed: a chunk of its own, without choices,
before the content).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from .errors import stream_event
from .generation import Generations
from .logprobs import chat_logprobs, prompt_logprobs
from .protocol import ChatCompletionRequest
from .reasoning import THINK_END, THINK_START
from .reply import ReasoningDelta, Reply, ReplyParser
from .custom_tools import CustomInputs, custom_input
from .responses import (DONE, AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatResponse, CustomCall,
                        CustomToolCall, DeltaCustomCall, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall,
                        RoleDelta, StreamChunks, ToolCall, Usage, event, now, request_id, with_usage)
from .state import ServerState
from .structured import compile_grammar, structured_request
from .forced_calls import ForcedCallParser
from .tool_choice import ToolRequest, tool_request
from .tool_parsers import CallArguments, CallStart, ContentDelta
from .tool_protocol import NAMED


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(engine_reason: str | None, calls: int, choice=None) -> str | None:
    """OpenAI's "tool_calls" for a reply that stopped after making calls; a reply cut short keeps "length". A
    call forced by name (`tool_choice` a named function or custom tool) keeps "stop", as OpenAI and vLLM answer it."""
    named = isinstance(choice, NAMED)
    return "tool_calls" if calls and engine_reason == "stop" and not named else engine_reason


@dataclass
class ChatRun:
    """The engine requests of a chat's messages, submitted, and how their replies are read."""
    state: ServerState
    group: Generations
    prompt: list[int]  # the rendered messages' token ids
    tools: ToolRequest
    in_reasoning: bool  # the prompt opened a reasoning block: replies start inside it
    plain: bool  # replies are text as it is (no reasoning or tool parser)
    one_call: bool  # parallel_tool_calls false: a reply's first call only

    def parser(self) -> ReplyParser:
        """A new ReplyParser of one reply."""
        forced = ForcedCallParser(self.tools.choice) if self.tools.forced is not None else None
        return self.state.replies.parser(self.tools.functions, self.in_reasoning, forced, self.one_call)

    def usage(self, replies: list[tuple[list[int], str]]) -> Usage:
        """The group's usage; on a server with a reasoning parser, with `completion_tokens_details.reasoning_tokens`
        of `replies` (each choice's token ids and reasoning text), as OpenAI and vLLM count them."""
        usage = self.group.usage()
        if not self.state.replies.reasoning:
            return usage
        return usage.with_reasoning(sum(reasoning_tokens(self.state, self.in_reasoning, ids, text)
                                        for ids, text in replies))


def reasoning_tokens(state: ServerState, in_reasoning: bool, token_ids, reasoning: str) -> int:
    """The reply's tokens inside its reasoning block: from its start (the prompt's open `<think>`, else the reply's
    `<think>` token) up to its `</think>` token (the reply's end when cut inside). A reply without that token (a
    tokenizer without one, or a `</think>` written in pieces, which the parsers read as the block's end all the same):
    the reply's tokens from the first whose text completes `<think>` through the first whose text completes `</think>`
    (never more than the reply has: the reasoning's text encoded again could be more tokens than the model wrote, a
    byte token of a cut character decoding to U+FFFD, three bytes; never the answer's tokens after it)."""
    if not reasoning:
        return 0
    ids = list(token_ids)
    if state.think_end is None or state.think_end not in ids:
        start = 0 if in_reasoning else _tokens_until(state.tokenizer, ids, THINK_START) or 0
        return (_tokens_until(state.tokenizer, ids, THINK_END) or len(ids)) - start
    end = ids.index(state.think_end)
    start = 0
    if not in_reasoning:
        opening = state.tokenizer.convert_tokens_to_ids(THINK_START)
        start = ids.index(opening) + 1 if opening in ids[:end] else 0
    return end - start


def _tokens_until(tokenizer, ids: list[int], tag: str) -> int | None:
    """The fewest leading tokens of `ids` whose text holds `tag` (None: the whole text does not); a binary search, a
    longer prefix's text holding a shorter one's (`tag` is ASCII: no cut character changes it)."""
    if tag not in tokenizer.decode(ids):
        return None
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if tag in tokenizer.decode(ids[:mid]) else (mid + 1, high)
    return low


def reasoning_of(events: list) -> str:
    """The reasoning text of a reply's events (shown or not: include_reasoning false still spends its tokens)."""
    return "".join(e.text for e in events if isinstance(e, ReasoningDelta))


async def start_chat(state: ServerState, body, messages: list[dict], tools: ToolRequest,
                     param: str = "messages", logprobs: int | None = None) -> ChatRun:
    """Render `messages` (template dicts) with `tools`, check the request, compile its structured output and submit
    body.n engine requests: what /v1/chat/completions and /v1/responses share. `body` is a SamplingFields with a
    chat's fields (add_generation_prompt, continue_final_message, template_kwargs, max_new_tokens, logprobs,
    top_logprobs, parallel_tool_calls); `param`: the field the messages came from, which 400s name; `logprobs`: the
    top N of each new token's logprobs to ask for where the body has no chat `logprobs` (the Responses API's include)."""
    _, prompt, in_reasoning = await state.off_loop(state.chat_prompt, messages, body.add_generation_prompt,
                                                   body.continue_final_message, body.template_kwargs,
                                                   tools.template_tools, param, state.kept_tokens(body))
    state.check_room([prompt], body)
    structured, field = structured_request(state, body, tools.forced, state.think_end if in_reasoning else None,
                                           tools.calls_tag if tools.calls is not None else None, tools.required)
    if structured is not None:
        await compile_grammar(state, structured, field)
        # held from its first token (the tokenizer has no one token that ends the reasoning): the reply is the
        # grammar's output, all of it content
        in_reasoning = in_reasoning and structured.starts_after is not None
    if body.logprobs:
        logprobs = body.top_logprobs or 0
    plain = tools.functions is None and tools.forced is None and state.replies.plain
    sampling = state.sampling(body, body.max_new_tokens, logprobs, body.prompt_logprobs, structured, not plain)
    group = Generations.submit(state, [prompt], sampling, body.n, param=param)
    return ChatRun(state, group, prompt, tools, in_reasoning, plain, body.parallel_tool_calls is False)


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, raw_request):
    """A ChatResponse, or the event stream's body when body.stream."""
    state.check(body)
    tools = tool_request(body.tools, body.tool_choice, state.replies.tool_format, body.parallel_tool_calls)
    run = await start_chat(state, body, [m.template_dict() for m in body.messages], tools)
    group, prompt, plain, parser = run.group, run.prompt, run.plain, run.parser
    rid = request_id("chatcmpl")

    if body.stream:
        return _events(state, body, run, rid)
    results = await group.whole(raw_request)
    ids = body.return_token_ids
    choices, replies = [], []
    for i, r in enumerate(results):
        if plain:
            message, calls = AssistantMessage(content=r.text or ""), 0
        else:
            reader = parser()
            events = reader.feed(r.text or "") + reader.finish()
            replies.append((r.token_ids, reasoning_of(events)))
            reply = Reply.of(_shown(body, events))
            message = AssistantMessage(content=reply.content, reasoning_content=reply.reasoning, reasoning=reply.reasoning,
                                       tool_calls=[_tool_call(run.tools, n, a) for n, a in reply.calls] or None)
            calls = len(reply.calls)
        if body.echoed:
            message.content = body.echoed + (message.content or "")
        finish = finish_reason(r.finish_reason, calls, body.tool_choice)
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                  stop_reason=group.stop_reason(i, r.finish_reason, r.token_ids),
                                  logprobs=_logprobs(state, body, r.token_ids, r.logprobs),
                                  token_ids=list(r.token_ids) if ids else None))
    return ChatResponse(id=rid, model=state.model_name, choices=choices, usage=run.usage(replies),
                        prompt_logprobs=_prompt_logprobs(state, body, prompt, results[0].prompt_logprobs),
                        prompt_token_ids=prompt if ids else None)


def _tool_call(tools: ToolRequest, name: str, arguments: str) -> ToolCall | CustomToolCall:
    """A whole reply's call: a custom tool's with its input (custom_tools.custom_input), a function's arguments."""
    if name in tools.custom:
        return CustomToolCall(id=call_id(), custom=CustomCall(name=name, input=custom_input(arguments)))
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))


def _logprobs(state: ServerState, body: ChatCompletionRequest, token_ids, entries):
    return chat_logprobs(state.logprob_strings(body), token_ids, entries, body.top_logprobs or 0) if body.logprobs \
        else None


def _prompt_logprobs(state: ServerState, body: ChatCompletionRequest, prompt: list[int], entries):
    if body.prompt_logprobs is None or entries is None:
        return None
    return prompt_logprobs(state.token_strings, prompt, entries, body.prompt_logprobs)


def _shown(body: ChatCompletionRequest, events: list) -> list:
    """The reply's events the response shows: without its reasoning under vLLM's include_reasoning false."""
    return events if body.include_reasoning else [e for e in events if not isinstance(e, ReasoningDelta)]


def _delta(event, call_ids: list[str], customs: CustomInputs) -> DeltaMessage | None:
    """The stream's delta of one reply event (None: none yet); a call's first gets its id (appended to `call_ids`). A
    custom tool's call: its name and input "" first, then its input once its arguments are whole (`customs`)."""
    if isinstance(event, ContentDelta):
        return DeltaMessage(content=event.text)
    if isinstance(event, ReasoningDelta):
        return DeltaMessage(reasoning_content=event.text, reasoning=event.text)
    if isinstance(event, CallStart):
        call_ids.append(call_id())
        first = dict(index=event.index, id=call_ids[event.index])
        if customs.start(event):
            return DeltaMessage(tool_calls=[DeltaToolCall(**first, type="custom",
                                                          custom=DeltaCustomCall(name=event.name, input=""))])
        return DeltaMessage(tool_calls=[DeltaToolCall(**first, type="function",
                                                      function=DeltaFunctionCall(name=event.name, arguments=""))])
    assert isinstance(event, CallArguments)
    if customs.holds(event):
        text = customs.feed(event)
        return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, custom=DeltaCustomCall(input=text))]) \
            if text else None
    return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))])


async def _events(state: ServerState, body: ChatCompletionRequest, run: ChatRun, rid: str) -> AsyncIterator[str]:
    """The stream's events: each choice's reply read by the run's parser (none when the run is plain: text as it is)."""
    created, model, ids = now(), state.model_name, body.return_token_ids
    group, parser = run.group, None if run.plain else run.parser

    options = body.stream_options
    usage_chunk = options is not None and options.include_usage

    def sent(sse: str) -> str:  # with include_usage, "usage": null (vLLM's continuous_usage_stats: the usage so far)
        return with_usage(sse, group.usage_so_far() if options.continuous else None) if usage_chunk else sse

    def chunk(choices, usage=None, prompt_token_ids=None) -> str:
        return event(ChatChunk(id=rid, created=created, model=model, choices=choices, usage=usage,
                               prompt_token_ids=prompt_token_ids))

    chunks = StreamChunks("chat.completion.chunk", rid, created, model)
    readers = [parser() for _ in range(len(group))] if parser is not None else None
    call_ids: list[list[str]] = [[] for _ in range(len(group))]
    customs = [CustomInputs(run.tools.custom) for _ in range(len(group))]
    replies: list[tuple[list[int], list[str]]] = [([], []) for _ in range(len(group))]  # its tokens, its reasoning
    pending: dict[int, tuple[list, list]] = {}  # per choice, the tokens (and logprobs) of outputs not sent yet
    shown = [bool(body.echoed)] * len(group)  # per choice, whether a delta has shown something of the reply
    try:
        yield sent(chunk([ChatChunkChoice(index=i, delta=RoleDelta(content="" if readers is None else None))
                          for i in range(len(group))], prompt_token_ids=group.prompt_of(0) if ids else None))
        if body.echoed:  # (vLLM's echo: the message's text first, a delta of its own per choice)
            yield sent(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=body.echoed))
                              for i in range(len(group))]))
        async for choice, out in group.stream():
            if choice == 0 and out.prompt_logprobs is not None and body.prompt_logprobs is not None:
                yield sent(event(ChatChunk(id=rid, created=created, model=model, choices=[],
                                           prompt_logprobs=_prompt_logprobs(state, body, group.prompt_of(0),
                                                                            out.prompt_logprobs))))
            token_ids, entries = pending.setdefault(choice, ([], []))
            token_ids += out.token_ids
            entries += out.logprobs or []
            if readers is None:
                if not (out.text or out.finish_reason or (ids and out.token_ids)):
                    continue
                pending[choice] = ([], [])
                yield sent(chunks.chat(choice, out.text or None, out.finish_reason, token_ids if ids else None,
                                       _logprobs(state, body, token_ids, entries),
                                       group.stop_reason(choice, out.finish_reason, out.token_ids)))
                continue
            reader = readers[choice]
            events = reader.feed(out.text) if out.text else []
            if out.finish_reason:
                events += reader.finish()
            replies[choice][0].extend(out.token_ids)
            replies[choice][1].append(reasoning_of(events))
            events = _shown(body, events)
            finish = finish_reason(out.finish_reason, reader.calls, body.tool_choice)
            deltas = [d for e in events if (d := _delta(e, call_ids[choice], customs[choice])) is not None]
            shown[choice] = shown[choice] or bool(deltas)
            if finish and not shown[choice]:  # (the whole reply's content "": nothing shown, no null left)
                deltas = [DeltaMessage(content="")]
            if not deltas and (finish or (ids and out.token_ids)):
                deltas = [DeltaMessage()]
            if not deltas:  # (text the parsers hold back: its tokens and logprobs go with the next delta)
                continue
            pending[choice] = ([], [])
            stop_reason = group.stop_reason(choice, out.finish_reason, out.token_ids)
            for k, delta in enumerate(deltas):
                yield sent(chunk([ChatChunkChoice(index=choice, delta=delta,
                                                  logprobs=_logprobs(state, body, token_ids, entries) if k == 0 else None,
                                                  finish_reason=finish if k == len(deltas) - 1 else None,
                                                  stop_reason=stop_reason if k == len(deltas) - 1 else None,
                                                  token_ids=(token_ids if ids else None) if k == 0 else None)]))
        if usage_chunk:
            yield chunk([], run.usage([(tokens, "".join(texts)) for tokens, texts in replies]))
    except Exception as e:  # the request failed after the stream began (a step's error, shutdown)
        yield stream_event(e)
    finally:
        group.close()
    yield DONE
