"""Full-attention layer, part 2: write the new tokens' K / V into the paged cache, then causal
GQA attention of each stream's new tokens over its cached context plus themselves.

Stream b's token i sits at position p = context_lens[b] + i, stored in block
block_tables[b, p // BS] at offset p % BS. A zero-length stream (padding) writes and reads
nothing.
"""

import torch
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor

OP = "paged_attention"


@torch.library.custom_op("metrale::paged_attention", mutates_args=("k_cache", "v_cache"), device_types="cpu")
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


@paged_attention.register_kernel("cuda")
def _(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    _check(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)
    return paged_attention_ref(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)
