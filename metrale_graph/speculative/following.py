"""Speculative decoding on the followers of a plan broadcast (plan_sync.py): rank 0 decides, every rank computes.

Under tensor parallelism with `broadcast_plans` rank 0 alone holds the requests: their tokens, drafts, sampling
parameters, generators, penalty counts and grammar matchers. Each rank holds a shard of the model, so every step's
collectives must meet on every rank, in the same order and shapes; and each rank holds its shard of one logical
cache, so every rank must keep the same tokens in the same slots, blocks and states. A speculative step
(verify.py) therefore runs like this:

1. Rank 0 sends a SPECULATE plan: every stream's tokens (a speculating decode's last token and its drafts, n-gram
   or MTP, so the drafts travel as tokens), the decodes' count, the sampling rows, and how it will accept (the
   captured acceptance or the eager one, greedy or sampled). The follower lays the step out from the stream lengths
   alone (layout.verify_layout: the same verify entries), and runs the same verify step (the same bucket, the same
   checkpoint targets).
2. Acceptance: rank 0 runs it and shares the outcome; the followers do not recompute it. Recomputing would be exact
   for plain greedy rows (the gathered logits are the same on every rank), but not in general: the eager path's
   logits processors read state only rank 0 keeps (grammar matchers on its host, penalty counts, min_tokens, bias),
   and sampled rows draw uniforms from the requests' generators on rank 0. So, as a plain step's sampled tokens are
   (plan_sync.share_tokens), rank 0 broadcasts each row's accept count and last token after its read back, and
   the followers apply them: the accepted states copied into the slots from the same verify entries
   (SpeculativeStep.keep_states), the tokens into last_tokens, the kept lengths committed. Exact by construction,
   whatever the sampling, seeds and processors; one more small broadcast a verify step. The LM head is
   vocabulary-parallel: each rank computes its part of the vocabulary for the rows rank 0's acceptance reads, and
   the all-gather joins them, so the follower runs the head over exactly those rows, and drops the logits: with
   the captured acceptance it runs the same entry with those rows in its buffer (SpeculativeGraphs.replay; the same
   lazy warm-up too, so the same number of gathers), with the eager one the head over the same rows in the same
   two calls (position_rows, then last_rows).
3. "mtp": the head is a sharded decoder layer, so its catch-up and drafts run on every rank. Rank 0 sends a DRAFT
   message once the step's tokens are delivered (its journal first: the slots its stops gave back free their blocks
   before the drafts take theirs, as on rank 0) with the drafting's inputs (drafting.DraftBatch: slots, the catch-up's
   next tokens, rows, contexts, drafts wanted); the follower runs the same drafting on the hidden states its verify
   step kept, allocating the same blocks and writing the same head entries, and drops the drafts, which come back
   as tokens in rank 0's next SPECULATE plan. With prefix caching, where the step's tokens end requests, a DRAFT
   message before their delivery comes first: their catch-up alone (drafting.catch_up_ending), which every rank
   runs on the same hidden states.

A step that fails on rank 0 alone leaves the ranks out of step, as a plain step does (plan_sync.py).
"""

from __future__ import annotations

from ..numbers import int_tensor, to_device
from ..protocol import prefill_call
from .drafting import DraftBatch
from .layout import acceptance_rows, kept_lengths, last_rows, position_rows, verify_layout


class SpeculativeFollower:
    """A follower's side of the engine loop's SpeculativeStep (`spec`: this rank's, built from the same options)."""

    def __init__(self, spec, broadcast):
        self.spec, self.broadcast = spec, broadcast
        self._verified = None  # (h, bucket) of the last verify step, which a DRAFT message drafts after

    def verify(self, plan) -> None:
        """Run rank 0's verify step (a plan_sync.Plan of kind SPECULATE) and settle it with rank 0's counts."""
        spec, model, cache = self.spec, self.spec.model, self.spec.cache
        streams, (captured, sampled) = plan.streams, plan.extra
        layout = verify_layout([len(s.tokens) for s in streams], plan.decodes, plan.sampling, spec.base, spec.k,
                               cache.verify_entries)
        rows, S = layout.spec + layout.plain, len(layout.spec)
        self._verified, out = None, {}

        def settle(h):
            out["h"] = h
            if not rows:
                return kept_lengths(layout, [])
            dev = h.device
            if spec.graphs is not None and out["bucket"] is not None and captured:
                spec.graphs.replay(out["bucket"], h, acceptance_rows(layout, spec.k), bool(sampled))
            else:  # rank 0's _accept_eager: the head over the speculating streams' positions, then the plain rows
                if S:
                    starts = [layout.starts[i] for i in layout.spec]
                    drafts = [layout.lengths[i] - 1 for i in layout.spec]
                    model.logits_of(h.index_select(0, to_device(int_tensor(position_rows(starts, drafts, spec.k)), dev)))
                if layout.plain:
                    model.logits_of(h.index_select(0, to_device(int_tensor(last_rows(layout, layout.plain)), dev)))
            shared = self.broadcast.receive_tokens(S + len(rows))  # rank 0's counts, then each row's last token
            counts = shared[:S].tolist()
            slots = [streams[i].slot for i in rows]
            spec.keep_states(layout, slots[:S], counts)
            spec.loop.last_tokens.index_copy_(0, to_device(int_tensor(slots), dev), shared[S:])
            return kept_lengths(layout, counts)

        with prefill_call(model, cache, streams) as call:
            call.run_settled(lambda packed: spec.forward(packed, layout, out), settle, layout.spec)
        if spec.mtp is not None:  # (kept for the DRAFT message after it)
            self._verified = (out["h"], out["bucket"])

    def draft(self, plan) -> None:
        """Run rank 0's MTP drafting (a plan_sync.Plan of kind DRAFT) after the verify step just run: one or two
        (with prefix caching, where the step's delivery ends requests, their catch-up first: catch_up_ending)."""
        if self._verified is None:
            raise RuntimeError("rank 0 sent an MTP drafting without a verify step before it on this rank")
        h, bucket = self._verified
        self.spec.mtp.run(DraftBatch.of(plan.streams, plan.extra), h, self.spec.graphs, bucket)
