"""POST /v1/completions: prompts (strings, token ids, or lists of either) to text, whole or streamed.

Choice `index` is prompt p's k-th of n at p * n + k. Streamed, every output of the engine that
adds text (or tokens, with return_token_ids) is one event; an output whose text is held back (an
incomplete UTF-8 character, a possible stop string) waits for the next, and so do its tokens' logprobs.
`usage` counts each prompt once (not once per choice) and every choice's new tokens.

`logprobs: N` gives OpenAI's legacy logprobs of the new tokens (server/logprobs.py); `echo` puts the prompt
before the text (a prompt sent as a string as it was sent, token ids decoded) and, with logprobs, the prompt's
tokens before the new ones (the first with None), computed by the engine as prompt logprobs; `echo` with
`max_tokens: 0` gives the prompt alone (the engine samples one token, which is dropped): how lm-eval scores
loglikelihood tasks. vLLM's `prompt_logprobs: N` adds the choice's `prompt_logprobs` (in a stream, with the
choice's first event). OpenAI's `best_of` runs best_of candidates per prompt and returns the n of the highest
mean logprob per token, best first (usage counts them all; not streamed). Structured output (`response_format`,
`structured_outputs`, `guided_*`: server/structured.py) holds every choice's text to its grammar.
"""

from __future__ import annotations

from typing import AsyncIterator

from .errors import stream_event
from .generation import Generations, check_count
from .logprobs import completion_logprobs, prompt_logprobs
from .protocol import CompletionRequest
from .responses import (DONE, CompletionChoice, CompletionResponse, StreamChunks, Usage, event, now, request_id,
                        with_usage)
from .state import ServerState
from .structured import compile_grammar, structured_request


def prompts_of(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token id lists (one prompt: a string or a list of token ids; several: a
    list of strings or of token id lists)."""
    prompt, keep = body.prompt, state.kept_tokens(body)
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [state.prompt_ids(prompt, "prompt", keep=keep)]
    return [state.prompt_ids(p, "prompt", i, keep) for i, p in enumerate(prompt)]


def prompt_texts(state: ServerState, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What echo puts before each prompt's text: a string prompt as sent, token ids (and a prompt that
    truncate_prompt_tokens cut) decoded with their special tokens (as vLLM echoes them: the text the echoed tokens'
    strings and text_offsets spell)."""
    raw = body.prompt
    sent = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    cut = body.truncate_prompt_tokens is not None
    return [p if isinstance(p, str) and not cut else "" if state.tokenizer is None else state.tokenizer.decode(ids)
            for p, ids in zip(sent, prompts)]


async def create_completion(state: ServerState, body: CompletionRequest, raw_request):
    """The response of one /v1/completions request: a CompletionResponse, or the event stream's body
    (an async iterator of server-sent events) when body.stream."""
    state.check(body)
    structured, field = structured_request(state, body)
    prompt = body.prompt
    one = isinstance(prompt, str) or isinstance(prompt[0], int)
    check_count(state, 1 if one else len(prompt), body.candidates)  # (before tokenizing prompts that cannot all run)
    text = isinstance(prompt, str) or any(isinstance(p, str) for p in prompt)
    prompts = await state.off_loop(prompts_of, state, body) if text else prompts_of(state, body)
    state.check_room(prompts, body)
    if structured is not None:
        await compile_grammar(state, structured, field)
    echoed = body.echo and body.logprobs is not None  # the prompt's logprobs in `logprobs`
    wanted = [n for n in (body.logprobs if echoed else None, body.prompt_logprobs) if n is not None]
    ranked = body.candidates > body.n  # best_of: the candidates' logprobs rank them
    logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
    sampling = state.sampling(body, 1 if body.echo_only else body.max_tokens, logprobs,
                              max(wanted) if wanted else None, structured)
    group = Generations.submit(state, prompts, sampling, body.candidates)
    echo = prompt_texts(state, body, prompts) if body.echo else None
    rid = request_id("cmpl")
    if body.stream:
        return _events(state, body, group, rid, echo)
    results = await group.whole(raw_request)
    choices = []
    for i, c in enumerate(_best(results, body.n, body.candidates)):  # (candidate c is choice i)
        r = results[c]
        ids, entries = ([], []) if body.echo_only else (list(r.token_ids), list(r.logprobs or []))
        text = "" if body.echo_only else r.text or ""
        if echo is not None:
            text = echo[c // body.candidates] + text
            if echoed:
                ids, entries = group.prompt_of(c) + ids, r.prompt_logprobs + entries
        choices.append(CompletionChoice(
            index=i, text=text, finish_reason=r.finish_reason,
            stop_reason=group.stop_reason(c, r.finish_reason, r.token_ids),
            logprobs=None if body.logprobs is None else completion_logprobs(state.logprob_strings(body), ids, entries,
                                                                            body.logprobs),
            token_ids=([] if body.echo_only else list(r.token_ids)) if body.return_token_ids else None,
            prompt_token_ids=group.prompt_of(c) if body.return_token_ids else None,
            prompt_logprobs=_prompt_logprobs(state, body, group.prompt_of(c), r.prompt_logprobs)))
    return CompletionResponse(id=rid, model=state.model_name, choices=choices, usage=_usage(body, group))


def _best(results, n: int, candidates: int) -> list[int]:
    """The candidates returned, in choice order: every one; with best_of (`candidates` > n) each prompt's n of the
    highest mean logprob per new token (OpenAI's "best"; the raw distribution's, whatever the sampling), best first,
    the earlier first on a tie."""
    if candidates == n:
        return list(range(len(results)))

    def score(c: int) -> float:
        values = [e.logprob for e in results[c].logprobs or ()]
        return sum(values) / len(values) if values else 0.0

    return [c for p in range(0, len(results), candidates)
            for c in sorted(range(p, p + candidates), key=lambda c: -score(c))[:n]]


def _prompt_logprobs(state: ServerState, body: CompletionRequest, prompt: list[int], entries):
    if body.prompt_logprobs is None:
        return None
    return prompt_logprobs(state.token_strings, prompt, entries, body.prompt_logprobs)


def _usage(body: CompletionRequest, group: Generations, so_far: bool = False) -> Usage:
    """The request's usage (`so_far`: of the tokens output so far, for continuous_usage_stats)."""
    usage = group.usage_so_far() if so_far else group.usage()
    if body.echo_only:  # the token the engine sampled is dropped
        usage = Usage.of(usage.prompt_tokens, 0, usage.prompt_tokens_details.cached_tokens)
    return usage


class _Pending:
    """What a streamed choice has not sent yet: an output whose text is held back sends nothing, so its tokens and
    logprobs wait for the next event; the prompt's logprobs wait for the choice's first event."""

    def __init__(self):
        self.started = False  # the choice's first output has come
        self.text, self.token_ids, self.logprob_ids, self.entries = "", [], [], []
        self.prompt_logprobs = None  # the first output's, until sent
        self.prompt_token_ids = None  # with return_token_ids, until sent (in the choice's first event, as vLLM)
        # the next text_offset: the characters of the token strings sent so far (as a whole response counts them;
        # not of the text sent, which lags the tokens while a possible stop string is held back)
        self.offset = 0


async def _events(state: ServerState, body: CompletionRequest, group: Generations, rid: str,
                  echo: list[str] | None) -> AsyncIterator[str]:
    created, model = now(), state.model_name
    chunks = StreamChunks("text_completion", rid, created, model)
    pending: dict[int, _Pending] = {}
    options = body.stream_options
    usage_chunk = options is not None and options.include_usage
    strings = state.logprob_strings(body)

    def sent(sse: str) -> str:  # with include_usage, "usage": null (vLLM's continuous_usage_stats: the usage so far)
        return with_usage(sse, _usage(body, group, so_far=True) if options.continuous else None) if usage_chunk else sse

    try:
        async for choice, out in group.stream():
            p = pending.setdefault(choice, _Pending())
            if not p.started:
                p.started, p.prompt_logprobs = True, out.prompt_logprobs
                p.prompt_token_ids = group.prompt_of(choice) if body.return_token_ids else None
                if echo is not None:
                    p.text = echo[choice // body.n]
                    if body.logprobs is not None:
                        p.logprob_ids, p.entries = list(group.prompt_of(choice)), list(out.prompt_logprobs or [])
            if not body.echo_only:
                p.text += out.text or ""
                p.token_ids += out.token_ids
                p.logprob_ids += out.token_ids
                p.entries += out.logprobs or []
            prompt = (p.prompt_logprobs is not None and body.prompt_logprobs is not None) or p.prompt_token_ids is not None
            if not (p.text or out.finish_reason or (body.return_token_ids and p.token_ids) or prompt):
                continue
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(strings, p.logprob_ids, p.entries, body.logprobs, p.offset)
                p.offset += sum(len(strings(t)) for t in p.logprob_ids)
            text, token_ids = p.text, p.token_ids if body.return_token_ids else None
            stop_reason = group.stop_reason(choice, out.finish_reason, out.token_ids)
            p.text, p.token_ids, p.logprob_ids, p.entries = "", [], [], []
            if prompt:  # (once per choice: the event built from the models)
                choice_body = CompletionChoice(index=choice, text=text, logprobs=logprobs,
                                               finish_reason=out.finish_reason, stop_reason=stop_reason,
                                               token_ids=token_ids, prompt_token_ids=p.prompt_token_ids,
                                               prompt_logprobs=_prompt_logprobs(state, body, group.prompt_of(choice),
                                                                                p.prompt_logprobs))
                p.prompt_logprobs = p.prompt_token_ids = None
                yield sent(event(CompletionResponse(id=rid, created=created, model=model, choices=[choice_body])))
            else:
                yield sent(chunks.completion(choice, text, out.finish_reason, token_ids, logprobs, stop_reason))
        if usage_chunk:
            yield event(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                           usage=_usage(body, group)))
    except Exception as e:  # the request failed after the stream began (a step's error, shutdown)
        yield stream_event(e)
    finally:
        group.close()
    yield DONE
