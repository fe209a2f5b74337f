"""GDN phase 2, the gated delta rule over packed varlen streams, each from its slot's state.

Per value head j (key head j // r, r = HV / H), token by token:
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (q_t * K**-0.5)
with S [K, V] in fp32. The final S of each stream goes back to its slot. A zero-length
stream (padding) leaves its slot unchanged.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor, decode_shaped
from .registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, rand, register, stream_meta

def _check(a):
    check_tensor(a.q, "q", ndim=3)
    T, H, K = a.q.shape
    dtype, device = a.q.dtype, a.q.device
    check_tensor(a.k, "k", ndim=3, dtype=dtype, device=device)
    check(tuple(a.k.shape) == (T, H, K), f"k has shape {tuple(a.k.shape)}, q has {(T, H, K)}")
    check_tensor(a.v, "v", ndim=3, dtype=dtype, device=device)
    HV, V = a.v.shape[1], a.v.shape[2]
    check(a.v.shape[0] == T and HV % H == 0,
          f"v has shape {tuple(a.v.shape)}; need {T} tokens and value heads a multiple of {H}")
    check_tensor(a.g, "g", ndim=2, dtype=torch.float32, device=device)
    check(tuple(a.g.shape) == (T, HV), f"g has shape {tuple(a.g.shape)}, expected {(T, HV)}")
    check_tensor(a.beta, "beta", ndim=2, dtype=(dtype, torch.float32), device=device)
    check(tuple(a.beta.shape) == (T, HV), f"beta has shape {tuple(a.beta.shape)}, expected {(T, HV)}")
    check_tensor(a.cu_seqlens, "cu_seqlens", ndim=1, dtype=torch.int32, device=device)
    check_tensor(a.slot_ids, "slot_ids", ndim=1, dtype=INDEX_DTYPES, device=device)
    check(a.slot_ids.shape[0] + 1 == a.cu_seqlens.shape[0],
          f"{a.slot_ids.shape[0]} slot_ids for {a.cu_seqlens.shape[0] - 1} streams")
    check_tensor(a.gdn_state, "gdn_state", ndim=4, dtype=torch.float32, device=device)
    check(tuple(a.gdn_state.shape[1:]) == (HV, K, V),
          f"gdn_state slots are {tuple(a.gdn_state.shape[1:])}, expected {(HV, K, V)}")


@metrale_op(mutates_args=("gdn_state",), check=_check)
def gdn_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                   slot_ids: Tensor, gdn_state: Tensor) -> Tensor:
    """Varlen gated delta rule with per-slot recurrent state. The CPU reference (the spec): plain
    torch, token by token, in fp32.

    Args:
        q, k: [T, H, K] L2-normalized queries and keys (model dtype); q is scaled by K**-0.5 here.
        v: [T, HV, V] values (model dtype), HV a multiple of H.
        g: [T, HV] float32 log-decay (<= 0).
        beta: [T, HV] write strength in (0, 1) (model dtype or float32).
        cu_seqlens: [B+1] int32 stream boundaries.
        slot_ids: [B] int32/int64 state slot of each stream.
        gdn_state: [S, HV, K, V] float32 pool. MUTATED: each stream's slot holds its final state.
    Returns:
        o: [T, HV, V] in v's dtype.
    """
    T, H, K = q.shape
    HV = v.shape[1]
    r = HV // H
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    qf = q.float().repeat_interleave(r, dim=1) * K**-0.5  # [T, HV, K]
    kf = k.float().repeat_interleave(r, dim=1)
    vf, bf, decay = v.float(), beta.float(), g.float().exp()
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            continue
        S = gdn_state[slot].clone()  # [HV, K, V]
        for t in range(s, e):
            S = S * decay[t, :, None, None]
            pred = torch.einsum("hk,hkv->hv", kf[t], S)
            delta = (vf[t] - pred) * bf[t, :, None]
            S = S + kf[t, :, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qf[t], S)
        gdn_state[slot] = S
    return o.to(v.dtype)


@metrale_fake(gdn_recurrence)
def _(a):
    return a.v.new_empty(a.v.shape)


# CUDA path: flash-linear-attention's chunked kernels on a chunk-aligned layout -------------------
# (decode-shaped calls take the recurrent kernel further down instead; ops.common.decode_shaped)
#
# fla 0.6.0's varlen chunked gated delta rule replays exactly in a CUDA graph only if the
# number of sequences and the total chunk count sum(ceil(len_i / 64)) stay fixed, its chunk
# indices come in explicitly (its own preparation syncs with the host) and its identity-keyed
# tensor cache is off (a captured graph would keep stale offsets). So every call lays the T
# tokens out chunk-aligned in a buffer of NT chunks, an upper bound of the chunk count that
# depends on shapes alone: stream b starts at a multiple of 64, identity tokens (g = 0, beta = 0,
# k = q = v = 0, which leave a state unchanged) fill the gaps, and one absorber sequence from the
# scratch-state zero takes the chunks left over. Sequences: B + 1; chunks: NT; both fixed for a
# bucket. All index math runs on the device.
#
# Laying out every stream would give each one-token decode of a mixed step (decodes with a prompt
# chunk, not decode-shaped) a chunk of its own: 31 decodes + 512 prompt tokens, 41 chunks. So calls
# that are not decode-shaped and have several streams are split, by lengths read on the device
# (gdn_recurrence_split): streams of at most SHORT = 64 tokens are left out of the layout (length 0
# there; their slots get their state back unchanged), then the recurrent kernel runs them straight
# on the pool and writes their rows of the same output. Only streams longer than SHORT take chunks,
# at most T // (SHORT + 1) of them, so NT = ceil(T/64) + min(B, T // 65) (the mixed step: 17), never
# more than the ceil(T/64) + B of laying out every stream. A batch of long streams pays only the
# recurrent kernel's launch (its programs return at once); a single stream stays on the chunked path.
CHUNK = 64


def num_chunks(num_streams: int, num_tokens: int, short: int = 0) -> int:
    """NT, the layout's chunk count: ceil(T / 64) + min(B, T // (short + 1)) (see aligned_layout)."""
    return -(-num_tokens // CHUNK) + min(num_streams, num_tokens // (short + 1))


def aligned_layout(cu_seqlens: Tensor, num_tokens: int, short: int = 0) -> tuple[Tensor, Tensor, Tensor, int]:
    """Device-side chunk-aligned layout of the T packed tokens of the streams longer than `short`.

    Returns dest [T] int64 (the aligned row of each token; T_al for tokens in no stream or in a
    stream of at most `short` tokens), cu_aligned [B+2] int64 (B streams, those of at most `short`
    tokens at length 0, + the absorber), chunk_indices [NT, 2] int64 rows (sequence, chunk within
    sequence), and T_al = 64 * NT with NT = ceil(T / 64) + min(B, T // (short + 1)): each stream
    in the layout adds at most one partial chunk, and at most T // (short + 1) streams are longer
    than `short`.
    """
    B = cu_seqlens.shape[0] - 1
    dev = cu_seqlens.device
    NT = num_chunks(B, num_tokens, short)
    T_al = NT * CHUNK
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    laid = lengths > short  # the streams in the layout
    counts = torch.where(laid, lengths + CHUNK - 1, 0) // CHUNK
    # device ops only (a scalar written into a CUDA tensor is a host-to-device copy, not capturable)
    chunk_off = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0), counts.new_full((1,), NT)])
    t = torch.arange(num_tokens, device=dev)
    b = torch.searchsorted(cu[1:], t, right=True)  # B for tokens past the last stream
    bc = b.clamp(max=max(B - 1, 0))
    in_layout = torch.cat([laid, laid.new_zeros(1)])[b]
    dest = torch.where(in_layout, chunk_off[bc] * CHUNK + t - cu[bc], T_al)
    c = torch.arange(NT, device=dev)
    seq = torch.searchsorted(chunk_off, c, right=True) - 1
    chunk_indices = torch.stack([seq, c - chunk_off[seq]], 1)
    return dest, chunk_off * CHUNK, chunk_indices, T_al


# The layout on the device in three kinds of launch (aligned_layout above is the same layout in torch
# ops, about twenty launches a layer, and the tests' oracle): one program computes the chunk offsets
# and every chunk's (sequence, chunk within); then one program per (chunk, column block) gathers a
# tensor's rows into the aligned buffer (identity zeros in gaps and absorber chunks: no zero fill, no
# scatter), and after the varlen kernel the same mapping scatters the output rows back.
@triton.jit
def _chunk_layout_kernel(cu_ptr, cu_al_ptr, idx_ptr, B, NT, short, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    b = tl.arange(0, BLOCK_B)  # BLOCK_B >= B + 2: the streams, the absorber, the end
    mb = b < B
    L = tl.load(cu_ptr + b + 1, mask=mb, other=0) - tl.load(cu_ptr + b, mask=mb, other=0)
    counts = tl.where(mb & (L > short), (L + CHUNK - 1) // CHUNK, 0)
    off = tl.cumsum(counts, 0) - counts  # first chunk of stream b; of the absorber (b = B): all used chunks
    off = tl.where(b <= B, off, NT)
    tl.store(cu_al_ptr + b, off.to(tl.int64) * CHUNK, mask=b < B + 2)
    for c0 in range(0, NT, BLOCK_C):  # chunk c: the last sequence (streams, absorber) starting at or before it
        c = c0 + tl.arange(0, BLOCK_C)
        before = (off[None, :] <= c[:, None]) & (b <= B)[None, :]
        seq = tl.sum(before.to(tl.int32), 1) - 1
        first = tl.max(tl.where(before, off[None, :], 0), 1)  # offsets do not decrease: that sequence's
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
    """aligned_layout's cu_aligned [B+2] and chunk_indices [NT, 2] (int64) in one Triton launch."""
    B = cu_seqlens.shape[0] - 1
    NT = num_chunks(B, num_tokens, short)
    cu_al = torch.empty(B + 2, dtype=torch.int64, device=cu_seqlens.device)
    chunk_indices = torch.empty((NT, 2), dtype=torch.int64, device=cu_seqlens.device)
    _chunk_layout_kernel[(1,)](cu_seqlens, cu_al, chunk_indices, B, NT, short, CHUNK=CHUNK,
                               BLOCK_B=triton.next_power_of_2(B + 2), BLOCK_C=64)
    return cu_al, chunk_indices


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
    Streams of at most `short` tokens are left out (the layout of aligned_layout): their slots get
    their state back unchanged and their output rows are unspecified, for the caller to compute.
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


_fla_fwd = None


def fla_varlen(q, k, v, g, beta, cu_aligned, chunk_indices, h0):
    """flash-linear-attention 0.6.0's forward, called below its autograd wrapper (which is
    compile-disabled and prepares chunk indices on the host)."""
    global _fla_fwd
    if _fla_fwd is None:
        os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")
        import fla.utils
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

        # fla reads this module attribute on every call, so this holds even if fla was imported first
        fla.utils.FLA_DISABLE_TENSOR_CACHE = True
        _fla_fwd = chunk_gated_delta_rule_fwd
    _, o, _, final, _, _ = _fla_fwd(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=q.shape[-1] ** -0.5,
        initial_state=h0, output_final_state=True, cu_seqlens=cu_aligned, chunk_indices=chunk_indices)
    return o[0], final


# CUDA path for decode-shaped calls: a recurrent kernel straight on the pool --------------------
#
# One program per (stream, value head, V tile of BV columns) holds its [K, BV] slice of the state in
# registers: it loads it from the stream's pool row, runs the rule over the stream's tokens (a loop
# bounded by cu_seqlens, read on the device), writes each token's output, and stores the slice back
# into the same pool row. No layout, no gather / scatter, one launch; its grid (B, HV, cdiv(V, BV))
# follows from shapes. Each program reads and writes only its own slice of its own slot, and slots of
# non-empty streams are distinct, so updating the pool in place is safe. A zero-length stream's
# programs return before touching anything, and so do those of streams longer than max_len (a split
# call: the chunked path has computed them; decode-shaped calls pass T, taking every stream).
# max_len is not specialized on (one compiled kernel whatever the bucket's T).
@triton.jit(do_not_specialize=["max_len"])
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, cu_ptr, slot_ptr, scale, R, K, V,
                          max_len, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                          stride_gh, stride_bt, stride_bh, stride_ot, stride_oh, stride_s0, stride_s1, stride_s2,
                          stride_s3, BK: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    if (end > start) & (end - start <= max_len):  # others (padding, long streams) read and write nothing
        h = hv // R  # the key head of this value head
        kk = tl.arange(0, BK)
        vv = tl.program_id(2) * BV + tl.arange(0, BV)
        mk, mv = kk < K, vv < V
        slot = tl.load(slot_ptr + b).to(tl.int64)
        p_s = (state_ptr + slot * stride_s0 + hv * stride_s1 + kk[:, None].to(tl.int64) * stride_s2
               + vv[None, :].to(tl.int64) * stride_s3)
        m_s = mk[:, None] & mv[None, :]
        S = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] fp32
        t0 = start.to(tl.int64)
        p_q = q_ptr + t0 * stride_qt + h * stride_qh + kk
        p_k = k_ptr + t0 * stride_kt + h * stride_kh + kk
        p_v = v_ptr + t0 * stride_vt + hv * stride_vh + vv
        p_g = g_ptr + t0 * stride_gt + hv * stride_gh
        p_b = beta_ptr + t0 * stride_bt + hv * stride_bh
        p_o = o_ptr + t0 * stride_ot + hv * stride_oh + vv
        for _ in range(start, end):
            q = tl.load(p_q, mask=mk, other=0.0).to(tl.float32) * scale
            k = tl.load(p_k, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(p_v, mask=mv, other=0.0).to(tl.float32)
            decay = tl.exp(tl.load(p_g).to(tl.float32))
            beta = tl.load(p_b).to(tl.float32)
            S = S * decay
            delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BV]
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(p_o, o.to(p_o.dtype.element_ty), mask=mv)
            p_q += stride_qt
            p_k += stride_kt
            p_v += stride_vt
            p_g += stride_gt
            p_b += stride_bt
            p_o += stride_ot
        tl.store(p_s, S, mask=m_s)


def recurrent_tiles(K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps) of the recurrent kernel: the whole key dim (masked to a power of two) by 8
    value columns, fla's fused_recurrent choice (many small programs: decode is bound by reading and
    writing the state, so parallelism over (stream, head, V tile) is what counts)."""
    BK = max(16, triton.next_power_of_2(K))
    return BK, min(8, triton.next_power_of_2(V)), 1 if BK <= 128 else 2


def gdn_recurrence_recurrent(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, max_len=None, o=None):
    """The gated delta rule token by token, each stream from and back into its pool row (one launch,
    no host sync). Exact for any lengths; sequential in each stream's length.

    Streams longer than `max_len` (default: none) are left alone: their slots and output rows are not
    touched. `o` (default: a fresh [T, HV, V] in v's dtype) receives the other streams' rows.
    """
    T, H, K = q.shape
    HV, V = v.shape[1:]
    B = slot_ids.shape[0]
    if o is None:
        o = torch.empty((T, HV, V), dtype=v.dtype, device=v.device)  # rows of tokens in no stream: unspecified
    if T == 0 or B == 0:
        return o
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    cu_seqlens, slot_ids = cu_seqlens.contiguous(), slot_ids.contiguous()  # indexed as contiguous; the pool by strides
    BK, BV, warps = recurrent_tiles(K, V)
    _gdn_recurrent_kernel[(B, HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, o, gdn_state, cu_seqlens, slot_ids, K**-0.5, HV // H, K, V, T if max_len is None else max_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), *gdn_state.stride(),
        BK=BK, BV=BV, num_warps=warps)
    return o


def use_recurrent(q: Tensor, slot_ids: Tensor) -> bool:
    """The path choice of the CUDA implementation: static sizes (B, T) only (ops.common.decode_shaped)."""
    return decode_shaped(slot_ids.shape[0], q.shape[0])


SHORT = 64


def split_max_len(num_streams: int) -> int:
    """In a call that is not decode-shaped, streams of at most this many tokens take the recurrent kernel
    and longer ones the chunked path: SHORT with several streams; 0 with one (all of it chunked, no
    second launch). Static sizes only."""
    return SHORT if num_streams > 1 else 0


def gdn_recurrence_split(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, varlen_fn):
    """A call that is not decode-shaped: the chunked path (`varlen_fn` on the aligned layout) over the
    streams longer than split_max_len(B), then the recurrent kernel over the others, into the same output.

    In this order: the chunked path writes every slot of the batch back (the short streams' unchanged),
    then the recurrent kernel updates the short streams' slots in place and writes their rows of o.
    Which stream goes where is decided on the device (cu_seqlens); shapes depend on (B, T) only.
    """
    max_len = split_max_len(slot_ids.shape[0])
    o = gdn_recurrence_aligned(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, varlen_fn, max_len)
    if max_len:
        gdn_recurrence_recurrent(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, max_len, o)
    return o


@metrale_cuda(gdn_recurrence)
def gdn_recurrence_cuda(a):
    """Decode-shaped calls: the recurrent kernel on every stream; others: gdn_recurrence_split with fla."""
    if use_recurrent(a.q, a.slot_ids):
        return gdn_recurrence_recurrent(*a)
    return gdn_recurrence_split(*a, fla_varlen)


def example(s: Shapes, dtype, g):
    cu, slots, _, _ = stream_meta(s, g)
    T, H, HV = s.T, s.H, s.HV
    qk = torch.nn.functional.normalize(torch.randn(T, 2 * H, s.K, generator=g), dim=-1).to(dtype)
    q, k = qk[:, :H], qk[:, H:]  # strided views, as the model passes them
    if T == 0:  # except when empty: opcheck's input clone sizes an empty strided view at < 0 elements
        q, k = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
    return (q, k, rand(g, T, HV, s.V, dtype=dtype), -torch.rand(T, HV, generator=g) * 0.5,
            torch.rand(T, HV, generator=g).to(dtype), cu, slots,
            torch.randn(s.num_slots + 1, HV, s.K, s.V, generator=g) * 0.1)


def cost(s: Shapes):
    """Per token: the chunked form, chunk 64 (kk^T, w / u, state update and read, intra-chunk output), or
    for the recurrent kernel's tokens (decode-shaped calls; otherwise streams of <= split_max_len(B)
    tokens) decay, S^T k, the rank-1 update and S^T q. Each slot of the batch is read and written once,
    a short stream's of a split call twice (the chunked path hands it back, the recurrent kernel updates it)."""
    decode = decode_shaped(s.B, s.T)
    short = [n for n in s.lengths if decode or n <= split_max_len(s.B)]
    T_rec, again = sum(short), 0 if decode else sum(n > 0 for n in short)
    per_rec, per_chunked = 2 * (3 * s.K * s.V), 2 * (192 * s.K + 128 * s.V + 3 * s.K * s.V)
    return (s.HV * (T_rec * per_rec + (s.T - T_rec) * per_chunked),
            2 * (s.T * 2 * s.H * s.K + 2 * s.T * s.HV * s.V) + 6 * s.T * s.HV + 8 * (s.B + again) * s.HV * s.K * s.V)


# fla 0.6.0's chunk kernels, by name
FLA_KERNELS = ("chunk_", "recompute_w_u", "solve_tril", "merge_16x16", "kkt")
register(OpSpec(gdn_recurrence, example, cost, cuda=gdn_recurrence_cuda,
                kernels=FLA_KERNELS + ("gdn_recurrent",),
                onnx="metrale_graph.onnx.translations:gdn_recurrence"))
