"""The read-back: what a launched step's sampling gives the host, and each token taken into its request.

A step's sampled tokens (and the logprobs asked for) are copied to host memory behind the step (`_to_host`: a
CUDA event after the copies; two pinned buffers for the tokens in turn). With overlap (loop.py) the loop reads
step N back after it has launched N + 1: `_finish` waits for N's event, commits N (if not yet) and N + 1 (the
slots' contexts advance once the host knows the tokens they read on the device), then takes each token into its
request (`_advance`: stop tokens, length, the grammar, stop strings, text) and delivers the step's outputs
together. A request that ended at N was already in N + 1: its token there is dropped. A failure fails its
requests (`_fail`), never the loop.

`LoopReadBack` is EngineLoop's base class: its state is EngineLoop's, made in EngineLoop.__init__ (`_inflight`,
the host buffers `_host_tokens` / `_flip`, the scheduler, the counters `_steps`, `_prompt_tokens`,
`_generated`, and under a plan broadcast rank 0's cache `journal`, which each commit goes into: plan_journal.py).
speculative/verify.py calls `_advance` and `_fail` for the tokens of its steps.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .handle import Failure, RequestOutput, deliver
from .logprobs import DeviceLogprobs
from .scheduler import Request

_new_output = tuple.__new__  # RequestOutput's six fields, built as a plain tuple (_advance)
assert len(RequestOutput._fields) == 6

@dataclass
class _HostCopy:
    """What a step's sampling gives the host, in host memory once `ready`: the tokens of its sampling rows, the
    logprobs of the rows that ask (row indices, each row's top N), and the prompt logprobs of its prompt chunks
    that ask (prompt_logprobs.PromptPiece, their logprobs on the host)."""
    tokens: torch.Tensor | None
    logprob_rows: list
    top_n: list
    logprobs: DeviceLogprobs | None
    pieces: list

    def read(self) -> tuple[list[int], list]:
        """The tokens, and each row's TokenLogprobs (None for a row that did not ask)."""
        tokens = self.tokens.tolist() if self.tokens is not None else []
        entries = [None] * len(tokens)
        if self.logprobs is not None:
            for k, entry in zip(self.logprob_rows, self.logprobs.to_host(self.top_n)):
                entries[k] = entry
        return tokens, entries


@dataclass
class Launched:
    """A step launched and not read back yet."""
    step: list  # its chunks (scheduler.Chunk), decodes first
    decodes: int  # how many of them are decodes (their token read on the device)
    sampled: list  # the requests whose rows sampled, in row order
    host: _HostCopy  # their tokens (and logprobs), copied to the host behind the step
    ready: object  # a CUDA event recorded after those copies (None on the CPU)
    commit: Callable[[list[int]], None]  # PrefillCall.launch's commit
    prompt_tokens: int
    grammars: bool = False  # a sampled request has a grammar: read it back before the next plan
    committed: bool = False


class LoopReadBack:
    """EngineLoop's read-back of its launched steps (the module docstring)."""

    _undelivered: dict | None = None  # a step's outputs by channel while they are made, until deliver() puts them

    def _to_host(self, result, pieces: list) -> tuple[_HostCopy, object]:
        """(_HostCopy, event): a step's sampling result (sampling.SampleResult, or None) and prompt logprobs
        (pieces) copied to host memory behind the step, and the CUDA event after the copies (None on the CPU,
        where they are host memory already). The tokens go to one of two pinned buffers in turn (step N + 1's
        copy must not overwrite N's before it is read); the logprobs, which few requests ask for, to pinned
        memory torch's non-blocking copy allocates."""
        if result is None:
            host = _HostCopy(None, [], [], None, pieces)
        else:
            host = _HostCopy(result.tokens, result.logprob_rows, result.top_n, result.logprobs, pieces)
        if self.cache.device.type != "cuda":
            return host, None
        if host.tokens is not None:
            buf = self._host_tokens[self._flip][:host.tokens.numel()]
            self._flip ^= 1
            host.tokens = buf.copy_(host.tokens, non_blocking=True)
        to_cpu = lambda lp: DeviceLogprobs(*(t.to("cpu", non_blocking=True) for t in lp))  # noqa: E731
        if host.logprobs is not None:
            host.logprobs = to_cpu(host.logprobs)
        host.pieces = [piece._replace(logprobs=to_cpu(piece.logprobs)) for piece in pieces]
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _read_back(self) -> None:
        """Read the step in flight back (nothing launched after it)."""
        previous, self._inflight = self._inflight, None
        self._finish(previous, None)

    def _finish(self, done: Launched, launched: Launched | None) -> None:
        """Read `done`'s tokens back and take them into their requests (stop checks, text, outputs). Each step
        is committed once the host knows the tokens it read on the device: `done` (without overlap) before
        its own tokens are taken in, `launched` (the step after it, which read them) after."""
        try:
            if done.ready is not None:
                done.ready.synchronize()
            tokens, logprobs = done.host.read()
            for piece in done.host.pieces:  # (before the first token's output, which carries them)
                piece.request.prompt_logprobs.extend(piece.to_host())
        except BaseException as e:  # the device failed: neither step's tokens can be trusted
            for c in done.step + (launched.step if launched is not None else []):
                self._fail(c.request, e)
            return
        if not done.committed:
            self._commit(done)
        for r, t in zip(done.sampled, tokens):
            if r.finish_reason is None and r.error is None:  # (not r.ended, without a property call per request)
                r.out.append(t)
        if launched is not None:
            self._commit(launched)
        self._steps += 1
        self._prompt_tokens += done.prompt_tokens
        # one pass over the step's requests, the cheapest per request that it can be (a decode step of many streams
        # is host work per request): outputs grouped by channel, the channel's list looked up only when it changes
        now, outputs, channel, items, skipped = time.perf_counter(), {}, None, None, 0
        self._undelivered = outputs  # (should the loop die before deliver: its end delivers them)
        advance = self._advance
        for r, token, entry in zip(done.sampled, tokens, logprobs):
            if r.finish_reason is not None or r.error is not None:  # (r.ended) it stopped at the step before (this
                skipped += 1  # token is one past its stop), or failed
                continue
            try:
                # _advance inlined for the usual token (the request goes on, has had its first token, and asks for
                # no logprobs, grammar or text): the same output, without a call per request
                out = r.out
                if (entry is None and r.first_token_time is not None and r.grammar is None and r.text is None
                        and len(out) < r.max_new and token not in r.stop_ids):
                    output = _new_output(RequestOutput, (r.index, [token], None, None, None,
                                                         r.prompt_logprobs if len(out) == 1 else None))
                else:
                    output = advance(r, token, now, entry)
            except BaseException as e:  # the tokenizer, its slot's reset or prefix save failed: only r sees it
                self._fail(r, e, flush=False)
                continue
            if r.channel is not channel:
                channel = r.channel
                items = outputs.setdefault(channel, [])
            items.append(output)
        self._generated += len(done.sampled) - skipped
        deliver(outputs)  # the step's outputs together: one wakeup per consumer, not one per token
        self._undelivered = None

    def _flush_undelivered(self) -> None:
        """Deliver what a step cut short by a failure had made (best effort): a request it ended (its slot freed,
        out of the scheduler) gets its last output, so no consumer waits for it forever."""
        outputs, self._undelivered = self._undelivered, None
        if outputs:  # (none when no step was cut short)
            with contextlib.suppress(Exception):
                deliver(outputs)

    def _commit(self, launched: Launched) -> None:
        """Advance `launched`'s slots: its decodes read the last token each request has taken in."""
        step = launched.step
        try:
            k = launched.decodes  # (the ids label the blocks they fill: prefix caching's only)
            ids = [c.request.out[-1] if c.request.out else 0 for c in step[:k]] if self.cache.prefix_caching else [0] * k
            if self.journal is not None:  # (a plan broadcast's followers commit the step with these ids)
                self.journal.commit(ids)
            launched.commit(ids)
            launched.committed = True
            self.scheduler.advance(step, launched.decodes)
        except BaseException as e:
            for c in step:
                self._fail(c.request, e)

    def _advance(self, r: Request, token: int, now: float, logprobs=None) -> RequestOutput:
        """Take `token` (already in r.out; and its TokenLogprobs, when r asks for them) into `r`: its output; an
        ending request is finished (its slot freed) first. The first output carries the prompt's logprobs, when r
        asks."""
        if logprobs is not None:
            r.logprobs.append(logprobs)
        if r.first_token_time is None:
            r.first_token_time = now
        out = r.out
        reason = "stop" if token in r.stop_ids else "length" if len(out) >= r.max_new else None
        if r.grammar is not None:
            r.grammar.accept(token)  # (a token it does not allow fails the request)
            if reason is None and r.grammar.complete:
                reason = "stop"
        text = None
        if r.text is not None:
            text, stopped = r.text.add([token], final=reason is not None)
            reason = "stop" if stopped else reason
        if reason is not None:
            self.scheduler.remove(r)  # the slot is free before the consumer sees the last output
            r.finish_reason = reason
        # (tuple.__new__: a NamedTuple's own __new__ is a Python function, a third of this method's time)
        return _new_output(RequestOutput, (r.index, [token], text, reason, None if logprobs is None else [logprobs],
                                           r.prompt_logprobs if len(out) == 1 else None))

    def _fail_step(self, step: list, error: BaseException) -> None:
        """`step`'s requests fail with `error`, raised while it was planned, after the step in flight has delivered."""
        if self._inflight is not None:
            self._read_back()
        for c in step:
            self._fail(c.request, error)

    def _reset_failed_launch(self, requests: list[Request], error: BaseException) -> None:
        """A launch that failed with `error`: after its step ran (its sampling) its requests' slots hold its tokens,
        never committed. Each slot is reset before the step before is delivered (a request ending there keeps its
        slot's context as a prefix: nothing of its turn then, never that state), each on its own: a reset that raises
        (anything: the loop goes on) leaves the others' to be done. Its request's slot cannot be trusted: it keeps no
        prefix when it ends (Request.slot_untrusted), and it ends as the step before leaves it: "stop" / "length"
        if it stopped there (its output complete), else the caller fails it with `error`, as the others."""
        for r in requests:
            slot = r.slot
            try:
                self.cache.reset(slot)
            except BaseException:  # (a cache the failure broke refuses every later call: cache_ownership.py)
                r.slot_untrusted = True  # (its release resets it again: scheduler.remove)
                continue
            if self.journal is not None:  # (the release journals its own)
                self.journal.reset(slot)

    def _fail(self, r: Request, error: BaseException, flush: bool = True) -> None:
        """End r with `error` (a no-op once it has ended). flush: first deliver the outputs of a step cut short
        (requests it ended must still see their last output); False from inside the loops that make them."""
        if flush:
            self._flush_undelivered()
        if r.ended:
            return
        r.error = error
        with contextlib.suppress(BaseException):  # a reset of a cache the failure broke: the error says enough
            self.scheduler.remove(r)
        r.channel.put(Failure(r.index, error))

