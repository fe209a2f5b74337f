"""POST /v1/completions: prompts (strings, token ids, or lists of either) to text, whole or streamed.

Choice `index` is prompt p's k-th of n at p * n + k. Streamed, every output of the engine that
adds text (or tokens, with return_token_ids) is one event; an output whose text is held back (an
incomplete UTF-8 character, a possible stop string) waits for the next. `usage` counts each
prompt once (not once per choice) and every choice's new tokens.
"""

from __future__ import annotations

from typing import AsyncIterator

from .errors import stream_event
from .generation import Generations
from .protocol import (DONE, CompletionChoice, CompletionRequest, CompletionResponse, StreamChunks, event, now,
                       request_id)
from .state import ServerState


def prompts_of(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token id lists (one prompt: a string or a list of token ids; several: a
    list of strings or of token id lists)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [state.prompt_ids(prompt, "prompt")]
    return [state.prompt_ids(p, "prompt", i) for i, p in enumerate(prompt)]


async def create_completion(state: ServerState, body: CompletionRequest, raw_request):
    """The response of one /v1/completions request: a CompletionResponse, or the event stream's body
    (an async iterator of server-sent events) when body.stream."""
    state.check(body)
    prompt = body.prompt
    text = isinstance(prompt, str) or any(isinstance(p, str) for p in prompt)
    prompts = await state.off_loop(prompts_of, state, body) if text else prompts_of(state, body)
    state.check_room(prompts, body)
    group = Generations.submit(state, prompts, state.sampling(body, body.max_tokens), body.n)
    rid = request_id("cmpl")
    if body.stream:
        return _events(state, body, group, rid)
    results = await group.whole(raw_request)
    choices = [CompletionChoice(index=i, text=r.text or "", finish_reason=r.finish_reason,
                                token_ids=list(r.token_ids) if body.return_token_ids else None,
                                prompt_token_ids=group.prompt_of(i) if body.return_token_ids else None)
               for i, r in enumerate(results)]
    return CompletionResponse(id=rid, model=state.model_name, choices=choices, usage=group.usage())


async def _events(state: ServerState, body: CompletionRequest, group: Generations, rid: str) -> AsyncIterator[str]:
    created, model = now(), state.model_name
    ids = body.return_token_ids
    chunks = StreamChunks("text_completion", rid, created, model)
    try:
        async for choice, out in group.stream():
            if not (out.text or out.finish_reason or (ids and out.token_ids)):
                continue
            yield chunks.completion(choice, out.text or "", out.finish_reason, list(out.token_ids) if ids else None)
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = group.usage()
            yield event(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))
    except Exception as e:  # the request failed after the stream began (a step's error, shutdown)
        yield stream_event(e)
    finally:
        group.close()
    yield DONE
