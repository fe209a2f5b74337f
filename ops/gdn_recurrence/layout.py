"""The GDN recurrence's chunk layout, built on the device in Triton: the chunk rows of both chunked paths
(each stream's chunks of 64 tokens, a count fixed by (B, T)), and the chunk-aligned layout that fla's
chunked kernels run on (the "fla" backend). Why: docs/ops.md, "How the GDN op keeps its chunked
path static".

The layout of the T packed tokens of B streams, those of at most `short` tokens left out: each other
stream's tokens lie in order from a multiple of CHUNK = 64 rows; the left-out streams have length 0;
identity rows (q = k = v = g = beta = 0, which leave a state unchanged) fill the gaps, and one
absorber sequence (from a zero state) takes the chunks left over. Its sizes follow from (B, T) alone:
B + 1 sequences (cu_aligned [B+2] int64 row offsets) and NT = num_chunks(B, T, short) chunks
(chunk_indices [NT, 2] int64 rows (sequence, chunk within sequence)), T_al = 64 * NT rows. The same
launch writes the same sequences' bounds on the packed tokens (bounds [2, B+1]: our chunked kernels
read the tokens where they lie, chunked.py).

Three kinds of launch: one program computes cu_aligned, bounds and chunk_indices (chunk_layout_bounds);
for the aligned path, one program per (chunk, column block) gathers a tensor's rows into the aligned
buffer, writing every aligned row (zeros where no token lies: no zero fill, no scatter); after the
varlen kernel the same mapping scatters the output rows back (gdn_recurrence_aligned).
tests/kernel_oracles.py builds the same layout in torch ops.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 64


def num_chunks(num_streams: int, num_tokens: int, short: int = 0) -> int:
    """NT = ceil(T / 64) + min(B, T // (short + 1)): each stream in the layout adds at most one partial
    chunk, and at most T // (short + 1) streams are longer than `short`."""
    return -(-num_tokens // CHUNK) + min(num_streams, num_tokens // (short + 1))


@triton.jit
def _chunk_layout_kernel(cu_ptr, slot_ptr, cu_al_ptr, bounds_ptr, slots_out_ptr, idx_ptr, B, M, NT, short,
                         CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                         COMPACT: tl.constexpr):
    """Both layouts: the B + 1 sequences (streams, absorber / spare B: chunk_layout_bounds), or with COMPACT the
    M + 1 (the streams in the layout in order, empty ones, spare M: chunk_layout_compact; slot_ptr and
    slots_out_ptr are read and written only then)."""
    b = tl.arange(0, BLOCK_B)  # BLOCK_B >= B + 2: the streams, the absorber, the end
    mb = b < B
    start = tl.load(cu_ptr + b, mask=b <= B, other=0)
    L = tl.load(cu_ptr + b + 1, mask=mb, other=0) - start
    in_layout = mb & (L > short)
    counts = tl.where(in_layout, (L + CHUNK - 1) // CHUNK, 0)
    off = tl.cumsum(counts, 0) - counts  # first chunk of stream b; of the absorber (b = B): all used chunks
    off = tl.where(b <= B, off, NT)
    tl.store(cu_al_ptr + b, off.to(tl.int64) * CHUNK, mask=b < B + 2)
    if COMPACT:  # sequence j < M: the j-th stream in the layout (rank), or empty at cu[B]; M the spare one
        rank = tl.cumsum(in_layout.to(tl.int32), 0) - in_layout.to(tl.int32)
        end = tl.load(cu_ptr + B).to(tl.int64)
        j = tl.arange(0, BLOCK_M)  # BLOCK_M >= M + 1
        tl.store(bounds_ptr + j, tl.full((BLOCK_M,), 0, tl.int64) + end, mask=j <= M)
        tl.store(bounds_ptr + (M + 1) + j, tl.full((BLOCK_M,), 0, tl.int64) + end, mask=j <= M)
        tl.store(slots_out_ptr + j, tl.full((BLOCK_M,), 0, tl.int64), mask=j < M)  # unread for empty sequences
        tl.debug_barrier()  # one program: the empty bounds land before the real ones over them
        slot = tl.load(slot_ptr + b, mask=in_layout, other=0).to(tl.int64)
        tl.store(bounds_ptr + rank, start.to(tl.int64), mask=in_layout)
        tl.store(bounds_ptr + (M + 1) + rank, (start + L).to(tl.int64), mask=in_layout)
        tl.store(slots_out_ptr + rank, slot, mask=in_layout)
        named = in_layout
    else:  # the packed bounds: stream b's tokens where they lie (none when left out), the spare sequence B empty
        tl.store(bounds_ptr + b, start.to(tl.int64), mask=b <= B)
        tl.store(bounds_ptr + (B + 1) + b, tl.where(in_layout, start + L, start).to(tl.int64), mask=b <= B)
        named = b <= B
    total = tl.sum(counts, 0)
    for c0 in range(0, NT, BLOCK_C):  # chunk c: the last sequence named starting at or before it
        c = c0 + tl.arange(0, BLOCK_C)
        before = (off[None, :] <= c[:, None]) & named[None, :]
        seq = tl.sum(before.to(tl.int32), 1) - 1
        first = tl.max(tl.where(before, off[None, :], 0), 1)  # offsets do not decrease: that sequence's
        if COMPACT:  # chunks past every stream's: the spare sequence's
            used = c < total
            seq = tl.where(used, seq, M)
            first = tl.where(used, first, total)
        mc = c < NT
        tl.store(idx_ptr + 2 * c, seq.to(tl.int64), mask=mc)
        tl.store(idx_ptr + 2 * c + 1, (c - first).to(tl.int64), mask=mc)


@triton.jit
def _chunk_rows(cu_ptr, idx_ptr, c, B, short, CHUNK: tl.constexpr):
    """The packed token of each of chunk c's CHUNK aligned rows, and whether the row holds one."""
    seq = tl.load(idx_ptr + 2 * c)
    within = tl.load(idx_ptr + 2 * c + 1)
    s = tl.minimum(seq, B - 1)
    start = tl.load(cu_ptr + s)
    L = tl.load(cu_ptr + s + 1) - start
    pos = within * CHUNK + tl.arange(0, CHUNK)
    return (start + pos).to(tl.int64), (seq < B) & (L > short) & (pos < L)


@triton.jit
def _aligned_copy_kernel(x_ptr, out_ptr, cu_ptr, idx_ptr, B, short, stride_x, W, TO_ALIGNED: tl.constexpr,
                         CHUNK: tl.constexpr, BLOCK_W: tl.constexpr):
    """Chunk c's rows, BLOCK_W columns: packed -> aligned (TO_ALIGNED; every aligned row written, zeros
    where no token lies) or aligned -> packed (only the rows of tokens in the layout)."""
    c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mcol = cols < W
    t, valid = _chunk_rows(cu_ptr, idx_ptr, c, B, short, CHUNK)
    rows = (c * CHUNK + tl.arange(0, CHUNK)).to(tl.int64)
    m = valid[:, None] & mcol[None, :]
    if TO_ALIGNED:
        src, dst, store = t, rows, mcol[None, :]
    else:
        src, dst, store = rows, t, m
    x = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
    tl.store(out_ptr + dst[:, None] * W + cols[None, :], x, mask=store)


_LAYOUT_BLOCK_W = 128


def chunk_layout(cu_seqlens: Tensor, num_tokens: int, short: int = 0) -> tuple[Tensor, Tensor]:
    """The layout's cu_aligned [B+2] and chunk_indices [NT, 2] (int64), in one Triton launch."""
    cu_al, _, chunk_indices = chunk_layout_bounds(cu_seqlens, num_tokens, short)
    return cu_al, chunk_indices


def chunk_layout_bounds(cu_seqlens: Tensor, num_tokens: int, short: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(cu_aligned [B+2], bounds [2, B+1], chunk_indices [NT, 2]), int64, in one Triton launch.

    The chunks are the aligned layout's (chunk_layout), stream b's first at row cu_aligned[b] // CHUNK, the
    rows after every stream's naming sequence B. bounds are the same sequences on the packed tokens: stream
    b is rows [bounds[0, b], bounds[1, b]), i.e. [cu_seqlens[b], cu_seqlens[b+1]), or empty at cu_seqlens[b]
    when it has at most `short` tokens; sequence B (the absorber there, the spare sequence here) is empty at
    cu_seqlens[B]. Static sizes: NT = num_chunks(B, num_tokens, short)."""
    B = cu_seqlens.shape[0] - 1
    NT = num_chunks(B, num_tokens, short)
    dev = cu_seqlens.device
    cu_al = torch.empty(B + 2, dtype=torch.int64, device=dev)
    bounds = torch.empty((2, B + 1), dtype=torch.int64, device=dev)
    chunk_indices = torch.empty((NT, 2), dtype=torch.int64, device=dev)
    _chunk_layout_kernel[(1,)](cu_seqlens, cu_seqlens, cu_al, bounds, cu_al, chunk_indices, B, 0, NT, short,
                               CHUNK=CHUNK, BLOCK_B=triton.next_power_of_2(B + 2), BLOCK_M=1, BLOCK_C=64,
                               COMPACT=False)  # (slot_ptr, slots_out_ptr: unread stand-ins)
    return cu_al, bounds, chunk_indices


def num_long(num_streams: int, num_tokens: int, short: int = 0) -> int:
    """M = min(B, T // (short + 1)): at most this many of B streams over T tokens are longer than `short`."""
    return min(num_streams, num_tokens // (short + 1))


def chunk_layout_compact(cu_seqlens: Tensor, slot_ids: Tensor, num_tokens: int, short: int = 0
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(cu_aligned [B+2], bounds [2, M+1], slots [M], chunk_indices [NT, 2]), int64, in one Triton launch:
    chunk_layout_bounds' layout over the M = num_long(B, T, short) sequences that can be in it instead of
    all B: sequence j < M is the j-th stream longer than `short` (its bounds on the packed tokens, its slot),
    or empty at cu_seqlens[B] when fewer are; sequence M is the spare one; chunk_indices name these
    sequences. cu_aligned is chunk_layout_bounds' (per stream b: the checkpoints' chunk rows, chunk_rows).
    So the state pass launches over M + 1 sequences, not B + 1 (a verify step of 32 streams x 3 tokens: 2,
    not 33, most of them empty programs). Static sizes: NT = num_chunks(B, T, short)."""
    B = cu_seqlens.shape[0] - 1
    NT, M = num_chunks(B, num_tokens, short), num_long(B, num_tokens, short)
    dev = cu_seqlens.device
    cu_al = torch.empty(B + 2, dtype=torch.int64, device=dev)
    bounds = torch.empty((2, M + 1), dtype=torch.int64, device=dev)
    slots = torch.empty(M, dtype=torch.int64, device=dev)
    chunk_indices = torch.empty((NT, 2), dtype=torch.int64, device=dev)
    _chunk_layout_kernel[(1,)](cu_seqlens, slot_ids, cu_al, bounds, slots, chunk_indices, B, M, NT, short,
                               CHUNK=CHUNK, BLOCK_B=triton.next_power_of_2(B + 2),
                               BLOCK_M=triton.next_power_of_2(M + 1), BLOCK_C=64, COMPACT=True)
    return cu_al, bounds, slots, chunk_indices


def _row_major(x: Tensor) -> Tensor:
    """x with each token's row contiguous (a view when it already is, e.g. q / k as head slices)."""
    inner = x.shape[1:]
    expected, ok = 1, True
    for d in range(x.dim() - 1, 0, -1):
        ok = ok and (inner[d - 1] == 1 or x.stride(d) == expected)
        expected *= inner[d - 1]
    return x if ok else x.contiguous()


def gdn_recurrence_aligned(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, varlen_fn, short=0):
    """Gather states, lay tokens out chunk-aligned, run `varlen_fn`, scatter states and outputs back.

    varlen_fn(q, k, v, g, beta, cu_aligned, chunk_indices, h0) -> (o [T_al, HV, V], final [B+1, HV, K, V])
    computes the gated delta rule over aligned sequences (q unscaled, scale K**-0.5 inside).
    Streams of at most `short` tokens are left out of the layout: their slots get their state back
    unchanged and their output rows are unspecified, for the caller to compute.
    The layout, the gathers into it and the output scatter are Triton launches (seven in all).
    """
    T, H, K = q.shape
    HV, V = v.shape[1:]
    B = slot_ids.shape[0]
    cu_seqlens = cu_seqlens.contiguous()  # the layout kernels index it as contiguous
    cu_al, chunk_indices = chunk_layout(cu_seqlens, T, short)
    NT = chunk_indices.shape[0]
    T_al = NT * CHUNK

    def grid(W):
        return (NT, triton.cdiv(W, _LAYOUT_BLOCK_W))

    def aligned(x):
        x = _row_major(x)
        if not (NT and B):  # nothing to gather (no streams: the absorber's zeros only)
            return x.new_zeros((T_al,) + tuple(x.shape[1:]))
        out = x.new_empty((T_al,) + tuple(x.shape[1:]))
        W = out[0].numel()
        _aligned_copy_kernel[grid(W)](x, out, cu_seqlens, chunk_indices, B, short, x.stride(0), W, TO_ALIGNED=True,
                                      CHUNK=CHUNK, BLOCK_W=_LAYOUT_BLOCK_W)
        return out

    h0 = torch.cat([gdn_state.index_select(0, slot_ids), gdn_state.new_zeros(1, HV, K, V)])
    o_al, final = varlen_fn(aligned(q), aligned(k), aligned(v), aligned(g), aligned(beta), cu_al, chunk_indices, h0)
    gdn_state.index_copy_(0, slot_ids.long(), final[:B])  # index_copy_ takes int64 indices only; slot_ids may be int32
    # rows of tokens outside the layout: unspecified, but zeros, not the allocator's leftovers (a padding
    # row's NaN would reach the MoE router)
    o = v.new_zeros((T, HV, V))
    if NT and B:
        o_al = _row_major(o_al)
        _aligned_copy_kernel[grid(HV * V)](o_al, o, cu_seqlens, chunk_indices, B, short, o_al.stride(0), HV * V,
                                           TO_ALIGNED=False, CHUNK=CHUNK, BLOCK_W=_LAYOUT_BLOCK_W)
    return o


