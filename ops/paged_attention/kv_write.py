"""The KV write of the paged attention: each new token's K / V into its block of the paged cache.
Stream b's token i sits at position p = context_lens[b] + i, in block block_tables[b, p // BS] at offset
p % BS; tokens past cu_seqlens[-1] belong to no stream and are not written."""

import triton
import triton.language as tl
from torch import Tensor

from ..tiles import _stream_of, search_steps


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache, v_cache, cu_ptr, ctx_ptr, bt_ptr, B, BS, N, HD, stride_kt, stride_vt,
                     stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, stride_bt,
                     BLOCK: tl.constexpr, STEPS: tl.constexpr):
    t = tl.program_id(0)
    b = _stream_of(cu_ptr, t, B, STEPS)
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


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor, context_lens: Tensor,
             block_tables: Tensor) -> None:
    """k, v [T, HKV * HD] with unit inner stride into the pools (through their strides, in place); the index
    tensors contiguous. One launch (each token's stream found in the kernel: tiles._stream_of), no host sync."""
    T, N = k.shape
    B, BS, HD = cu_seqlens.shape[0] - 1, k_cache.shape[1], k_cache.shape[3]
    _kv_write_kernel[(T,)](k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables, B, BS, N, HD,
                           k.stride(0), v.stride(0), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
                           BLOCK=triton.next_power_of_2(N), STEPS=search_steps(B))
