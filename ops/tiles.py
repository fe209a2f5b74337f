"""Work-tile lookup shared by the attention kernels (ops/paged_attention/decode.py's split-K decode, and
ops/attention_varlen.py's context-merge kernel): a launch of a fixed number of programs over the query
tiles of varlen streams finds its (stream, tile) from cu_seqlens on the device."""

import triton
import triton.language as tl


@triton.jit
def _tile_of(cu_ptr, ctx_ptr, w, B, QB, CH: tl.constexpr, CONTEXT_ONLY: tl.constexpr):
    """(stream, query tile within it) of work tile w, stream-major, QB queries a tile (stream B: none).
    Streams whose cumulative tile count ends at or before w come before it (zero-length ones too; with
    CONTEXT_ONLY, streams without cached context, ctx_ptr[b] == 0, count no tiles either; without it
    ctx_ptr is not read)."""
    b = tl.full([], 0, tl.int32)
    before = tl.full([], 0, tl.int32)  # tiles of the streams before b
    base = tl.full([], 0, tl.int32)  # tiles of the streams before this chunk
    for c0 in range(0, B, CH):
        i = c0 + tl.arange(0, CH)
        mi = i < B
        lo = tl.load(cu_ptr + i, mask=mi, other=0)
        hi = tl.load(cu_ptr + 1 + i, mask=mi, other=0)
        n = (hi - lo + QB - 1) // QB
        if CONTEXT_ONLY:
            n = tl.where(tl.load(ctx_ptr + i, mask=mi, other=0) > 0, n, 0)
        done = mi & (base + tl.cumsum(n, axis=0) <= w)
        b += tl.sum(done.to(tl.int32), axis=0)
        before += tl.sum(tl.where(done, n, 0), axis=0)
        base += tl.sum(n, axis=0)
    return b, w - before
