"""The engine loop: the one thread that steps an Engine's model.

    loop = EngineLoop(model, runner, cache, token, token_budget)
    loop.submit(requests)      # from any thread: they join the running batch at the next step
    loop.abort(requests)       # from any thread: freed at the next step
    loop.run_job(fn)           # from any thread: fn runs in the loop between two steps (warmup)
    loop.close(error)          # outstanding requests end with `error`; the thread ends

Each iteration takes what other threads handed in (new requests, aborts, jobs; under one lock,
so requests submitted together join together), then launches one step: Scheduler.plan picks the
streams (scheduler.py has the policy), the step runs once (GraphRunner.launch, or the eager
model step with compile=False) and `sample` draws every sampling row's next token on the device.

The loop runs one step ahead of what it reads back (overlap, the default; vLLM's async scheduling,
SGLang's overlap scheduler). A step's sampled tokens stay on the device, in `last_tokens[slot]`,
which the next step's decode streams read there; the loop launches step N+1 and only then waits
for step N's tokens, so the host's work for N+1 (planning, packing, the graph launch) and for N
(stop checks, text, delivery) runs while the device computes. In order, each iteration:

    plan N+1, launch N+1 (it reads N's tokens on the device)
    wait for N's tokens; commit N+1 (the slots' contexts; prefix caching labels blocks with the ids)
    N's stop checks, text, outputs (a request that ends frees its slot)

A request that stops at N (a stop token, a stop string) was already in N+1: that step's token for
it is dropped, never emitted nor counted, and its slot is reset behind N+1 on the device's stream.
Stops the host can foresee (max_new_tokens) are never overrun: a request is planned only while it
has tokens left to sample. Each sampled request draws from its own generator once per step it
samples in, so the streams are the ones of a loop without overlap (`overlap=False`: each step read
back before the next is planned), token for token.

Structured output (grammar.py): a request with a grammar samples under a token bitmask that allows what its
grammar allows after the tokens it has taken in, so its next step's mask needs this step's token on the host.
A step in flight that sampled such a request is therefore read back before the next step is planned: while
any request with a grammar runs, steps do not overlap (the others' steps keep overlapping). The mask is filled
on the host after the next step is launched, while the device runs it, and applied in `sample` on the device.
Each token read back advances its request's grammar; one it does not allow fails the request, and a request
without stop tokens ends ("stop") when its output is complete.

Speculative decoding (Engine(speculative=...), speculative/verify.py): a plan holding a request that speculates,
and no more decodes than the option's max_streams, reads the step in flight back first, then runs as a
speculative step (drafts verified in one step, accept counts read back, the accepted tokens delivered in order)
when it holds drafts to verify (for "mtp": any chunk of a request the head follows); otherwise it launches as
above. While such requests run in steps of at most max_streams decodes, steps do not overlap.

Each request's output goes to its channel (handle.py), never waiting for a consumer. A request
that ends frees its slot before its last output is delivered, so whoever sees that output finds the
slot free.

The thread runs inside `cache.acting_for(token)`: the engine holds its cache with that token, so
the loop alone may use it. A step that raises (an op error, out of memory) fails the requests of
that step with that exception (the cache transaction has reset their slots; the scheduler frees
them) and the loop goes on with the others. When the loop ends, by close() or by an error of its
own, every request still outstanding ends with an error: no consumer waits for ever.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .batch import Stream
from .grammar import TokenMasks
from .handle import EngineClosedError, EngineFullError, Failure, RequestOutput, deliver, wait_for
from .logits_processors import PenaltyState
from .logprobs import DeviceLogprobs
from .numbers import int_tensor, to_device
from .prompt_logprobs import prefill_step
from .protocol import prefill_call, restore_prefix
from .plan_sync import IDLE, IDLE_SYNC_S, SHUTDOWN, STEP, WARMUP, PlanBroadcast
from .sampling import sample
from .scheduler import Request, Scheduler


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine loop (Engine.stats())."""
    running: int  # requests holding a slot
    waiting: int  # requests submitted, not yet admitted
    num_slots: int
    used_blocks: int  # KV blocks held by running requests
    num_blocks: int
    steps: int  # steps run so far
    prompt_tokens: int  # prompt tokens fed so far
    generated_tokens: int  # new tokens sampled so far
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead (prefix caching)
    prefix: dict | None = None  # the cache's prefix-caching counters (HybridCache.prefix_stats), or None
    mask_rows: int = 0  # structured output: token masks filled so far (one per grammar request and step)
    mask_fill_s: float = 0.0  # host seconds spent filling them
    speculative: dict | None = None  # speculative decoding: method, num_tokens, proposed, accepted, drafts, steps


class _Job:
    def __init__(self, fn: Callable[[], object], warmup: bool):
        self.fn, self.warmup = fn, warmup
        self.done, self.finished = threading.Condition(threading.Lock()), False
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:
            self.error = e
        finally:
            self.end()

    def end(self, error: BaseException | None = None) -> None:
        with self.done:
            self.error = self.error or error
            self.finished = True
            self.done.notify_all()


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
class _Launched:
    """A step launched and not read back yet."""
    step: list  # its chunks (scheduler.Chunk), decodes first
    decodes: int  # how many of them are decodes (their token read on the device)
    sampled: list  # the requests whose rows sampled, in row order
    host: "_HostCopy"  # their tokens (and logprobs), copied to the host behind the step
    ready: object  # a CUDA event recorded after those copies (None on the CPU)
    commit: Callable[[list[int]], None]  # PrefillCall.launch's commit
    prompt_tokens: int
    grammars: bool = False  # a sampled request has a grammar: read it back before the next plan
    committed: bool = False


class EngineLoop:
    def __init__(self, model, runner, cache, token: object, token_budget: int,
                 broadcast: PlanBroadcast | None = None, overlap: bool = True, speculative=None):
        self.model, self.runner, self.cache, self._token = model, runner, cache, token
        self._model_version = model.version
        prefix = cache.prefix_caching
        self.scheduler = Scheduler(cache, token_budget, self._restore if prefix else None,
                                   self._keep if prefix else None)
        self._broadcast = broadcast
        self.overlap = overlap
        dev = cache.device
        with torch.inference_mode(False):
            # the last token each slot sampled (scratch slot included), which its next decode reads on the device
            self.last_tokens = torch.zeros(cache.num_slots + 1, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        # two host buffers for the sampled tokens' copies: step N + 1's copy must not overwrite N's before it is read
        self._host_tokens = [torch.zeros(cache.num_slots, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self._inflight: _Launched | None = None  # the step launched and not read back yet (overlap)
        self.penalties = PenaltyState(cache.num_slots, model.config.vocab_size, model.device)  # sampling's
        self.masks: TokenMasks | None = None  # structured output's bitmask, made for the first grammar
        self._cond = threading.Condition(threading.Lock())
        self._inbox: list[Request] = []
        self._aborts: collections.deque[Request] = collections.deque()  # appended without the lock (abort())
        self._jobs: list[_Job] = []
        self._closing: BaseException | None = None  # set by close(): what outstanding requests end with
        self._draining: BaseException | None = None  # set by drain(): what new requests are refused with
        self._thread: threading.Thread | None = None
        self._scheduled_waiting = 0  # len(scheduler.waiting) and len(scheduler.free_slots), kept under the
        self._free_slots = len(self.scheduler.free_slots)  # lock for other threads (_publish_queue)
        self._steps = self._prompt_tokens = self._generated = self._cached = 0
        self.spec = None  # speculative decoding's step (speculative/verify.py), with Engine(speculative=...)
        if speculative is not None:
            from .speculative.verify import SpeculativeStep

            self.spec = SpeculativeStep(self, speculative)

    # other threads ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closing is not None

    def submit(self, requests: list[Request], max_waiting: int | None = None) -> None:
        """Hand `requests` to the loop, all in one iteration, in order. EngineClosedError once closed (or
        shutting down); with max_waiting, EngineFullError if they would make more than that many wait (requests
        not in a slot yet, beyond the slots free now)."""
        with self._cond:
            if self._closing is not None or self._draining is not None:
                raise EngineClosedError(f"{self._closing or self._draining}: build a new Engine")
            # what would wait: the requests not yet in a slot, less the slots free for them
            if (max_waiting is not None
                    and len(self._inbox) + self._scheduled_waiting + len(requests) - self._free_slots > max_waiting):
                raise EngineFullError(f"the engine's waiting queue is full ({max_waiting} requests wait for a "
                                      "slot): try again later")
            now = time.perf_counter()
            for r in requests:
                r.submit_time = now
            self._inbox.extend(requests)
            self._start()
            self._cond.notify()

    def abort(self, requests: list[Request]) -> None:
        """End `requests` at the next iteration. Takes no lock in the loop thread: a stream the garbage
        collector finalizes there aborts its requests while the loop may hold its lock."""
        self._aborts.extend(requests)  # atomic
        if not self.is_loop_thread():
            with self._cond:
                self._cond.notify()

    def run_job(self, fn: Callable[[], object], warmup: bool = False):
        """Run fn() in the loop thread between two steps and return its result (or raise its error).
        warmup: fn compiles / captures the runner's buckets, which followers of a plan broadcast mirror."""
        job = _Job(fn, warmup)
        with self._cond:
            if self._closing is not None:
                raise EngineClosedError(f"{self._closing}: build a new Engine")
            self._jobs.append(job)
            self._start()
            self._cond.notify()
        with job.done:
            wait_for(job.done, lambda: job.finished, None)
        if job.error is not None:
            raise job.error
        return job.result

    def drain(self, wait_s: float) -> None:
        """Refuse new requests (EngineClosedError) and wait up to `wait_s` seconds for the outstanding ones
        to end."""
        with self._cond:
            if self._draining is None:
                self._draining = EngineClosedError("the engine is shutting down")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            with self._cond:
                if not (self._inbox or self._scheduled_waiting or self.scheduler.running):
                    return
            time.sleep(0.01)

    def close(self, error: BaseException | None = None, timeout: float | None = None) -> bool:
        """Stop the loop: requests still outstanding end with `error` (default EngineClosedError), the thread
        ends after the step it is running and releases the cache. Waits up to `timeout` seconds for it
        (None: until it ends); returns whether it has ended."""
        error = error or EngineClosedError("the engine was shut down")
        if self.is_loop_thread():  # the engine collected by the garbage collector in this thread, which may
            self._closing = self._closing or error  # hold the lock: the next iteration sees it
            return False
        with self._cond:
            self._closing = self._closing or error
            thread = self._thread
            self._cond.notify()
        if thread is None:  # never started: nothing was handed in
            self.cache.release(self._token)
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def stats(self) -> EngineStats:
        with self._cond:
            s, cache = self.scheduler, self.cache
            masks = self.masks
            return EngineStats(len(s.running), len(self._inbox) + self._scheduled_waiting, cache.num_slots,
                               cache.num_blocks - cache.free_blocks, cache.num_blocks, self._steps,
                               self._prompt_tokens, self._generated, self._cached,
                               cache.prefix_stats() if cache.prefix_caching else None,
                               masks.filled if masks else 0, masks.fill_s if masks else 0.0,
                               self.spec.stats() if self.spec is not None else None)

    def is_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _start(self) -> None:  # under the lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metrale-engine-loop", daemon=True)
            self._thread.start()

    # the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        error = None
        with torch.no_grad(), self.cache.acting_for(self._token), self._on_device():
            try:
                while self._iterate():
                    pass
            except BaseException as e:  # a bug of the loop itself: it cannot go on
                error = e
            finally:
                with self._cond:
                    if self._closing is None:
                        self._closing = EngineClosedError(f"the engine loop stopped ({type(error).__name__}: "
                                                          f"{error})")
                        self._closing.__cause__ = error
                self._finish_outstanding(self.scheduler.release_all())
                if self._broadcast is not None:
                    with contextlib.suppress(Exception):  # the process group may be gone at exit
                        self._broadcast.send(SHUTDOWN)
        with contextlib.suppress(Exception):  # (another thread's hold() attempt at this very moment)
            self.cache.release(self._token)

    def _has_work(self) -> bool:  # under the lock
        return bool(self._inbox or self._aborts or self._jobs or self._closing or not self.scheduler.done)

    def _iterate(self) -> bool:
        """One iteration; False once the loop is closed."""
        sched = self.scheduler
        while True:
            with self._cond:
                if self._cond.wait_for(self._has_work, IDLE_SYNC_S if self._broadcast is not None else None):
                    new, self._inbox = self._inbox, []
                    aborts = [self._aborts.popleft() for _ in range(len(self._aborts))]
                    jobs, self._jobs = self._jobs, []
                    closing = self._closing
                    sched.waiting.extend(new)
                    self._publish_queue()
                    break
            self._broadcast.send(IDLE)  # nothing to run: keep the followers' broadcast alive
        if (aborts or jobs or closing is not None) and self._inflight is not None:
            self._read_back()  # aborts, jobs and the end see every launched step read back
        for r in aborts:
            if not r.ended:
                try:
                    self.scheduler.remove(r)
                except Exception as e:  # the reset of its slot failed (a cache a failure broke)
                    self._fail(r, e)
                    continue
                r.finish_reason = "abort"
                r.channel.put(RequestOutput(r.index, [], "" if r.text is not None else None, "abort"))
        if aborts:  # waiting requests may have left: submit's max_waiting counts them (no step may follow)
            with self._cond:
                self._publish_queue()
        for job in jobs:  # between steps: a capture never runs while a step does
            if job.warmup and self._broadcast is not None:
                self._broadcast.send(WARMUP, resets=self._take_released())
            job.run()
        if closing is not None:
            return False
        if not sched.done:
            self._step()
        return True

    def _publish_queue(self) -> None:
        """What submit() reads of the scheduler, copied for other threads (the caller holds the lock)."""
        self._scheduled_waiting = len(self.scheduler.waiting)
        self._free_slots = len(self.scheduler.free_slots)

    def _step(self) -> None:
        sched = self.scheduler
        if self._inflight is not None and self._inflight.grammars:
            self._read_back()  # its tokens advance the grammars the next step's masks need (module docstring)
            if sched.done:
                return
        step = sched.plan()
        with self._cond:
            self._publish_queue()
        if self.spec is not None and step:
            if self.spec.may_take(step, sched.decodes):
                step = self._speculate(step)
            else:  # the loop's own step: drafts made for it are dropped ("mtp": the head stops following)
                self.spec.normal(step)
        launched, error = self._launch(step, sched.decodes) if step else (None, None)
        previous, self._inflight = self._inflight, None
        if previous is not None:  # (overlap only)
            self._finish(previous, launched)
        if error is not None:  # after the step before has delivered its tokens, as without overlap
            for c in step:
                self._fail(c.request, error)
        elif launched is not None and not self.overlap:
            self._finish(launched, None)
        elif launched is not None:
            if previous is None:  # nothing was in flight: the tokens it read are all read back
                self._commit(launched)
            if launched.committed:
                self._inflight = launched

    def _speculate(self, step: list) -> list:
        """Speculative decoding (speculative/verify.py): read the step in flight back (its tokens are the decodes'
        last ones; a request it ended leaves `step`), then run `step` as a speculative step if it takes it:
        returns then what is left for the loop's own launch (prompt chunks asking for prompt logprobs), else the
        whole step (the head, "mtp", did not see it)."""
        sched = self.scheduler
        if self._inflight is not None:
            self._read_back()
            decodes = sum(1 for c in step[:sched.decodes] if not c.request.ended)
            step = [c for c in step if not c.request.ended]
            sched.decodes = decodes
        # prompt chunks asking for prompt logprobs take the loop's own step (prompt_logprobs.py), launched after
        rest = [c for c in step[sched.decodes:] if c.request.params.prompt_logprobs is not None]
        mine = [c for c in step if all(c is not x for x in rest)]
        if mine and self.spec.takes(mine, sched.decodes):
            try:
                self.spec.run(mine, sched.decodes)
            except BaseException as e:  # KeyboardInterrupt included: only this step's requests see it
                for c in mine:
                    self._fail(c.request, e)
            sched.decodes = 0
            return rest
        self.spec.normal(step)
        return step

    def _launch(self, step: list, decodes: int) -> tuple[_Launched | None, BaseException | None]:
        """Run `step` (its first `decodes` chunks decodes, which read their token on the device) and sample its
        sampling rows on the device; their tokens are copied to the host behind it. (launched, None), or
        (None, the error) if it failed: the caller fails its requests."""
        streams = [Stream(c.request.slot, c.tokens) for c in step]
        prompts = step[decodes:]
        try:
            if self._broadcast is not None:
                self._broadcast.send(STEP, streams, self._take_released(), decodes, [k for k, c in enumerate(step)
                                                                                   if c.sample])
            # the prompt chunks of requests asking for prompt logprobs run apart (prompt_logprobs.py)
            logits, commit, pieces = prefill_step(self.launch, self.model, self.cache, step, streams, decodes)
            rows = None if all(c.sample for c in prompts) else [k for k, c in enumerate(step) if c.sample]
            todo = [c.request for c in step] if rows is None else [step[k].request for k in rows]
            result = None
            if todo:
                if rows is not None:  # (else every row samples, as in a decode step: no gather)
                    logits = logits.index_select(0, to_device(int_tensor(rows), logits.device))
                # (filled on the host while the device runs the step launched above)
                result = sample(logits, todo, self.penalties, self._token_masks(todo))
                self._share(result.tokens)
                self.last_tokens.index_copy_(0, to_device(int_tensor([r.slot for r in todo]), logits.device),
                                             result.tokens)
            host, ready = self._to_host(result, pieces)
        except BaseException as e:  # KeyboardInterrupt included: only this step's requests see it
            return None, e
        return _Launched(step, decodes, todo, host, ready, commit, sum(len(c.tokens) for c in prompts),
                         any(r.grammar is not None for r in todo)), None

    def _token_masks(self, requests: list[Request]) -> torch.Tensor | None:
        """The bitmask of the sampling rows `requests` (grammar.TokenMasks), or None when none has a grammar."""
        if all(r.grammar is None for r in requests):
            return None
        if self.masks is None:
            self.masks = TokenMasks(self.cache.num_slots, self.model.config.vocab_size, self.cache.device)
        return self.masks.fill(requests)

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

    def _share(self, sampled: torch.Tensor) -> None:
        """With a plan broadcast: the sampled tokens go to every rank (followers read them on the device)."""
        if self._broadcast is not None:
            self._broadcast.share_tokens(sampled)

    def _read_back(self) -> None:
        """Read the step in flight back (nothing launched after it)."""
        previous, self._inflight = self._inflight, None
        self._finish(previous, None)

    def _finish(self, done: _Launched, launched: _Launched | None) -> None:
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
            if not r.ended:
                r.out.append(t)
        if launched is not None:
            self._commit(launched)
        self._steps += 1
        self._prompt_tokens += done.prompt_tokens
        now, outputs = time.perf_counter(), {}
        for r, token, entry in zip(done.sampled, tokens, logprobs):
            if r.ended:  # it stopped at the step before (this token is one past its stop), or failed
                continue
            self._generated += 1
            try:
                output = self._advance(r, token, now, entry)
            except Exception as e:  # the tokenizer failed on its tokens, or its slot's reset did
                self._fail(r, e)
            else:
                outputs.setdefault(r.channel, []).append(output)
        deliver(outputs)  # the step's outputs together: one wakeup per consumer, not one per token

    def _commit(self, launched: _Launched) -> None:
        """Advance `launched`'s slots: its decodes read the last token each request has taken in."""
        step = launched.step
        try:
            launched.commit([c.request.out[-1] if c.request.out else 0 for c in step[:launched.decodes]])
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
        reason = "stop" if token in r.stop_ids else "length" if len(r.out) >= r.max_new else None
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
        return RequestOutput(r.index, [token], text, reason, None if logprobs is None else [logprobs],
                             r.prompt_logprobs if len(r.out) == 1 else None)

    def launch(self, streams: list[Stream], decodes: int):
        """One step: (logits [len(streams), vocab] of each stream's last token, commit) (PrefillCall.launch);
        the first `decodes` streams read their token from last_tokens."""
        if self.model.version != self._model_version:
            raise ValueError("the model was converted or moved (model.to / .half / ...) after this Engine was built: "
                             "its cache and compiled step hold the old dtype and device: build a new Engine")
        if self.runner is not None:
            return self.runner.launch(streams, self.last_tokens, decodes)
        with prefill_call(self.model, self.cache, streams) as call:
            return call.launch(lambda batch: self.model.forward_packed(self.cache, batch), self.last_tokens, decodes)

    def follow_step(self, streams: list[Stream], decodes: int, sampling: list[int]) -> None:
        """A follower of a plan broadcast: run rank 0's step and take its sampled tokens (rows `sampling`)."""
        _, commit = self.launch(streams, decodes)
        commit([0] * decodes)  # (no prefix caching under a plan broadcast: the ids are not needed)
        if sampling:
            tokens = self._broadcast.receive_tokens(len(sampling))
            slots = to_device(int_tensor([streams[k].slot for k in sampling]), tokens.device)
            self.last_tokens.index_copy_(0, slots, tokens)

    def _restore(self, r: Request) -> int:
        """Prefix caching: start r's fresh slot from the longest cached prefix of its prompt (none when r asks
        for prompt logprobs: a restored prefix has no logits)."""
        if r.params.prompt_logprobs is not None:
            return 0
        n = restore_prefix(self.model, self.cache, r.slot, r.prompt)
        self._cached += n
        return n

    def _keep(self, r: Request) -> None:
        """Prefix caching: keep r's slot's context (all its fed tokens) for later prompts."""
        self.cache.save_prefix(r.slot)

    def _fail(self, r: Request, error: BaseException) -> None:
        if r.ended:
            return
        r.error = error
        with contextlib.suppress(Exception):  # a reset of a cache the failure broke: the error says enough
            self.scheduler.remove(r)
        r.channel.put(Failure(r.index, error))

    def _take_released(self) -> list[int]:
        released, self.scheduler.released = self.scheduler.released, []
        return released

    def _finish_outstanding(self, requests: list[Request]) -> None:
        """End every request handed in or scheduled and not ended yet with the closing error."""
        with self._cond:
            requests = requests + self._inbox
            self._inbox, jobs, self._jobs = [], self._jobs, []
            error = self._closing
        for r in requests:
            if not r.ended:
                r.error = error
                r.channel.put(Failure(r.index, error))
        for job in jobs:
            job.end(error)

    @contextlib.contextmanager
    def _on_device(self):
        """CUDA's current device is per thread: the loop's must be the model's (kernels launch on it)."""
        device = self.model.device
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield
