"""Continuous batching with chunked prefill: which streams go into each step (host side only).

Policy, one step at a time (each step is one call of the captured prefill step):

1. Decodes first: every running request whose prompt is fully prefilled feeds its last sampled
   token (a one-token stream), unless it has sampled its max_new tokens already (the engine loop may
   not have read the last of them yet: it runs one step ahead of its reads, loop.py). The token is
   the step's to read on the device: the chunk carries a placeholder id (DEVICE_TOKEN).
2. Then prompt chunks, first come first served, under what is left of the token budget: the
   requests already admitted whose prompt is partly prefilled, then waiting requests, admitted
   in arrival order while a slot is free and their worst-case KV blocks can be reserved. A
   prompt longer than what is left of the budget goes in this step's remainder and continues
   in the next steps (chunked prefill); only its last chunk's logits are sampled.
3. A finished request gives its slot back at once (cache.reset), so a waiting one can take it
   in the next step.

Admission is strict FIFO (a request that does not fit blocks the ones behind it, so none
starves). Its reservation is the KV blocks of everything it can ever feed: prompt + new tokens
- 1 (the last sampled token is never fed), the new tokens already capped by max_context. A
request is admitted only when the free blocks, minus what the running requests may still take,
hold its reservation, so a step never runs out of blocks.

With prefix caching (the cache keeps prefixes for later prompts, prefix_cache.py), an admitted request
starts from the longest cached prefix of its prompt (`restore`, given by the engine: its tokens count as
fed), and its prompt is fed in two parts: every token but the last, in chunks whose ends fall on
multiples of 64 tokens (the GDN chunk, so the state checkpoints a prompt leaves line up), then the last
token alone, sampled, in a later step; in between the engine keeps the state after all but the last
token (`keep`), so that the same prompt sent again restores all of it but its last token.

One scheduler lives as long as its engine and owns every slot of the engine's cache: the engine
holds the cache (HybridCache.hold) from the moment it builds it, so no stream gets into it from
outside (a prefill, a runner or a reset of another caller raises CacheInUseError) and every slot
it hands out is empty. Requests join (add) and leave (finish, abort, drop) between steps.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from .cache import HybridCache
from .sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """One request, from submission to its end: what the scheduler plans with (prompt, max_new, slot,
    fed, out) and what the engine loop samples, stops and delivers with."""
    index: int  # position in the caller's list of prompts (0 for submit)
    prompt: list[int]
    max_new: int  # already capped so that prompt + new tokens <= max_context
    params: SamplingParams
    generator: torch.Generator | None  # None: greedy
    stop_ids: frozenset = frozenset()
    text: object | None = None  # detokenizer.StreamingText when the request streams text
    channel: object | None = None  # handle.Channel its outputs go to
    request_id: int = -1
    submit_time: float = 0.0
    first_token_time: float | None = None
    slot: int | None = None
    fed: int = 0  # prompt tokens in the cache
    cached: int = 0  # of those, restored from the prefix cache
    sampled: int = 0  # tokens the steps planned so far sample (out, and those not read back yet)
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"; set when it ends
    error: BaseException | None = None  # what failed it
    # sampling: params.logprobs / prompt_logprobs set: the TokenLogprobs of each new token / of each prompt
    # token (None for the first) as they come, else None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    grammar: object | None = None  # structured output: its grammar.Grammar (the tokens it may sample), else None
    # speculative decoding (speculative/verify.py): whether it may speculate, the drafts its next decode verifies,
    # ("mtp") whether the head has followed it from its first position, ("ngram") its tokens for prompt lookup
    speculate: bool = True
    drafts: list[int] = field(default_factory=list)
    mtp_ok: bool = True
    slot_untrusted: bool = False  # a failed launch's reset of its slot raised: it keeps no prefix (loop_readback.py)
    history: object | None = field(default=None, repr=False)  # ("ngram") its proposers.TokenHistory
    decode: Chunk | None = field(default=None, repr=False)  # its decode chunk while it holds a slot (plan reuses it)

    @property
    def generated(self) -> int:
        """Tokens drawn for it before the step being sampled (sampling.SampleRow's field): the draws the scheduler
        planned (`sampled` counts this step's), not the tokens read back (`out`, a step behind with overlap)."""
        return self.sampled - 1

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def prefilled(self) -> bool:
        return self.fed == len(self.prompt)

    @property
    def kv_tokens(self) -> int:
        """The most tokens this request ever puts in its slot."""
        return len(self.prompt) + self.max_new - 1


DEVICE_TOKEN = [0]  # a decode chunk's tokens: a placeholder id; the step reads the slot's last sampled token


@dataclass
class Chunk:
    """One stream of a step: `tokens` for `request`'s slot; `sample`: its logits give a new token."""
    request: Request
    tokens: list[int]
    sample: bool


class Scheduler:
    def __init__(self, cache: HybridCache, token_budget: int, restore=None, keep=None):
        """restore(request) -> prompt tokens restored into its fresh slot (a request it failed is ended, its slot
        given back); keep(request): its slot's context kept for later prompts. Both given with prefix caching
        (module docstring), else None."""
        assert not any(cache.context_lens), "the scheduler starts on an empty cache (module docstring)"
        self.cache, self.token_budget = cache, token_budget
        self.restore, self.keep = restore, keep
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted (holding a slot), in admission order
        self.free_slots = list(range(cache.num_slots))
        self.on_release = None  # on_release(slot) after each slot's reset (a plan broadcast's journal, plan_journal.py)
        self.decodes = 0  # how many chunks of the last plan() are decodes (they come first)

    def blocks_for(self, request: Request) -> int:
        return -(-request.kv_tokens // self.cache.block_size)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def plan(self) -> list[Chunk]:
        """The next step's streams (decodes first, then prompt chunks); admits waiting requests."""
        step, prefilling = [], []
        for r in self.running:  # (one pass: a decode step of many requests is host work per request)
            if r.fed == len(r.prompt):  # (r.prefilled)
                if r.sampled < r.max_new:
                    step.append(r.decode or self._decode_chunk(r))
                    r.sampled += 1
            else:
                prefilling.append(r)
        self.decodes = len(step)  # <= slots <= budget
        budget = self.token_budget - self.decodes
        for r in prefilling:
            if budget <= 0:
                break
            budget -= self._chunk(r, budget, step)
        failed = False  # a request whose restore failed at admission (nothing of it in the step)
        while budget > 0 and self.waiting and self.free_slots and self._fits(self.waiting[0]) and self._worth(budget):
            r = self.waiting.popleft()
            r.slot = self.free_slots.pop(0)
            self.running.append(r)
            if self.restore is not None:
                r.fed = r.cached = self.restore(r)
                if r.ended:  # its restore failed: the engine failed it and gave its slot back
                    failed = True
                    continue
            budget -= self._chunk(r, budget, step)
        assert step or failed or any(r.sampled > len(r.out) for r in self.running), \
            "requests that fit no step (a request's KV blocks are checked against the cache at submit)"
        return step

    @staticmethod
    def _decode_chunk(r: Request) -> Chunk:
        r.decode = Chunk(r, DEVICE_TOKEN, True)  # (dropped when its slot is: _release)
        return r.decode

    def _worth(self, budget: int) -> bool:
        """With prefix caching a request is admitted with at least 64 tokens of budget (or its whole prompt)
        left: admitted with a handful, it would look its prefix up a step before the checkpoints of the
        prompts ahead of it exist. (A token budget below 64 asks for the whole budget: with nothing else in the
        step a request is always admitted.)"""
        return self.restore is None or budget >= min(64, len(self.waiting[0].prompt), self.token_budget)

    def _chunk(self, r: Request, budget: int, step: list[Chunk]) -> int:
        n = min(len(r.prompt) - r.fed, budget)
        if self.restore is not None and r.fed < len(r.prompt) - 1:  # prefix caching: all but the last token first
            n = min(n, len(r.prompt) - 1 - r.fed)
            end = (r.fed + n) // 64 * 64
            if r.fed + n < len(r.prompt) - 1 and end > r.fed:  # cut by the budget: end on a multiple of 64
                n = end - r.fed
        last = r.fed + n == len(r.prompt)
        step.append(Chunk(r, r.prompt[r.fed:r.fed + n], last))
        r.sampled += last
        return n

    def _fits(self, r: Request) -> bool:
        # what the running requests may still take: their reservations less the blocks their slots hold (a verify
        # step's slot may hold one past its context: its rejected drafts' positions, speculative/verify.py)
        held = self.cache.slot_blocks.blocks
        pending = sum(max(0, self.blocks_for(q) - len(held[q.slot])) for q in self.running)
        return self.blocks_for(r) <= self.cache.free_blocks - pending

    def advance(self, step: list[Chunk], decodes: int) -> None:
        """A step plan() gave (its first `decodes` chunks decodes) ran and its slots were committed: count the
        prompt tokens it fed."""
        for c in itertools.islice(step, decodes, None):  # its prompt chunks (the decodes feed no prompt)
            r = c.request
            r.fed += len(c.tokens)
            if self.keep is not None and r.fed == len(r.prompt) - 1:
                self.keep(r)  # the state after all but the last prompt token

    def finish(self, r: Request, reason: str) -> None:
        """End `r` (running or waiting) with `reason`: free its slot at once."""
        r.finish_reason = reason
        self.remove(r)

    def remove(self, r: Request) -> None:
        """Take `r` out of the waiting queue or the running set, its slot reset and given back; a no-op
        for a request the scheduler does not hold."""
        if r in self.running:
            self.running.remove(r)
            try:
                if self.keep is not None and r.error is None and not r.slot_untrusted:
                    self.keep(r)  # prompt + new tokens fed: the next turn of a conversation starts from them
            finally:
                self._release(r)
        elif r in self.waiting:
            self.waiting.remove(r)

    def release_all(self) -> list[Request]:
        """Forget every request and give every held slot back (the engine stops); returns the requests
        that were waiting or running. Best effort: a reset that fails (a cache left unusable by a
        failure, or one raising any BaseException) does not stop the others, nor keep the caller from ending the
        requests returned."""
        left = list(self.running) + list(self.waiting)
        self.waiting.clear()
        while self.running:
            try:
                self._release(self.running.pop())
            except BaseException:  # (the loop's end: its requests must still be ended, whatever a reset raised)
                pass
        return left

    def _release(self, r: Request) -> None:
        slot, r.slot, r.decode = r.slot, None, None
        try:
            self.cache.reset(slot)
        finally:
            self.free_slots.append(slot)
            self.free_slots.sort()
            if self.on_release is not None:
                self.on_release(slot)
