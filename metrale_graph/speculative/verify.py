"""The engine's speculative step: draft, verify in one step of the main model, accept, keep the cache exact.

    spec = SpeculativeStep(loop, Speculative("ngram", 3))     # the engine loop's, with Engine(speculative=...)
    if spec.takes(step): spec.run(step, decodes)               # instead of the loop's own launch (loop.py)

A request speculates (`speculates`) unless it opted out (Request.speculate False): grammars, logprobs, penalties,
min_tokens and logit_bias included, their processors seeing each position as if the drafts before it had been
emitted (step 3); "mtp" does not follow a request asking for prompt logprobs (its prompt chunks run the loop's way).
A step with more decodes than max_streams speculates not at all (the loop's own overlapped step; "mtp"'s head then
stops following its requests). Each step of at most max_streams decodes holding a speculating decode (with drafts)
or, for "mtp", any chunk of a request the head follows, runs here, synchronously (loop.py: the step before read
back first; for "ngram" only while some decode's lookup over its tokens on the host finds a match,
`worth_reading_back`; with METRALE_VERIFY_AHEAD, "mtp" decodes of captured rows launch ahead of it: ahead.py);
its layers through the runner's hidden-states step of the bucket it fits (GraphRunner.hidden_bucket), else eagerly:

1. Streams: a speculating decode feeds (x_n, d_1 .. d_k), k = min(num_tokens, tokens it may still emit - 1)
   (so neither max_new_tokens nor its KV reservation is overrun); the other chunks are the plan's own.
2. One step of the main model (`model.hidden_states` through the prefill protocol's `run_settled`) over all of
   them, with the verify checkpoints (cache.checkpoint_tokens past prefix_targets, ops/checkpoints.py) asking
   the GDN ops to keep the conv window and recurrent state after each of a speculating stream's first k tokens
   in its verify entries (cache entries prefix_checkpoints + j * num_tokens + t for the j-th speculating stream).
3. Logits at every position of a speculating stream, through the logits processors batched over all positions
   (`_processed`): position j (after d_1 .. d_j) has min_tokens counting the drafts before it, the penalties
   counting them on top of the slot's statistics, and its grammar's mask after them (grammar.TokenMasks
   .fill_drafts: the matcher advanced along the drafts and rolled back); then each position's token drawn as a plain
   step draws it, with one uniform a position from the request's generator, and the drafts kept while they equal
   those draws (`acceptance.accept_drawn`: for one-hot drafts, rejection sampling whose randomness is plain
   sampling's; the generator then settles just past the uniforms the emitted tokens used, so a seeded request emits
   plain decoding's tokens whatever was drafted); the emitted tokens join the penalty statistics, and their logprobs
   come from their position's raw logits (logprobs.py, as a plain step's). The other sampling rows go through
   `sampling.sample` as in a plain step. Accept counts, tokens and logprobs read back (one sync). With a runner and
   a step in one of its buckets whose rows no processor touches (`unprocessed`), all of this is one replay of the
   bucket's acceptance graph instead (`_accept_captured`: capture/speculative.py, tail.py), and the state copy of
   step 4 and the MTP head of step 6 replay graphs too.
4. Settling the cache: a stream that kept a of its k drafts keeps a + 1 tokens: its slot's conv / GDN states
   are replaced by verify entry a (a == k: the step's own final state, nothing to copy), its context advances by
   a + 1 (KV of the rejected positions lies past it; the next step overwrites it) and with prefix caching only
   the kept tokens label blocks. Nothing of a rejected draft stays in a state. With prefix caching (a slot's context
   kept when its request ends) a stream that stops at a kept draft keeps its drafts through that one (stops.py).
5. Emission, in order, through the loop's `_advance` (stop tokens, stop strings, max_new_tokens): a token after
   a stop is neither emitted nor counted.
6. Drafts for the next step: "ngram" looks them up when the step is planned (proposers.ngram_propose over prompt
   + output); "mtp" runs the head now (drafting.py: catch-up on the positions this step kept, then k drafts; behind
   the captured acceptance if every row is a followed decode; a request the delivery ends is caught up on first).

Under a plan broadcast (plan_sync.py) this runs on rank 0, which sends each step (SPECULATE: its streams, drafts
included, laid out alike everywhere by layout.py), shares its accept counts and last tokens after the read back,
and sends each MTP drafting (DRAFT); following.py is the other ranks' side.
"""

from __future__ import annotations

import time

import torch

from .. import envs
from ..batch import Stream
from ..cache_prefixes import set_verify_targets
from ..grammar import TokenMasks
from ..handle import deliver
from ..logits_processors import process_logits
from ..logprobs import token_logprobs
from ..numbers import int_tensor, to_device
from ..plan_sync import DRAFT, SPECULATE
from ..protocol import prefill_call
from ..sampling import SampleRow, sample
from .acceptance import accept_drawn, draw_positions, draw_uniforms, unprocessed
from .ahead import VerifyAhead
from .drafting import MtpDrafter
from .layout import VerifyLayout, acceptance_rows, kept_lengths, last_rows, pads_one_stream, position_rows, verify_layout
from .options import Speculative
from .proposers import history, ngram_propose
from .stops import kept_counts
from .tail import host_rows, keep_verified_states


def speculates(r) -> bool:  # whether request `r` may speculate at all: unless it opted out (module docstring)
    return r.speculate


class SpeculativeStep:
    def __init__(self, loop, spec: Speculative):
        self.loop, self.spec, self.k = loop, spec, spec.num_tokens
        self.cache, self.model = loop.cache, loop.model
        self.base = self.cache.prefix_checkpoints  # the first verify entry
        self.mtp = MtpDrafter(self.model, self.cache, loop._fail) if spec.method == "mtp" else None
        self.runner = loop.runner  # its hidden-states buckets run the verify steps (compile=True), else None
        self.graphs = None  # the tail compiled (on CUDA captured) beside the runner's buckets (capture/speculative.py)
        if loop.runner is not None:
            from ..capture.speculative import SpeculativeGraphs

            self.graphs = SpeculativeGraphs(loop.runner, self.k, self.mtp is not None, loop.last_tokens)
        if self.mtp is not None and loop._broadcast is not None and loop._broadcast.leader:
            def announce(batch):  # rank 0 of a plan broadcast: each drafting goes to the followers (following.py)
                streams, extra = batch.message()
                loop._send(DRAFT, streams, extra=extra)
            self.mtp.on_batch = announce
        self.proposed = self.accepted = self.drafts = self.steps = 0
        self.ahead = VerifyAhead(self) if envs.METRALE_VERIFY_AHEAD and self.mtp is not None else None  # (ahead.py)

    def stats(self) -> dict:
        """So far: drafts proposed and accepted (tokens), drafts verified (`drafts`: one per stream and verify
        step, vLLM's num_drafts; a stream gains (accepted + drafts) / drafts tokens per verify on average), and
        the steps that verified any."""
        return {"method": self.spec.method, "num_tokens": self.k, "proposed": self.proposed,
                "accepted": self.accepted, "drafts": self.drafts, "steps": self.steps}

    def room(self, r) -> int:  # the drafts r may verify now: at most num_tokens, and room for the added token
        return max(0, min(self.k, r.max_new - len(r.out) - 1))

    def follows(self, r) -> bool:
        """"mtp": whether the head has followed r from its first position (a restored prefix whose head entries
        are not r's, loop._restore, or a step that did not run here, leaves it behind: no MTP drafts for r)."""
        return (self.mtp is not None and speculates(r) and r.mtp_ok
                and r.params.prompt_logprobs is None)  # (whose prompt chunks run the loop's way: loop._speculate)

    def may_take(self, step: list, decodes: int) -> bool:
        """Whether `step` (a plan whose first `decodes` chunks are decodes) may run here: the loop then reads the
        step in flight back first. Not with more decodes than max_streams (the module docstring): the loop then
        runs it its own way (and calls normal)."""
        return decodes <= self.spec.max_streams and any(speculates(c.request) for c in step)

    def worth_reading_back(self, step: list, decodes: int, in_flight: bool) -> bool:
        """Whether `step` (may_take's) should read the step in flight back and try to speculate. Always for "mtp"
        (the head follows its requests step by step) and with nothing in flight (reading back costs nothing). For
        "ngram" only when prompt lookup over a speculating decode's tokens known on the host (its output up to
        the step before the one in flight) proposes something: a stream whose text repeats goes on speculating,
        and one whose lookup finds nothing keeps the loop's overlapped step (no read back: the host's work for
        the step hides behind the device's). A stream whose lookup first hits with the token in flight
        speculates one step later. The tokens are the same either way; only which steps verify drafts moves."""
        if self.mtp is not None or not in_flight:
            return True
        try:
            return any(self.lookup(c.request) for c in step[:decodes])
        except BaseException:  # (after the read back takes looks it up again, and fails that request alone)
            return True

    def lookup(self, r) -> list[int]:  # "ngram": r's drafts by prompt lookup over its tokens on the host, or none
        room = self.room(r)
        return (ngram_propose(history(r), room, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
                if speculates(r) and room else [])

    def takes(self, step: list, decodes: int) -> bool:
        """Whether `step` (read back: every decode's last token on the host) runs here, its requests that ended left
        out; sets each decode's drafts ("ngram": looked up now; a lookup that raises fails its request alone, which
        the loop then leaves out of the step)."""
        take = False
        for i, c in enumerate(step):
            r = c.request
            if self.mtp is None and i < decodes and not r.ended:
                try:
                    r.drafts = self.lookup(r)
                except BaseException as e:  # (KeyboardInterrupt included: only r sees it)
                    r.drafts = []
                    self.loop._fail(r, e)
            take = take or (not r.ended and ((i < decodes and bool(r.drafts)) or self.follows(r)))
        return take

    def normal(self, step: list) -> None:
        """`step` ran the loop's own way: the head did not see its positions, and drafts made for it are gone."""
        for c in step:
            c.request.drafts = []
            c.request.mtp_ok = False

    def run(self, step: list, decodes: int) -> None:
        cache, model, loop = self.cache, self.model, self.loop
        reqs = [c.request for c in step]
        tokens = [[r.out[-1]] + r.drafts if i < decodes else c.tokens for i, (c, r) in enumerate(zip(step, reqs))]
        if self.ahead is not None and self.ahead.starts(step, decodes, tokens):  # (read back when the loop's
            self.ahead.pending = self.ahead.launch(step, None)  # next plan is known: ahead.go_on)
            return
        sampling = [i for i, c in enumerate(step) if c.sample]
        layout = verify_layout([len(t) for t in tokens], decodes, sampling, self.base, self.k, cache.verify_entries)
        before = [cache.context_lens[r.slot] for r in reqs]
        rows = [reqs[i] for i in layout.spec + layout.plain]
        # the captured acceptance where it may run: no logits processor on any row (else the eager one)
        captured, sampled = all(map(unprocessed, rows)), not all(r.params.greedy for r in rows)
        streams, out = [Stream(r.slot, t) for r, t in zip(reqs, tokens)], {"before": before}
        follow = all(self.follows(r) and cache.mtp_context_lens[r.slot] == b for r, b in zip(reqs, before))
        # "mtp" drafting behind the captured acceptance (every stream a followed decode; verify ahead implies it)
        out["fuse"] = (follow and (envs.METRALE_MTP_AFTER or self.ahead is not None) and captured
                       and loop._broadcast is None and len(layout.spec) == len(reqs))

        def settle(h):
            out["h"] = h
            spec, plain = layout.spec, layout.plain
            if rows and self.graphs is not None and out["bucket"] is not None and captured:
                counts = done = self._accept_captured(h, out, reqs, layout)  # (its graph also keeps the states)
            else:
                counts, done = self._accept_eager(h, out, reqs, layout), None
            if cache.prefix_caching and spec:  # nothing past a stop stays in a slot kept for later (stops.py)
                counts = kept_counts([reqs[i] for i in spec], [out["spec"][i][0] for i in spec], counts)
            if counts != done:
                self.keep_states(layout, [reqs[i].slot for i in spec], counts, done)
            if rows and loop._broadcast is not None:  # the followers settle with rank 0's counts (following.py)
                last = [out["spec"][i][0][-1] for i in spec] + [out["plain"][i][0][-1] for i in plain]
                loop._broadcast.share_tokens(to_device(int_tensor(counts + last), cache.device))
            return kept_lengths(layout, counts)

        with prefill_call(model, cache, streams) as call:
            if loop._broadcast is not None:  # rank 0 of a plan broadcast: its followers run the same step
                loop._send(SPECULATE, streams, decodes, sampling, [int(captured), int(sampled)])
            call.run_settled(lambda packed: self.forward(packed, layout, out), settle, layout.spec)
        drafted = out.get("after")  # (the drafting ran behind the acceptance: launch_after)
        if drafted is not None:
            self.mtp.note_after(reqs, before, [out["spec"][i][0] for i in layout.spec])
        elif self.mtp is not None and cache.prefix_caching:  # the head's entries of the prefixes the delivery keeps
            self.mtp.catch_up_ending(out, [r if self.follows(r) else None for r in reqs], before, layout.starts, self.graphs)
        self._deliver(step, decodes, reqs, out, layout.spec)
        if drafted is not None:
            drafted, live = self.mtp.take_after(reqs, drafted, [self.room(r) for r in reqs]), range(len(reqs))
        elif self.mtp is not None:
            live = [i for i, r in enumerate(reqs) if self.follows(r) and not r.ended]
            try:
                drafted = self.mtp.draft(out["h"], [reqs[i] for i in live], [before[i] for i in live],
                                         [layout.starts[i] for i in live], [self.room(reqs[i]) for i in live],
                                         self.graphs, out["bucket"])
            except BaseException as e:  # its transaction reset the slots it drafts in: those requests fail alone
                for i in live:
                    loop._fail(reqs[i], e)
                return
        for i in live if self.mtp is not None else ():
            reqs[i].drafts = drafted.get(reqs[i].slot, [])

    def forward(self, packed, layout: VerifyLayout, out: dict) -> torch.Tensor:
        """The verify step's hidden states of `packed` (run_settled's step): through the runner's hidden-states
        bucket it fits (out["bucket"]; None: eagerly), the verify states of `layout`'s speculating streams kept
        in their entries. The same on rank 0 and its followers (following.py)."""
        cache = self.cache
        if (cache.device.type == "cuda" and packed.num_streams == 1 and layout.keep_tokens  # (any token kept)
                and pads_one_stream(self.runner, packed.num_tokens)):
            packed = packed.padded(2, packed.num_tokens, cache)
        runner = self.runner  # its compiled (captured) hidden-states step of the bucket the step fits, if any
        entry = runner.hidden_bucket(packed.num_streams, packed.num_tokens) if runner is not None else None
        targets(cache, layout.keep_tokens, layout.keep_entries)  # (left set after the step: cleared before another)
        out["bucket"] = None if entry is None else entry.bucket
        if entry is not None:
            return runner.run_hidden(entry, packed)
        return self.model.hidden_states(cache, packed)

    def _accept_eager(self, h, out: dict, reqs: list, layout: VerifyLayout) -> list[int]:
        """settle's acceptance with every logits processor (_accept), and the plain sampling rows through
        sampling.sample; sets out["spec"] / out["plain"]; returns the speculating streams' accept counts. (Its
        collectives, the LM head's two gathers, are what a follower's settle meets: following.py.)"""
        counts, dev, loop, spec, plain = [], h.device, self.loop, layout.spec, layout.plain
        if spec:
            counts, emitted, logprobs = self._accept(h, [reqs[i] for i in spec], [layout.starts[i] for i in spec], self.k)
            out["spec"] = {i: (t, lp) for i, t, lp in zip(spec, emitted, logprobs)}
        if plain:
            rows = to_device(int_tensor(last_rows(layout, plain)), dev)
            todo = [reqs[i] for i in plain]
            result = sample(self.model.logits_of(h.index_select(0, rows)), todo, loop.penalties, loop._token_masks(todo))
            host, entries = result.to_host()
            out["plain"] = {i: ([t], [e]) for i, t, e in zip(plain, host, entries)}
        return counts

    def _accept_captured(self, h, out: dict, reqs: list, layout: VerifyLayout) -> list[int]:
        """_accept_eager's tokens for rows no logits processor touches (`unprocessed`), in one replay of the
        bucket's acceptance graph (capture/speculative.py, speculative/tail.py) and one read back; the graph
        also puts each speculating stream's accepted state into its slot (settle's step 4)."""
        K, spec, plain = self.k, layout.spec, layout.plain
        drafts = [reqs[i].drafts for i in spec] + [[] for _ in plain]
        positions = acceptance_rows(layout, K)
        rows = [reqs[i] for i in spec + plain]
        uniforms = draw_uniforms([r.generator for r in rows], [len(d) for d in drafts], K)
        ints, floats = host_rows(positions, drafts, [r.params for r in rows], uniforms.values, K,
                                 self.model.config.vocab_size)
        keep = [(reqs[i].slot, self.base + j * K) for j, i in enumerate(spec)] + [None] * len(plain)
        result = self.graphs.accept(out["bucket"], h, ints, floats, keep, [r.slot for r in rows])
        after = None
        if out["fuse"]:  # (rows: the speculating decodes alone, in reqs' order)
            after = self.mtp.launch_after(self.graphs, out["bucket"], h, result, reqs, out["before"],
                                          [layout.starts[i] for i in spec], [len(d) for d in drafts])
        if after is not None:  # one read back brings both (the result as the drafting's entry copied it)
            both = after.tolist()
            result, out["after"] = [row[:K + 2] for row in both], [row[K + 2:] for row in both]
        else:
            result = result.tolist()  # one read back
        out["last_set"] = True  # (each row's slot's last token, set on the device: tail.write_last_tokens)
        uniforms.settle([row[0] for row in result])
        counts = [row[0] for row in result[:len(spec)]]
        out["spec"] = {i: (row[1:row[0] + 2], [None] * (row[0] + 1)) for i, row in zip(spec, result)}
        out["plain"] = {i: ([row[1]], [None]) for i, row in zip(plain, result[len(spec):])}
        if spec:
            self._count([len(d) for d in drafts[:len(spec)]], counts)
        return counts

    def keep_states(self, layout: VerifyLayout, slots: list[int], counts: list[int], done=None) -> None:
        """After an eager acceptance (rank 0's, or a follower's with rank 0's counts): each speculating stream (slots,
        in layout.spec's order) that kept c < its drafts takes the state after its kept tokens, verify entry c of
        the j-th speculating stream; `done`: the counts whose states the slots hold already (the captured's)."""
        redo = [(j, slot, c) for j, (i, slot, c) in enumerate(zip(layout.spec, slots, counts))
                if c < layout.lengths[i] - 1 and (done is None or c != done[j])]
        if redo:
            self._keep_states([slot for _, slot, _ in redo], [self.base + j * self.k + c for j, _, c in redo])

    def _keep_states(self, slots: list[int], entries: list[int]) -> None:
        """Each slot's conv and GDN states of every layer := verify entry entries[i]'s (one graph with a runner)."""
        if self.graphs is not None:
            self.graphs.copy_states(slots, entries)
            return
        keep_verified_states(self.cache, to_device(torch.tensor([slots, entries], dtype=torch.int64), self.cache.device))

    def _count(self, proposed: list[int], accepted: list[int]) -> None:
        self.proposed += sum(proposed)
        self.accepted += sum(accepted)
        self.drafts += len(proposed)
        self.steps += 1

    def _accept(self, h, reqs: list, starts: list[int], K: int) -> tuple[list[int], list[list[int]], list[list]]:
        """Rejection sampling over the speculating streams (h: the step's hidden states): accepted drafts, the
        tokens each emits (its kept drafts and one more) and their TokenLogprobs (None where not asked), on the
        host."""
        dev, n = h.device, [len(r.drafts) for r in reqs]
        flat = to_device(int_tensor(position_rows(starts, n, K)), dev)  # [S * (K + 1)]
        raw = self.model.logits_of(h.index_select(0, flat))
        logits = self._processed(raw, reqs, K)
        uniforms = draw_uniforms([r.generator for r in reqs], n, K)
        drawn = draw_positions(logits, [r.params for r in reqs], uniforms.values)
        drafts = to_device(int_tensor([t for r in reqs for t in r.drafts + [0] * (K - len(r.drafts))]), dev)
        result = accept_drawn(drawn, drafts.view(len(reqs), K), to_device(int_tensor(n), dev))
        penalized = [b for b, r in enumerate(reqs) if r.params.penalized]
        if penalized:  # the emitted tokens (kept drafts, the added one) join the counts; rejected drafts do not
            index = to_device(int_tensor(penalized), dev)
            self.loop.penalties.record_runs(to_device(int_tensor([reqs[b].slot for b in penalized]), dev),
                                            result.tokens.index_select(0, index))
        want = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:  # each position's emitted token under its raw logits, as a plain step's (logprobs.py)
            index = to_device(int_tensor([b * (K + 1) + t for b in want for t in range(K + 1)]), dev)
            chosen = result.tokens.index_select(0, to_device(int_tensor(want), dev)).reshape(-1).clamp(min=0)
            device_logprobs = token_logprobs(raw.index_select(0, index), chosen,
                                             max(reqs[b].params.logprobs for b in want))
        counts, emitted = result.counts.tolist(), result.tokens.tolist()  # the step's one read back
        uniforms.settle(counts)
        entries = [[None] * (c + 1) for c in counts]
        if want:
            host = device_logprobs.to_host([reqs[b].params.logprobs for b in want for _ in range(K + 1)])
            for w, b in enumerate(want):
                entries[b] = host[w * (K + 1):w * (K + 1) + counts[b] + 1]
        self._count(n, counts)
        return counts, [row[:c + 1] for row, c in zip(emitted, counts)], entries

    def _processed(self, raw, reqs: list, K: int):
        """The logits processors over the verify rows `raw` [S * (K + 1), V], batched: row (b, t) is request b
        after its drafts d_1 .. d_j (j = min(t, its drafts)), as a plain step would see it had they been emitted:
        min_tokens counts them, the penalties count them on top of the slot's statistics, the grammar's mask is
        its matcher's after them (grammar.TokenMasks.fill_drafts)."""
        rows, pending = [], []
        for r in reqs:
            for t in range(K + 1):
                j = min(t, len(r.drafts))
                rows.append(SampleRow(r.params, r.generator, r.slot, len(r.out) + j, r.prompt, r.stop_ids))
                pending.append(r.drafts[:j])
        bitmask = None
        if any(r.grammar is not None for r in reqs):
            loop = self.loop
            if loop.masks is None:
                loop.masks = TokenMasks(loop.cache.num_slots, self.model.config.vocab_size, loop.cache.device)
            bitmask = loop.masks.fill_drafts(reqs, K)
        return process_logits(raw, rows, self.loop.penalties, bitmask, pending)

    def _deliver(self, step: list, decodes: int, reqs: list, out: dict, spec: list[int]) -> None:
        """Take the step's tokens into their requests, in order, through the loop's stop checks; count the step."""
        loop = self.loop
        loop.scheduler.advance(step, decodes)
        loop._steps += 1
        loop._prompt_tokens += sum(len(c.tokens) for c in step[decodes:])
        now, outputs, last = time.perf_counter(), {}, []
        loop._undelivered = outputs  # (should the loop die before deliver: its end delivers them)
        emitted = out.get("spec", {}) | out.get("plain", {})
        for i, (toks, entries) in sorted(emitted.items()):
            r = reqs[i]
            for t, entry in zip(toks, entries):
                if r.ended:  # a stop before it: never emitted nor counted
                    break
                r.out.append(t)
                loop._generated += 1
                try:
                    outputs.setdefault(r.channel, []).append(loop._advance(r, t, now, entry))
                except BaseException as e:  # the tokenizer, its slot's reset or prefix save failed: only r sees it
                    loop._fail(r, e, flush=False)
            r.sampled = len(r.out)
            if not r.ended:
                last.append((r.slot, r.out[-1]))
        if last and not out.get("last_set"):  # a later plain step's decodes read them on the device
            slots, ids = zip(*last)
            loop.last_tokens.index_copy_(0, to_device(int_tensor(slots), loop.last_tokens.device),
                                         to_device(int_tensor(ids), loop.last_tokens.device))
        deliver(outputs)
        loop._undelivered = None


def targets(cache, tokens: list[int], entries: list[int]) -> None:
    """The verify checkpoints of a step (cache.checkpoint_tokens / entries past prefix_targets): the GDN ops keep
    the state after packed token tokens[i] in entry entries[i]; the rest -1 (none). One copy to the device, none
    when the device holds them already (cache_prefixes.set_verify_targets); the prefill protocol clears them
    before any other step."""
    if cache.verify_entries:
        set_verify_targets(cache, tokens, entries)
