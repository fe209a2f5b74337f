"""Buckets and padding: which static shape a batch runs in, how it is padded to it, and how a
batch larger than every bucket is cut into pieces that fit.

A bucket (B, T) holds at most B streams and T tokens. The GDN op's chunked path has a chunk
count fixed by (B, T) whatever the lengths (ops/gdn_recurrence/chunked.py), so a
batch needs no per-stream padding here: it fits a bucket when it has <= B streams and
<= T tokens, and is padded to it by the contract in metrale_graph/batch.py (zero-length
streams on the scratch slot, spare tokens in no stream).
"""

from __future__ import annotations


from dataclasses import dataclass

from metrale_graph.numbers import as_int

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
    duplicates count once. Each argument is any iterable of positive ints (read once); ValueError
    naming the values that are not, or if there is no bucket."""
    lists = {}
    for name, values in (("batch_sizes", batch_sizes), ("token_counts", token_counts)):
        try:
            items = list(values)
        except TypeError:
            items = None
        ints = None if items is None else [as_int(v) for v in items]  # numpy / torch integers too
        bad = None if items is None else [v for v, n in zip(items, ints) if n is None or n < 1]
        if not items or bad:
            what = f" ({', '.join(map(repr, bad))}: not a positive integer)" if bad else ""
            raise ValueError(f"{name} must be a non-empty list of positive integers, got "
                             f"{values if items is None else items!r}{what}")
        lists[name] = ints
    batch_sizes, token_counts = lists["batch_sizes"], lists["token_counts"]
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
    the one whose logits count. ValueError unless max_streams and max_tokens are positive ints
    (a piece that holds nothing would never end) and every length is a positive int (a stream of
    no tokens would have no range, so no logits).
    """
    for name, value in (("max_streams", max_streams), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"lengths[{i}] must be a positive integer (a stream of no tokens has no range), "
                             f"got {n!r}")
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
