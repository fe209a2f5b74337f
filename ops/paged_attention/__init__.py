"""Full-attention layer, part 2: write the new tokens' K / V into the paged cache, then causal
GQA attention of each stream's new tokens over its cached context plus themselves.

Stream b's token i sits at position p = context_lens[b] + i, stored in block
block_tables[b, p // BS] at offset p % BS. A zero-length stream (padding) writes and reads
nothing.

Here: the op (its CPU reference is the spec), its check, fake, CUDA path and spec. The CUDA path writes
K / V (kv_write.py), then attends: decode-shaped calls by split-K (decode.py); others, where the library
kernels take the call (bf16 / fp16, head dims multiples of 8 up to 256, sm_80+), by
ops/attention_varlen.py (the new tokens over themselves by cuDNN's dense kernel for one stream or
FlashAttention-2 varlen, the cached context by our context + merge kernel), else by our 64-row query
tiles (prefill.py). Our kernels share one online-softmax step (ops/attend.py).
"""

import functools

import torch
from torch import Tensor

from ..attention_varlen import varlen_prefill_attention, varlen_supported
from ..common import INDEX_DTYPES, check, check_tensor, decode_shaped
from ..registry import (OpSpec, Shapes, attention_pairs, metrale_cuda, metrale_fake, metrale_op, rand, register,
                        stream_meta)
from .decode import paged_attention_decode
from .kv_write import write_kv
from .prefill import paged_attention_prefill


def _check(a):
    check_tensor(a.q, "q", ndim=3)
    T, HQ, HD = a.q.shape
    check(HQ > 0 and HD > 0, f"q must have heads of a positive size, got shape {tuple(a.q.shape)}")
    dtype, device = a.q.dtype, a.q.device
    for name, t in (("k", a.k), ("v", a.v)):
        check_tensor(t, name, ndim=3, dtype=dtype, device=device)
    HKV = a.k.shape[1]
    check(tuple(a.k.shape) == (T, HKV, HD) and a.k.shape == a.v.shape and HKV > 0 and HQ % HKV == 0,
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


def use_decode(q: Tensor, cu_seqlens: Tensor) -> bool:
    """The path choice of the CUDA implementation: static sizes (B, T) only (ops.common.decode_shaped)."""
    return decode_shaped(cu_seqlens.shape[0] - 1, q.shape[0])


def _write_new_kv(k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    """The KV write (the index tensors contiguous, the pools through their strides: mutated in place)."""
    T, HKV, HD = k.shape
    k, v = k.reshape(T, HKV * HD), v.reshape(T, HKV * HD)
    k, v = (t if t.stride(1) == 1 else t.contiguous() for t in (k, v))
    write_kv(k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)


def paged_attention_triton(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables, decode=None):
    """KV write, then attention over the paged cache: split-K when decode-shaped (`decode`, default
    `use_decode`), else flash-style varlen with 64-row query tiles; no host sync."""
    T, HQ, HD = q.shape
    B = cu_seqlens.shape[0] - 1
    # index tensors of any strides (the kernels index them as contiguous); the pools are read and written
    # through their strides (they are mutated in place: no copy)
    cu_seqlens, context_lens, block_tables = (x.contiguous() for x in (cu_seqlens, context_lens, block_tables))
    o = torch.empty((T, HQ, HD), dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return o
    _write_new_kv(k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)
    if decode is None:
        decode = use_decode(q, cu_seqlens)
    attend = paged_attention_decode if decode else paged_attention_prefill
    return attend(q, k_cache, v_cache, cu_seqlens, context_lens, block_tables, o)


# The attention of calls that are not decode-shaped (prefill_backend): the library kernels where they take the
# call, cuDNN's dense kernel for one stream at CUDNN_DENSE_HEAD_DIMS on sm_90 (H200, HQ 16 / HKV 4 / HD 256: 603
# TFLOP/s at 1 x 16384 against FlashAttention-2's 300 and our Triton kernel's 237), FlashAttention-2 varlen for
# the rest (263 / 159 TFLOP/s at 8 x 2048 / 8 x 512, Triton 201 / 92), the context by our merge kernel. Our
# 64-row Triton kernel (prefill.py) is the fallback for what the libraries do not take: fp32, head dims that are
# not a multiple of 8 or above 256, GPUs before sm_80. (It was also an environment setting's choice, "triton",
# beside "fa2" for FlashAttention-2 everywhere; both lost and the setting was removed. Pending: the one shape where
# Triton was timed faster, 4 x 512 new after 2048 cached, 0.417 ms against 0.522 before the merge kernel's tile
# was tuned, ~0.373 estimated since; benchmarks/kernels/check_attention_varlen.py times both.)
# head dims at which cuDNN's dense kernel was measured on the H200 (correctness, capture, 556-603 TFLOP/s at
# HD 256); other head dims of one-stream calls take FlashAttention-2 varlen
CUDNN_DENSE_HEAD_DIMS = (128, 256)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, cached; (0, 0) for other devices."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def prefill_backend(q: Tensor, num_streams: int) -> str:
    """The attention backend of a call that is not decode-shaped, from static facts only (q's dtype, head dim
    and device, the call's stream count): "cudnn_fa2" (one stream, cuDNN's dense kernel), "fa2" (FlashAttention-2
    varlen) or "triton" (the fallback where the libraries do not take q; the comment above says why)."""
    if not library_prefill_supported(q):
        return "triton"
    dense = num_streams == 1 and q.shape[-1] in CUDNN_DENSE_HEAD_DIMS and device_capability(q.device) >= (9, 0)
    return "cudnn_fa2" if dense else "fa2"


def library_prefill_supported(q: Tensor) -> bool:
    """Whether FlashAttention-2 (and cuDNN) take q: a CUDA tensor of bf16 / fp16, HD a multiple of 8 up to 256
    (attention_varlen.varlen_supported), on sm_80 or newer."""
    return varlen_supported(q, "fa2") and device_capability(q.device) >= (8, 0)


def paged_attention_library(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables, backend):
    """KV write, then attention_varlen.varlen_prefill_attention with `backend` ("cudnn_fa2" or "fa2"): the
    new tokens over themselves by the library kernel (reading k / v), the cached context (positions below
    context_lens, read from the pools) by the context + merge kernel, which also zeroes the rows of tokens in
    no stream. No host sync."""
    cu_seqlens, context_lens, block_tables = (x.contiguous() for x in (cu_seqlens, context_lens, block_tables))
    if q.shape[0] and cu_seqlens.shape[0] > 1:
        _write_new_kv(k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables)
    return varlen_prefill_attention(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables, backend)


@metrale_cuda(paged_attention)
def paged_attention_cuda(a):
    """Decode-shaped calls: split-K (paged_attention_triton); others: prefill_backend's choice."""
    backend = "triton" if use_decode(a.q, a.cu_seqlens) else prefill_backend(a.q, a.cu_seqlens.shape[0] - 1)
    if backend == "triton":
        return paged_attention_triton(*a)
    return paged_attention_library(*a, backend=backend)


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


# the library kernels by name: FlashAttention-2's flash_fwd_kernel, cuDNN's generated SDPA kernels
LIBRARY_KERNELS = ("flash_fwd", "cudnn", "sdpa", "fmha")
register(OpSpec(paged_attention, example, cost, cuda=paged_attention_cuda,
                kernels=("paged_attention", "paged_decode", "kv_write", "_context_merge_kernel") + LIBRARY_KERNELS,
                onnx="metrale_graph.onnx.translations:paged_attention"))
