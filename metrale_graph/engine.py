"""Engine: text generation over the captured prefill step, with continuous batching.

    engine = Engine(model, num_slots=64)
    results = engine.generate(prompts, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0,
                              seed=None, stop_token_ids=None)
    results[i].token_ids, results[i].text, results[i].finish_reason

Every step is ONE call of the step (GraphRunner.prefill: a CUDA graph replay on CUDA, the same
compiled step on the CPU; or model.prefill with compile=False): one-token decode streams of the
running requests plus prompt chunks under the token budget (scheduler.py has the policy). The
next tokens are sampled on the device (sampling.py).

Semantics:
- A request's output `token_ids` holds the new tokens only; a stop token ends the request with
  finish_reason "stop" and is included (as transformers' generate keeps the eos token).
  Reaching max_new_tokens, or max_context (prompt + new tokens == max_context), ends it with
  "length".
- A prompt must leave room for at least one new token: 1 <= len(prompt) < max_context.
- stop_token_ids=None uses the engine's default stop tokens (Engine(stop_token_ids=...), by
  default the eos token(s) of the model folder's generation_config.json, as transformers'
  generate does, else the tokenizer's eos token; none for presets); [] stops on nothing.
- Sampling: temperature 0 is greedy; otherwise temperature, top-k (0: off), top-p (1.0: off).
  Request i draws from its own generator seeded with seed + i (seed=None: from the OS; under tensor
  parallelism rank 0 draws the seed and shares it, so every rank samples the same tokens), so its
  tokens do not depend on the other requests of the batch.
- Bad requests raise ValueError before anything runs (nothing queued, the cache untouched).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from .batch import Stream, check_token_ids, token_tensor
from .model import HybridModel
from .sampling import check_params, check_seed, new_generator, sample
from .scheduler import Request, Scheduler
from .tokenizer import decode_kwargs, default_stop_ids, resolve_tokenizer

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_TOKEN_BUDGET = 2048


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only (a stop token included)
    text: str | None  # token_ids decoded (special tokens skipped) when the engine has a tokenizer
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    first_token_s: float  # seconds from the start of the call to this request's first new token


class TokenEvent(NamedTuple):
    """One new token of `engine.stream`: request index, token id, and the finish reason when this
    token ended the request (else None)."""
    index: int
    token_id: int
    finish_reason: str | None


class EngineBusyError(RuntimeError):
    """The engine is already generating (one call at a time, a stream counts until exhausted or closed)."""


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
                 token_counts: Sequence[int] | None = None):
        """A generation engine owning a cache of `num_slots` slots over `model`.

        max_context: the most tokens (prompt + new) a request holds, at most the model's
        max_position_embeddings (default: that, capped at 4096). token_budget: the most tokens one step feeds
        (default max(2048, num_slots); at least num_slots, so every running request decodes in
        every step). num_blocks: KV blocks of `block_size` tokens (default: every slot can hold
        max_context; fewer make admission wait for blocks). compile=False runs the eager
        model.prefill (no GraphRunner); use_graphs (default: on CUDA) is the GraphRunner's
        option. batch_sizes / token_counts: the bucket grid (default: `default_grid`).
        """
        cfg = model.config
        if max_context is None:
            max_context = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if token_budget is None:
            token_budget = max(DEFAULT_TOKEN_BUDGET, num_slots if _is_int(num_slots) else 0)
        for name, value, low in (("num_slots", num_slots, 1), ("max_context", max_context, 2),
                                 ("token_budget", token_budget, 1), ("block_size", block_size, 1)):
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context ({max_context}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if token_budget < num_slots:
            raise ValueError(f"token_budget ({token_budget}) must be at least num_slots ({num_slots}): every "
                             "running request feeds one token per step")
        if num_blocks is None:
            num_blocks = num_slots * -(-max_context // block_size)
        if use_graphs and not compile:
            raise ValueError("use_graphs=True needs compile=True (graphs replay the compiled step)")
        self.model, self.num_slots, self.max_context, self.token_budget = model, num_slots, max_context, token_budget
        self.tokenizer = resolve_tokenizer(tokenizer, model)
        self._decode_kwargs = decode_kwargs(self.tokenizer) if self.tokenizer is not None else {}
        if stop_token_ids is None:
            stop_token_ids = [t for t in default_stop_ids(model, self.tokenizer) if 0 <= t < cfg.vocab_size]
        self.stop_token_ids = self._check_stop_ids(stop_token_ids)
        self.cache = model.new_cache(num_slots, num_blocks, block_size, max_context)
        self.runner = None
        if compile:
            from .capture import GraphRunner

            default_b, default_t = default_grid(num_slots, token_budget)
            self.runner = GraphRunner(model, self.cache, default_b if batch_sizes is None else batch_sizes,
                                      default_t if token_counts is None else token_counts,
                                      use_graphs=use_graphs)
        self._lock = threading.Lock()

    def warmup(self, progress: bool = False) -> list:
        """Compile (and on CUDA capture) every bucket now rather than on first use; returns the
        runner's per-bucket reports. With compile=False: one 1-token request, so that one-time
        initialization stays out of later timings; returns []. Raises EngineBusyError while a
        generate or stream is running."""
        if self.runner is None:
            self.generate([[0]], max_new_tokens=1, stop_token_ids=[])
            return []
        self._hold()  # capturing under a running generation would fail it
        try:
            return self.runner.warmup(progress=progress)
        finally:
            self._lock.release()

    # public calls ------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids: Sequence[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (token id lists, 1-D int tensors, or strings with a tokenizer);
        results in the prompts' order. `on_token(request_index, token_id)` is called for each new
        token as it is sampled."""
        t0 = time.perf_counter()
        if on_token is not None and not callable(on_token):
            raise ValueError(f"on_token must be a callable (request_index, token_id) or None, got "
                             f"{type(on_token).__name__}")
        requests, stops = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids)
        events = self._events(requests, stops, t0)
        try:
            for event in events:
                if on_token is not None:
                    on_token(event.index, event.token_id)
        finally:
            events.close()  # on an error (a callback's too): free the cache now, not when collected
        return [self._result(r) for r in requests]

    def stream(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None,
               stop_token_ids: Sequence[int] | None = None) -> Iterator[TokenEvent]:
        """generate's requests as a stream of TokenEvents, in the order tokens are sampled. The
        arguments are checked now (ValueError); the work runs as the stream is consumed. Closing
        the stream early (or dropping it) frees the cache."""
        t0 = time.perf_counter()
        requests, stops = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids)
        return self._events(requests, stops, t0)

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """Text of `token_ids` (special tokens skipped where the tokenizer's decode takes
        skip_special_tokens), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(token_ids), **self._decode_kwargs)

    # the loop ----------------------------------------------------------------------------------
    def _hold(self) -> None:
        """Take the engine for one generate / stream / warmup (released by the caller); EngineBusyError while
        another holds it."""
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError("the engine is already generating (finish or close the other stream first)")

    def _events(self, requests: list[Request], stops: frozenset, t0: float) -> Iterator[TokenEvent]:
        self._hold()
        sched = None
        try:
            sched = Scheduler(self.cache, self.token_budget)  # may reset leftover streams: inside the try
            for r in requests:
                sched.add(r)
            while not sched.done:
                step = sched.plan()
                logits = self._prefill([Stream(c.request.slot, c.tokens) for c in step])
                sched.advance(step)
                rows = [k for k, c in enumerate(step) if c.sample]
                if not rows:  # only prompt chunks that are not their prompt's last
                    continue
                todo = [step[k].request for k in rows]
                index = torch.tensor(rows, device=logits.device)
                tokens = sample(logits.index_select(0, index), [r.params for r in todo],
                                [r.generator for r in todo]).tolist()
                now = time.perf_counter() - t0
                for r, token in zip(todo, tokens):
                    r.out.append(token)
                    if r.first_token_s is None:
                        r.first_token_s = now
                    reason = "stop" if token in stops else "length" if len(r.out) >= r.max_new else None
                    if reason:
                        sched.finish(r, reason)
                    yield TokenEvent(r.index, token, reason)
        finally:
            try:
                if sched is not None:
                    sched.release_all()
            finally:
                self._lock.release()

    def _prefill(self, streams: list[Stream]) -> torch.Tensor:
        if self.runner is not None:
            return self.runner.prefill(streams)
        return self.model.prefill(self.cache, streams)

    def _result(self, r: Request) -> GenerationResult:
        return GenerationResult(list(r.out), self.decode(r.out), r.finish_reason, len(r.prompt), r.first_token_s)

    # checking requests -------------------------------------------------------------------------
    def _requests(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids):
        """Requests from generate's arguments; ValueError naming the first bad one."""
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of prompts (each a list of token ids, a 1-D int tensor, "
                             f"or a string with a tokenizer), got {type(prompts).__name__}")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        params = check_params(temperature, top_k, top_p)
        seed = check_seed(seed)
        stops = self.stop_token_ids if stop_token_ids is None else self._check_stop_ids(stop_token_ids)
        ids_of = [self._prompt_ids(i, prompt) for i, prompt in enumerate(prompts)]
        check_token_ids(ids_of, self.model.config.vocab_size, what="prompt")
        requests = []
        for i, ids in enumerate(ids_of):
            ids = ids.tolist()
            if len(ids) >= self.max_context:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; max_context is {self.max_context} and a "
                                 f"prompt must leave room for at least one new token (at most {self.max_context - 1})")
            max_new = min(max_new_tokens, self.max_context - len(ids))
            r = Request(i, ids, max_new, params, None)
            need = -(-r.kv_tokens // self.cache.block_size)
            if need > self.cache.num_blocks:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + {max_new} new need {need} KV blocks; the "
                                 f"cache has {self.cache.num_blocks} (raise num_blocks or lower max_new_tokens)")
            requests.append(r)
        if not params.greedy:  # every check passed (on every rank alike): only now agree on a seed
            if seed is None and self.model.tp is not None:
                seed = self._shared_seed()
            for r in requests:
                r.generator = new_generator(None if seed is None else seed + r.index)
        return requests, stops

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
        elif prompt is None or isinstance(prompt, bytes) or not isinstance(prompt, (Sequence, torch.Tensor)):
            raise ValueError(f"prompt {i}: expected a list of token ids, a 1-D int tensor or a string, got "
                             f"{type(prompt).__name__}")
        return token_tensor(prompt, f"prompt {i}", self.model.device)

    def _check_stop_ids(self, stop_token_ids) -> frozenset:
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__}")
        vocab = self.model.config.vocab_size
        for t in stop_token_ids:
            if not _is_int(t):
                raise ValueError(f"stop token {t!r} must be an int, got {type(t).__name__}")
            if not 0 <= t < vocab:
                raise ValueError(f"stop token {t!r} is not a token id in [0, {vocab})")
        return frozenset(stop_token_ids)

    def __repr__(self) -> str:
        mode = "eager" if self.runner is None else "CUDA graphs" if self.runner.use_graphs else "compiled"
        return (f"Engine(slots={self.num_slots}, max_context={self.max_context}, token_budget={self.token_budget}, "
                f"{mode}, tokenizer={'yes' if self.tokenizer is not None else 'no'}, {self.cache})")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
