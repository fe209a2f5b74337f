"""The Responses API's `truncation: "auto"` (OpenAI's): a conversation (previous_response_id's items, then `input`)
whose prompt does not fit in the context with room for the reply loses its oldest items, where "disabled" (the
default) answers 400 context_length_exceeded.

What goes: whole items from the conversation's start, never part of one chat message (a past reply's reasoning,
message and function calls, which the template renders as one assistant message, go together: a cut falls only where
an item begins a message of its own), never a function_call without the function_call_output that answers it (a cut
between them is no cut), never the instructions nor the system / developer messages the conversation begins with,
and never the last user message or what follows it. The prompt keeps the most items that fit: its tokens (the kept
messages through the chat template, with the tools) plus max_output_tokens (unset: 1, the one new token a reply
needs) at most the context. When the conversation cut at its last user message still does not fit, the request is a
400 context_length_exceeded saying so.

The items are dropped for the prompt only: a stored response's context (responses_store.py) is its whole
conversation, which a later response runs on, cut again where it must be.
"""

from __future__ import annotations

from .errors import bad_request
from .responses_api_items import FunctionCallItem, FunctionCallOutputItem, MessageItem, chat_messages, joined_messages
from .responses_api_protocol import ResponsesRequest

KEPT_ROLES = ("system", "developer")  # of the messages a conversation begins with, never dropped


def cuts(items: list) -> tuple[int, list[int]]:
    """(lead, places) of a conversation's items: the first `lead` items are the system / developer messages it begins
    with (always kept); `places`, ascending from `lead`, where the rest may begin (items[lead:k] dropped for place k):
    an item that begins a chat message of its own, no call dropped whose output is kept, at most the last user
    message (the last item when there is none)."""
    lead = 0
    while lead < len(items) and isinstance(items[lead], MessageItem) and items[lead].role in KEPT_ROLES:
        lead += 1
    _, starts = joined_messages(None, items)
    users = [i for i, item in enumerate(items) if isinstance(item, MessageItem) and item.role == "user"]
    last = users[-1] if users else len(items) - 1
    parted = [0] * (len(items) + 1)  # per place, the calls it would part from their outputs (running sums)
    calls: dict[str, int] = {}
    for j, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            calls[item.call_id] = j
        elif isinstance(item, FunctionCallOutputItem) and item.call_id in calls:
            parted[calls[item.call_id] + 1] += 1  # places i+1 .. j drop the call and keep its output
            parted[j + 1] -= 1
    places, running = [], 0
    for k in range(len(items) + 1):  # (place len(items): the leading messages alone, where they are all there is)
        running += parted[k]
        if lead <= k <= max(last, lead) and (k == lead or (starts[k] and not running)):
            places.append(k)
    return lead, places


async def truncate(state, body: ResponsesRequest, tools: list[dict] | None) -> None:
    """Make `body` run on the most recent items of its conversation whose prompt fits (body.keep), or raise the 400
    saying that none do. `tools`: the functions the template renders."""
    items = body.conversation_items()
    lead, places = cuts(items)
    kept = await state.off_loop(_fitting, state, body, items, lead, places, tools)
    body.keep(kept)


def _fitting(state, body: ResponsesRequest, items: list, lead: int, places: list[int], tools) -> list:
    """The kept items of the first place whose prompt fits (a binary search: fewer items, fewer tokens)."""
    need = body.max_output_tokens or 1
    room = state.max_context - need
    if room < 1:
        raise bad_request(f"max_output_tokens is too large: {need}. This model's maximum context length is "
                          f"{state.max_context} tokens, which leaves no room for a prompt, truncated or not",
                          param="max_output_tokens", code="context_length_exceeded")

    def tokens(k: int) -> tuple[int, bool]:  # (the count, whether exact: a text certainly too long is not tokenized)
        messages = [m.template_dict() for m in chat_messages(body.instructions, items[:lead] + items[k:])]
        text = state.chat_text(messages, body.add_generation_prompt, body.continue_final_message,
                               body.template_kwargs, tools, "input")
        fewest = state.token_bound.fewest_tokens(text)
        return (fewest, False) if fewest > room else (len(state.tokenizer.encode(text, add_special_tokens=False)), True)

    shortest, exact = tokens(places[-1])
    if shortest > room:
        kept = "its last user message" + (" and the instructions" if body.instructions is not None else "")
        asked = f"max_output_tokens ({need})" if body.max_output_tokens is not None else "one new token"
        raise bad_request(f"input: with truncation \"auto\" the conversation was cut down to {kept}, which is still "
                          f"{'' if exact else 'at least '}{shortest} tokens: with {asked} that passes this model's "
                          f"maximum context length of {state.max_context} tokens", param="input",
                          code="context_length_exceeded")
    lo, hi = 0, len(places) - 1  # places[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if tokens(places[mid])[0] <= room:
            hi = mid
        else:
            lo = mid + 1
    return items[:lead] + items[places[hi]:]
