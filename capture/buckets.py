"""Buckets and padding: which static shape a batch runs in, how it is padded to it, and how a
batch larger than every bucket is cut into pieces that fit.

A bucket (B, T) holds at most B streams and T tokens. The GDN op lays tokens out
chunk-aligned inside itself with a chunk count fixed by (B, T) (ops/gdn_recurrence.py), so a
batch needs no per-stream padding here: it fits a bucket when it has <= B streams and
<= T tokens. Padding streams are zero-length on the scratch slot with null-block block
tables; padding tokens sit past cu_seqlens[-1], in no stream, so no op reads or writes
state for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metrale_graph.batch import PackedBatch
from metrale_graph.cache import HybridCache

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_TOKEN_COUNTS = (256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True, order=True)
class Bucket:
    tokens: int  # T first: the smallest bucket is the one with the fewest tokens
    streams: int

    def holds(self, num_streams: int, num_tokens: int) -> bool:
        return num_streams <= self.streams and num_tokens <= self.tokens

    def __str__(self) -> str:
        return f"B{self.streams}xT{self.tokens}"


def make_grid(batch_sizes, token_counts) -> list[Bucket]:
    """All (B, T) with B <= T (a bucket of more streams than tokens could never fill), sorted;
    ValueError if there is none."""
    for name, values in (("batch_sizes", batch_sizes), ("token_counts", token_counts)):
        if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
            raise ValueError(f"{name} must be a non-empty list of positive integers, got {values!r}")
    grid = sorted({Bucket(t, b) for b in batch_sizes for t in token_counts if b <= t})
    if not grid:
        raise ValueError(f"no bucket: every batch size exceeds every token count (a bucket needs B <= T), "
                         f"batch_sizes {batch_sizes}, token_counts {token_counts}")
    return grid


def choose(grid: list[Bucket], num_streams: int, num_tokens: int) -> Bucket | None:
    """The smallest bucket (fewest tokens, then fewest streams) that holds the batch, or None."""
    return next((b for b in grid if b.holds(num_streams, num_tokens)), None)


def split(lengths: list[int], max_streams: int, max_tokens: int) -> list[list[tuple[int, int, int]]]:
    """Cut a batch that fits no bucket into pieces that fit the largest one.

    Returns pieces, each a list of (stream index, start, stop) token ranges. A stream longer
    than what is left of a piece continues in the next piece (its slot then continues from the
    context the earlier piece left, exactly as a chunked prefill does). A stream's last range is
    the one whose logits count.
    """
    pieces, piece, used = [], [], 0
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            if len(piece) == max_streams or used == max_tokens:
                pieces.append(piece)
                piece, used = [], 0
            take = min(n - start, max_tokens - used)
            piece.append((i, start, start + take))
            used += take
            start += take
    if piece:
        pieces.append(piece)
    return pieces


class StaticBatch:
    """The static input buffers of one bucket (a PackedBatch whose tensors never move).

    Buffers hold at least 2 streams and 2 tokens (a B1 bucket runs with one extra zero-length
    padding stream): dynamo treats sizes 0 and 1 as constants, so without this the single-stream
    buckets would need a trace of their own instead of sharing the grid's one dynamic trace.
    """

    def __init__(self, bucket: Bucket, cache: HybridCache):
        B, T, dev = max(bucket.streams, 2), max(bucket.tokens, 2), cache.device
        self.bucket, self.cache = bucket, cache
        self.batch = PackedBatch(
            tokens=torch.zeros(T, dtype=torch.int64, device=dev),
            positions=torch.zeros(T, dtype=torch.int64, device=dev),
            cu_seqlens=torch.zeros(B + 1, dtype=torch.int32, device=dev),
            slot_ids=torch.full((B,), cache.scratch_slot, dtype=torch.int64, device=dev),
            context_lens=torch.zeros(B, dtype=torch.int32, device=dev),
            block_tables=torch.full((B, cache.max_blocks_per_slot), cache.null_block, dtype=torch.int32, device=dev),
        )

    def fill(self, packed: PackedBatch) -> None:
        """Copy a packed batch in and pad the rest (no allocation on the device side of the copy)."""
        n, t = packed.num_streams, packed.num_tokens
        s = self.batch
        s.tokens[:t].copy_(packed.tokens)
        s.tokens[t:].zero_()
        s.positions[:t].copy_(packed.positions)
        s.positions[t:].zero_()
        s.cu_seqlens[: n + 1].copy_(packed.cu_seqlens)
        s.cu_seqlens[n + 1:].fill_(t)  # zero-length padding streams
        s.slot_ids[:n].copy_(packed.slot_ids)
        s.slot_ids[n:].fill_(self.cache.scratch_slot)
        s.context_lens[:n].copy_(packed.context_lens)
        s.context_lens[n:].zero_()
        s.block_tables[:n].copy_(packed.block_tables)
        s.block_tables[n:].fill_(self.cache.null_block)
