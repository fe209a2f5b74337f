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
from typing import Callable, Iterator, Sequence

import torch

from .batch import PackedBatch, Stream, check_token_ids, pack, token_tensor, validate
from .cache import HybridCache

Piece = list[tuple[int, int, int]]  # (stream index, start, stop) token ranges of one step


class PrefillCall:
    """One prefill call: its validated streams (`tokens[i]`: stream i's int64 ids) on a held cache."""

    def __init__(self, cache: HybridCache, streams: Sequence[Stream], tokens: list[torch.Tensor]):
        self.cache, self.streams, self.tokens = cache, list(streams), tokens
        self.lengths = [t.numel() for t in tokens]
        self.growth = {s.slot: n for s, n in zip(self.streams, self.lengths)}  # new tokens per slot
        self._ran = False

    @property
    def whole(self) -> Piece:
        """Every stream, whole: the one piece of a call that is not split."""
        return [(i, 0, n) for i, n in enumerate(self.lengths)]

    def run(self, step: Callable[[PackedBatch], torch.Tensor], pieces: Sequence[Piece] | None = None) -> torch.Tensor:
        """Write the streams into the cache: reserve their KV blocks, then per piece (default: one piece
        holding every stream) pack it, run `step(packed)` (logits [piece streams, vocab], row r for the
        piece's r-th range) and commit its tokens. Returns logits [num_streams, vocab] of each stream's
        last token. Anything raised inside (by `step` too) resets the call's slots and propagates
        (HybridCache.transaction). One run per call."""
        if self._ran:
            raise RuntimeError("a PrefillCall runs once")
        self._ran = True
        pieces = [self.whole] if pieces is None else list(pieces)
        self._check_pieces(pieces)
        cache = self.cache
        logits: list[torch.Tensor | None] = [None] * len(self.streams)
        with cache.transaction(self.growth):
            cache.allocate(self.growth)
            for piece in pieces:
                sub = [Stream(self.streams[i].slot, self.tokens[i][a:b]) for i, a, b in piece]
                fed = {s.slot: s.tokens.tolist() for s in sub} if cache.prefix_caching else None
                plan = cache.plan_checkpoints(_offsets(sub, fed)) if fed is not None else []
                try:
                    out = step(pack(sub, [s.tokens for s in sub], cache))
                except BaseException:
                    cache.record_checkpoints(plan, written=False)
                    raise
                cache.record_checkpoints(plan, written=True)
                cache.commit({s.slot: b - a for s, (_, a, b) in zip(sub, piece)}, fed)
                for row, (i, _, b) in enumerate(piece):
                    if b == self.lengths[i]:
                        logits[i] = out[row]
        return torch.stack(logits)

    def _check_pieces(self, pieces: list[Piece]) -> None:
        """Internal invariant: the pieces cover each stream's tokens once, in order."""
        done = [0] * len(self.streams)
        for piece in pieces:
            for i, a, b in piece:
                assert a == done[i] and a < b <= self.lengths[i], f"piece range {(i, a, b)} out of order"
                done[i] = b
        assert done == self.lengths, "the pieces do not cover every stream's tokens"


def _offsets(sub: list[Stream], fed: dict[int, list[int]]) -> list[tuple[int, int, list[int]]]:
    """(slot, packed offset, new tokens) of each stream of a piece, as laid out by pack."""
    out, offset = [], 0
    for s in sub:
        out.append((s.slot, offset, fed[s.slot]))
        offset += len(fed[s.slot])
    return out


@contextlib.contextmanager
def prefill_call(model, cache: HybridCache, streams: Sequence[Stream]) -> Iterator[PrefillCall]:
    """Check and validate a prefill of `streams` on `cache` and hold the cache for it (module docstring).
    Raises ValueError (bad input, another model's cache) or CacheInUseError before anything changes."""
    model.check_cache(cache, claim=False)
    with cache.exclusive():
        tokens = validate(streams, cache, model.config.vocab_size)
        cache.bind(model)  # the input is good: a cache made without an owner becomes this model's
        yield PrefillCall(cache, streams, tokens)


def restore_prefix(model, cache: HybridCache, slot: int, tokens, limit: int | None = None) -> int:
    """Start empty `slot` of a cache with prefix caching from the longest cached prefix of `tokens` (at
    most `limit` tokens; default len(tokens) - 1, leaving the last token to prefill, whose logits a caller
    samples): its KV blocks shared, its GDN states restored (HybridCache._restore_prefix). Returns the
    number of tokens restored, 0 when none is cached (or prefix caching is off); the caller then
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
        if not (isinstance(limit, int) and 0 <= limit <= min(n, cache.max_context)):
            raise ValueError(f"limit must be an int in [0, {min(n, cache.max_context)}], got {limit!r}")
        cache.bind(model)
        return cache._restore_prefix(slot, ids.tolist(), limit)
