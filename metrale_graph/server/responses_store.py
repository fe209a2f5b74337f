"""The Responses API's stored responses: an in-memory LRU of the last `size` responses (metrale-serve's
--responses-store-size, default DEFAULT_SIZE; 0: none stored), and what reads it: `previous_response_id`,
GET /v1/responses/{id}, DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items.

A response is stored when its request's `store` is true or unset (the Responses API's default, which vLLM follows
once its store is on), once it has ended (completed or incomplete; a failed or abandoned one is not): the response
object GET answers, and its context, the input items it ran on, each with an id (`msg_`, `fc_`, `fco_`, `ctc_`,
`ctco_`, `rs_`, or the one the client sent): the previous response's context and output items, then its own `input`
(`instructions` are not items: OpenAI does not carry them to the next response). A request with
`previous_response_id` runs on that response's context and output, then its own input. The context is a tuple of
the same item dicts its ancestors hold, so a conversation that a response follows stays whole when its ancestors
are evicted or deleted. An input item whose id is already in the conversation it follows, or twice in the input, is
OpenAI's 400 "Duplicate item found with id ...", before anything runs (a client that sends the last output back with
previous_response_id would have the conversation hold it twice). With no store (size 0) `store: true` is taken and
does nothing (vLLM's way without its store) and `previous_response_id` is a 400.

One lock guards the store, held only for a dict's operations, so the event loop and any other thread may use it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from .errors import APIError, bad_request
from .responses_api_output import ResponseObject, item_id
from .responses_api_items import MessageItem, as_items

DEFAULT_SIZE = 1024  # responses kept (each its output and a tuple of references to its context's items)
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "custom_tool_call": "ctc",
               "custom_tool_call_output": "ctco", "reasoning": "rs"}
MAX_LIST_LIMIT = 100  # the most items one page of input_items holds (OpenAI's)


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject  # what GET /v1/responses/{id} answers
    context: tuple[dict, ...]  # the input items it ran on, with ids, as the API writes them (input_items lists them)

    def conversation(self) -> tuple[dict, ...]:
        """What a response that follows this one runs on before its own input: the context, then the output."""
        return self.context + tuple(_context_item(item.model_dump()) for item in self.response.output)


class ResponseStore:
    """The last `size` stored responses by id, least recently used evicted first (a read counts as a use)."""

    def __init__(self, size: int = DEFAULT_SIZE):
        if size < 0:
            raise ValueError(f"the responses store's size must be >= 0 (0: none stored), got {size}")
        self.size = size
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._responses[stored.response.id] = stored
            self._responses.move_to_end(stored.response.id)
            while len(self._responses) > self.size:
                self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response, or a 404 naming its id (`param`: the request's field that named it)."""
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is not None:
                self._responses.move_to_end(response_id)
        if stored is None:
            raise not_found(response_id, param)
        return stored

    def delete(self, response_id: str) -> None:
        with self._lock:
            found = self._responses.pop(response_id, None)
        if found is None:
            raise not_found(response_id)

    def history(self, previous_response_id: str) -> tuple[dict, ...]:
        """The conversation a request with `previous_response_id` runs on before its input: 400 without a store,
        404 for an id not stored (never, deleted, or evicted)."""
        if not self.enabled:
            raise bad_request("previous_response_id: this server stores no responses (--responses-store-size 0): "
                              "send the whole conversation as input", param="previous_response_id")
        return self.get(previous_response_id, param="previous_response_id").conversation()


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's 404 for a response it does not have (the openai client raises NotFoundError)."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(404, f"{what} with id {response_id!r} not found (never stored, deleted, or evicted from the "
                         "server's store of the last responses: --responses-store-size)", param=param,
                    code="previous_response_not_found" if param == "previous_response_id" else "not_found")


def check_unique(history: tuple[dict, ...], items: str | list) -> None:
    """OpenAI's 400 for an input item whose id is already in the conversation: an item of previous_response_id's
    conversation sent again (a client resending the last output with the chain: the conversation would hold it twice),
    or an id twice in `input`. Items without ids, or with new ones, are taken."""
    seen = {item.get("id") for item in history} - {None}
    for item in as_items(items):
        if item.id is None:
            continue
        if item.id in seen:
            raise bad_request(f"Duplicate item found with id {item.id}. Remove duplicate items from your input and try "
                              "again.", param="input")
        seen.add(item.id)


def input_items(items: str | list) -> tuple[dict, ...]:
    """A request's `input` as stored items: each with an id, a message's content as parts (a string as one
    input_text part, output_text in an assistant's)."""
    out = []
    for item in as_items(items):
        d = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            d["content"] = [{"type": "output_text" if item.role == "assistant" else "input_text", "text": item.content}]
        d.setdefault("id", item_id(ID_PREFIXES[d.get("type", "message")]))
        if d.get("type") != "reasoning":
            d.setdefault("status", "completed")
        out.append(d)
    return tuple(out)


def _context_item(item: dict) -> dict:
    """An output item as a later response's input item: the text's logprobs left out."""
    if item["type"] == "message":
        item["content"] = [{k: v for k, v in part.items() if k != "logprobs"} for part in item["content"]]
    return item


class ItemList(BaseModel):
    """GET /v1/responses/{id}/input_items: a page of a stored response's input items."""
    object: Literal["list"] = "list"
    data: list[dict]
    first_id: str | None
    last_id: str | None
    has_more: bool


def list_items(stored: StoredResponse, after: str | None = None, limit: int = 20,
               order: str = "desc") -> ItemList:
    """A page of `stored`'s input items (OpenAI's: newest first unless order "asc"; `after` an item id, the page
    starts after it; at most `limit`, 1 to 100)."""
    if order not in ("asc", "desc"):
        raise bad_request(f"order: expected 'asc' or 'desc', got {order!r}", param="order")
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise bad_request(f"limit: expected 1 to {MAX_LIST_LIMIT}, got {limit}", param="limit")
    items = list(stored.context if order == "asc" else reversed(stored.context))
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in response {stored.response.id!r}", param="after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return ItemList(data=page, first_id=page[0]["id"] if page else None, last_id=page[-1]["id"] if page else None,
                    has_more=start + limit < len(items))
