"""Full-attention layer, part 2: write the new tokens' K / V into the paged cache, then causal
GQA attention of each stream's new tokens over its cached context plus themselves.

Stream b's token i sits at position p = context_lens[b] + i, stored in block
block_tables[b, p // BS] at offset p % BS. A zero-length stream (padding) writes and reads
nothing.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INDEX_DTYPES, INTERPRET, check, check_tensor, decode_shaped
from .registry import OpSpec, Shapes, attention_pairs, metrale_cuda, metrale_fake, metrale_op, rand, register, stream_meta

LOG2E = 1.4426950408889634


def _check(a):
    check_tensor(a.q, "q", ndim=3)
    T, HQ, HD = a.q.shape
    dtype, device = a.q.dtype, a.q.device
    for name, t in (("k", a.k), ("v", a.v)):
        check_tensor(t, name, ndim=3, dtype=dtype, device=device)
    HKV = a.k.shape[1]
    check(tuple(a.k.shape) == (T, HKV, HD) and a.k.shape == a.v.shape and HQ % HKV == 0,
          f"k {tuple(a.k.shape)} / v {tuple(a.v.shape)} do not fit q {(T, HQ, HD)} (GQA needs HQ % HKV == 0)")
    for name, t in (("k_cache", a.k_cache), ("v_cache", a.v_cache)):
        check_tensor(t, name, ndim=4, dtype=dtype, device=device)
        check(tuple(t.shape[2:]) == (HKV, HD), f"{name} blocks hold {tuple(t.shape[2:])}, expected {(HKV, HD)}")
    check(a.k_cache.shape == a.v_cache.shape, "k_cache and v_cache differ in shape")
    check_tensor(a.cu_seqlens, "cu_seqlens", ndim=1, dtype=torch.int32, device=device)
    B = a.cu_seqlens.shape[0] - 1
    check_tensor(a.context_lens, "context_lens", ndim=1, dtype=torch.int32, device=device)
    check_tensor(a.block_tables, "block_tables", ndim=2, dtype=INDEX_DTYPES, device=device)
    check(a.context_lens.shape[0] == B and a.block_tables.shape[0] == B,
          f"context_lens ({a.context_lens.shape[0]}) / block_tables ({a.block_tables.shape[0]}) rows for {B} streams")


@metrale_op(mutates_args=("k_cache", "v_cache"), check=_check)
def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor,
                    context_lens: Tensor, block_tables: Tensor) -> Tensor:
    """Batched varlen attention prefill over a paged KV cache, including the KV write. The CPU
    reference: plain torch, one stream at a time, fp32 scores and softmax.

    Args:
        q: [T, HQ, HD] (RoPE applied), k, v: [T, HKV, HD] the new tokens' keys / values.
        k_cache, v_cache: [NB, BS, HKV, HD] pools, model dtype. MUTATED: the new tokens' K / V
            are written at their positions.
        cu_seqlens: [B+1] int32 stream boundaries.
        context_lens: [B] int32 tokens already cached per stream.
        block_tables: [B, MB] int32 block ids of each stream, in position order.
    Returns:
        o: [T, HQ, HD] model dtype, softmax(q k^T * HD**-0.5, causal) v with fp32 softmax.
    """
    T, HQ, HD = q.shape
    HKV, BS = k.shape[1], k_cache.shape[1]
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    bounds, ctxs = cu_seqlens.tolist(), context_lens.tolist()
    for b in range(len(ctxs)):
        s, e, ctx = bounds[b], bounds[b + 1], ctxs[b]
        if e == s:
            continue
        L = e - s
        pos = torch.arange(ctx + L, device=q.device)
        blk, off = block_tables[b].long()[pos // BS], pos % BS
        k_cache[blk[ctx:], off[ctx:]] = k[s:e]
        v_cache[blk[ctx:], off[ctx:]] = v[s:e]
        keys = k_cache[blk, off].float().repeat_interleave(HQ // HKV, dim=1)  # [ctx+L, HQ, HD]
        vals = v_cache[blk, off].float().repeat_interleave(HQ // HKV, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), keys) * HD**-0.5
        causal = pos[None, :] <= (ctx + torch.arange(L, device=q.device))[:, None]  # [L, ctx+L]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o[s:e] = torch.einsum("hqk,khd->qhd", probs, vals)
    return o.to(q.dtype)


@metrale_fake(paged_attention)
def _(a):
    return a.q.new_empty(a.q.shape)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache, v_cache, tok_stream_ptr, cu_ptr, ctx_ptr, bt_ptr, B, BS, N, HD,
                     stride_kt, stride_vt, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
                     stride_vd, stride_bt, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    b = tl.load(tok_stream_ptr + t)
    if b < B:  # tokens past cu_seqlens[-1] belong to no stream and are not written
        pos = tl.load(ctx_ptr + b) + t - tl.load(cu_ptr + b)
        blk = tl.load(bt_ptr + b * stride_bt + pos // BS).to(tl.int64)
        i = tl.arange(0, BLOCK)  # the token's HKV * HD values, head-major
        m = i < N
        h, d = i // HD, i % HD
        k_dst = blk * stride_kb + (pos % BS) * stride_ks + h * stride_kh + d * stride_kd
        v_dst = blk * stride_vb + (pos % BS) * stride_vs + h * stride_vh + d * stride_vd
        tl.store(k_cache + k_dst, tl.load(k_ptr + t * stride_kt + i, mask=m), mask=m)
        tl.store(v_cache + v_dst, tl.load(v_ptr + t * stride_vt + i, mask=m), mask=m)


def _attention_configs():
    if INTERPRET:
        return [triton.Config({"BN": 32}, num_warps=4)]
    return [triton.Config({"BN": bn}, num_warps=w, num_stages=st)
            for bn in (32, 64) for w in (4, 8) for st in (1, 2, 3)]


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, hi, q_pos, d, md, qk_scale,
                 stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, stride_bt, BS,
                 BN: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """One online-softmax step over keys [n0, n0 + BN) below `hi`; MASKED tiles apply the causal /
    length mask. EMPTY_ROWS: a row may have seen no key yet (a split-K part that starts past its
    position); it stays at m = -inf, l = 0, acc = 0 instead of computing exp2(-inf - -inf)."""
    kpos = n0 + tl.arange(0, BN)
    mk = kpos < hi
    blk = tl.load(bt_ptr + b * stride_bt + kpos // BS, mask=mk, other=0).to(tl.int64)
    slot = (kpos % BS)[:, None]
    k_off = blk[:, None] * stride_kb + slot * stride_ks + kvh * stride_kh + d[None, :] * stride_kd
    v_off = blk[:, None] * stride_vb + slot * stride_vs + kvh * stride_vh + d[None, :] * stride_vd
    kv_mask = mk[:, None] & md[None, :]
    k = tl.load(k_cache + k_off, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale  # log2 domain: exp2 below
    if MASKED:
        s = tl.where((kpos[None, :] <= q_pos[:, None]) & mk[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # without EMPTY_ROWS key 0 is visible to every row: finite
    if EMPTY_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache + v_off, mask=kv_mask, other=0.0)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


# cache_results: the choice is kept in Triton's cache folder (tools.warmup points it into its
# --cache-dir), so a warm start neither benchmarks nor compiles the losing configs
@triton.autotune(configs=_attention_configs(), key=["HD", "GROUP", "IEEE"], cache_results=True)
@triton.jit
def _paged_attention_kernel(q_ptr, k_cache, v_cache, o_ptr, work_ptr, cu_ptr, ctx_ptr, bt_ptr, qk_scale,
                            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs,
                            stride_vh, stride_vd, stride_ot, stride_oh, stride_bt, GROUP, BS, HD,
                            BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    b = tl.load(work_ptr + 2 * tl.program_id(0))
    if b < 0:  # work rows past the batch's real q blocks
        return
    qb = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    h = tl.program_id(1)
    kvh = h // GROUP
    start = tl.load(cu_ptr + b)
    L = tl.load(cu_ptr + b + 1) - start
    ctx = tl.load(ctx_ptr + b)
    m_idx = qb * BM + tl.arange(0, BM)  # query index within the stream
    mq = m_idx < L
    q_pos = ctx + m_idx
    d = tl.arange(0, BLOCK_D)
    md = d < HD
    rows = (start + m_idx).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=mq[:, None] & md[None, :],
                other=0.0)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BLOCK_D], dtype=tl.float32)
    hi = ctx + tl.minimum(qb * BM + BM, L)  # keys this block can see: positions [0, hi)
    # key tiles wholly below the block's first query position need no mask
    full = ((ctx + qb * BM) // BN) * BN
    for n0 in range(0, full, BN):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, hi, q_pos, d, md,
                                     qk_scale, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs,
                                     stride_vh, stride_vd, stride_bt, BS, BN, False, IEEE, False)
    for n0 in range(full, hi, BN):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, hi, q_pos, d, md,
                                     qk_scale, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs,
                                     stride_vh, stride_vd, stride_bt, BS, BN, True, IEEE, False)
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mq[:, None] & md[None, :])


BM = 64  # query rows per program; the work list is built for it


def q_block_work(cu_seqlens: Tensor, num_tokens: int, block: int) -> Tensor:
    """[cdiv(T, block) + B, 2] int32 rows (stream, q block within stream), then rows of -1: a fixed
    row count for a bucket, built on the device (no host sync)."""
    B = cu_seqlens.shape[0] - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offsets = torch.zeros(B + 1, dtype=torch.int64, device=cu_seqlens.device)
    offsets[1:] = torch.cumsum((lens + block - 1) // block, 0)
    rows = torch.arange(triton.cdiv(num_tokens, block) + B, device=cu_seqlens.device)
    stream = torch.searchsorted(offsets, rows, right=True) - 1
    valid = rows < offsets[-1]
    within = rows - offsets[stream.clamp(max=B)]
    return torch.stack([torch.where(valid, stream, -1), torch.where(valid, within, 0)], 1).to(torch.int32)


# Decode-shaped calls: split-K (flash-decoding) over the cached context ---------------------------
#
# When queries per stream are few (ops.common.decode_shaped), 64-row query tiles leave the GPU idle:
# one stream of one token is HQ programs, each walking the whole context alone. Here a program takes
# a tile of QB consecutive queries of one stream times the GROUP query heads that share one KV head
# (QB * GROUP <= 16 rows where GROUP allows: a [16, HD] x [HD, BN] dot, each key tile read once for
# all of them) and one split of SL keys; the grid is (work tiles, HKV, NS splits), all static:
#   work tiles NW = min(cdiv(T, QB) + B, T) >= the (stream, query tile) pairs of any batch of the
#   bucket (each program finds its pair from cu_seqlens on the device; surplus programs return);
#   NS = cdiv(MB * BS, SL), MB the block table's width (a static dim), SL from `decode_split`.
# Each program writes its rows' partial softmax state (running max m, sum l, unnormalized acc, log2
# domain) for its split; a second kernel, one program per (token, query head), merges the splits that
# hold keys for that token (cdiv(position + 1, SL) of them, every one non-empty: split s starts at key
# s * SL <= position) into the output. Tokens in no stream are skipped (their rows: unspecified).
DECODE_PROGRAMS = 1024  # splits are chosen to give about this many programs (H200: 132 SMs, ~8 each)
SPLIT_ALIGN = 64  # split lengths are multiples of every key tile BN
STREAM_CHUNK = 64  # streams looked at per vector step when a program finds its stream
MERGE_SPLITS = 16  # splits merged per vector step


def decode_queries(group: int) -> tuple[int, int]:
    """(QB, BLOCK_M): queries per work tile, and the tile's rows QB * GROUP padded to a power of two
    (at least 16, tl.dot's least M)."""
    qb = max(1, 16 // group)
    return qb, max(16, triton.next_power_of_2(qb * group))


def decode_split(num_streams: int, num_tokens: int, num_kv_heads: int, max_keys: int) -> int:
    """Keys per split, a multiple of SPLIT_ALIGN, from static sizes only: enough splits that the busy
    programs (about one work tile per stream and KV head) number about DECODE_PROGRAMS for a context of
    max_keys = MB * BS, the most a stream's block table holds."""
    tiles = max(1, min(num_streams, num_tokens)) * num_kv_heads
    splits = max(1, -(-DECODE_PROGRAMS // tiles))
    per = -(-max(max_keys, 1) // splits)
    return max(SPLIT_ALIGN, -(-per // SPLIT_ALIGN) * SPLIT_ALIGN)


def _decode_configs():
    if INTERPRET:
        return [triton.Config({"BN": 32}, num_warps=4)]
    return [triton.Config({"BN": bn}, num_warps=w, num_stages=st)
            for bn in (32, 64) for w in (4, 8) for st in (1, 2, 3)]


@triton.jit
def _stream_of(cu_ptr, t, B, CH: tl.constexpr):
    """The stream holding packed token t: how many streams end at or before t (B: none)."""
    b = tl.full([], 0, tl.int32)
    for c0 in range(0, B, CH):
        i = c0 + tl.arange(0, CH)
        mi = i < B
        ends = tl.load(cu_ptr + 1 + i, mask=mi, other=0)
        b += tl.sum((mi & (ends <= t)).to(tl.int32), axis=0)
    return b


@triton.jit
def _tile_of(cu_ptr, w, B, QB, CH: tl.constexpr):
    """(stream, query tile within it) of work tile w, stream-major, QB queries a tile (stream B: none).
    Streams whose cumulative tile count ends at or before w come before it (zero-length ones too)."""
    b = tl.full([], 0, tl.int32)
    before = tl.full([], 0, tl.int32)  # tiles of the streams before b
    base = tl.full([], 0, tl.int32)  # tiles of the streams before this chunk
    for c0 in range(0, B, CH):
        i = c0 + tl.arange(0, CH)
        mi = i < B
        lo = tl.load(cu_ptr + i, mask=mi, other=0)
        hi = tl.load(cu_ptr + 1 + i, mask=mi, other=0)
        n = (hi - lo + QB - 1) // QB
        done = mi & (base + tl.cumsum(n, axis=0) <= w)
        b += tl.sum(done.to(tl.int32), axis=0)
        before += tl.sum(tl.where(done, n, 0), axis=0)
        base += tl.sum(n, axis=0)
    return b, w - before


@triton.autotune(configs=_decode_configs(), key=["HD", "GROUP", "QB", "SL", "IEEE"], cache_results=True)
@triton.jit
def _paged_decode_kernel(q_ptr, k_cache, v_cache, m_ptr, l_ptr, acc_ptr, cu_ptr, ctx_ptr, bt_ptr, qk_scale, B,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs,
                         stride_vh, stride_vd, stride_bt,
                         GROUP, QB, SL, NS, HQ, BS, HD, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BN: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr):
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    b, tile = _tile_of(cu_ptr, tl.program_id(0), B, QB, CH)
    if b < B:  # else: a work tile past the batch's
        start = tl.load(cu_ptr + b)
        L = tl.load(cu_ptr + b + 1) - start
        ctx = tl.load(ctx_ptr + b)
        hi = ctx + tl.minimum(tile * QB + QB, L)  # keys the tile's queries see: positions [0, hi)
        lo = sp * SL
        if lo < hi:  # else: the split lies past every query of the tile
            end = tl.minimum(lo + SL, hi)
            r = tl.arange(0, BLOCK_M)
            j = r // GROUP
            qi = tile * QB + j  # query index within the stream
            mq = (j < QB) & (qi < L)
            q_pos = ctx + qi
            head = kvh * GROUP + r % GROUP
            rows = (start + qi).to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            md = d < HD
            q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=mq[:, None] & md[None, :], other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for n0 in range(lo, end, BN):  # a row may see no key of this split yet: EMPTY_ROWS
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, end, q_pos, d,
                                             md, qk_scale, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
                                             stride_vs, stride_vh, stride_vd, stride_bt, BS, BN=BN,
                                             MASKED=True, IEEE=IEEE, EMPTY_ROWS=True)
            part = (rows * HQ + head) * NS + sp  # [T, HQ, NS] partials
            tl.store(m_ptr + part, m_i, mask=mq)
            tl.store(l_ptr + part, l_i, mask=mq)
            tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=mq[:, None] & md[None, :])


@triton.jit
def _paged_decode_merge_kernel(o_ptr, m_ptr, l_ptr, acc_ptr, cu_ptr, ctx_ptr, B, SL, NS, HQ, HD, stride_ot,
                               stride_oh, BLOCK_D: tl.constexpr, SC: tl.constexpr, CH: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = _stream_of(cu_ptr, t, B, CH)
    if b < B:  # else: a token in no stream
        pos = tl.load(ctx_ptr + b) + t - tl.load(cu_ptr + b)
        n = (pos + SL) // SL  # splits holding keys [0, pos]: each has at least one
        base = (t.to(tl.int64) * HQ + h) * NS
        s = tl.arange(0, SC)
        d = tl.arange(0, BLOCK_D)
        md = d < HD
        m_max = tl.full([], float("-inf"), dtype=tl.float32)
        for s0 in range(0, n, SC):
            m_max = tl.maximum(m_max, tl.max(tl.load(m_ptr + base + s0 + s, mask=s0 + s < n, other=float("-inf")),
                                              axis=0))
        l_sum = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s0 in range(0, n, SC):
            ms = s0 + s < n
            w = tl.exp2(tl.load(m_ptr + base + s0 + s, mask=ms, other=float("-inf")) - m_max)
            l_sum += tl.sum(w * tl.load(l_ptr + base + s0 + s, mask=ms, other=0.0), axis=0)
            a = tl.load(acc_ptr + (base + s0 + s)[:, None] * HD + d[None, :], mask=ms[:, None] & md[None, :],
                        other=0.0)
            acc += tl.sum(a * w[:, None], axis=0)
        tl.store(o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, (acc / l_sum).to(o_ptr.dtype.element_ty),
                 mask=md)


def paged_attention_decode(q, k_cache, v_cache, cu_seqlens, context_lens, block_tables, o, split=None):
    """Split-K attention of the (already written) new tokens over the paged cache into o. `split`: keys
    per split (a multiple of SPLIT_ALIGN), default `decode_split` of the static sizes."""
    T, HQ, HD = q.shape
    HKV, BS = k_cache.shape[2], k_cache.shape[1]
    B = cu_seqlens.shape[0] - 1
    GROUP = HQ // HKV
    QB, BLOCK_M = decode_queries(GROUP)
    max_keys = block_tables.shape[1] * BS
    cu_seqlens, context_lens, block_tables = (x.contiguous() for x in (cu_seqlens, context_lens, block_tables))
    SL = split or decode_split(B, T, HKV, max_keys)
    if SL % SPLIT_ALIGN:
        raise ValueError(f"split {SL} is not a multiple of {SPLIT_ALIGN}")
    NS = max(1, triton.cdiv(max_keys, SL))
    NW = min(triton.cdiv(T, QB) + B, T)
    m = torch.empty((T, HQ, NS), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((T, HQ, NS, HD), dtype=torch.float32, device=q.device)
    if q.stride(2) != 1:
        q = q.contiguous()
    BLOCK_D = max(16, triton.next_power_of_2(HD))
    _paged_decode_kernel[(NW, HKV, NS)](
        q, k_cache, v_cache, m, l, acc, cu_seqlens, context_lens, block_tables, HD**-0.5 * LOG2E, B,
        q.stride(0), q.stride(1), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        GROUP, QB, SL, NS, HQ, BS, HD, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, CH=STREAM_CHUNK,
        IEEE=q.dtype == torch.float32 or INTERPRET)
    _paged_decode_merge_kernel[(T, HQ)](o, m, l, acc, cu_seqlens, context_lens, B, SL, NS, HQ, HD, o.stride(0),
                                        o.stride(1), BLOCK_D=BLOCK_D, SC=MERGE_SPLITS, CH=STREAM_CHUNK)
    return o


def use_decode(q: Tensor, cu_seqlens: Tensor) -> bool:
    """The path choice of the CUDA implementation: static sizes (B, T) only (ops.common.decode_shaped)."""
    return decode_shaped(cu_seqlens.shape[0] - 1, q.shape[0])


def paged_attention_triton(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables, decode=None):
    """KV write, then attention over the paged cache: split-K when decode-shaped (`decode`, default
    `use_decode`), else flash-style varlen with 64-row query tiles; no host sync."""
    T, HQ, HD = q.shape
    HKV, BS = k.shape[1], k_cache.shape[1]
    B = cu_seqlens.shape[0] - 1
    k, v = k.reshape(T, HKV * HD), v.reshape(T, HKV * HD)
    k, v = (t if t.stride(1) == 1 else t.contiguous() for t in (k, v))
    # index tensors of any strides (the kernels index them as contiguous); the pools are read and written
    # through their strides (they are mutated in place: no copy)
    cu_seqlens, context_lens, block_tables = (x.contiguous() for x in (cu_seqlens, context_lens, block_tables))
    o = torch.empty((T, HQ, HD), dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return o
    tok_stream = torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=q.device, dtype=torch.int32),
                                    right=True).to(torch.int32)
    N = HKV * HD
    _kv_write_kernel[(T,)](k, v, k_cache, v_cache, tok_stream, cu_seqlens, context_lens, block_tables, B, BS, N, HD,
                           k.stride(0), v.stride(0), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
                           BLOCK=triton.next_power_of_2(N))
    if decode is None:
        decode = use_decode(q, cu_seqlens)
    if decode:
        return paged_attention_decode(q, k_cache, v_cache, cu_seqlens, context_lens, block_tables, o)
    work = q_block_work(cu_seqlens, T, BM)
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_attention_kernel[(work.shape[0], HQ)](
        q, k_cache, v_cache, o, work, cu_seqlens, context_lens, block_tables, HD**-0.5 * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride(), *v_cache.stride(), o.stride(0), o.stride(1),
        block_tables.stride(0), HQ // HKV, BS, HD, BLOCK_D=max(16, triton.next_power_of_2(HD)), BM=BM,
        IEEE=q.dtype == torch.float32 or INTERPRET)
    return o


@metrale_cuda(paged_attention)
def paged_attention_cuda(a):
    return paged_attention_triton(*a)


def example(s: Shapes, dtype, g):
    cu, _, ctx, blocks = stream_meta(s, g)
    kv = (s.num_blocks + 1, s.BS, s.HKV, s.HD)
    return (rand(g, s.T, s.HQ, s.HD, dtype=dtype), rand(g, s.T, s.HKV, s.HD, dtype=dtype),
            rand(g, s.T, s.HKV, s.HD, dtype=dtype), rand(g, *kv, dtype=dtype), rand(g, *kv, dtype=dtype), cu, ctx,
            blocks)


def cost(s: Shapes):
    cached = sum(s.context)
    return 4 * s.HQ * s.HD * attention_pairs(s), 2 * (2 * s.T * s.HQ * s.HD + 4 * s.T * s.HKV * s.HD
                                                      + 2 * cached * s.HKV * s.HD)


register(OpSpec(paged_attention, example, cost, cuda=paged_attention_cuda,
                kernels=("paged_attention", "paged_decode", "kv_write"),
                onnx="metrale_graph.onnx.translations:paged_attention"))
