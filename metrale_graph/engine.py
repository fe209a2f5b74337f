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
  tokens), so its tokens do not depend on the other requests of the batch.
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
  ValueError (StructuredOutputError). Needs a transformers tokenizer; not with min_tokens.
- Speculative decoding (Engine(speculative=...), docs/speculative.md): speculate=False (generate, stream,
  submit) makes a call's requests decode one token per step; requests with a grammar, logprobs, penalties or
  min_tokens do anyway.
- Bad requests raise ValueError before anything is queued (numbers may be Python or numpy ones,
  prompts lists, 1-D integer tensors or numpy arrays, or strings with a tokenizer); submit raises
  EngineFullError when max_waiting requests already wait, EngineClosedError after shutdown.
- The engine holds its cache (HybridCache.hold) for its whole life: any other use of engine.cache
  (model.prefill, a runner, reset) raises CacheInUseError, so no stream gets into it from outside.
"""

from __future__ import annotations

import itertools
import math
import numbers
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from .batch import check_token_ids, token_tensor
from .detokenizer import StreamingText, check_stop_strings
from .grammar import Grammars
from .handle import (Channel, EngineBusyError, EngineClosedError, EngineFullError, Failure, GenerationResult,
                     RequestHandle, RequestOutput)
from .loop import EngineLoop, EngineStats
from .model import HybridModel
from .plan_sync import PlanBroadcast, follow
from .sampling import check_params, check_seed, new_generator
from .logprobs import TokenLogprobs
from .scheduler import Request
from .structured import StructuredOutput, StructuredOutputError, structured_output
from .tokenizer import decode_kwargs, default_stop_ids, resolve_tokenizer

__all__ = ["Engine", "EngineBusyError", "EngineClosedError", "EngineFullError", "EngineStats", "GenerationResult",
           "RequestHandle", "RequestOutput", "StructuredOutput", "StructuredOutputError", "TokenEvent", "TokenLogprobs",
           "default_grid"]

DEFAULT_MAX_CONTEXT = 4096
# submit / generate / stream's keyword arguments that go to sampling.check_params
SAMPLING_CONTROLS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                     "logprobs", "prompt_logprobs")
DEFAULT_TOKEN_BUDGET = 2048


class TokenEvent(NamedTuple):
    """One new token of `engine.stream`: request index, token id, and the finish reason when this
    token ended the request (else None)."""
    index: int
    token_id: int
    finish_reason: str | None


def default_grid(num_slots: int, token_budget: int) -> tuple[list[int], list[int]]:
    """Batch sizes 2, 4, 8, ... up to num_slots and token counts 2, 4, 8, ... up to token_budget
    (each list ends at the limit itself): every step fits one bucket (its streams <= num_slots,
    its tokens <= token_budget), pure-decode steps of B streams land in (B', B') with B' < 2B, and
    padding is under 2x in both dimensions. Sizes start at 2 because the runner pads smaller
    buckets to 2 streams and 2 tokens anyway."""
    return _doubling(num_slots), _doubling(token_budget)


def _doubling(limit: int) -> list[int]:
    sizes, n = [], min(2, limit)
    while n < limit:
        sizes.append(n)
        n *= 2
    return sizes + [limit]


class Engine:
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
        option. batch_sizes / token_counts: the bucket grid (default: `default_grid`).
        max_waiting: the most submit() requests waiting for a slot before submit raises
        EngineFullError (default max(256, 4 x num_slots); generate / stream are never refused).
        broadcast_plans: under tensor parallelism, rank 0 serves and the other ranks run follow()
        (plan_sync.py); without tensor parallelism it changes nothing.
        prefix_cache: keep prompts' prefixes for later requests (prefix_cache.py: KV blocks shared, GDN states
        checkpointed every `checkpoint_interval` tokens of a prompt, after all but a prompt's last token and at
        the end of every request; `prefix_checkpoints` state checkpoints at most, default 4 x num_slots); each
        result reports its `cached_tokens`, stats() the hit counters. prefix_checkpoints and checkpoint_interval
        without prefix_cache=True are a ValueError.
        overlap: the loop launches each step before it reads the previous one's tokens back (loop.py), so the
        host's work runs while the device computes; False reads each step back before planning the next (the
        same tokens, for debugging and comparison).
        speculative: None (off), "ngram", "mtp" or {"method": ..., "num_tokens": k} (speculative/options.py; a
        ValueError naming the problem first, e.g. "mtp" for a model without an MTP head): each decode step
        verifies k drafts per request in one step of the model, emitting the accepted ones and one more, with the
        same tokens as without (greedy) or the same distribution (sampled); speculative/verify.py and
        docs/speculative.md. stats().speculative counts drafts proposed and accepted.

        Sizes that ask for more memory than the device has free (the cache's pools: num_slots, num_blocks x
        block_size, prefix_checkpoints; the bucket grid's buffers: token_budget) are a ValueError naming the
        largest, before it is allocated.
        """
        cfg = model.config
        from .speculative import check_speculative

        speculative = check_speculative(speculative, model)
        if speculative is not None and broadcast_plans and model.tp is not None:
            raise ValueError("speculative with broadcast_plans under tensor parallelism is not supported yet (the plan "
                             "broadcast does not carry drafts or accept counts): turn one of them off")
        if max_context is None:
            max_context = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if token_budget is None:
            token_budget = max(DEFAULT_TOKEN_BUDGET, num_slots if _is_int(num_slots) else 0)
        if max_waiting is None:
            max_waiting = max(256, 4 * num_slots) if _is_int(num_slots) else 0
        for name, value, low in (("num_slots", num_slots, 1), ("max_context", max_context, 2),
                                 ("token_budget", token_budget, 1), ("block_size", block_size, 1),
                                 ("max_waiting", max_waiting, 0)):
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        num_slots, max_context, token_budget, block_size, max_waiting = map(
            int, (num_slots, max_context, token_budget, block_size, max_waiting))
        if max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context ({max_context}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if token_budget < num_slots:
            raise ValueError(f"token_budget ({token_budget}) must be at least num_slots ({num_slots}): every "
                             "running request feeds one token per step")
        if num_blocks is None:
            num_blocks = num_slots * -(-max_context // block_size)
        elif _is_int(num_blocks):
            num_blocks = int(num_blocks)
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
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {prefix_cache!r}")
        for name, value in (("prefix_checkpoints", prefix_checkpoints), ("checkpoint_interval", checkpoint_interval)):
            if value is not None and not prefix_cache:
                raise ValueError(f"{name}={value!r} sizes the prefix cache, which is off: pass prefix_cache=True too, "
                                 f"or leave {name} out")
        checkpoints, interval = (_prefix_sizes(num_slots, block_size, prefix_checkpoints, checkpoint_interval)
                                 if prefix_cache else (0, 0))
        if prefix_cache and broadcast_plans and model.tp is not None:
            raise ValueError("prefix_cache with broadcast_plans under tensor parallelism is not supported yet (the plan "
                             "broadcast does not carry the prefix restores): turn one of them off")
        self.speculative = speculative
        verify = num_slots * speculative.num_tokens if speculative is not None else 0  # speculative/verify.py
        self.cache = model.new_cache(num_slots, num_blocks, block_size, max_context, checkpoints, interval, verify)
        self.runner = None
        if compile:
            from .capture import GraphRunner

            default_b, default_t = default_grid(num_slots, token_budget)
            self.runner = GraphRunner(model, self.cache, default_b if batch_sizes is None else batch_sizes,
                                      default_t if token_counts is None else token_counts,
                                      use_graphs=use_graphs)
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
               structured=None, **controls) -> RequestHandle:
        """Queue one request (a prompt as generate takes them) from any thread; it joins the running batch
        at the next step. Returns its RequestHandle (outputs as they come, result(), abort()). With a
        tokenizer each output carries the text its tokens add (UTF-8 safe; `stop` strings matched across
        tokens and cut, or kept with include_stop_str_in_output). `controls`: the sampling controls
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
                                    include_stop=include_stop_str_in_output, structured=structured)
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
        events = self._events(requests)
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

    def compile_grammar(self, structured) -> Future:
        """Compile `structured`'s grammar (a dict as submit takes it, or a StructuredOutput) in the engine's grammar
        worker, or find it compiled: a Future whose exception is a StructuredOutputError when it does not compile.
        A request with the same grammar then finds it done (a server awaits this off its event loop before it
        submits). StructuredOutputError now for a bad spec."""
        spec = structured_output(structured, self.model.config.vocab_size)
        if spec is None:
            raise StructuredOutputError("expected a structured output, got None")
        return self._grammar_compiler().compile(spec)

    def _grammar_compiler(self) -> Grammars:
        if self.tokenizer is None:
            raise StructuredOutputError("structured output needs a tokenizer (Engine(model, tokenizer=...)): the "
                                        "grammar is over its vocabulary")
        if self._loop.closed:  # (its grammar worker is shut down too)
            raise EngineClosedError("the engine was shut down: build a new Engine")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)
            return self._grammars

    def warmup(self, progress: bool = False) -> list:
        """Compile (and on CUDA capture) every bucket now rather than on first use; returns the
        runner's per-bucket reports. Runs in the engine loop between two steps (requests running
        meanwhile wait for it). With compile=False: one 1-token request, so that one-time
        initialization stays out of later timings; returns []. With speculation, the buckets' hidden-states
        steps too (the verify steps', GraphRunner.hidden_bucket; not in the reports)."""
        self._check_not_follower("warmup")
        if self.runner is None:
            self.generate([[0]], max_new_tokens=1, stop_token_ids=[])
            return []
        return self._loop.run_job(lambda: self._warm_all(progress), warmup=True)

    def _warm_all(self, progress: bool) -> list:
        reports = self.runner.warmup(progress=progress)
        if self.speculative is not None:
            with self.cache.exclusive():
                for bucket in sorted(self.runner.grid, reverse=True):
                    self.runner.hidden_bucket(bucket.streams, bucket.tokens)
        return reports

    def reset_prefix_cache(self) -> None:
        """Forget every prompt prefix the prefix cache keeps (HybridCache.clear_prefixes), between two steps
        of the engine loop: requests running meanwhile go on (what they hold stays theirs); later prompts
        hit only what is kept from now on. Without prefix caching: nothing to forget."""
        self._check_not_follower("reset_prefix_cache")
        self._loop.run_job(self.cache.clear_prefixes)

    def follow(self) -> None:
        """Under tensor parallelism with broadcast_plans, on every rank but 0: replay rank 0's steps (and
        warmup) until rank 0 shuts its engine down (plan_sync.py). Blocks the calling thread."""
        if self._broadcast is None or self._broadcast.leader:
            raise ValueError("follow() runs on the ranks other than 0 of an Engine(..., broadcast_plans=True) under "
                             "tensor parallelism")
        runner = self.runner
        with torch.no_grad(), self.cache.acting_for(self._token), self._loop._on_device():
            follow(self._broadcast, self.cache.reset, self._loop.follow_step,
                   (lambda: runner.warmup(progress=False)) if runner is not None else (lambda: None))

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
        channel = Channel(len(requests))
        for r in requests:
            r.channel = channel
        self._loop.submit(requests)
        ended = 0
        try:
            while ended < len(requests):
                for item in channel.get():
                    if isinstance(item, Failure):
                        raise item.error
                    ended += item.finish_reason is not None
                    yield TokenEvent(item.index, item.token_ids[0], item.finish_reason)
        finally:
            if channel.open:  # stopped early (an error, a close): free what the others hold, then go on
                self._loop.abort([r for r in requests if not r.ended])
                if not self._loop.is_loop_thread():  # (collected in the loop thread: it cannot wait for itself)
                    channel.wait_closed()

    def _result(self, r: Request, t0: float) -> GenerationResult:
        return GenerationResult(list(r.out), self.decode(r.out), r.finish_reason, len(r.prompt),
                                r.first_token_time - t0, r.cached, r.logprobs, r.prompt_logprobs)

    # checking requests -------------------------------------------------------------------------
    def _requests(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                  stop: tuple[str, ...] = (), text: bool = False, controls: dict | None = None,
                  include_stop: bool = False, structured=None) -> list[Request]:
        """Requests from generate's arguments (`controls`: the sampling controls, check_params' keywords);
        ValueError naming the first bad one."""
        self._check_not_follower("generate / stream / submit")
        controls = dict(controls or {})
        speculate = controls.pop("speculate", True)  # (a request's opt-out of Engine(speculative=...))
        if not isinstance(speculate, bool):
            raise ValueError(f"speculate must be True or False, got {speculate!r}")
        if self.model.version != self._loop._model_version:
            raise ValueError("the model was converted or moved (model.to / .half / ...) after this Engine was built: "
                             "its cache and compiled step hold the old dtype and device: build a new Engine")
        if isinstance(prompts, (str, bytes, torch.Tensor)) or _numpy_array(prompts) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of prompts (each a list of token ids, a 1-D int tensor or array, "
                             f"or a string with a tokenizer), got {type(prompts).__name__}")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        params = self._check_controls(temperature, top_k, top_p, max_new_tokens, controls)
        seed = check_seed(seed)
        stops = self.stop_token_ids if stop_token_ids is None else self._check_stop_ids(stop_token_ids)
        spec = structured_output(structured, self.model.config.vocab_size)
        if spec is not None and params.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured output: the grammar decides where the "
                             "output may end (it may allow nothing but a stop token)")
        ids_of = [self._prompt_ids(i, prompt) for i, prompt in enumerate(prompts)]
        check_token_ids(ids_of, self.model.config.vocab_size, what="prompt")
        requests = []
        for i, ids in enumerate(ids_of):
            ids = ids.tolist()
            if len(ids) >= self.max_context:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; max_context is {self.max_context} and a "
                                 f"prompt must leave room for at least one new token (at most {self.max_context - 1})")
            max_new = min(int(max_new_tokens), self.max_context - len(ids))
            r = Request(i, ids, max_new, params, None, stop_ids=stops, speculate=speculate,
                        logprobs=[] if params.logprobs is not None else None,
                        prompt_logprobs=[] if params.prompt_logprobs is not None else None)
            need = -(-r.kv_tokens // self.cache.block_size)
            if need > self.cache.num_blocks:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + {max_new} new need {need} KV blocks; the "
                                 f"cache has {self.cache.num_blocks} (raise num_blocks or lower max_new_tokens)")
            requests.append(r)
        if spec is not None:  # the last check: the grammar compiles (waited for here, never in the engine loop)
            compiled = self._grammar_compiler().compile(spec).result()
            for r in requests:
                r.grammar = self._grammars.matcher(compiled, spec, stops)
        # every check passed (on every rank alike): only now agree on a seed
        if not params.greedy and seed is None and self.model.tp is not None and self._broadcast is None:
            seed = self._shared_seed()
        for r in requests:
            r.request_id = next(self._ids)
            if not params.greedy:
                r.generator = new_generator(None if seed is None else seed + r.index)
            if text:
                r.text = StreamingText(self.tokenizer, r.prompt, self._decode_kwargs, stop, include_stop,
                                       params.min_tokens)
        return requests

    def _check_controls(self, temperature, top_k, top_p, max_new_tokens: int, controls: dict):
        """The SamplingParams of a call (sampling.check_params), min_tokens within max_new_tokens; ValueError
        naming an unknown or bad control."""
        unknown = sorted(set(controls) - set(SAMPLING_CONTROLS))
        if unknown:
            raise ValueError(f"{unknown[0]} is not a sampling control (expected one of {', '.join(SAMPLING_CONTROLS)})")
        params = check_params(temperature, top_k, top_p, vocab_size=self.model.config.vocab_size, **controls)
        if params.min_tokens > max_new_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must be at most max_new_tokens ({max_new_tokens})")
        if params.prompt_logprobs is not None and self.model.tp is not None:
            raise ValueError("prompt_logprobs under tensor parallelism is not supported yet (its eager step is not "
                             "part of the broadcast plans)")
        return params

    def _check_not_follower(self, what: str) -> None:
        if self._broadcast is not None and not self._broadcast.leader:
            raise ValueError(f"{what} on tensor-parallel rank {self._broadcast.tp.rank}: with broadcast_plans only "
                             "rank 0 takes requests; the other ranks run engine.follow()")

    def _shared_seed(self) -> int:
        """A seed drawn from the OS on rank 0 of the model's tensor-parallel group and given to every
        rank: the ranks sample from the same logits, so with the same generators they draw the same
        tokens and keep feeding the same batches (independent seeds let them diverge, and with stop
        tokens their schedules, and so their collectives, part ways)."""
        tp = self.model.tp
        mine = int(torch.randint(0, 2**62, (1,), generator=new_generator(None))) if tp.rank == 0 else 0
        return int(tp.all_reduce(torch.tensor([mine], dtype=torch.int64, device=self.model.device))[0])

    def _prompt_ids(self, i: int, prompt) -> torch.Tensor:
        """Prompt i's token ids (text through the tokenizer), type-checked as a batch's streams are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is a string but the engine has no tokenizer: pass token ids, or "
                                 "Engine(model, tokenizer=folder_or_object)")
            prompt = list(self.tokenizer.encode(prompt))
        elif _numpy_array(prompt):
            prompt = _numpy_ids(prompt, f"prompt {i}")
        elif prompt is None or isinstance(prompt, bytes) or not isinstance(prompt, (Sequence, torch.Tensor)):
            raise ValueError(f"prompt {i}: expected a list of token ids, a 1-D int tensor or array, or a string, "
                             f"got {type(prompt).__name__}")
        if not isinstance(prompt, torch.Tensor) and not (type(prompt) is list and set(map(type, prompt)) == {int}):
            prompt = [_plain_int(x) for x in prompt]
        return token_tensor(prompt, f"prompt {i}", self.model.device)

    def _check_stop_ids(self, stop_token_ids) -> frozenset:
        if _numpy_array(stop_token_ids):
            stop_token_ids = _numpy_ids(stop_token_ids, "stop_token_ids")
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__}")
        vocab = self.model.config.vocab_size
        for t in stop_token_ids:
            if not _is_int(t):
                raise ValueError(f"stop token {t!r} must be an int, got {type(t).__name__}")
            if not 0 <= t < vocab:
                raise ValueError(f"stop token {t!r} is not a token id in [0, {vocab})")
        return frozenset(int(t) for t in stop_token_ids)

    def __repr__(self) -> str:
        mode = "eager" if self.runner is None else "CUDA graphs" if self.runner.use_graphs else "compiled"
        s = self.speculative
        spec = "" if s is None else f"speculative={s.method} k={s.num_tokens} max_streams={s.max_streams}, "
        return (f"Engine(slots={self.num_slots}, max_context={self.max_context}, token_budget={self.token_budget}, "
                f"{mode}, {spec}tokenizer={'yes' if self.tokenizer is not None else 'no'}, {self.cache})")


def _close(loop: EngineLoop) -> None:
    """The engine was collected, or the interpreter exits: end its loop (which releases the cache). Only the
    main thread waits for it (at exit, so that followers of a plan broadcast hear the end); a collection in
    another thread must not wait for the loop, which may be waiting to deliver to that thread."""
    loop.close(timeout=5.0 if threading.current_thread() is threading.main_thread() else 0.0)


DEFAULT_CHECKPOINT_INTERVAL = 128


def _prefix_sizes(num_slots: int, block_size: int, checkpoints, interval) -> tuple[int, int]:
    """Prefix caching's checkpoint entries (default: four per slot: a request leaves a few, and the ones a
    later prompt needs must outlive the requests between) and interval (default: the first multiple of
    the block size and of 64 from DEFAULT_CHECKPOINT_INTERVAL on; 0: checkpoints at prompts' ends only)."""
    if checkpoints is None:
        checkpoints = 4 * num_slots
    if not _is_int(checkpoints) or checkpoints < 1:
        raise ValueError(f"prefix_checkpoints must be an integer >= 1, got {checkpoints!r}")
    if interval is None:
        unit = block_size * 64 // math.gcd(block_size, 64)
        interval = -(-DEFAULT_CHECKPOINT_INTERVAL // unit) * unit
    return int(checkpoints), interval


def _is_int(x) -> bool:
    """An integer as users pass them: a Python or numpy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _plain_int(x):
    """A numpy integer as a Python int; anything else as it is (token_tensor names what is not an int)."""
    return int(x) if _is_int(x) and not isinstance(x, int) else x


def _numpy_array(x) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _numpy_ids(array, where: str) -> list[int]:
    """A 1-D integer numpy array as a list of Python ints; ValueError naming `where` otherwise."""
    if array.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be an integer array, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{where}: token ids must be 1-D, got shape {tuple(array.shape)}")
    return array.tolist()
