"""POST /v1/responses: OpenAI's Responses API as vLLM serves it, over the chat endpoint's machinery.

The request (responses_api_protocol.py) becomes a chat: its instructions and input items chat messages, its flat
function tools chat's tools, its `text.format` a response_format; chat.start_chat renders, checks and submits it
as /v1/chat/completions does (one reply: the Responses API has no `n`), and the server's reply parsers (reply.py)
read the reply into reasoning, text and calls, which become output items (responses_api_output.py). A response
with `store` true or unset is kept in the server's store once it ends, and a request's `previous_response_id` runs
it after that response's conversation (responses_store.py); `include: ["message.output_text.logprobs"]` (with
`top_logprobs`) asks the engine for the new tokens' logprobs, which the output text carries. A conversation too long for
the context (with max_output_tokens) is a 400 context_length_exceeded, as a chat's is, unless `truncation` is "auto":
then its oldest items are dropped until it fits (responses_truncation.py) and the prompt is rendered again.

A whole response has status "completed", or "incomplete" with incomplete_details {"reason": "max_output_tokens"}
when the reply was cut by max_output_tokens or the context; usage counts the input, output and reasoning tokens
(the reply's tokens from the reasoning block's start up to its `</think>` token). A stream sends
`response.created` and `response.in_progress` (the response in progress, no output), each output item's events,
then `response.completed` with the whole response (its status "incomplete" when cut: vLLM's way, where OpenAI's
server sends `response.incomplete`; the openai client's stream helper takes its final response from
`response.completed` alone: openai 3.3's `get_final_response` raises without it). An error after the stream began
is an `error` event and `response.failed`.
"""

from __future__ import annotations

from typing import AsyncIterator

from pydantic import BaseModel, ValidationError

from .chat import ChatRun, call_id, reasoning_tokens, start_chat
from .errors import APIError, bad_request, from_failure, pydantic_message
from .logprobs import chat_logprobs
from .responses import now
from .responses_api_output import (EventWriter, IncompleteDetails, InputTokenCount, InputTokensDetails, NoEvents,
                                   OutputItems, OutputTokensDetails, ResponseError, ResponseObject, ResponseUsage,
                                   item_id)
from .responses_api_protocol import ResponsesRequest
from .responses_store import StoredResponse, check_unique, input_items
from .responses_truncation import truncate
from .state import ServerState
from .tool_choice import tool_request


async def create_response(state: ServerState, body: ResponsesRequest, raw_request):
    """A ResponseObject, or the event stream's body when body.stream."""
    state.check(body)
    history, tools = _conversation(state, body)
    try:
        run = await start_chat(state, body, _messages(body), tools, param="input", logprobs=body.output_logprobs)
    except APIError as e:  # too long for the context: truncation "auto" drops the oldest items that must go
        if body.truncation != "auto" or e.code != "context_length_exceeded":
            raise
        await truncate(state, body, tools.template_tools)
        run = await start_chat(state, body, _messages(body), tools, param="input", logprobs=body.output_logprobs)
    rid, created = item_id("resp"), now()
    context = history + input_items(body.input) if _stored(state, body) else None
    if body.stream:
        return _events(state, body, run, rid, created, context)
    reply = _Reply(state, body, run, NoEvents())
    await run.group.whole(raw_request, lambda _, out: reply.feed(out))
    reply.end()
    return _kept(state, context, _response(state, body, rid, created, reply.status, reply.items.items,
                                           _usage(state, run, reply.token_ids, reply.items.items)))


async def count_input_tokens(state: ServerState, body: ResponsesRequest) -> InputTokenCount:
    """POST /v1/responses/input_tokens (OpenAI's, the openai client's `responses.input_tokens.count`): the tokens of the
    prompt a response to `body` would run on, its usage.input_tokens (previous_response_id's conversation, the
    instructions, tools and reasoning effort through the chat template; truncation "auto" cutting it as a response's
    is cut, for one new token), without running it: the engine need not be warm. A prompt of more tokens than the
    context is a 400 context_length_exceeded, as /tokenize answers."""
    state.check(body, ready=False)
    _, tools = _conversation(state, body)

    def prompt():
        return state.off_loop(state.chat_prompt, _messages(body), body.add_generation_prompt,
                              body.continue_final_message, body.template_kwargs, tools.template_tools, "input")

    try:
        _, ids, _ = await prompt()
    except APIError as e:
        if body.truncation != "auto" or e.code != "context_length_exceeded":
            raise
        await truncate(state, body, tools.template_tools)
        _, ids, _ = await prompt()
    return InputTokenCount(input_tokens=len(ids))


class _Reply:
    """A reply's output items, read from its outputs as they come, whole and streamed alike: each output's text through
    the reply parser, its tokens' logprobs (with include's output text logprobs) kept for the next text delta, so that
    a whole response's items, the logprobs each message carries included, are those its stream builds. `feed` and
    `end` return the stream's events."""

    def __init__(self, state: ServerState, body: ResponsesRequest, run: ChatRun, write: EventWriter):
        self.state, self.body = state, body
        self.items = OutputItems(write, call_id, [] if body.output_logprobs is not None else None,
                                 body.reasoning_summary, run.tools.custom)
        self.reader = run.parser()
        self.token_ids: list[int] = []
        self.status = "completed"

    def feed(self, out) -> list[str]:
        self.token_ids += out.token_ids
        if self.items.logprobs is not None:
            self.items.logprobs += _logprobs(self.state, self.body, out.token_ids, out.logprobs)
        events = self.reader.feed(out.text) if out.text else []
        if out.finish_reason:
            events += self.reader.finish()
            self.status = "incomplete" if out.finish_reason == "length" else "completed"
        self.items.feed(events)
        return self.items.drain()

    def end(self) -> list[str]:
        """The open item closed (the stop token's logprobs first, in a last text delta while a message is open)."""
        self.items.flush_logprobs()
        self.items.close(self.status)
        return self.items.drain()


def _conversation(state: ServerState, body: ResponsesRequest):
    """(the stored conversation `body` follows, its tools): previous_response_id's items (404 for an id not stored),
    which `body` now runs after (400 for an input item of an id already in it, or twice in the input); the tools and
    tool_choice checked."""
    history = () if body.previous_response_id is None else state.responses.history(body.previous_response_id)
    check_unique(history, body.input)
    tools = tool_request(body.chat_tools, body.chat_tool_choice, state.replies.tool_format, body.parallel_tool_calls)
    try:
        body.follow(list(history))
    except ValidationError as e:  # (a stored item read back: never expected)
        raise bad_request(f"input: {pydantic_message(e.errors()[0])}", param="input") from None
    return history, tools


def _messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages of `body`'s conversation (its kept items, once truncated), as the template reads them."""
    try:
        return [m.template_dict() for m in body.messages]
    except ValidationError as e:  # (an item a chat message cannot hold)
        raise bad_request(f"input: {pydantic_message(e.errors()[0])}", param="input") from None


def _stored(state: ServerState, body: ResponsesRequest) -> bool:
    """Whether the response is to be stored: `store` true or unset (the API's default) on a server with a store."""
    return state.responses.enabled and body.store is not False


def _kept(state: ServerState, context: tuple[dict, ...] | None, response: ResponseObject) -> ResponseObject:
    """`response`, stored with its context unless `context` is None."""
    if context is not None:
        state.responses.put(StoredResponse(response, context))
    return response


def _logprobs(state: ServerState, body: ResponsesRequest, token_ids, entries) -> list[dict] | None:
    """The output text's logprobs of these tokens (the chat endpoint's logprobs.content entries), or None when the
    request asks for none."""
    top = body.output_logprobs
    if top is None:
        return None
    return chat_logprobs(state.token_strings, token_ids, entries or [], top).model_dump()["content"]


def _response(state: ServerState, body: ResponsesRequest, rid: str, created: int, status: str, output=(),
              usage: ResponseUsage | None = None, error: ResponseError | None = None) -> ResponseObject:
    """The response object: the request's settings echoed, `output` and `usage`."""
    choice = body.tool_choice
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    return ResponseObject(
        id=rid, created_at=created, status=status, error=error, model=state.model_name, output=list(output),
        previous_response_id=body.previous_response_id, top_logprobs=body.top_logprobs,
        store=_stored(state, body) and status != "failed",
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        instructions=body.instructions, max_output_tokens=body.max_output_tokens, metadata=body.metadata,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        reasoning=body.reasoning.model_dump() if body.reasoning is not None else None,
        temperature=body.temperature, top_p=body.top_p, truncation=body.truncation or "disabled",
        **({"text": text} if text else {}),
        tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
        tools=[t.model_dump(exclude_none=True) for t in body.tools or ()], usage=usage, user=body.user)


def _usage(state: ServerState, run: ChatRun, token_ids, output) -> ResponseUsage:
    usage = run.group.usage()
    reasoning = "".join(part.text for item in output if item.type == "reasoning" for part in item.content or ())
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
                         output_tokens_details=OutputTokensDetails(
                             reasoning_tokens=reasoning_tokens(state, run.in_reasoning, token_ids, reasoning)))


async def _events(state: ServerState, body: ResponsesRequest, run: ChatRun, rid: str, created: int,
                  context: tuple[dict, ...] | None) -> AsyncIterator[str]:
    """The stream's events (responses_api_output.py says which, in what order); the response stored once complete
    unless `context` is None."""
    write = EventWriter()
    reply = _Reply(state, body, run, write)
    try:
        started = _response(state, body, rid, created, "in_progress")
        yield write("response.created", response=started)
        yield write("response.in_progress", response=started)
        async for _, out in run.group.stream():
            for sse in reply.feed(out):
                yield sse
        for sse in reply.end():
            yield sse
        response = _response(state, body, rid, created, reply.status, reply.items.items,
                             _usage(state, run, reply.token_ids, reply.items.items))
        yield write("response.completed", response=_kept(state, context, response))
    except Exception as e:  # the request failed after the stream began (a step's error, shutdown)
        error = from_failure(e)
        yield write("error", code=error.code, message=error.message, param=error.param)
        yield write("response.failed", response=_response(state, body, rid, created, "failed", reply.items.items,
                                                          error=ResponseError(code="server_error",
                                                                              message=error.message)))
    finally:
        run.group.close()
