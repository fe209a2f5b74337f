"""The MTP head's drafts in the engine, batched over the requests of a speculative step (verify.py): compiled (on
CUDA captured) through capture/speculative.py's SpeculativeGraphs where the step ran in a bucket, else eagerly.

The conventions are mtp.py's (draft_mtp is the one-stream form of the same thing). After a step kept positions
b .. n' - 1 of a request (b: its context before the step; n': after; the head has caught up on b positions,
cache.mtp_context_lens[slot] == b), the head catches up on them: position p reads token p + 1 (the request's
prompt and output hold it: a prompt token, a kept draft, or the token the step emitted) beside the main model's
normed hidden state of p from this very step; the last output gives draft 1 (of token n' + 1), and draft j + 1
runs the head at position n' + j - 1 on draft j beside its own previous output. Drafts are the head's argmax
(one-hot proposals for acceptance.accept_drawn, whatever the request's temperature: exact either way). The drafts' own
KV entries (positions n' .. n' + k - 2) are not counted (mtp_context_lens becomes n'); the next catch-up
rewrites the kept positions. With prefix caching the tokens each kept entry read are noted with its block
(SlotBlocks.head_written), so that a request restoring those blocks keeps its MTP drafts; a request the step
ends is caught up on before the delivery keeps its prefix (catch_up_ending: the next turn of a conversation
restoring it drafts too). The blocks they need are the slot's, within its reservation (k leaves room for the
added token: n' + k - 1 <= prompt + max_new - 1).
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import torch

from ..batch import PackedBatch, Stream
from ..numbers import int_tensor, to_device
from .mtp import mtp_hidden_states
from .stops import stop_index


class DraftBatch(NamedTuple):
    """One drafting's inputs, on the host: per stream its slot, its catch-up's next tokens (`ids`, one per kept
    position), where its kept positions' rows of the verify step's h begin (`starts`), its context before the
    step (`begins`: the head's first catch-up position) and the drafts it gets (`want`)."""
    slots: list[int]
    ids: list[list[int]]
    starts: list[int]
    begins: list[int]
    want: list[int]

    def message(self) -> tuple[list[Stream], list[int]]:
        """(streams, extra) of the plan broadcast's DRAFT message (plan_sync.py)."""
        return [Stream(s, i) for s, i in zip(self.slots, self.ids)], self.starts + self.begins + self.want

    @classmethod
    def of(cls, streams: list[Stream], extra: list[int]) -> "DraftBatch":
        """message()'s batch back."""
        n = len(streams)
        return cls([s.slot for s in streams], [list(s.tokens) for s in streams], extra[:n], extra[n:2 * n],
                   extra[2 * n:3 * n])


class MtpDrafter:
    def __init__(self, model, cache, fail: Callable | None = None):
        self.model, self.cache = model, cache
        self.fail = fail  # fail(request, error): the engine loop's, for catch_up_ending (None: raise)
        self.on_batch: Callable[[DraftBatch], None] | None = None  # told each batch before it runs (plan_sync.py)

    def draft(self, h: torch.Tensor, reqs: list, before: list[int], starts: list[int], room: list[int],
              graphs=None, bucket=None) -> dict:
        """Drafts {slot: ids} for requests `reqs` after a step whose hidden states (before the final norm) are `h`:
        request i's kept positions are before[i] .. its context now - 1, its rows of h from starts[i] on; it gets
        room[i] drafts (none for 0). A request the head has not followed up to before[i] gets none. `graphs`,
        `bucket`: a SpeculativeGraphs (capture/speculative.py) and the bucket whose hidden-states step made `h`:
        the head runs there, compiled (on CUDA captured: one replay, one read back), else eagerly."""
        cache = self.cache
        todo = [i for i, r in enumerate(reqs) if cache.mtp_context_lens[r.slot] == before[i]
                and cache.context_lens[r.slot] > before[i]]
        if not todo:
            return {}
        ids = []
        for i in todo:  # catch-up: every kept position of each request, its next token from the request's tokens
            seq = reqs[i].prompt + reqs[i].out
            ids.append(seq[before[i] + 1:cache.context_lens[reqs[i].slot] + 1])
        batch = DraftBatch([reqs[i].slot for i in todo], ids, [starts[i] for i in todo], [before[i] for i in todo],
                           [room[i] for i in todo])
        if self.on_batch is not None:
            self.on_batch(batch)
        return self.run(batch, h, graphs, bucket)

    def catch_up_ending(self, out: dict, reqs: list, before: list[int], starts: list[int], graphs=None) -> None:
        """With prefix caching, after a verify step (`out`: its hidden states "h", its tokens per request index in
        "spec" / "plain", (tokens, logprobs)) has committed, before its tokens are delivered: the head catches up,
        drafting nothing, on the kept positions of each request reqs[i] (None: one it does not follow; its context
        before[i], its rows of h from starts[i]) that the delivery will end (stops.stop_index over its tokens). The
        prefix its slot keeps when it ends then holds the head's entries of every position, so a later prompt going
        on past it (the next turn of a conversation) keeps its MTP drafts (cache_prefixes.PrefixStore.restore). The
        last kept position reads the token after it in prompt + output + the step's tokens: the one the step added
        (never fed), or where r stops at a kept draft the step's token after that draft (a restore checks it against
        the prompt's). `graphs` and out["bucket"]: as draft's. One that raises fails those requests alone (`fail`;
        its transaction reset their slots)."""
        cache, todo = self.cache, {}
        heads, contexts = cache.mtp_context_lens, cache.context_lens
        for i, (tokens, _) in itertools.chain(out.get("spec", {}).items(), out.get("plain", {}).items()):
            r = reqs[i]  # (one without tokens goes on; stop_index answers most requests by stops.may_end alone)
            if (r is None or r.finish_reason is not None or r.error is not None
                    or heads[r.slot] != before[i] or contexts[r.slot] <= before[i]):
                continue
            try:
                if stop_index(r, tokens) is not None:
                    todo[i] = tokens
            except BaseException:  # (the delivery meets it again and fails r alone: nothing kept for it)
                pass
        if not todo:
            return
        todo = dict(sorted(todo.items()))
        ids = [(reqs[i].prompt + reqs[i].out + t)[before[i] + 1:contexts[reqs[i].slot] + 1] for i, t in todo.items()]
        batch = DraftBatch([reqs[i].slot for i in todo], ids, [starts[i] for i in todo], [before[i] for i in todo],
                           [0] * len(todo))
        try:
            if self.on_batch is not None:
                self.on_batch(batch)
            self.run(batch, out["h"], graphs, out["bucket"])
        except BaseException as e:
            if self.fail is None:
                raise
            for i in todo:
                self.fail(reqs[i], e)

    def run(self, batch: DraftBatch, h: torch.Tensor, graphs=None, bucket=None) -> dict:
        """draft's head over `batch` (on a follower of a plan broadcast: rank 0's): the catch-up, the drafts, the
        head's context; {slot: drafts}."""
        cache, slots = self.cache, batch.slots
        with cache.exclusive(), cache.transaction(slots):
            lengths = [len(i) for i in batch.ids]
            ids = [t for i in batch.ids for t in i]
            rows = [r for s, n in zip(batch.starts, lengths) for r in range(s, s + n)]
            want = batch.want
            cache.allocate(cache.block_needs([(s, k - 1) for s, k in zip(slots, want) if k > 1]))
            args = (h, slots, ids, rows, lengths, batch.begins, want)
            if graphs is not None and bucket is not None and bucket.holds(len(slots), len(ids)):
                drafts = self._captured(graphs, bucket, *args)
            else:
                drafts = self._eager(*args)
            for slot, begin, new in zip(slots, batch.begins, batch.ids):
                cache.mtp_context_lens[slot] = cache.context_lens[slot]
                if cache.prefix_caching:  # what a restore of these blocks checks (cache_prefixes.restore)
                    cache.slot_blocks.head_written(slot, begin, new)
        return drafts

    def launch_after(self, graphs, bucket, h: torch.Tensor, result: torch.Tensor, reqs: list, before: list[int],
                     starts: list[int], drafts: list[int], patch=None) -> torch.Tensor | None:
        """The head's catch-up and drafts launched right behind a captured acceptance (graphs.draft_after), its
        inputs taken from the acceptance's `result` [r, K + 2] on the device, so that one read back brings the
        accept counts and the next drafts: for a step whose r rows are all speculating decodes the head follows
        up to their context `before` (request reqs[j] with drafts[j] drafts verified from h row starts[j], in
        result's row order). Every verify position is caught up on (what follows a stream's count is rewritten
        later, never counted); the blocks its draft steps may write (the most at the least count, within the
        reservation) are given now. None when the drafting does not fit the bucket (draft then runs after the
        read back), else graphs.draft_after's [r, K + 2 + K]: `result` as its entry copied it, then the drafts. The
        caller notes what the head wrote (`note_after`) once the step has committed. `patch`: graphs.draft_after's
        (a step launched ahead: its positions, contexts and tokens left from the device, speculative/ahead.py)."""
        cache, K = self.cache, graphs.K
        lengths = [n + 1 for n in drafts]
        if self.on_batch is not None or not bucket.holds(len(reqs), sum(lengths)):
            return None
        remaining = [r.max_new - len(r.out) for r in reqs]
        cache.allocate(cache.block_needs([(r.slot, max(0, min(n + K, rem - 2)))
                                          for r, n, rem in zip(reqs, drafts, remaining)]))
        ends = list(itertools.accumulate(lengths))
        index = [j * (K + 2) + 1 + t for j, n in enumerate(lengths) for t in range(n)]
        positions = [b + t for b, n in zip(before, lengths) for t in range(n)]
        rows = [s + t for s, n in zip(starts, lengths) for t in range(n)]
        tok = torch.tensor([index, positions, rows], dtype=torch.int64)
        strm = torch.tensor([ends, [r.slot for r in reqs], before, [e - n for e, n in zip(ends, lengths)], remaining],
                            dtype=torch.int64)
        return graphs.draft_after(bucket, h, result, tok, strm, patch)

    def note_after(self, reqs: list, before: list[int], emitted: list[list[int]]) -> None:
        """After a step whose drafting ran behind its acceptance (launch_after) has committed: each request's head
        context is its context, and with prefix caching its kept entries read `emitted` (its kept drafts and the
        token the step added: the next token of each kept position)."""
        cache = self.cache
        with cache.exclusive():
            for r, begin, new in zip(reqs, before, emitted):
                cache.mtp_context_lens[r.slot] = cache.context_lens[r.slot]
                if cache.prefix_caching:  # what a restore of these blocks checks (cache_prefixes.restore)
                    cache.slot_blocks.head_written(r.slot, begin, new)

    def take_after(self, reqs: list, rows: list[list[int]], room: list[int]) -> dict:
        """draft's {slot: drafts} from a launch_after's read back `rows` (request reqs[j]'s K drafts): room[j] of
        them for each request still running, none for one that ended."""
        return {r.slot: row[:k] for r, row, k in zip(reqs, rows, room) if k > 0 and not r.ended}

    def _captured(self, graphs, bucket, h, slots, ids, rows, lengths, begins, want) -> dict:
        """draft's head through graphs.draft (tail.mtp_drafts' layouts): every stream runs every draft step, a
        stream past its own drafts on the scratch slot at position 0 (its null-block row), as padding does."""
        cache, K = self.cache, graphs.K
        context = [cache.context_lens[s] for s in slots]
        positions = [p for b, n in zip(begins, lengths) for p in range(b, b + n)]
        tok = torch.tensor([ids, positions, list(rows)], dtype=torch.int64)
        ends = list(itertools.accumulate(lengths))
        strm = [ends, slots, begins, [e - 1 for e in ends]]
        for step in range(K - 1):  # draft step + 2 at position n' + step, for a stream that wants it
            live = [k > step + 1 for k in want]
            strm += [[c + step if w else 0 for c, w in zip(context, live)],
                     [s if w else cache.scratch_slot for s, w in zip(slots, live)]]
        out = graphs.draft(bucket, h, tok, torch.tensor(strm, dtype=torch.int64)).tolist()  # the drafting's one read back
        return {s: row[:k] for s, row, k in zip(slots, out, want) if k > 0}

    def _eager(self, h, slots, ids, rows, lengths, begins, want) -> dict:
        """draft's head step by step: the catch-up, then one batched head step per draft (a read back each)."""
        cache, model = self.cache, self.model
        hidden = model.normed(h.index_select(0, to_device(int_tensor(rows), h.device)))
        out = mtp_hidden_states(model, cache, _packed(cache, slots, ids, lengths, begins), hidden)
        ends = [s - 1 for s in itertools.accumulate(lengths)]
        prev = out.index_select(0, to_device(int_tensor(ends), out.device))
        drafts = {s: [] for s, k in zip(slots, want) if k > 0}
        live = [j for j, k in enumerate(want) if k > 0]
        prev = prev.index_select(0, to_device(int_tensor(live), prev.device)) if live else prev
        step = 0
        while live:
            for j, t in zip(live, model.head(prev).argmax(dim=-1).tolist()):
                drafts[slots[j]].append(t)
            more = [x for x, j in enumerate(live) if want[j] > step + 1]
            if not more:
                break
            live = [live[x] for x in more]
            prev = prev.index_select(0, to_device(int_tensor(more), prev.device))
            # draft step + 2 from the head at position n' + step on draft step + 1, beside its own output
            batch = _packed(cache, [slots[j] for j in live], [drafts[slots[j]][-1] for j in live],
                            [1] * len(live), [cache.context_lens[slots[j]] + step for j in live])
            prev = mtp_hidden_states(model, cache, batch, prev)
            step += 1
        return drafts


def _packed(cache, slots: list[int], ids: list[int], lengths: list[int], starts: list[int]) -> PackedBatch:
    """A PackedBatch of streams writing `slots` (the head's entries) with `lengths` tokens `ids` at positions
    starts[i] ..; their entries start at starts[i]."""
    dev = cache.device
    positions = [p for s, n in zip(starts, lengths) for p in range(s, s + n)]
    cu = [0, *itertools.accumulate(lengths)]
    slot_ids = to_device(int_tensor(slots), dev)
    return PackedBatch(tokens=to_device(int_tensor(ids), dev), positions=to_device(int_tensor(positions), dev),
                       cu_seqlens=to_device(int_tensor(cu, torch.int32), dev), slot_ids=slot_ids,
                       context_lens=to_device(int_tensor(starts, torch.int32), dev),
                       block_tables=cache.block_tables.index_select(0, slot_ids))
