"""The engine requests of one HTTP request, consumed in asyncio.

    group = Generations.submit(state, prompts, sampling, n)   # n engine requests per prompt
    async for choice, output in group.stream(): ...           # outputs of all, as they come
    results = await group.results()                           # or: every GenerationResult, in order
    group.close()                                             # in a finally: aborts what still runs

The engine loop is the only thing that steps the model; this only submits (Engine.submit, which
checks the request and returns at once) and awaits each RequestHandle's outputs. Choice k of
prompt p is request p * n + k (OpenAI's and vLLM's `index`); with a seed, choice k samples with
seed + k, so the n choices differ and each is reproducible. A request that is closed before it
ended (its client went away, the stream was cancelled) is aborted: the engine frees its slot and
blocks at its next step, and its metrics are recorded once it has.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ..handle import GenerationResult, RequestOutput
from ..sampling import wrapped_seed
from .errors import bad_request, from_engine, from_failure
from .responses import Usage
from .state import Sampling, ServerState


# the engine's argument names its ValueErrors begin with, and the request fields they come from ("stop token"
# before "stop": the engine's stop_token_ids errors)
ENGINE_FIELDS = {"seed": "seed", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "max_new_tokens": "max_tokens", "stop_token_ids": "stop_token_ids", "stop token": "stop_token_ids",
                 "stop": "stop", **{name: name for name in ("min_p", "presence_penalty", "frequency_penalty",
                                                            "repetition_penalty", "logit_bias", "min_tokens",
                                                            "logprobs", "prompt_logprobs")}}


def param_of(e: BaseException, default: str) -> str:
    """The request field an engine ValueError is about (its message begins with the engine's argument name),
    else `default` (the prompt or the messages)."""
    text = str(e)
    for name, field in ENGINE_FIELDS.items():
        if text.startswith((f"{name} ", f"{name}:", f"{name}=")):
            return field
    return default


def check_count(state: ServerState, prompts: int, n: int, param: str = "prompt") -> None:
    """400 for a request of more generations (`prompts` x n) than the engine's slots and waiting queue hold together
    (num_slots + max_waiting): even an idle engine could never take them all, so a 503 would be retried forever."""
    total, waiting = prompts * n, getattr(state.engine, "max_waiting", None)
    queue = None if waiting is None else waiting + state.engine.num_slots
    if queue is not None and total > queue:
        what = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
        raise bad_request(f"this request asks for {total} generations ({what}) but the server queues at most "
                          f"{queue} at once (--num-slots + --max-waiting): send fewer", param="n" if n > 1 else param)


class Generations:
    def __init__(self, state: ServerState, handles: list, metrics: list, prompts: list[list[int]], n: int,
                 stop_ids: frozenset = frozenset()):
        self.state, self.handles, self.metrics, self.prompts, self.n = state, handles, metrics, prompts, n
        self.stop_ids = stop_ids  # the request's own stop_token_ids
        self._results: list[GenerationResult | None] = [None] * len(handles)
        self._generated = [0] * len(handles)  # new tokens each request has output so far

    @classmethod
    def submit(cls, state: ServerState, prompts: list[list[int]], sampling: Sampling, n: int,
               param: str = "prompt") -> "Generations":
        """Submit n requests per prompt, all or none: if the engine refuses one (ValueError: 400,
        EngineFullError / EngineClosedError: 503), those already submitted are aborted and the error is
        raised as an APIError. More requests than the engine's slots and waiting queue hold together
        (num_slots + max_waiting) are a 400: even an idle engine could never take them all."""
        handles, metrics = [], []
        engine = state.engine
        # (only when set: an engine of another kind need not take it)
        keep = {"keep_special_ids": sampling.keep_special_ids} if sampling.keep_special_ids else {}
        check_count(state, len(prompts), n, param)
        try:
            for ids in prompts:
                for k in range(n):
                    # (wrapped past 2**64 - 1: a seed near the top stays valid for every choice)
                    seed = None if sampling.seed is None else wrapped_seed(sampling.seed + k)
                    metrics.append(state.metrics.request())
                    handles.append(engine.submit(ids, sampling.max_new_tokens, sampling.temperature, sampling.top_k,
                                                 sampling.top_p, seed, sampling.stop_token_ids, sampling.stop,
                                                 include_stop_str_in_output=sampling.include_stop_str_in_output,
                                                 structured=sampling.structured, **sampling.controls,
                                                 **keep))
        except Exception as e:
            for h, m in zip(handles, metrics):  # (taken by the engine: each ends as an abort in the metrics)
                _abort(state, h, m)
            raise from_engine(e, param_of(e, param)) from e
        return cls(state, handles, metrics, prompts, n, sampling.request_stop_ids)

    def __len__(self) -> int:
        return len(self.handles)

    def usage(self) -> Usage:
        """Usage of the requests that ended: each prompt counted once (not once per choice; its cached
        tokens: the most any of its choices found in the prefix cache), every choice's new tokens."""
        done = [r for r in self._results if r is not None]
        cached = sum(max((getattr(r, "cached_tokens", 0) or 0 for r in self._results[p * self.n:(p + 1) * self.n]
                          if r is not None), default=0) for p in range(len(self.prompts)))
        return Usage.of(sum(len(p) for p in self.prompts), sum(len(r.token_ids) for r in done), cached)

    def usage_so_far(self) -> Usage:
        """Usage of the tokens output so far (a stream's continuous usage: vLLM's continuous_usage_stats); cached
        tokens as usage() counts them, of the requests that ended."""
        return Usage.of(sum(len(p) for p in self.prompts), sum(self._generated),
                        self.usage().prompt_tokens_details.cached_tokens)

    def stop_reason(self, choice: int, finish_reason: str | None, token_ids) -> int | str | None:
        """vLLM's stop_reason of a choice that ended with `finish_reason` (its last tokens `token_ids`): the stop
        string that ended it, or the token of the request's stop_token_ids; None for an eos token, a length."""
        if finish_reason != "stop":
            return None
        string = getattr(self.handles[choice], "stop_string", None)
        if string is not None:
            return string
        return token_ids[-1] if token_ids and token_ids[-1] in self.stop_ids else None

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]

    async def _outputs(self, choice: int) -> AsyncIterator[RequestOutput]:
        """Request `choice`'s outputs, timed; its result is kept once it ends (its error raised)."""
        handle, metrics = self.handles[choice], self.metrics[choice]
        try:
            async for out in handle:
                metrics.output(len(out.token_ids))
                self._generated[choice] += len(out.token_ids)
                yield out
        except Exception:
            metrics.fail(handle.prompt_tokens)
            raise
        result = await handle.result_async()  # (the last output came: this returns at once)
        metrics.finish(result)
        self._results[choice] = result

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice, output) of every request as they come; raises the first request's error."""
        if len(self.handles) == 1:
            async for out in self._outputs(0):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: int) -> None:
            try:
                async for out in self._outputs(choice):
                    queue.put_nowait((choice, out, None))
            except Exception as e:
                queue.put_nowait((choice, None, e))
            queue.put_nowait((choice, None, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in range(len(self.handles))]
        try:
            open_ = len(tasks)
            while open_:
                choice, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    open_ -= 1
                else:
                    yield choice, out
        finally:
            for t in tasks:
                t.cancel()

    async def results(self, each=None) -> list[GenerationResult]:
        """Every request's GenerationResult, in choice order, once all have ended; a request's failure as an
        APIError (503 at shutdown, 500 for a failed step). `each(choice, output)`, if given, reads every output as it
        comes (a whole response built as its stream is: responses_api.py)."""
        try:
            async for choice, out in self.stream():
                if each is not None:
                    each(choice, out)
        except Exception as e:
            raise from_failure(e) from e
        return list(self._results)

    async def whole(self, request, each=None) -> list[GenerationResult]:
        """results(each) for a whole (not streamed) response: unless the client of `request` disconnects first
        (ClientGone); the group is closed either way."""
        try:
            return await until_disconnected(request, self.results(each))
        finally:
            self.close()

    def close(self) -> None:
        """Abort every request that has not ended (a no-op for those that have); each is recorded in the
        metrics once the engine has ended it."""
        for handle, metrics in zip(self.handles, self.metrics):
            if not metrics.ended:
                _abort(self.state, handle, metrics)


def _abort(state: ServerState, handle, metrics) -> None:
    """Abort `handle`'s request; its end is recorded in `metrics` once the engine has ended it."""
    handle.abort()
    task = asyncio.ensure_future(_record_end(handle, metrics))
    state.background.add(task)
    task.add_done_callback(state.background.discard)


async def _record_end(handle, metrics) -> None:
    try:
        result = await handle.result_async()
    except Exception:
        metrics.fail(handle.prompt_tokens)
    else:
        metrics.finish(result)


class ClientGone(Exception):
    """The client of a request disconnected before its response was ready (the app answers 499, which
    nobody reads)."""


async def until_disconnected(request, awaitable):
    """Await `awaitable` unless the client of `request` disconnects first; then cancel it and raise
    ClientGone. Streamed responses need none of this: Starlette cancels a StreamingResponse whose client
    has gone."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        raise ClientGone("the client disconnected")
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()


async def _disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
