"""How kernels of several ops find and load their work tiles.

- `_tile_of`: the attention kernels' (ops/paged_attention/decode.py's split-K decode, and
  ops/attention_varlen.py's context-merge kernel): a launch of a fixed number of programs over the query
  tiles of varlen streams finds its (stream, tile) from cu_seqlens on the device.
- `_stream_of`: the stream of packed tokens, a binary search of cu_seqlens inside the kernel: ops/causal_conv1d.py's
  conv and the paged attention's KV write (in place of a searchsorted, three launches per layer, before them),
  the split-K decode's merge and the checkpoint kernels (ops/checkpoints.py's _stream_bounds).
- `_grouped_tile`, `_block_pairs`, `_load_rows`, `_load_cols`, `EVEN_K`: the routed experts' grouped
  GEMMs (bf16 ops/moe/gemm.py, FP8 ops/fp8/experts.py) over the expert-sorted pairs of
  ops/moe/align.py: a program's (row block, column tile), its block's pairs, and one K step's tiles.
"""

import triton
import triton.language as tl


def search_steps(num_streams: int) -> int:
    """_stream_of's STEPS for B streams: enough halvings of [0, B] to end on one index."""
    return max(1, int(num_streams).bit_length())


@triton.jit
def _stream_of(cu_ptr, t, B, STEPS: tl.constexpr):
    """The stream of packed token(s) t (a scalar or a vector): the largest b in [0, B] with cu_ptr[b] <= t, that is
    searchsorted(cu_seqlens[1:], t, right=True) (cu_seqlens nondecreasing, cu_seqlens[0] = 0 <= t); B for a token
    past cu_seqlens[B], which belongs to no stream. STEPS (search_steps(B)) halvings of [lo, hi]."""
    lo = t * 0
    hi = lo + B
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_ptr + mid) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo


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


# the grouped GEMMs' K loop drops its masks when BK divides K
EVEN_K = {"EVEN_K": lambda a: a["K"] % a["BK"] == 0}


@triton.jit
def _grouped_tile(pid, num_blocks, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (row block, column tile), GROUP_M row blocks at a time: consecutive programs share a
    weight tile (same expert) in L2."""
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _block_pairs(ids_ptr, pid_m, num_pairs, BM: tl.constexpr):
    """(pair ids of row block pid_m, which of them are real pairs: ids past num_pairs pad the block)."""
    pair = tl.load(ids_ptr + pid_m * BM + tl.arange(0, BM))
    return pair, pair < num_pairs


@triton.jit
def _load_rows(ptrs, valid, k, k_left, EVEN_K: tl.constexpr):
    """A [BM, BK] activation tile: the rows of real pairs, the columns k < k_left (EVEN_K: all); 0 elsewhere."""
    if EVEN_K:
        return tl.load(ptrs, mask=valid[:, None], other=0.0)
    return tl.load(ptrs, mask=valid[:, None] & (k < k_left)[None, :], other=0.0)


@triton.jit
def _load_cols(ptrs, k, k_left, EVEN_K: tl.constexpr):
    """A [BK, BN] weight tile: the rows k < k_left (EVEN_K: all); 0 elsewhere."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(k < k_left)[:, None], other=0.0)
