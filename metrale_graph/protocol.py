"""The prefill protocol: the one place where a batch of streams meets a cache.

    with prefill_call(model, cache, streams) as call:   # checked, the cache held: nothing written yet
        ...                                              # (a runner compiles / captures its buckets here)
        logits = call.run(step)                          # reserve, pack, step, commit: one transaction

Every caller goes through it: `HybridModel.prefill`, `GraphRunner.prefill`, the ONNX export's check
and the tests. Its steps, in order:

1. check: the cache is this model's (`model.check_cache`, config / dtype / device / owner), and it is
   held for the whole call (`cache.exclusive()`: another caller gets CacheInUseError);
2. validate: every stream (`batch.validate`: types, slots, token ids, per-slot capacity, free KV
   blocks); a ValueError here leaves every slot as it was; only then does a cache made without an
   owner become this model's (`cache.bind`);
3. `run(step, pieces)`: inside `cache.transaction` (a failure resets the batch's slots), reserve the
   KV blocks of every stream (`cache.allocate`), then for each piece (all streams at once, or the
   bucket-sized pieces a runner asks for) pack it (`batch.pack`), run `step(packed)` and advance the
   slots' contexts (`cache.commit`); return each stream's last-token logits.

A piece is a list of (stream index, start, stop) token ranges (`capture.buckets.split` makes them); a
stream cut over several pieces continues from the context the earlier piece left, as a chunked
prefill does, and its logits are those of its last range.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Iterator, Sequence

import torch

from .batch import BatchTokens, PackedBatch, Stream, check_token_ids, pack, token_tensor, validate
from .cache import HybridCache
from .cache_prefixes import clear_verify_targets
from .numbers import int_tensor, is_int, to_device

Piece = list[tuple[int, int, int]]  # (stream index, start, stop) token ranges of one step


class PrefillCall:
    """One prefill call: its validated batch (`batch.validate`: each stream's slot, its token ids and
    count) on a held cache."""

    def __init__(self, cache: HybridCache, tokens: BatchTokens):
        self.cache, self.tokens = cache, tokens
        self.slots, self.lengths = tokens.slots, tokens.lengths
        self.num_tokens = tokens.ids.numel()
        self.growth = dict(zip(self.slots, self.lengths))  # new tokens per slot
        self._ran = False

    @property
    def whole(self) -> Piece:
        """Every stream, whole: the one piece of a call that is not split."""
        return [(i, 0, n) for i, n in enumerate(self.lengths)]

    def run(self, step: Callable[[PackedBatch], torch.Tensor], pieces: Sequence[Piece] | None = None) -> torch.Tensor:
        """Write the streams into the cache: reserve their KV blocks, then per piece (default: one piece
        holding every stream) pack it, run `step(packed)` (logits [piece streams, vocab], row r for the
        piece's r-th range) and commit its tokens. Returns logits [num_streams, vocab] of each stream's
        last token (with one piece, the rows of step's own output). Anything raised inside (by `step`
        too) resets the call's slots and propagates (HybridCache.transaction). One run per call."""
        if self._ran:
            raise RuntimeError("a PrefillCall runs once")
        self._ran = True
        if pieces is not None:
            pieces = list(pieces)
            self._check_pieces(pieces)
        cache, B = self.cache, len(self.slots)
        chosen: list[torch.Tensor] = []  # per piece, the logits of the streams whose last range it holds
        order: list[int] = []  # those streams, in the order of `chosen`'s rows
        with cache.transaction(self.growth):
            cache.allocate(self.tokens.new_blocks)
            for slots, ids, lengths, piece in self._pieces(pieces):
                out, fed = self._step(step, slots, ids, lengths)
                growth = self.growth if piece is None else dict(zip(slots, lengths))
                cache.commit(growth, None if fed is None else dict(zip(slots, fed)))
                if piece is None:  # every stream whole: the step's rows are the logits
                    return out if out.shape[0] == B else out[:B]
                rows = [r for r, (i, _, b) in enumerate(piece) if b == self.lengths[i]]
                if rows:
                    order += [piece[r][0] for r in rows]
                    chosen.append(out.index_select(0, to_device(int_tensor(rows), out.device)))
        logits = torch.cat(chosen) if len(chosen) > 1 else chosen[0]
        if order != list(range(B)):  # pieces that end their streams out of order
            logits = logits.index_select(0, to_device(int_tensor(order), logits.device).argsort())
        return logits

    def launch(self, step: Callable[[PackedBatch], torch.Tensor], last_tokens: torch.Tensor,
               k: int) -> tuple[torch.Tensor, Callable[[list[int]], None]]:
        """run()'s one step for a caller that knows the first `k` streams' token ids only on the device (the
        engine's asynchronous loop: the tokens it sampled in the step before, not read back yet). Each of
        those streams is one token, given in `streams` as a placeholder id; the step reads
        `last_tokens[slot]` (int64 [slots + 1], on the cache's device) instead. Returns (logits, commit):
        the logits as `step` returned them (one piece: the whole batch), and commit(ids), which the caller
        calls with those k ids once it has them, before any other use of the cache: it advances the slots'
        contexts (and with prefix caching labels the blocks they filled). Anything raised before launch
        returns resets the call's slots (as run's); a caller that never commits resets them itself."""
        if self._ran:
            raise RuntimeError("a PrefillCall runs once")
        self._ran = True
        assert 0 <= k <= len(self.slots) and self.lengths[:k].count(1) == k, "k one-token streams first"

        def read_last(packed: PackedBatch) -> torch.Tensor:
            # (index_select into the packed tokens: a third of the cost of assigning a slice)
            if k == packed.tokens.shape[0] == packed.slot_ids.shape[0]:  # every token and stream a decode's
                torch.index_select(last_tokens, 0, packed.slot_ids, out=packed.tokens)
            elif k:
                torch.index_select(last_tokens, 0, packed.slot_ids[:k], out=packed.tokens[:k])
            return step(packed)

        with self.cache.transaction(self.growth):
            self.cache.allocate(self.tokens.new_blocks)
            out, fed = self._step(read_last, self.slots, self.tokens.ids, self.lengths)

        def commit(ids: list[int]) -> None:
            assert len(ids) == k, "commit takes the k ids the step read on the device"
            if fed is not None:
                for i, t in enumerate(ids):
                    fed[i] = [t]
            self.cache.commit(self.growth, None if fed is None else dict(zip(self.slots, fed)))

        return out, commit

    def run_settled(self, step: Callable[[PackedBatch], torch.Tensor], settle: Callable[[torch.Tensor], list[int]],
                    partial: Sequence[int] = ()):
        """One step whose streams keep only part of what they fed (speculative decoding's verify,
        speculative/verify.py): reserve, pack, `step(packed)`, then `settle(step's output)` returns how many of
        each stream's tokens it keeps (a prefix, <= its length; its states already made those of the kept
        tokens), and only those are committed (the context advances by them; with prefix caching only they label
        blocks). KV written past a kept run lies past the context: never read, overwritten later; the blocks
        stay with the slot. `partial`: the streams settle may cut (the speculating decodes), in which no prefix
        checkpoint is planned (one after a draft would keep a state of tokens that may be rejected; a plain decode
        keeps none either). All inside one transaction (a failure resets the call's slots). Returns step's output."""
        if self._ran:
            raise RuntimeError("a PrefillCall runs once")
        self._ran = True
        with self.cache.transaction(self.growth):
            self.cache.allocate(self.tokens.new_blocks)
            out, fed = self._step(step, self.slots, self.tokens.ids, self.lengths, verify=True, partial=partial)
            kept = settle(out)
            assert all(0 <= k <= n for k, n in zip(kept, self.lengths)), "settle keeps a prefix of each stream"
            self.cache.commit(dict(zip(self.slots, kept)),
                              None if fed is None else {s: f[:k] for s, f, k in zip(self.slots, fed, kept)})
        return out

    def launch_settled(self, step: Callable[[PackedBatch], torch.Tensor], extra: list[tuple[int, int]] = ()):
        """run_settled's step launched with its settling left to the caller (speculative/ahead.py: a verify step
        launched before the previous one's accept counts are on the host). Reserves the streams' KV blocks and,
        past them, `extra`'s (slot, tokens past its context) pairs (cache.block_needs), packs, runs `step(packed)`
        and returns (its output, commit): commit({slot: kept tokens}) advances those slots' contexts once the
        caller knows them (slots left out keep theirs: a request that ended meanwhile, its slot reset). Anything
        raised before it returns resets the call's slots. Not with prefix caching (the kept tokens would label
        blocks with ids the host does not know)."""
        if self._ran:
            raise RuntimeError("a PrefillCall runs once")
        self._ran = True
        assert not self.cache.prefix_caching, "launch_settled does not label blocks"
        with self.cache.transaction(self.growth):
            self.cache.allocate(self.tokens.new_blocks)
            self.cache.allocate(self.cache.block_needs(list(extra)))
            out, _ = self._step(step, self.slots, self.tokens.ids, self.lengths, verify=True)
        return out, self.cache.commit

    def _step(self, step, slots: list[int], ids: torch.Tensor, lengths: list[int], verify: bool = False,
              partial: Sequence[int] = ()):
        """Pack one piece, run `step` on it with prefix caching's checkpoints planned (and recorded once it has
        run, or given back if it raises) in its streams but `partial` (run_settled's); returns (step's output,
        each stream's new ids with prefix caching else None), the slots not committed yet. A step that is not a
        verify step (run_settled's) first drops the verify targets a verify step left
        (cache_prefixes.clear_verify_targets)."""
        cache = self.cache
        if not verify:
            clear_verify_targets(cache)
        fed = _split_list(ids.tolist(), lengths) if cache.prefix_caching else None
        plan = []
        try:  # the planned entries go back if the step fails (plan_checkpoints gives back its own)
            if fed is not None:
                skip = set(partial)
                plan = cache.plan_checkpoints([s for i, s in enumerate(_offsets(slots, fed)) if i not in skip])
            out = step(pack(slots, ids, lengths, cache))
        except BaseException:
            cache.record_checkpoints(plan, written=False)
            raise
        cache.record_checkpoints(plan, written=True)
        return out, fed

    def _pieces(self, pieces: list[Piece] | None):
        """(slots, ids, lengths, piece) of each step: the whole batch (piece None) or each piece's ranges."""
        tokens = self.tokens
        if pieces is None:
            yield self.slots, tokens.ids, self.lengths, None
            return
        starts = [0, *itertools.accumulate(self.lengths)][:-1]  # of each stream in tokens.ids
        for piece in pieces:
            spans = [(starts[i] + a, starts[i] + b) for i, a, b in piece]
            if all(spans[k][1] == spans[k + 1][0] for k in range(len(spans) - 1)):  # one run of ids (split's)
                ids = tokens.ids[spans[0][0]:spans[-1][1]]
            else:
                ids = torch.cat([tokens.ids[a:b] for a, b in spans])
            yield [self.slots[i] for i, _, _ in piece], ids, [b - a for _, a, b in piece], piece

    def _check_pieces(self, pieces: list[Piece]) -> None:
        """Internal invariant: the pieces cover each stream's tokens once, in order."""
        done = [0] * len(self.slots)
        for piece in pieces:
            for i, a, b in piece:
                assert a == done[i] and a < b <= self.lengths[i], f"piece range {(i, a, b)} out of order"
                done[i] = b
        assert done == self.lengths, "the pieces do not cover every stream's tokens"


def _split_list(ids: list[int], lengths: list[int]) -> list[list[int]]:
    """`ids` cut into consecutive runs of `lengths`."""
    out, start = [], 0
    for n in lengths:
        out.append(ids[start:start + n])
        start += n
    return out


def _offsets(slots: list[int], fed: list[list[int]]) -> list[tuple[int, int, list[int]]]:
    """(slot, packed offset, new tokens) of each stream of a piece, as laid out by pack."""
    out, offset = [], 0
    for slot, new in zip(slots, fed):
        out.append((slot, offset, new))
        offset += len(new)
    return out


@contextlib.contextmanager
def prefill_call(model, cache: HybridCache, streams: Sequence[Stream]) -> Iterator[PrefillCall]:
    """Check and validate a prefill of `streams` on `cache` and hold the cache for it (module docstring).
    Raises ValueError (bad input, another model's cache) or CacheInUseError before anything changes."""
    model.check_cache(cache, claim=False)
    with cache.exclusive():
        tokens = validate(streams, cache, model.config.vocab_size)
        cache.bind(model)  # the input is good: a cache made without an owner becomes this model's
        yield PrefillCall(cache, tokens)


def restore_prefix(model, cache: HybridCache, slot: int, tokens, limit: int | None = None) -> int:
    """Start empty `slot` of a cache with prefix caching from the longest cached prefix of `tokens` (at
    most `limit` tokens; default len(tokens) - 1, leaving the last token to prefill, whose logits a caller
    samples): its KV blocks shared, its GDN states restored (`cache.prefixes`: cache_prefixes.PrefixStore.restore).
    Returns the number of tokens restored, 0 when none is cached (or prefix caching is off); the caller then
    prefills `tokens[restored:]` into the slot. ValueError for bad tokens or a slot that holds context,
    before anything changes."""
    model.check_cache(cache, claim=False)
    with cache.exclusive():
        cache.check_slot(slot)
        if cache.context_lens[slot]:
            raise ValueError(f"slot {slot} holds {cache.context_lens[slot]} tokens: a prefix is restored into an "
                             "empty slot (reset it first)")
        ids = token_tensor(tokens, "tokens", cache.device)
        check_token_ids([ids], model.config.vocab_size, what="tokens")
        n = ids.numel()
        limit = n - 1 if limit is None else limit
        if not (is_int(limit) and 0 <= limit <= min(n, cache.max_context)):  # (a bool is not a limit)
            raise ValueError(f"limit must be an int in [0, {min(n, cache.max_context)}], got {limit!r}")
        limit = int(limit)
        cache.bind(model)
        return cache.prefixes.restore(slot, ids.tolist(), limit)
