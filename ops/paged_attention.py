"""Full-attention layer, part 2: write the new tokens' K / V into the paged cache, then causal
GQA attention of each stream's new tokens over its cached context plus themselves.

Stream b's token i sits at position p = context_lens[b] + i, stored in block
block_tables[b, p // BS] at offset p % BS. A zero-length stream (padding) writes and reads
nothing.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor
from .registry import OpSpec, Shapes, attention_pairs, metrale_op, rand, register, stream_meta

OP = "paged_attention"
# Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.6.0): there the kernel takes its
# fp32 path on upcast tiles, so the CPU suite still checks the indexing and the online softmax.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634


@metrale_op("paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor,
                    context_lens: Tensor, block_tables: Tensor) -> Tensor:
    """Batched varlen attention prefill over a paged KV cache, including the KV write.

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
    _check(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)
    return paged_attention_ref(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    _check(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)
    return q.new_empty(q.shape)


def _check(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    check_tensor(q, OP, "q", ndim=3)
    T, HQ, HD = q.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(t, OP, name, ndim=3, dtype=q.dtype, device=q.device)
    HKV = k.shape[1]
    check(tuple(k.shape) == (T, HKV, HD) and k.shape == v.shape and HQ % HKV == 0, OP,
          f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {(T, HQ, HD)} (GQA needs HQ % HKV == 0)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(t, OP, name, ndim=4, dtype=q.dtype, device=q.device)
        check(tuple(t.shape[2:]) == (HKV, HD), OP, f"{name} blocks hold {tuple(t.shape[2:])}, expected {(HKV, HD)}")
    check(k_cache.shape == v_cache.shape, OP, "k_cache and v_cache differ in shape")
    check_tensor(cu_seqlens, OP, "cu_seqlens", ndim=1, dtype=torch.int32, device=q.device)
    B = cu_seqlens.shape[0] - 1
    check_tensor(context_lens, OP, "context_lens", ndim=1, dtype=torch.int32, device=q.device)
    check_tensor(block_tables, OP, "block_tables", ndim=2, dtype=INDEX_DTYPES, device=q.device)
    check(context_lens.shape[0] == B and block_tables.shape[0] == B, OP,
          f"context_lens ({context_lens.shape[0]}) / block_tables ({block_tables.shape[0]}) rows for {B} streams")


def paged_attention_ref(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    """Plain torch, one stream at a time, fp32 scores and softmax."""
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


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache, v_cache, tok_stream_ptr, cu_ptr, ctx_ptr, bt_ptr, B, BS, N,
                     stride_kt, stride_vt, stride_cb, stride_bt, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    b = tl.load(tok_stream_ptr + t)
    if b < B:  # tokens past cu_seqlens[-1] belong to no stream and are not written
        pos = tl.load(ctx_ptr + b) + t - tl.load(cu_ptr + b)
        blk = tl.load(bt_ptr + b * stride_bt + pos // BS).to(tl.int64)
        dst = blk * stride_cb + (pos % BS) * N
        i = tl.arange(0, BLOCK)
        m = i < N
        tl.store(k_cache + dst + i, tl.load(k_ptr + t * stride_kt + i, mask=m), mask=m)
        tl.store(v_cache + dst + i, tl.load(v_ptr + t * stride_vt + i, mask=m), mask=m)


def _attention_configs():
    if INTERPRET:
        return [triton.Config({"BN": 32}, num_warps=4)]
    return [triton.Config({"BN": bn}, num_warps=w, num_stages=st)
            for bn in (32, 64) for w in (4, 8) for st in (1, 2, 3)]


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, hi, q_pos, d, md, qk_scale,
                 stride_cb, stride_cs, stride_ch, stride_bt, BS, BN: tl.constexpr, MASKED: tl.constexpr,
                 IEEE: tl.constexpr):
    """One online-softmax step over keys [n0, n0 + BN); MASKED tiles apply the causal / length mask."""
    kpos = n0 + tl.arange(0, BN)
    mk = kpos < hi
    blk = tl.load(bt_ptr + b * stride_bt + kpos // BS, mask=mk, other=0).to(tl.int64)
    kv_off = blk[:, None] * stride_cb + (kpos % BS)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
    kv_mask = mk[:, None] & md[None, :]
    k = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale  # log2 domain: exp2 below
    if MASKED:
        s = tl.where((kpos[None, :] <= q_pos[:, None]) & mk[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # key 0 is visible to every row: m_new is finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
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
                            stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh, stride_bt,
                            GROUP, BS, HD, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            IEEE: tl.constexpr):
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
                                     qk_scale, stride_cb, stride_cs, stride_ch, stride_bt, BS, BN, False, IEEE)
    for n0 in range(full, hi, BN):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, hi, q_pos, d, md,
                                     qk_scale, stride_cb, stride_cs, stride_ch, stride_bt, BS, BN, True, IEEE)
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


def paged_attention_triton(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    """KV write, then flash-style varlen attention over the paged cache; no host sync."""
    T, HQ, HD = q.shape
    HKV, BS = k.shape[1], k_cache.shape[1]
    B = cu_seqlens.shape[0] - 1
    k, v = k.reshape(T, HKV * HD), v.reshape(T, HKV * HD)
    k, v = (t if t.stride(1) == 1 else t.contiguous() for t in (k, v))
    block_tables = block_tables.contiguous()
    o = torch.empty((T, HQ, HD), dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return o
    tok_stream = torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=q.device, dtype=torch.int32),
                                    right=True).to(torch.int32)
    N = HKV * HD
    _kv_write_kernel[(T,)](k, v, k_cache, v_cache, tok_stream, cu_seqlens, context_lens, block_tables, B, BS, N,
                           k.stride(0), v.stride(0), k_cache.stride(0), block_tables.stride(0),
                           BLOCK=triton.next_power_of_2(N))
    work = q_block_work(cu_seqlens, T, BM)
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_attention_kernel[(work.shape[0], HQ)](
        q, k_cache, v_cache, o, work, cu_seqlens, context_lens, block_tables, HD**-0.5 * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), o.stride(0), o.stride(1),
        block_tables.stride(0), HQ // HKV, BS, HD, BLOCK_D=max(16, triton.next_power_of_2(HD)), BM=BM,
        IEEE=q.dtype == torch.float32 or INTERPRET)
    return o


@paged_attention.register_kernel("cuda")
def paged_attention_cuda(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    _check(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)
    return paged_attention_triton(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)


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


register(OpSpec(paged_attention, paged_attention_ref, example, cost, cuda=paged_attention_cuda,
                kernels=("paged_attention", "kv_write"), onnx="metrale_graph.onnx.translations:paged_attention"))
