"""Engine: text generation over the captured prefill step, online, with continuous batching.

    engine = Engine(model, num_slots=64)
    results = engine.generate(prompts, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0,
                              seed=None, stop_token_ids=None)
    results[i].token_ids, results[i].text, results[i].finish_reason

    handle = engine.submit(prompt, max_new_tokens=128, ..., stop=["\\n\\n"])   # any time, any thread
    for out in handle: out.token_ids, out.text, out.finish_reason             # or: async for
    handle.result(), handle.abort()

One engine loop (loop.py: a background thread, started on first use, ended by shutdown(), the
context manager, or when the engine is collected or the interpreter exits) drives every step: ONE
call of the step (GraphRunner.prefill: a CUDA graph replay on CUDA, the same compiled step on the
CPU; or model.prefill with compile=False) holding the running requests' one-token decode streams
and prompt chunks under the token budget (scheduler.py has the policy). A request submitted while
others run joins the batch at the next step; generate and stream submit their requests together
and wait for them, so any number of calls (threads, a server) share the engine.

Semantics:
- A request's output `token_ids` holds the new tokens only; a stop token ends the request with
  finish_reason "stop" and is included (as transformers' generate keeps the eos token).
  Reaching max_new_tokens, or max_context (prompt + new tokens == max_context), ends it with
  "length". submit's stop strings end it with "stop" too: its text ends before the stop string
  (nothing after it is ever streamed), its token_ids end with the token that completed it.
- A prompt must leave room for at least one new token: 1 <= len(prompt) < max_context.
- stop_token_ids=None uses the engine's default stop tokens (Engine(stop_token_ids=...), by
  default the eos token(s) of the model folder's generation_config.json, as transformers'
  generate does, else the tokenizer's eos token; none for presets); [] stops on nothing.
- Sampling: temperature 0 is greedy; otherwise temperature, top-k (0: off), top-p (1.0: off).
  Request i of a call draws from its own generator seeded with seed + i (seed=None: from the OS;
  under tensor parallelism rank 0 draws the seed and shares it, so every rank samples the same
  tokens), so its draws do not depend on the other requests of the batch (its logits may, by rounding:
  docs/generation.md, "Sampling").
- Sampling controls (keyword arguments, vLLM's semantics; sampling.py and logits_processors.py have the
  order): logit_bias {token id: bias in [-100, 100]} added first; min_tokens suppresses the stop tokens
  (and submit's stop strings) until that many tokens are out; repetition_penalty (> 0) over the prompt
  and the output, presence_penalty and frequency_penalty (in [-2, 2]) over the output; min_p (in [0, 1])
  relative to the most likely token after temperature. logprobs=N / prompt_logprobs=N (N <= 20): each
  new / prompt token's raw log-probability (log_softmax of the model's logits, before any of the above:
  vLLM's default) and the N most likely, in RequestOutput.logprobs and GenerationResult.logprobs /
  .prompt_logprobs (the first prompt token's is None).
- Structured output (structured=, structured.py and grammar.py): {"json": schema}, {"json_object": True},
  {"regex": ...}, {"choice": [...]} or {"grammar": EBNF} holds every request of the call to it: each token is
  sampled under a mask of what the grammar allows next (eos only where the output may end), so a request that
  ends with "stop" has a whole, valid output ("length" may cut it). The grammar is compiled (once per distinct
  one, cached) in the engine's grammar worker before the request is queued; one that does not compile is a
  ValueError (StructuredOutputError). Needs a transformers tokenizer. With min_tokens the stop tokens are held back
  while the grammar allows anything else (where it allows only a stop, the grammar wins: vLLM's rule).
- Speculative decoding (Engine(speculative=...), docs/speculative.md): speculate=False (generate, stream,
  submit) makes a call's requests decode one token per step; requests with a grammar, logprobs, penalties or
  min_tokens speculate too, their processors run per verify position (speculative/verify.py).
- Bad requests raise ValueError before anything is queued (numbers may be Python or numpy ones,
  prompts lists, 1-D integer tensors or numpy arrays, or strings with a tokenizer); submit raises
  EngineFullError when max_waiting requests already wait, EngineClosedError after shutdown.
- The engine holds its cache (HybridCache.hold) for its whole life: any other use of engine.cache
  (model.prefill, a runner, reset) raises CacheInUseError, so no stream gets into it from outside.

The Engine's code: this module (the Engine: construction, the public calls, generate / stream's events),
engine_requests.py (RequestIntake, its base class: each call's arguments checked and made into Requests) and
engine_sizes.py (the constructor's sizes defaulted and checked, the bucket grid, prefix caching's sizes).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import time
import weakref
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from .detokenizer import check_stop_strings
from .engine_requests import RequestIntake
# the defaults, re-exported: the tools import them from here
from .engine_sizes import DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_MAX_CONTEXT, DEFAULT_TOKEN_BUDGET  # noqa: F401
from .engine_sizes import check_sizes, default_grid, prefix_sizes
from .grammar import Grammars
from .handle import (Channel, EngineBusyError, EngineClosedError, EngineFullError, Failure, GenerationResult,
                     RequestHandle, RequestOutput)
from .loop import EngineLoop, EngineStats
from .model import HybridModel
from .plan_sync import PlanBroadcast, follow
from .logprobs import TokenLogprobs
from .scheduler import Request
from .structured import StructuredOutput, StructuredOutputError
from .tokenizer import decode_kwargs, default_stop_ids, resolve_tokenizer

__all__ = ["Engine", "EngineBusyError", "EngineClosedError", "EngineFullError", "EngineStats", "GenerationResult",
           "RequestHandle", "RequestOutput", "StructuredOutput", "StructuredOutputError", "TokenEvent", "TokenLogprobs",
           "default_grid"]


class TokenEvent(NamedTuple):
    """One new token of `engine.stream`: request index, token id, and the finish reason when this
    token ended the request (else None)."""
    index: int
    token_id: int
    finish_reason: str | None


class Engine(RequestIntake):
    def __init__(self, model: HybridModel, num_slots: int = 64, *, max_context: int | None = None,
                 token_budget: int | None = None, block_size: int = 64, num_blocks: int | None = None,
                 tokenizer=None, stop_token_ids: Sequence[int] | None = None, compile: bool = True,
                 use_graphs: bool | None = None, batch_sizes: Sequence[int] | None = None,
                 token_counts: Sequence[int] | None = None, max_waiting: int | None = None,
                 broadcast_plans: bool = False, prefix_cache: bool = False, prefix_checkpoints: int | None = None,
                 checkpoint_interval: int | None = None, overlap: bool = True, speculative=None):
        """A generation engine owning a cache of `num_slots` slots over `model`.

        max_context: the most tokens (prompt + new) a request holds, at most the model's
        max_position_embeddings (default: that, capped at 4096). token_budget: the most tokens one step feeds
        (default max(2048, num_slots); at least num_slots, so every running request decodes in
        every step). num_blocks: KV blocks of `block_size` tokens (default: every slot can hold
        max_context; fewer make admission wait for blocks). compile=False runs the eager
        model.prefill (no GraphRunner); use_graphs (default: on CUDA) is the GraphRunner's
        option. batch_sizes / token_counts: the bucket grid (default: `default_grid`; its largest bucket must hold
        num_slots streams and token_budget tokens, a step's most). max_waiting: the most submit() requests waiting
        for a slot before submit raises EngineFullError (default max(256, 4 x num_slots); generate / stream are never
        refused).
        broadcast_plans: under tensor parallelism, rank 0 serves and the other ranks run follow()
        (plan_sync.py); without tensor parallelism it changes nothing.
        prefix_cache: keep prompts' prefixes for later requests (prefix_cache.py: KV blocks shared, GDN states
        checkpointed every `checkpoint_interval` tokens of a prompt, after all but a prompt's last token and at
        the end of every request; `prefix_checkpoints` state checkpoints at most, default 4 x num_slots); each
        result reports its `cached_tokens`, stats() the hit counters. prefix_checkpoints and checkpoint_interval
        without prefix_cache=True are a ValueError. With broadcast_plans under tensor parallelism rank 0's plans
        carry its cache bookkeeping, which the other ranks replay (plan_journal.py): every rank keeps the same
        prefixes in the same blocks (give every rank the same arguments).
        overlap: the loop launches each step before it reads the previous one's tokens back (loop.py), so the
        host's work runs while the device computes; False reads each step back before planning the next (the
        same tokens, for debugging and comparison).
        speculative: None (off), "ngram", "mtp" or {"method": ..., "num_tokens": k} (speculative/options.py; a
        ValueError naming the problem first, e.g. "mtp" for a model without an MTP head): each decode step
        verifies k drafts per request in one step of the model, emitting the accepted ones and one more, with the
        same tokens as without (greedy) or the same distribution (sampled); speculative/verify.py and
        docs/speculative.md. stats().speculative counts drafts proposed and accepted. With broadcast_plans under
        tensor parallelism rank 0's plans carry the drafts and it shares each verify step's accept counts; the
        other ranks run the same verify steps and MTP drafting (speculative/following.py).

        Sizes that ask for more memory than the device has free (the cache's pools: num_slots, num_blocks x
        block_size, prefix_checkpoints; the bucket grid's buffers: token_budget) are a ValueError naming the
        largest, before it is allocated.
        """
        cfg = model.config
        from .speculative import check_speculative

        speculative = check_speculative(speculative, model)
        num_slots, max_context, token_budget, block_size, num_blocks, max_waiting = check_sizes(
            cfg, num_slots, max_context, token_budget, block_size, num_blocks, max_waiting)
        if use_graphs and not compile:
            raise ValueError("use_graphs=True needs compile=True (graphs replay the compiled step)")
        if not isinstance(broadcast_plans, bool):
            raise ValueError(f"broadcast_plans must be True or False, got {broadcast_plans!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        self.model, self.num_slots, self.max_context, self.token_budget = model, num_slots, max_context, token_budget
        self.max_waiting = max_waiting
        self.tokenizer = resolve_tokenizer(tokenizer, model)
        self._decode_kwargs = decode_kwargs(self.tokenizer) if self.tokenizer is not None else {}
        if stop_token_ids is None:
            stop_token_ids = [t for t in default_stop_ids(model, self.tokenizer) if 0 <= t < cfg.vocab_size]
        self.stop_token_ids = self._check_stop_ids(stop_token_ids)
        checkpoints, interval = prefix_sizes(prefix_cache, num_slots, block_size, prefix_checkpoints,
                                             checkpoint_interval)
        self.speculative = speculative
        # speculative/verify.py: num_tokens entries per stream of a step that may speculate (at most max_streams)
        verify = min(num_slots, speculative.max_streams) * speculative.num_tokens if speculative is not None else 0
        self.cache = model.new_cache(num_slots, num_blocks, block_size, max_context, checkpoints, interval, verify)
        self.runner = None
        if compile:
            from .capture import GraphRunner

            default_b, default_t = default_grid(num_slots, token_budget)
            self.runner = GraphRunner(model, self.cache, default_b if batch_sizes is None else batch_sizes,
                                      default_t if token_counts is None else token_counts,
                                      use_graphs=use_graphs)
            big = self.runner.largest  # every step of the loop runs in one bucket (GraphRunner.launch)
            if big.streams < num_slots or big.tokens < token_budget:
                raise ValueError(f"the grid's largest bucket {big} holds fewer than num_slots ({num_slots}) streams or "
                                 f"token_budget ({token_budget}) tokens, which one step may feed: extend batch_sizes / "
                                 "token_counts, or leave them out (default_grid)")
        self._token = object()  # the engine's hold on its cache: only its loop acts for it
        self.cache.hold(self._token, "the Engine that built it")
        self._broadcast = (PlanBroadcast(model.tp, model.device, num_slots, token_budget)
                           if broadcast_plans and model.tp is not None else None)
        self._loop = EngineLoop(model, self.runner, self.cache, self._token, token_budget, self._broadcast, overlap,
                                speculative)
        self._ids = itertools.count()
        self._grammars: Grammars | None = None  # structured output's compiler, made for the first grammar
        self._grammars_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close, self._loop)

    # public calls ------------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop_token_ids: Sequence[int] | None = None,
               stop: str | Sequence[str] | None = None, *, include_stop_str_in_output: bool = False,
               structured=None, keep_special_ids: Sequence[int] = (), **controls) -> RequestHandle:
        """Queue one request (a prompt as generate takes them) from any thread; it joins the running batch
        at the next step. Returns its RequestHandle (outputs as they come, result(), abort()). With a
        tokenizer each output carries the text its tokens add (UTF-8 safe; `stop` strings matched across
        tokens and cut, or kept with include_stop_str_in_output; `keep_special_ids`: special tokens whose text
        it keeps, the others skipped as always). `controls`: the sampling controls
        (min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens, logprobs,
        prompt_logprobs; the module docstring); `structured`: the output's grammar (module docstring). ValueError
        for a bad request, EngineFullError when max_waiting requests wait, EngineClosedError after shutdown();
        nothing is queued then."""
        if self.model.tp is not None and self._broadcast is None:
            raise ValueError("under tensor parallelism submit() needs Engine(..., broadcast_plans=True) (rank 0 "
                             "serves, the other ranks run engine.follow()); generate / stream called alike on "
                             "every rank need no broadcast")
        stop = check_stop_strings(stop)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (Engine(model, tokenizer=...)); use stop_token_ids")
        if not isinstance(include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be True or False, got {include_stop_str_in_output!r}")
        (request,) = self._requests([prompt], max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                    stop=stop, text=self.tokenizer is not None, controls=controls,
                                    include_stop=include_stop_str_in_output, structured=structured,
                                    keep_special=keep_special_ids)
        channel = Channel(1)
        request.channel = channel
        self._loop.submit([request], self.max_waiting)
        return RequestHandle(self._loop, request, channel, owner=self)

    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids: Sequence[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None, *, structured=None,
                 **controls) -> list[GenerationResult]:
        """Generate for every prompt (token id lists, 1-D int tensors or numpy arrays, or strings with a
        tokenizer); results in the prompts' order. `controls`: submit's sampling controls; `structured`: every
        request's grammar (module docstring). The requests are queued together, in order (under
        tensor parallelism every rank then schedules them alike). `on_token(request_index, token_id)` is
        called in this thread for each new token, in the order they are sampled. If anything fails (a
        request's step, the callback, Ctrl-C) the call's other requests are aborted and their slots
        freed before the error propagates."""
        t0 = time.perf_counter()
        if on_token is not None and not callable(on_token):
            raise ValueError(f"on_token must be a callable (request_index, token_id) or None, got "
                             f"{type(on_token).__name__}")
        requests = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                  controls=controls, structured=structured)
        events = self._events(requests) if on_token is not None else self._outputs(requests, each_step=False)
        try:
            for event in events:
                if on_token is not None:
                    on_token(event.index, event.token_id)
        finally:
            events.close()  # on an error (a callback's too): free the slots now, not when collected
        return [self._result(r, t0) for r in requests]

    def stream(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None,
               stop_token_ids: Sequence[int] | None = None, *, structured=None, **controls) -> Iterator[TokenEvent]:
        """generate's requests as a stream of TokenEvents, in the order tokens are sampled. The
        arguments are checked now (ValueError); the requests are queued on the first next() and run
        whether or not the stream is consumed. Once the last request has finished the stream holds
        nothing; closing it early (or dropping it) aborts its requests and frees their slots."""
        requests = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                                  controls=controls, structured=structured)
        return self._events(requests)

    def warmup(self, progress: bool = False) -> list:
        """Compile (and on CUDA capture) every bucket now rather than on first use; returns the
        runner's per-bucket reports. Runs in the engine loop between two steps (requests running
        meanwhile wait for it); a shutdown() meanwhile ends it after the bucket in progress (EngineClosedError;
        under tensor parallelism it warms the whole grid). With compile=False: one 1-token request, so that one-time
        initialization stays out of later timings; returns []. With speculation, the buckets' hidden-states
        steps too (the verify steps', GraphRunner.hidden_bucket) and their tails (acceptance, MTP drafts:
        capture/speculative.py); not in the reports."""
        self._check_not_follower("warmup")
        if self.runner is None:
            self.generate([[0]], max_new_tokens=1, stop_token_ids=[])
            return []
        return self._loop.run_job(lambda: self._warm_all(progress), warmup=True)

    def _warm_all(self, progress: bool) -> list:
        # a shutdown meanwhile (a server stopped while it warms: the whole grid takes a minute on a large model) ends
        # the warmup after the bucket in progress with EngineClosedError; under tensor parallelism every rank warms
        # every bucket (their collectives meet), so there it goes on
        stop = self._loop.check_open if self.model.tp is None else lambda: None
        reports = self.runner.warmup(progress=progress, on_bucket=lambda report: stop())
        if self.speculative is not None:
            with self.cache.exclusive():
                for bucket in sorted(self.runner.grid, reverse=True):
                    stop()
                    self.runner.hidden_bucket(bucket.streams, bucket.tokens)
                    self._loop.spec.graphs.warm(bucket)  # its tail: acceptance, MTP drafts (capture/speculative.py)
        return reports

    def reset_prefix_cache(self) -> None:
        """Forget every prompt prefix the prefix cache keeps (HybridCache.clear_prefixes), between two steps
        of the engine loop: requests running meanwhile go on (what they hold stays theirs); later prompts
        hit only what is kept from now on. Without prefix caching: nothing to forget."""
        self._check_not_follower("reset_prefix_cache")
        self._loop.run_job(self._loop.clear_prefixes)

    def follow(self) -> None:
        """Under tensor parallelism with broadcast_plans, on every rank but 0: replay rank 0's steps (and
        warmup) until rank 0 shuts its engine down (plan_sync.py). Blocks the calling thread."""
        if self._broadcast is None or self._broadcast.leader:
            raise ValueError("follow() runs on the ranks other than 0 of an Engine(..., broadcast_plans=True) under "
                             "tensor parallelism")
        warmup = (lambda: self._warm_all(False)) if self.runner is not None else (lambda: None)  # (rank 0's warmup)
        with torch.no_grad(), self.cache.acting_for(self._token), self._loop._on_device():
            follow(self._broadcast, self._loop.replay.replay, self._loop.follow_handlers(warmup))

    def stats(self) -> EngineStats:
        """Running and waiting requests, slot and KV-block use, and token counters, as of now."""
        return self._loop.stats()

    def shutdown(self, wait_s: float = 0.0, timeout: float | None = 60.0) -> None:
        """End the engine loop. New requests are refused at once (EngineClosedError); the ones waiting or
        running get up to `wait_s` seconds to finish, then end with EngineClosedError. Waits up to
        `timeout` seconds for the step in progress; once the loop has ended the cache is released (usable
        directly). Idempotent."""
        self._loop.drain(wait_s)
        self._loop.close(timeout=timeout)
        if self._grammars is not None:
            self._grammars.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """Text of `token_ids` (special tokens skipped where the tokenizer's decode takes
        skip_special_tokens), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), **self._decode_kwargs)

    # generate / stream ---------------------------------------------------------------------------
    def _events(self, requests: list[Request]) -> Iterator[TokenEvent]:
        with contextlib.closing(self._outputs(requests)) as batches:  # (closed: the requests left are aborted)
            for items in batches:
                for item in items:
                    yield TokenEvent(item.index, item.token_ids[0], item.finish_reason)

    def _outputs(self, requests: list[Request], each_step: bool = True) -> Iterator[list[RequestOutput]]:
        """`requests` submitted; their outputs as the loop delivers them, a step's at a time (each_step=False: all
        at once, woken only when they have ended or one has failed); the error that failed one raised after the
        outputs before it. Closed early, the requests not ended are aborted. (Taken a list at a time: the
        consumer's work per token, and each wakeup, competes with the loop thread's for the interpreter.)"""
        channel = Channel(len(requests))
        for r in requests:
            r.channel = channel
        self._loop.submit(requests)
        ended = 0
        try:
            while ended < len(requests):
                items = channel.get(until_ended=not each_step)
                if Failure in set(map(type, items)):
                    k = next(k for k, item in enumerate(items) if type(item) is Failure)
                    if k:
                        yield items[:k]
                    raise items[k].error
                reasons = list(map(_finish_reason, items))
                ended += len(reasons) - reasons.count(None)
                yield items
        finally:
            if channel.open:  # stopped early (an error, a close): free what the others hold, then go on
                self._loop.abort([r for r in requests if not r.ended])
                if not self._loop.is_loop_thread():  # (collected in the loop thread: it cannot wait for itself)
                    channel.wait_closed()

    def _result(self, r: Request, t0: float) -> GenerationResult:
        return GenerationResult(list(r.out), self.decode(r.out), r.finish_reason, len(r.prompt),
                                r.first_token_time - t0, r.cached, r.logprobs, r.prompt_logprobs)

    def __repr__(self) -> str:
        mode = "eager" if self.runner is None else "CUDA graphs" if self.runner.use_graphs else "compiled"
        s = self.speculative
        spec = "" if s is None else f"speculative={s.method} k={s.num_tokens} max_streams={s.max_streams}, "
        return (f"Engine(slots={self.num_slots}, max_context={self.max_context}, token_budget={self.token_budget}, "
                f"{mode}, {spec}tokenizer={'yes' if self.tokenizer is not None else 'no'}, {self.cache})")


_finish_reason = operator.attrgetter("finish_reason")


def _close(loop: EngineLoop) -> None:
    """The engine was collected, or the interpreter exits: end its loop (which releases the cache). Only the
    main thread waits for it (at exit, so that followers of a plan broadcast hear the end); a collection in
    another thread must not wait for the loop, which may be waiting to deliver to that thread."""
    loop.close(timeout=5.0 if threading.current_thread() is threading.main_thread() else 0.0)
