"""What a submitted request gives back: its outputs as they come, its result, its abort.

    handle = engine.submit(prompt, max_new_tokens=64, stop=["\\n\\n"])
    for out in handle:                  # or: async for out in handle
        out.token_ids, out.text, out.finish_reason, out.logprobs   # logprobs: submit(..., logprobs=N)
    handle.result()                     # GenerationResult (or: await handle.result_async())
    handle.abort()                      # the engine frees its slot and blocks at its next step

The engine loop delivers into a `Channel`: a deque it appends to under a short lock, never
waiting for a consumer (a slow consumer only lets its own outputs pile up). Threads waiting on
the channel are woken through a condition; asyncio consumers through their event loop's
`call_soon_threadsafe`, so the engine thread never runs consumer code.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from .logprobs import TokenLogprobs


class EngineBusyError(RuntimeError):
    """The engine cannot take this work now. Raised as its subclass EngineFullError (the waiting queue is
    full); an engine runs any number of generate / stream / submit calls at once."""


class EngineFullError(EngineBusyError):
    """submit() while the engine's waiting queue holds max_waiting requests: try again later (a server
    answers HTTP 503 with Retry-After)."""


class EngineClosedError(RuntimeError):
    """The engine was shut down (or its loop stopped): requests still running end with this error, and
    new ones are refused."""


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only (a stop token included)
    text: str | None  # generate: token_ids decoded (special tokens skipped); submit: the streamed text
    # (stop strings cut); None without a tokenizer
    finish_reason: str  # "stop", "length", or "abort" (a handle aborted before it finished)
    prompt_tokens: int
    first_token_s: float | None  # seconds from the call (generate) or submit to the first new token
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (Engine(prefix_cache=True)), not computed
    # logprobs=N: each new token's raw log-probability and the N most likely (logprobs.py), else None
    logprobs: list[TokenLogprobs] | None = None
    # prompt_logprobs=N: each prompt token's (None for the first), else None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class RequestOutput(NamedTuple):
    """One delivery of a request: the token(s) sampled for it since the last one, the text they add
    ("" while held back: an incomplete character or a possible stop string; None without a tokenizer),
    and the finish reason when this output ends the request ("stop", "length", "abort"), else None. The
    last output of an aborted request carries no tokens. With logprobs=N, `logprobs` holds each token's
    TokenLogprobs; with prompt_logprobs=N the first output holds the prompt's (None for its first token)."""
    index: int  # the request's position in its call (generate / stream's prompts; 0 for submit)
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Failure(NamedTuple):
    """A request ended by an error (its step failed, or the engine shut down)."""
    index: int
    error: BaseException


class Channel:
    """Outputs of `requests` requests, in delivery order: the engine loop puts, one consumer gets."""

    def __init__(self, requests: int):
        self._items: collections.deque = collections.deque()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # woken by every put: get()
        # woken only when the last request ends or one fails: wait_closed(), get(until_ended=True), which then do not
        # wake at every step (each wakeup of a waiting thread takes the interpreter from the engine loop's thread)
        self._ends = threading.Condition(lock)
        self._failed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.open = requests  # requests that have not delivered their last output

    def put(self, item: RequestOutput | Failure) -> None:
        """Append `item` (never blocks on a consumer) and wake whoever waits."""
        _wake_async(self.put_all([item]))

    def put_all(self, items: list) -> list:
        """Append `items` and wake the threads waiting; returns the asyncio waiters to wake (deliver())."""
        with self._cond:
            self._items.extend(items)
            # (one comprehension over a step's outputs: those that end their request, failures included)
            ends = [item for item in items if type(item) is Failure or item.finish_reason is not None]
            failed = Failure in set(map(type, ends))
            self.open -= len(ends)
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
            if failed or self.open == 0:
                self._failed |= failed
                self._ends.notify_all()
        return waiters

    def get(self, timeout: float | None = None, until_ended: bool = False) -> list:
        """Every item there is, waiting for at least one (TimeoutError after `timeout` seconds) unless every request
        has ended (then [] once they have all been taken); with until_ended, waiting until every request has ended
        or one has failed (a caller that wants the results, not each step)."""
        with self._cond:
            cond, ready = ((self._ends, lambda: self.open == 0 or self._failed) if until_ended
                           else (self._cond, lambda: self._items or self.open == 0))
            if not wait_for(cond, ready, timeout):
                raise TimeoutError(f"no output within {timeout} s")
            items = list(self._items)
            self._items.clear()
            self._failed = False  # (the failure is in `items`)
            return items

    def wait_closed(self, timeout: float | None = None) -> None:
        """Wait until every request delivered its last output (TimeoutError after `timeout` seconds)."""
        with self._cond:
            if not wait_for(self._ends, lambda: self.open == 0, timeout):
                raise TimeoutError(f"the request did not finish within {timeout} s")

    async def get_async(self) -> RequestOutput | Failure | None:
        """The next item, waiting for it; None once every request has ended and its items have all been taken."""
        while True:
            future = self._register(lambda: bool(self._items) or self.open == 0)
            if future is None:
                with self._cond:
                    return self._items.popleft() if self._items else None
            await future

    async def wait_closed_async(self) -> None:
        while (future := self._register(lambda: self.open == 0)) is not None:
            await future

    def _register(self, ready) -> asyncio.Future | None:
        """None when `ready()` already holds, else a future the next put() completes."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if ready():
                return None
            future = loop.create_future()
            self._waiters.append((loop, future))
            return future


def _copy(items: list | None) -> list | None:
    return None if items is None else list(items)


SIGNAL_SLICE_S = 0.1  # how long the main thread sleeps at a time while it waits (see wait_for)


def wait_for(cond: threading.Condition, predicate, timeout: float | None) -> bool:
    """cond.wait_for(predicate, timeout), held by the caller. The main thread waits in slices: a signal (Ctrl-C)
    may be delivered to the engine's thread, and Python runs its handler (KeyboardInterrupt) only once the main
    thread wakes up."""
    if threading.current_thread() is not threading.main_thread():
        return cond.wait_for(predicate, timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not predicate():
        left = SIGNAL_SLICE_S if deadline is None else min(SIGNAL_SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return False
        cond.wait(left)
    return True


def deliver(outputs: dict[Channel, list]) -> None:
    """Put each channel's items with one lock and one wakeup per channel, and wake the asyncio consumers with
    one call_soon_threadsafe per event loop (a step's outputs, all at once). Each channel's items leave `outputs`
    as they are put: what is left there after a failure was not delivered (the loop's end delivers it)."""
    waiters = []
    while outputs:
        channel, items = outputs.popitem()
        waiters += channel.put_all(items)
    _wake_async(waiters)


def _wake_async(waiters: list) -> None:
    by_loop: dict = {}
    for loop, future in waiters:
        by_loop.setdefault(loop, []).append(future)
    for loop, futures in by_loop.items():
        try:
            loop.call_soon_threadsafe(_wake, futures)
        except RuntimeError:  # that event loop is closed: nobody awaits its futures any more
            pass


def _wake(futures: list) -> None:
    for future in futures:
        if not future.done():  # a consumer cancelled while waiting
            future.set_result(None)


class RequestHandle:
    """A request of Engine.submit. Its outputs go to one consumer (iterating the handle, in a thread or
    with `async for`); result() and abort() may be called from any thread. Leaving a `with handle:`
    block aborts the request if it is still running. Iteration raises the error that failed the request
    (its step's error, EngineClosedError at shutdown). Iterating it again once its last output was taken ends at
    once (raising that error again for a failed request)."""

    def __init__(self, loop, request, channel: Channel, owner=None):
        self._loop, self._request, self._channel = loop, request, channel
        self._owner = owner  # the Engine: it lives (and its loop runs) while a handle of it does
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt)

    @property
    def done(self) -> bool:
        """Whether the request has ended (finished, aborted, or failed)."""
        return self._channel.open == 0

    @property
    def finish_reason(self) -> str | None:
        return self._request.finish_reason

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the request (set before its last output is delivered), else None."""
        text = self._request.text
        return None if text is None else text.stop_string

    def __iter__(self):
        while True:
            items = self._channel.get()
            if not items:  # ended, and its outputs all taken (a second iteration): nothing more will come
                self._ended()
                return
            for item in items:
                if isinstance(item, Failure):
                    raise item.error
                yield item
                if item.finish_reason is not None:
                    return

    async def __aiter__(self):
        while True:
            item = await self._channel.get_async()
            if item is None:
                self._ended()
                return
            if isinstance(item, Failure):
                raise item.error
            yield item
            if item.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end of the request: its GenerationResult, or the error that failed it.
        TimeoutError after `timeout` seconds (the request goes on)."""
        self._channel.wait_closed(timeout)
        return self._result()

    async def result_async(self) -> GenerationResult:
        await self._channel.wait_closed_async()
        return self._result()

    def _ended(self) -> None:
        """An iteration past the end: the error that failed the request raised again, else nothing."""
        if self._request.error is not None:
            raise self._request.error

    def _result(self) -> GenerationResult:
        r = self._request
        if r.error is not None:
            raise r.error
        first = None if r.first_token_time is None else r.first_token_time - r.submit_time
        return GenerationResult(list(r.out), None if r.text is None else r.text.text, r.finish_reason,
                                len(r.prompt), first, r.cached, _copy(r.logprobs), _copy(r.prompt_logprobs))

    def abort(self) -> None:
        """End the request: at the engine's next step its slot and KV blocks are freed and its last output
        (finish_reason "abort") is delivered. A no-op once it has ended."""
        if not self.done:
            self._loop.abort([self._request])

    def __enter__(self) -> "RequestHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def __repr__(self) -> str:
        r = self._request
        state = r.finish_reason or ("failed" if r.error is not None else "running")
        return f"RequestHandle(id={self.request_id}, prompt_tokens={self.prompt_tokens}, new={len(r.out)}, {state})"
