"""Streams in, packed tensors out.

`validate` checks a list of `Stream`s against a cache and raises ValueError naming the
problem before anything is touched; `pack` lays the streams back to back:

    tokens [T] int64, positions [T] int64, cu_seqlens [B+1] int32,
    slot_ids [B] int64, context_lens [B] int32, block_tables [B, MB] int32

The padding contract (one for CUDA graphs, the compiled step and the ONNX export): a batch
padded to B streams and T tokens keeps its streams first; spare streams have zero length, the
cache's scratch slot, context 0 and block tables of the null block; spare tokens (token id 0,
position 0) lie past cu_seqlens[-1], in no stream, so no op reads or writes state for them and
their output rows are unspecified.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from .cache import HybridCache
from .numbers import as_int, int_tensor, to_device


@dataclass
class Stream:
    """One request of a batched prefill: new `tokens` for cache slot `slot`. A slot that already
    holds context continues from it (positions, conv and recurrent state, KV cache)."""
    slot: int
    tokens: Sequence[int] | torch.Tensor


@dataclass
class PackedBatch:
    """The step's per-call inputs (see the module docstring for shapes and the padding contract)."""
    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    slot_ids: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor

    @classmethod
    def names(cls) -> list[str]:
        """Field names in order: the step's inputs, as the ONNX export names them."""
        return [f.name for f in dataclasses.fields(cls)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return _fields_of(self)

    @property
    def num_streams(self) -> int:
        return self.slot_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def padding(cls, num_streams: int, num_tokens: int, cache: HybridCache) -> "PackedBatch":
        """A batch of `num_streams` streams and `num_tokens` tokens that is all padding: the static
        buffers a bucket fills (fill) before each run."""
        B, T, dev = num_streams, num_tokens, cache.device
        with torch.inference_mode(False):  # normal tensors (filled in place in or out of inference mode)
            return cls(tokens=torch.zeros(T, dtype=torch.int64, device=dev),
                       positions=torch.zeros(T, dtype=torch.int64, device=dev),
                       cu_seqlens=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                       slot_ids=torch.full((B,), cache.scratch_slot, dtype=torch.int64, device=dev),
                       context_lens=torch.zeros(B, dtype=torch.int32, device=dev),
                       block_tables=torch.full((B, cache.max_blocks_per_slot), cache.null_block, dtype=torch.int32,
                                               device=dev))

    @staticmethod
    def padding_bytes(num_streams: int, num_tokens: int, cache: HybridCache) -> int:
        """The bytes padding(num_streams, num_tokens, cache) allocates."""
        B, T = num_streams, num_tokens
        return 16 * T + 4 * (B + 1) + 12 * B + 4 * B * cache.max_blocks_per_slot

    def fill(self, packed: "PackedBatch", cache: HybridCache, last: tuple[int, int] | None = None) -> None:
        """Copy `packed` into these (larger or equal) buffers and pad the rest; allocates nothing. `last`:
        the (streams, tokens) of the batch these buffers were last filled with, past which they hold padding
        already; then only the rows that batch used past packed's are padded again (a step of the same
        size as the last pads nothing but the padding streams' ends). None: every spare row is padded."""
        n, t = packed.num_streams, packed.num_tokens
        B, T = self.num_streams, self.num_tokens
        if n > B or t > T:
            raise ValueError(f"a batch of {n} streams and {t} tokens does not fit buffers of "
                             f"{B} streams and {T} tokens")
        used_streams, used_tokens = (B, T) if last is None else last
        # the views the batch is copied into, kept for the next fill of the same size (a decode step's are all
        # alike): slicing the six buffers again would cost as much as the copies themselves
        size, views = getattr(self, "_views", (None, None))
        if size != (n, t):
            views = (self.tokens[:t], self.positions[:t], self.cu_seqlens[:n + 1], self.slot_ids[:n], self.context_lens[:n],
                     self.block_tables[:n])
            self._views = ((n, t), views)
        for view, field in zip(views, packed.tensors()):
            view.copy_(field)
        if used_tokens > t:
            self.tokens[t:used_tokens].zero_()
            self.positions[t:used_tokens].zero_()
        if n < B:
            # zero-length padding streams, ending where packed's streams end (not at t: a padded batch's spare
            # tokens lie past its last stream and must stay in no stream)
            self.cu_seqlens[n + 1:].copy_(packed.cu_seqlens[n:].expand(B - n))
        if used_streams > n:
            self.slot_ids[n:used_streams].fill_(cache.scratch_slot)
            self.context_lens[n:used_streams].zero_()
            self.block_tables[n:used_streams].fill_(cache.null_block)

    def padded(self, num_streams: int, num_tokens: int, cache: HybridCache) -> "PackedBatch":
        """A new batch of exactly `num_streams` streams and `num_tokens` tokens: this one, padded."""
        out = PackedBatch.padding(num_streams, num_tokens, cache)
        out.fill(self, cache)
        return out

    def mark_dynamic(self) -> None:
        """Mark the token and stream dimensions dynamic for torch.compile (sizes 0 and 1 are still
        specialized by dynamo: keep both >= 2 to share one trace)."""
        for t in self.tensors():
            torch._dynamo.mark_dynamic(t, 0)


_fields_of = operator.attrgetter(*PackedBatch.names())  # (PackedBatch.tensors: the fields in order, at once)


def token_tensor(tokens, where: str, device: torch.device) -> torch.Tensor:
    """`tokens` (a sequence of ints, numpy integers included, a 1-D integer numpy array, or a 1-D integer
    tensor on the CPU or `device`) as a 1-D int64 tensor; ValueError starting with `where` (e.g. "stream 3")
    otherwise. Ids are range-checked by check_token_ids, all at once."""
    if type(tokens).__module__ == "numpy" and hasattr(tokens, "dtype") and hasattr(tokens, "ndim"):
        tokens = _from_numpy(tokens, where)
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"{where}: tokens must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.layout != torch.strided:
            raise ValueError(f"{where}: tokens must be a dense tensor, got layout {tokens.layout}")
        if tokens.device.type != "cpu" and tokens.device != device:
            raise ValueError(f"{where}: tokens are on {tokens.device}; the model is on {device} "
                             "(pass them on the CPU or on the model's device)")
        if tokens.dim() != 1:
            raise ValueError(f"{where}: tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.dtype == getattr(torch, "uint64", None):  # ids of 2**63 and up would wrap to negative ones
            wrapped = tokens.view(torch.int64)
            if bool((wrapped < 0).any()):
                big = int(wrapped[wrapped < 0][0]) + 2**64
                raise ValueError(f"{where}: token id {big} does not fit in int64")
        t = tokens.to(torch.int64)
    else:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise ValueError(f"{where}: tokens must be a sequence of ints or a 1-D tensor, "
                             f"got {type(tokens).__name__}")
        if type(tokens) is list and set(map(type, tokens)) == {int}:  # plain ints (a prompt): all at once
            try:
                t = int_tensor(tokens)
            except OverflowError:
                raise ValueError(f"{where}: a token id does not fit in int64") from None
        else:
            ids = [as_int(x) for x in tokens]  # ints, and numpy / 0-d torch integers as users pass them
            bad = next((k for k, i in enumerate(ids) if i is None), None)  # (its index: the token may be None)
            if bad is not None:
                raise ValueError(f"{where}: token {tokens[bad]!r} is not an int")
            try:
                t = torch.tensor(ids, dtype=torch.int64)
            except (ValueError, RuntimeError, OverflowError):  # an int beyond int64 (torch versions differ)
                raise ValueError(f"{where}: a token id does not fit in int64") from None
    if t.numel() == 0:
        raise ValueError(f"{where} is empty (no tokens)")
    return t


def _from_numpy(array, where: str) -> torch.Tensor:
    """A 1-D integer numpy array as an int64 tensor (ValueError for other dtypes and ids beyond int64)."""
    if array.dtype.kind not in "iu":
        raise ValueError(f"{where}: tokens must be integers, got a numpy array of dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{where}: tokens must be 1-D, got a numpy array of shape {tuple(array.shape)}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) >= 2**63:
        raise ValueError(f"{where}: token id {int(array.max())} does not fit in int64")
    return torch.from_numpy(array.astype("int64"))


def check_token_ids(tokens: list[torch.Tensor], vocab_size: int, what: str = "stream") -> None:
    """ValueError naming the first of `tokens` (f"{what} {i}") with an id outside [0, vocab_size). One
    min / max over each device's tokens together (a decode batch is many one-token streams); per
    stream only to name the culprit."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tokens:
        by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():
        ids = torch.cat(group) if len(group) > 1 else group[0]
        if int(ids.min()) >= 0 and int(ids.max()) < vocab_size:
            continue
        for i, t in enumerate(tokens):
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"{what} {i}: token id {lo if lo < 0 else hi} is out of range [0, {vocab_size})")


@dataclass(frozen=True)
class BatchTokens:
    """A validated batch (validate): stream i writes slot `slots[i]` with its `lengths[i]` new tokens, which
    are ids[sum(lengths[:i]) : sum(lengths[:i + 1])]. `ids` [sum(lengths)] int64 holds every stream's ids back
    to back, on the CPU, or on the cache's device when any stream's tokens were there. `new_blocks`: the
    (slot, blocks) of the streams that need more KV blocks (HybridCache.block_needs, as of validation: the
    cache is held until the call has run)."""
    slots: list[int]
    ids: torch.Tensor
    lengths: list[int]
    new_blocks: list[tuple[int, int]]


def validate(streams, cache: HybridCache, vocab_size: int) -> BatchTokens:
    """Check a batch against the cache; return its slots and token ids (BatchTokens).

    Raises ValueError (naming the stream and the problem) for: an empty batch, an object that
    is not a Stream, an unknown or duplicate slot, an empty stream, a token id out of range,
    tokens of the wrong dtype or device, a stream that would grow past the cache's per-slot
    capacity, or a batch that needs more KV blocks than are free. Touches nothing.

    A decode batch is many one-token streams, and its per-stream host work is the step's overhead: the
    common batch (plain int slots; every stream's tokens a list of ints, or every stream's a 1-D int64 CPU
    tensor) is checked in bulk, its ids made one tensor at once and range-checked in one pass; any other
    batch, or one the bulk checks refuse, is checked stream by stream (which names the problem).
    """
    if isinstance(streams, Stream):
        raise ValueError("prefill takes a list of Streams, got a single Stream")
    if not isinstance(streams, Sequence) or len(streams) == 0:
        raise ValueError("prefill needs a non-empty list of Streams")
    slots, ids, lengths, same, ends = _checked_in_bulk(streams, cache) or _checked_one_by_one(streams, cache)
    lo, hi = (min(same), max(same)) if same is not None else map(int, torch.aminmax(ids))
    if lo < 0 or hi >= vocab_size:  # name the first stream with a bad id
        check_token_ids(list(torch.split(ids, lengths)), vocab_size)
    new_blocks = cache.block_needs_to(slots, ends)
    need = sum(n for _, n in new_blocks)
    if need > cache.free_blocks:
        raise ValueError(f"the batch needs {need} more KV blocks but the cache has {cache.free_blocks} free "
                         "(reset finished slots or build a larger cache)")
    return BatchTokens(slots, ids, lengths, new_blocks)


_dtype_of = operator.attrgetter("dtype")


def _checked_in_bulk(streams: Sequence, cache: HybridCache) -> tuple[list[int], torch.Tensor, list[int], list | None,
                                                                     list[int]] | None:
    """(slots, ids, lengths, same, ends) of a batch of Streams with distinct plain int slots of the cache, every
    stream's tokens a non-empty list of plain ints or every stream's a non-empty 1-D int64 CPU tensor, all within the
    cache's capacity; None for any other batch (_checked_one_by_one then finds what is wrong, if anything).
    Each check is one pass over the batch (builtins or a comprehension). `same`: the one token list every stream
    holds (a decode step's), else None; `ends`: each slot's context after the stream (the capacity check's, which
    block_needs_to reads)."""
    if set(map(type, streams)) != {Stream}:
        return None
    slots = [s.slot for s in streams]  # (a comprehension: faster than map of an attrgetter)
    if (set(map(type, slots)) != {int} or min(slots) < 0 or max(slots) >= cache.num_slots
            or len(set(slots)) != len(slots)):
        return None
    first, same = streams[0].tokens, None
    if type(first) is list and not [s for s in streams if s.tokens is not first]:
        same = first  # every stream the same list (a decode step's ids)
        if not first or set(map(type, first)) != {int}:
            return None
        lengths, flat = [len(first)] * len(streams), first * len(streams)
        try:
            ids = int_tensor(flat)
        except OverflowError:  # an id beyond int64
            return None
        context, n = cache.context_lens, len(first)
        return _within_capacity(cache, slots, ids, lengths, same, [context[slot] + n for slot in slots])
    tokens = [s.tokens for s in streams]
    kinds = set(map(type, tokens))
    if kinds == {list}:
        lengths = list(map(len, tokens))
        flat = list(itertools.chain.from_iterable(tokens))
        if min(lengths) == 0 or set(map(type, flat)) != {int}:
            return None
        try:
            ids = int_tensor(flat)
        except OverflowError:  # an id beyond int64
            return None
    elif kinds == {torch.Tensor}:
        # int64, then on the CPU, 1-D and dense checked on the ids they make together: cat refuses tensors of
        # different devices or dims (and 0-d ones), so only its result needs looking at (an attribute read per
        # stream costs more than the cat)
        if set(map(_dtype_of, tokens)) != {torch.int64}:
            return None
        lengths = list(map(torch.Tensor.numel, tokens))
        if min(lengths) == 0:
            return None
        try:
            ids = torch.cat(tokens) if len(tokens) > 1 else tokens[0]
        except Exception:  # (devices or dims that do not go together: the checks one by one name the stream)
            return None
        if not (ids.is_cpu and ids.layout == torch.strided and ids.dim() == 1):
            return None
    else:
        return None
    context = cache.context_lens
    return _within_capacity(cache, slots, ids, lengths, None, [context[slot] + n for slot, n in zip(slots, lengths)])


def _within_capacity(cache: HybridCache, slots: list[int], ids: torch.Tensor, lengths: list[int], same: list | None,
                     ends: list[int]):
    """_checked_in_bulk's result, or None when a stream would grow its slot past the cache's capacity."""
    if max(ends) > cache.max_context:
        return None
    return slots, ids, lengths, same, ends


def _checked_one_by_one(streams: Sequence, cache: HybridCache) -> tuple[list[int], torch.Tensor, list[int], None,
                                                                        list[int]]:
    """validate's checks of each stream in turn, the first problem raised (ValueError naming the stream):
    (slots, ids, lengths, None, ends) of a batch that passes them (as _checked_in_bulk's)."""
    seen: dict[int, int] = {}
    slots, lengths, tokens, ends = [], [], [], []
    context, capacity, device = cache.context_lens, cache.max_context, cache.device
    for i, s in enumerate(streams):
        if not isinstance(s, Stream):
            raise ValueError(f"stream {i}: expected a Stream, got {type(s).__name__}")
        try:
            cache.check_slot(s.slot)
        except ValueError as e:
            raise ValueError(f"stream {i}: {e}") from None
        if s.slot in seen:
            raise ValueError(f"stream {i}: duplicate slot {s.slot} (also used by stream {seen[s.slot]})")
        seen[s.slot] = i
        t = token_tensor(s.tokens, f"stream {i}", device)
        ctx = context[s.slot]
        if ctx + t.numel() > capacity:
            raise ValueError(f"stream {i}: slot {s.slot} holds {ctx} tokens; {t.numel()} more exceed the "
                             f"cache's capacity of {capacity} tokens per slot")
        slots.append(s.slot)
        lengths.append(t.numel())
        tokens.append(t)
        ends.append(ctx + t.numel())
    if not all(t.is_cpu for t in tokens):  # some streams' tokens are on the device already
        tokens = [t.to(device) for t in tokens]
    return slots, torch.cat(tokens), lengths, None, ends  # (a copy also of one stream's: contiguous, not the caller's)


SMALL_STEP = 128  # pack: up to this many tokens positions are made in Python (one stream of 4: 27 -> 14 us here)


def pack(slots: list[int], ids: torch.Tensor, lengths: list[int], cache: HybridCache) -> PackedBatch:
    """Lay validated streams back to back on the cache's device: stream i writes slot `slots[i]` with
    `lengths[i]` tokens of `ids` (int64, all streams' back to back). Blocks must be allocated.

    Built on the host and moved in two copies, the int64 fields' and the int32 fields' (each split into its
    fields on the device, views), rather than one per stream and field: for a decode batch of many one-token
    streams the host work is the step's overhead (an int32 field made on the host costs less than a narrowing
    on the device)."""
    B, T = len(slots), ids.numel()
    ctx = list(map(cache.context_lens.__getitem__, slots))
    if T == B:  # one token per stream (a decode step): each at its stream's context
        starts = range(B + 1)
        host = int_tensor(ctx + slots)  # (array.array takes a list several times faster than an iterator)
    else:
        starts = [0, *itertools.accumulate(lengths)]
        if T <= SMALL_STEP:  # a verify or small mixed step: Python's lists cost less than three tensor ops
            host = int_tensor([p for c, n in zip(ctx, lengths) for p in range(c, c + n)] + slots)
        else:
            # position of token j of stream b: ctx[b] + j = arange(T)[j] - (start of b) + ctx[b]
            shift = int_tensor(map(operator.sub, ctx, starts))
            positions = torch.arange(T) + torch.repeat_interleave(shift, int_tensor(lengths), output_size=T)
            host = torch.cat([positions, int_tensor(slots)])
    on_host = ids.is_cpu
    dev = to_device(torch.cat([ids, host]) if on_host else host, cache.device)
    tok, positions, slot_ids = dev.split_with_sizes([T, T, B]) if on_host else (ids, *dev.split_with_sizes([T, B]))
    cu_seqlens, context_lens = to_device(int_tensor([*starts, *ctx], torch.int32),
                                         cache.device).split_with_sizes([B + 1, B])
    return PackedBatch(tokens=tok, positions=positions, cu_seqlens=cu_seqlens, slot_ids=slot_ids,
                       context_lens=context_lens, block_tables=cache.block_tables.index_select(0, slot_ids))


def empty_batch(cache: HybridCache) -> PackedBatch:
    """A batch of no streams and no tokens."""
    return PackedBatch.padding(0, 0, cache)
