"""Verify ahead (METRALE_VERIFY_AHEAD, on by default): speculative "mtp" step N + 1 launched before step N's accept counts
reach the host, its inputs made on the device from N's acceptance and drafting; vLLM's asynchronous scheduling with
speculative decoding, SGLang's overlapped speculative step (docs/speculative.md).

    ahead = VerifyAhead(spec)            # SpeculativeStep's, with the setting on
    if ahead.starts(step, decodes, tokens): ahead.pending = ahead.launch(step, None)  # N launched, not read back
    step = ahead.go_on(step)             # the loop's next plan: N + 1 launched, then N delivered (returns []);
                                         # or N delivered and the plan given back, less the requests N ended
    ahead.drain()                        # aborts, jobs, the end: the step in flight delivered

A chain holds while the loop plans the step's requests (or those a stop has not ended), all decodes, each a request
the MTP head follows whose rows no logits processor touches (the captured acceptance; greedy or sampled), each
verifying num_tokens (K) drafts, with at least 2K + 2 tokens left to sample as far as the host knows (the step
before's tokens not counted): step N + 1's positions lie at most K + 1 past N's and the head's draft steps behind it
stop where its tokens left do, so both stay inside the request's KV reservation. Not with prefix caching (its blocks
are labelled with ids the host must know), a plan broadcast, without a runner (the captured tail), or under
Engine(overlap=False).

Step N + 1's inputs from N's device result (the drafting's [B, 2K + 2]: count c, K + 1 tokens, K drafts) and N's
device context and tokens left: its context = N's + c + 1 (its tokens' positions from there, the step's
context_lens); its tokens = N's token after its count, then N's K drafts; the acceptance's drafts = those K; the
drafting's positions and contexts from the new context, its tokens left = N's - c - 1. Every stream feeds K + 1
tokens, so the host lays the step out (verify entries, hidden-state rows, buckets) as for N; the ids, positions and
contexts it packs from its own (older) view are placeholders the device overwrites before the step runs. The
step's blocks are given up to 3K + 1 tokens past the committed context (N's, N + 1's, the head's draft steps),
capped by the tokens left, before the step is packed.

When N's counts arrive, after N + 1 is launched, N commits each live stream's c + 1 kept tokens and delivers them
through the loop's stop checks (verify._deliver). A request that stopped at N was in N + 1 too: N + 1's tokens for
it are dropped when N + 1 is read back, never emitted nor counted, and its slot, reset when it stopped, was reset
behind N + 1 on the device's stream. The next plan holds N + 1's other requests: the chain goes on with them (step N
+ 2's inputs gathered from their rows of N + 1's results); a plan with a request N + 1 does not hold (a new one, or
a prompt chunk) ends it: N + 1 is delivered before that plan runs the usual way.

Sampled rows draw the uniforms a synchronous step would (acceptance.Uniforms: position j's is the generator's next
draw but j), though N + 1's start after N's c + 1, which the host does not know yet: at N + 1's launch the host
draws the 2K + 2 uniforms from where N's start (the generator set back there after), and the device picks the K + 1
after N's count from them. When N is read back its generator moves past its c + 1 uniforms, which is where N + 1's
start: its own settling and the next launch's draws begin there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..batch import Stream
from ..numbers import int_tensor, to_device
from ..protocol import prefill_call
from .acceptance import unprocessed
from .layout import VerifyLayout, acceptance_rows, pads_one_stream, verify_layout
from .tail import host_rows


@dataclass
class Pending:
    """A verify step launched and not read back: its plan, requests and layout; `both` the drafting's [B, 2K + 2]
    on the device (counts, tokens, drafts), `host` its copy on the host once `ready` (a CUDA event, or None) has
    passed; its streams' contexts before it and tokens left, on the device; the call's commit (protocol.py)."""
    step: list
    reqs: list
    layout: VerifyLayout
    both: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    before: torch.Tensor
    remaining: torch.Tensor
    commit: Callable[[dict], None]
    gens: list  # each row's generator (None: greedy) and its state where the step's uniforms start (None: not
    states: list  # known yet, for a step launched ahead of one not read back: set when that one is)
    rows: list[int] | None  # each row's row in the step before (None: that step was read back first)


class VerifyAhead:
    def __init__(self, spec):
        self.spec, self.loop, self.cache, self.k = spec, spec.loop, spec.cache, spec.k
        self.pending: Pending | None = None
        self.chained = 0  # steps launched before the step before them was read back
        self._host: dict[int, list[torch.Tensor]] = {}  # pinned copies' buffers by stream count, two each (CUDA)

    def eligible(self, reqs: list) -> bool:
        """Whether requests `reqs` may verify ahead (the module docstring's conditions per request)."""
        spec, least = self.spec, 2 * self.k + 2
        return all(not r.ended and unprocessed(r) and spec.follows(r) and r.max_new - len(r.out) >= least
                   for r in reqs)

    def starts(self, step: list, decodes: int, tokens: list[list[int]]) -> bool:
        """Whether speculative step `step` (read back: its tokens on the host) launches ahead: every stream a decode
        of an eligible request feeding K drafts, the head caught up on its context, a bucket of the runner."""
        spec, cache, K = self.spec, self.cache, self.k
        reqs = [c.request for c in step]
        if (decodes != len(step) or spec.graphs is None or cache.prefix_caching or self.loop._broadcast is not None
                or not self.loop.overlap  # (Engine(overlap=False): every step read back before the next is planned)
                or any(len(t) != K + 1 for t in tokens) or not self.eligible(reqs)
                or any(cache.mtp_context_lens[r.slot] != cache.context_lens[r.slot] for r in reqs)):
            return False
        from ..capture.buckets import choose  # (capture imports this package: not at the top)

        streams = 2 if len(reqs) == 1 and pads_one_stream(spec.runner, K + 1) else len(reqs)
        return choose(spec.runner.grid, streams, len(reqs) * (K + 1)) is not None

    def go_on(self, step: list) -> list:
        """The loop's plan `step` with a step pending: launched ahead when the chain holds (then the pending step
        is delivered and `step` is the new pending one: returns []); else the pending step delivered, and `step`
        returned less the requests it ended (the scheduler's decode count set to match, each decode's `sampled`
        counting this step's token again after the delivery)."""
        p, loop = self.pending, self.loop
        sched = loop.scheduler
        reqs = [c.request for c in step]
        index = {id(r): i for i, r in enumerate(p.reqs)}  # (the plan's requests among p's: those p ended are not)
        rows = [index.get(id(r)) for r in reqs]
        if (step and sched.decodes == len(step) and None not in rows and len(set(rows)) == len(rows)
                and self.eligible(reqs) and all(p.states[i] is not None for i in rows if p.gens[i] is not None)):
            try:
                launched = self.launch(step, p, rows)
            except BaseException as e:  # its transaction reset the slots: the step before cannot commit either
                self.pending = None
                for r in reqs:
                    loop._fail(r, e)
                return []
            self.pending = launched
            self.chained += 1
            self._finish(p)
            if all(r.ended for r in launched.reqs):  # (nothing of it to deliver: its slots were reset)
                self.pending = None
            return []
        self.drain()
        for c in step[:sched.decodes]:  # (its delivery set `sampled` to the tokens out: the plan counted this step's
            c.request.sampled = max(c.request.sampled, len(c.request.out) + 1)  # too, for the loop's own step)
        decodes = sum(1 for c in step[:sched.decodes] if not c.request.ended)
        step = [c for c in step if not c.request.ended]
        sched.decodes = decodes
        return step

    def drain(self) -> None:
        """Deliver the pending step, if any."""
        p, self.pending = self.pending, None
        if p is not None:
            self._finish(p)

    def launch(self, step: list, prev: Pending | None, rows: list[int] | None = None) -> Pending:
        """Launch verify step `step` (every chunk a decode of an eligible request): its inputs from the host's
        tokens (prev None: the step before is read back) or from `prev`'s results on the device, stream i from
        prev's row rows[i] (a request that ended in the step before prev has left the plan)."""
        spec, cache, K = self.spec, self.cache, self.k
        reqs = [c.request for c in step]
        B, dev = len(reqs), cache.device
        layout = verify_layout([K + 1] * B, B, list(range(B)), spec.base, K, cache.verify_entries)
        context = [cache.context_lens[r.slot] for r in reqs]  # (prev: the contexts before prev)
        left = [r.max_new - len(r.out) for r in reqs]
        gens = [r.generator for r in reqs]  # (None: greedy)
        drawn = None  # (a step launched ahead of prev with sampled rows: their uniforms, picked on the device)
        if prev is None:
            tokens = [[r.out[-1]] + r.drafts for r in reqs]
            before, remaining, fresh, extra = to_device(int_tensor(context), dev), to_device(int_tensor(left), dev), None, ()
            states = [None if g is None else g.get_state() for g in gens]
            uniforms = _draws(gens, states, K + 1)
        else:  # placeholders, overwritten on the device; blocks for prev's tokens, these and the head's draft steps
            tokens, states, uniforms = [[0] * (K + 1) for _ in reqs], [None] * B, torch.zeros(B, K + 1)
            both, before, remaining = prev.both, prev.before, prev.remaining
            if rows != list(range(len(prev.reqs))):
                index = to_device(int_tensor(rows), dev)
                both, before, remaining = (t.index_select(0, index) for t in (both, before, remaining))
            counts = both[:, 0]
            before, remaining = before + counts + 1, remaining - counts - 1
            fresh = torch.cat([both.gather(1, counts.unsqueeze(1) + 1), both[:, K + 2:]], dim=1)
            extra = [(r.slot, min(3 * K + 1, n)) for r, n in zip(reqs, left)]
            if any(g is not None for g in gens):  # sampled rows: the uniforms after prev's c + 1 (module docstring)
                window = to_device(_draws(gens, [prev.states[i] for i in rows], 2 * K + 2), dev)
                drawn = window.gather(1, (counts + 1).unsqueeze(1) + torch.arange(K + 1, device=dev))
        streams = [Stream(r.slot, t) for r, t in zip(reqs, tokens)]
        with prefill_call(spec.model, cache, streams) as call:
            both, commit = call.launch_settled(
                lambda packed: self._run(packed, reqs, layout, context, before, remaining, fresh, drawn, uniforms),
                extra)
        host, ready = self._to_host(both)
        return Pending(step, reqs, layout, both, host, ready, before, remaining, commit, gens, states, rows)

    def _run(self, packed, reqs: list, layout: VerifyLayout, context: list[int], before: torch.Tensor,
             remaining: torch.Tensor, fresh: torch.Tensor | None, drawn: torch.Tensor | None,
             uniforms: torch.Tensor) -> torch.Tensor:
        """The step inside its prefill call: the verify step's layers, the captured acceptance, the head's drafting
        behind it; `fresh` [B, K + 1] the tokens from the device (None: packed holds them), `drawn` [B, K + 1] the
        sampled rows' uniforms from the device (None: `uniforms`, on the host, holds them). Returns the drafting's
        [B, 2K + 2]."""
        spec, K, B = self.spec, self.k, len(reqs)
        if fresh is not None:
            positions = (before.unsqueeze(1) + torch.arange(K + 1, device=before.device)).reshape(-1)
            packed.tokens[:B * (K + 1)] = fresh.reshape(-1)
            packed.positions[:B * (K + 1)] = positions
            packed.context_lens[:B] = before.to(packed.context_lens.dtype)
        out: dict = {}
        h = spec.forward(packed, layout, out)
        bucket = out["bucket"]
        drafts = [r.drafts if fresh is None else [0] * K for r in reqs]
        ints, floats = host_rows(acceptance_rows(layout, K), drafts, [r.params for r in reqs], uniforms, K,
                                 spec.model.config.vocab_size)
        keep = [(r.slot, spec.base + j * K) for j, r in enumerate(reqs)]

        def set_drafts(buffer, floats_buffer):
            buffer[:B, K + 1:2 * K + 1] = fresh[:, 1:]
            if drawn is not None:
                floats_buffer[:B, :K + 1] = drawn

        result = spec.graphs.accept(bucket, h, ints, floats, keep, [r.slot for r in reqs],
                                    None if fresh is None else set_drafts)

        def set_contexts(tok, strm):
            tok[1, :B * (K + 1)] = positions
            strm[2, :B] = before
            strm[4, :B] = remaining

        both = spec.mtp.launch_after(spec.graphs, bucket, h, result, reqs, context, layout.starts, [K] * B,
                                     None if fresh is None else set_contexts)
        if both is None:  # (starts checked the bucket: launch_after declines only a bucket too small)
            raise RuntimeError(f"the drafting behind a verify step launched ahead fits no bucket ({bucket})")
        return both

    def _to_host(self, both: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`both` copied to the host behind the step (CUDA: into one of two pinned buffers, an event after it)."""
        if not both.is_cuda:
            return both, None
        buffers = self._host.get(both.shape[0])
        if buffers is None:
            buffers = self._host[both.shape[0]] = [torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
                                                   for _ in range(2)]
        buffers.reverse()  # (the other one may be the pending step's)
        buffers[0].copy_(both, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return buffers[0], ready

    def _finish(self, p: Pending) -> None:
        """Read pending step `p` back (its counts, tokens and the next drafts), commit its live streams' kept
        tokens and deliver them; a failure here fails its live requests."""
        spec, cache, loop, K = self.spec, self.cache, self.loop, self.k
        live = [i for i, r in enumerate(p.reqs) if not r.ended]
        try:
            if p.ready is not None:
                p.ready.synchronize()
            rows = p.host.tolist()
            if not live:
                return
            reqs = [p.reqs[i] for i in live]
            counts = [rows[i][0] for i in live]
            nxt = self.pending if self.pending is not p else None  # (the step launched ahead of p: its row of each of p's)
            after = {} if nxt is None else {i: j for j, i in enumerate(nxt.rows)}
            for i, c in zip(live, counts):  # each sampled row's generator past the c + 1 uniforms it used
                g = p.gens[i]
                if g is not None:
                    g.set_state(p.states[i])
                    torch.rand(c + 1, generator=g)
                    if i in after:  # where the next step's uniforms start
                        nxt.states[after[i]] = g.get_state()
            before = [cache.context_lens[r.slot] for r in reqs]
            p.commit({r.slot: c + 1 for r, c in zip(reqs, counts)})
            emitted = [rows[i][1:c + 2] for i, c in zip(live, counts)]
            spec.mtp.note_after(reqs, before, emitted)
            spec._count([K] * len(live), counts)
            out = {"spec": {i: (e, [None] * len(e)) for i, e in zip(live, emitted)}, "last_set": True}
            spec._deliver(p.step, len(p.step), p.reqs, out, p.layout.spec)
            drafted = spec.mtp.take_after(reqs, [rows[i][K + 2:] for i in live], [spec.room(r) for r in reqs])
            for r in reqs:
                r.drafts = drafted.get(r.slot, [])
        except BaseException as e:  # KeyboardInterrupt included: only this step's requests see it
            for i in live:
                loop._fail(p.reqs[i], e)


def _draws(gens: list, states: list, n: int) -> torch.Tensor:
    """fp32 [B, n]: each sampled row's first n uniforms from its generator at `states[b]` (zeros for greedy rows,
    generator None), the generator left at that state (acceptance.Uniforms' draws, settled later)."""
    values = torch.zeros(len(gens), n)
    for b, (g, state) in enumerate(zip(gens, states)):
        if g is not None:
            g.set_state(state)
            values[b] = torch.rand(n, generator=g)
            g.set_state(state)
    return values
