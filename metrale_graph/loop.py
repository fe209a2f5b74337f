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
without end tokens (grammar.py) ends ("stop") when its output is complete.

Speculative decoding (Engine(speculative=...), speculative/verify.py): a plan holding a request that speculates,
and no more decodes than the option's max_streams (for "ngram": and a decode whose prompt lookup over the tokens
on the host proposes drafts, SpeculativeStep.worth_reading_back), reads the step in flight back first, then runs as a
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

The loop's code is in three modules, one job each: this one (EngineLoop: the thread, each iteration's intake,
plan and launch), loop_intake.py (LoopIntake: what other threads call, the stats they read) and loop_readback.py
(LoopReadBack: a launched step's tokens read back and taken into their requests: stop checks, text, outputs).
"""

from __future__ import annotations

import collections
import contextlib
import threading

import torch

from .batch import Stream
from .grammar import TokenMasks
from .handle import EngineClosedError, RequestOutput
from .logits_processors import PenaltyState
from .loop_intake import EngineStats, Job, LoopIntake
from .loop_readback import Launched, LoopReadBack
from .numbers import int_tensor, to_device
from .prompt_logprobs import prefill_step, run_scored, scored_chunks
from .protocol import prefill_call, restore_prefix
from .plan_journal import CacheJournal, JournalReplay, cache_state
from .plan_sync import DRAFT, IDLE, IDLE_SYNC_S, SHUTDOWN, SPECULATE, STEP, WARMUP, PlanBroadcast
from .sampling import sample
from .scheduler import DEVICE_TOKEN, Request, Scheduler

__all__ = ["EngineLoop", "EngineStats"]


class EngineLoop(LoopIntake, LoopReadBack):
    def __init__(self, model, runner, cache, token: object, token_budget: int,
                 broadcast: PlanBroadcast | None = None, overlap: bool = True, speculative=None):
        self.model, self.runner, self.cache, self._token = model, runner, cache, token
        self._model_version = model.version
        prefix = cache.prefix_caching
        self.scheduler = Scheduler(cache, token_budget, self._restore if prefix else None,
                                   self._keep if prefix else None)
        self._broadcast = broadcast
        # a plan broadcast's cache journal (plan_journal.py): rank 0 writes it, the other ranks replay it
        self.journal = self.replay = None
        if broadcast is not None and broadcast.leader:
            self.journal = CacheJournal(prefix)
            if prefix:
                cache.prefixes.on_lookup = self.journal.lookup
        elif broadcast is not None:
            self.replay = JournalReplay(cache, broadcast.tp.rank)
        self.overlap = overlap
        dev = cache.device
        with torch.inference_mode(False):
            # the last token each slot sampled (scratch slot included), which its next decode reads on the device
            self.last_tokens = torch.zeros(cache.num_slots + 1, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        # two host buffers for the sampled tokens' copies: step N + 1's copy must not overwrite N's before it is read
        self._host_tokens = [torch.zeros(cache.num_slots, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._flip = 0
        self._inflight: Launched | None = None  # the step launched and not read back yet (overlap)
        self._decode_streams = [Stream(slot, DEVICE_TOKEN) for slot in range(cache.num_slots)]  # (each slot's decode)
        self.penalties = PenaltyState(cache.num_slots, model.config.vocab_size, model.device)  # sampling's
        self.masks: TokenMasks | None = None  # structured output's bitmask, made for the first grammar
        self._cond = threading.Condition(threading.Lock())
        self._inbox: list[Request] = []
        self._aborts: collections.deque[Request] = collections.deque()  # appended without the lock (abort())
        self._jobs: list[Job] = []
        self._closing: BaseException | None = None  # set by close(): what outstanding requests end with
        self._draining: BaseException | None = None  # set by drain(): what new requests are refused with
        self._thread: threading.Thread | None = None
        self._scheduled_waiting = 0  # len(scheduler.waiting) and len(scheduler.free_slots), kept under the
        self._free_slots = len(self.scheduler.free_slots)  # lock for other threads (_publish_queue)
        self.scheduler.on_release = self._released  # (a slot freed: published before its request's end is seen)
        self._steps = self._prompt_tokens = self._generated = self._cached = 0
        self.spec = None  # speculative decoding's step (speculative/verify.py), with Engine(speculative=...)
        if speculative is not None:
            from .speculative.verify import SpeculativeStep

            self.spec = SpeculativeStep(self, speculative)

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
                    self.cache.prefixes.on_lookup = None
                    with contextlib.suppress(Exception):  # the process group may be gone at exit
                        self._send(SHUTDOWN)  # (with the journal: the followers give back what release_all did)
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
            self._send(IDLE)  # nothing to run: keep the followers' broadcast alive
        if aborts or jobs or closing is not None:  # aborts, jobs and the end see every launched step read back
            if self._inflight is not None:
                self._read_back()
            if self.spec is not None and self.spec.ahead is not None:  # (a verify step launched ahead: ahead.py)
                self.spec.ahead.drain()
        aborted = []
        for r in aborts:
            if not r.ended:
                try:
                    self.scheduler.remove(r)
                except BaseException as e:  # its slot's reset or prefix save failed: r fails, the loop goes on
                    self._fail(r, e)
                    continue
                r.finish_reason = "abort"
                aborted.append(r)
        if aborts:  # waiting requests may have left: submit's max_waiting counts them (no step may follow), before
            with self._cond:  # their consumers see the end
                self._publish_queue()
        for r in aborted:
            r.channel.put(RequestOutput(r.index, [], "" if r.text is not None else None, "abort"))
        for job in jobs:  # between steps: a capture never runs while a step does
            if job.warmup and self._broadcast is not None:
                self._send(WARMUP)
            job.run()
        if closing is not None:
            return False
        if not sched.done:
            self._step()
        return True

    def _step(self) -> None:
        sched = self.scheduler
        if self._inflight is not None and self._inflight.grammars:
            self._read_back()  # its tokens advance the grammars the next step's masks need (module docstring)
            if sched.done:
                return
        step = sched.plan()
        with self._cond:
            self._publish_queue()
        if self.spec is not None and self.spec.ahead is not None and self.spec.ahead.pending is not None:
            step = self.spec.ahead.go_on(step)  # ([] when this step was launched ahead)
        if self.spec is not None and step:
            try:  # (planning it raises: the step in flight delivers, then its requests fail; a lookup: its own alone)
                if (self.spec.may_take(step, sched.decodes)
                        and self.spec.worth_reading_back(step, sched.decodes, self._inflight is not None)):
                    step = self._speculate(step)
                else:  # the loop's own step: drafts made for it are dropped ("mtp": the head stops following)
                    self.spec.normal(step)
            except BaseException as e:
                return self._fail_step(step, e)
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
        last ones), then run `step` as a speculative step if it takes it (a request the read back ended, or whose
        "ngram" lookup raised and failed it, leaves `step`): returns then what is left for the loop's own launch
        (prompt chunks asking for prompt logprobs), else the whole step (the head, "mtp", did not see it)."""
        sched = self.scheduler
        if self._inflight is not None:
            self._read_back()
        # prompt chunks asking for prompt logprobs take the loop's own step (prompt_logprobs.py), launched after
        rest = [c for c in step[sched.decodes:] if c.request.params.prompt_logprobs is not None]
        mine = [c for c in step if all(c is not x for x in rest)]
        take = bool(mine) and self.spec.takes(mine, sched.decodes)
        sched.decodes = sum(1 for c in step[:sched.decodes] if not c.request.ended)
        step, mine = [c for c in step if not c.request.ended], [c for c in mine if not c.request.ended]
        if take:
            try:
                self.spec.run(mine, sched.decodes)
            except BaseException as e:  # KeyboardInterrupt included: only this step's requests see it
                for c in mine:
                    self._fail(c.request, e)
            sched.decodes = 0
            return rest
        self.spec.normal(step)
        return step

    def _launch(self, step: list, decodes: int) -> tuple[Launched | None, BaseException | None]:
        """Run `step` (its first `decodes` chunks decodes, which read their token on the device) and sample its
        sampling rows on the device; their tokens are copied to the host behind it. (launched, None), or
        (None, the error) if it failed: the caller fails its requests."""
        # (one comprehension a pass: a decode step of many requests is host work per request)
        requests = [c.request for c in step]
        slots = [r.slot for r in requests]
        decode_streams = self._decode_streams
        streams = [decode_streams[slot] for slot in slots[:decodes]]
        prompts = step[decodes:]
        streams += [Stream(s, c.tokens) for s, c in zip(slots[decodes:], prompts)]
        try:
            if self._broadcast is not None:  # (extra: the prompt-logprob chunks and their targets' counts)
                extra = [x for k, targets in scored_chunks(step, decodes) for x in (k, len(targets))]
                self._send(STEP, streams, decodes, [k for k, c in enumerate(step) if c.sample], extra)
            # the prompt chunks of requests asking for prompt logprobs run apart (prompt_logprobs.py)
            logits, commit, pieces = prefill_step(self.launch, self.model, self.cache, step, streams, decodes)
            rows = None if all(c.sample for c in prompts) else [k for k, c in enumerate(step) if c.sample]
            todo, todo_slots = (requests, slots) if rows is None else ([requests[k] for k in rows], [slots[k] for k in rows])
            grammars = bool([r for r in todo if r.grammar is not None])
            result = None
            if todo:
                if rows is not None:  # (else every row samples, as in a decode step: no gather)
                    logits = logits.index_select(0, to_device(int_tensor(rows), logits.device))
                # (filled on the host while the device runs the step launched above)
                result = sample(logits, todo, self.penalties, self._token_masks(todo) if grammars else None)
                self._share(result.tokens)
                self.last_tokens.index_copy_(0, to_device(int_tensor(todo_slots), logits.device), result.tokens)
            host, ready = self._to_host(result, pieces)
        except BaseException as e:  # KeyboardInterrupt included: only this step's requests see it
            self._reset_failed_launch(requests, e)  # (its slots, before the step before is delivered: loop_readback.py)
            return None, e
        return Launched(step, decodes, todo, host, ready, commit, sum(len(c.tokens) for c in prompts), grammars), None

    def _token_masks(self, requests: list[Request]) -> torch.Tensor | None:
        """The bitmask of the sampling rows `requests` (grammar.TokenMasks), or None when none has a grammar."""
        if all(r.grammar is None for r in requests):
            return None
        if self.masks is None:
            self.masks = TokenMasks(self.cache.num_slots, self.model.config.vocab_size, self.cache.device)
        return self.masks.fill(requests)

    def _share(self, sampled: torch.Tensor) -> None:
        """With a plan broadcast: the sampled tokens go to every rank (followers read them on the device)."""
        if self._broadcast is not None:
            self._broadcast.share_tokens(sampled)

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

    def _send(self, kind: int, streams: list[Stream] = (), decodes: int = 0, sampling: list[int] = (),
              extra: list[int] = ()) -> None:
        """Rank 0 of a plan broadcast: send a message, with the cache journal since the last one and the cache's
        state now (plan_journal.py)."""
        self._broadcast.send(kind, streams, self.journal.take(), decodes, sampling, cache_state(self.cache), extra)

    def follow_handlers(self, warmup) -> dict:
        """A follower of a plan broadcast: what it runs for each kind of rank 0's messages (plan_sync.follow)."""
        handlers = {STEP: lambda plan: self.follow_step(plan), WARMUP: lambda plan: warmup()}
        if self.spec is not None:
            from .speculative.following import SpeculativeFollower

            follower = SpeculativeFollower(self.spec, self._broadcast)
            handlers |= {SPECULATE: follower.verify, DRAFT: follower.draft}
        return handlers

    def follow_step(self, plan) -> None:
        """A follower of a plan broadcast: run rank 0's step (a plan_sync.Plan of kind STEP; its prompt-logprob
        chunks apart, as rank 0 runs them: prompt_logprobs.run_scored) and take its sampled tokens (rows
        plan.sampling). The step is committed when rank 0's journal says so (with prefix caching: with the decodes'
        ids), else now."""
        streams, decodes, sampling, extra = plan.streams, plan.decodes, plan.sampling, plan.extra
        scored = [(k, [0] * n) for k, n in zip(extra[0::2], extra[1::2])]
        _, commit, _ = run_scored(self.launch, self.model, self.cache, streams, decodes, scored, 0)
        self.replay.stepped(commit, decodes)
        if sampling:
            tokens = self._broadcast.receive_tokens(len(sampling))
            slots = to_device(int_tensor([streams[k].slot for k in sampling]), tokens.device)
            self.last_tokens.index_copy_(0, slots, tokens)

    def _restore(self, r: Request) -> int:
        """Prefix caching: start r's fresh slot from the longest cached prefix of its prompt (none when r asks
        for prompt logprobs: a restored prefix has no logits). A restore that raises fails r (r.ended; its slot
        given back) and returns 0."""
        if r.params.prompt_logprobs is not None:
            return 0
        try:
            n = restore_prefix(self.model, self.cache, r.slot, r.prompt)
        except BaseException as e:  # (its copies failing on the device): r fails, as a step's requests do; the
            self._fail(r, e)  # restore's transaction reset the slot, which _fail gives back; the others go on
            return 0
        self._cached += n
        if n and self.cache.mtp_context_lens[r.slot] != n:  # the head's entries of the prefix are not r's
            r.mtp_ok = False
        return n

    def _keep(self, r: Request) -> None:
        """Prefix caching: keep r's slot's context (all its fed tokens) for later prompts."""
        saved = False
        try:
            self.cache.save_prefix(r.slot)
            saved = True
        finally:
            if self.journal is not None:
                self.journal.save(r.slot, saved)

    def clear_prefixes(self) -> None:
        """In the loop thread: forget every kept prefix (HybridCache.clear_prefixes), on every rank."""
        if self.journal is not None:
            self.journal.clear()
        self.cache.clear_prefixes()

    @contextlib.contextmanager
    def _on_device(self):
        """CUDA's current device is per thread: the loop's must be the model's (kernels launch on it)."""
        device = self.model.device
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield
