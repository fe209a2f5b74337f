"""The paged attention's prefill kernel: flash-style varlen attention of each stream's new tokens over
its cached context plus themselves, in 64-row query tiles (BM) and key tiles of BN (autotuned), read
through the block table. Its grid is a work list of (stream, query tile) rows whose length follows
from (B, T)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import INTERPRET
from ..attend import LOG2E, _attend_tile, attention_configs, one_config_for_fp32


# cache_results: the choice is kept in Triton's cache folder (tools.warmup points it into its
# --cache-dir), so a warm start neither benchmarks nor compiles the losing configs
@triton.autotune(configs=attention_configs(), key=["HD", "GROUP", "IEEE"],
                 prune_configs_by={"early_config_prune": one_config_for_fp32}, cache_results=True)
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


def paged_attention_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor, context_lens: Tensor,
                            block_tables: Tensor, o: Tensor) -> Tensor:
    """Attention of the (already written) new tokens q [T, HQ, HD] over the paged cache into o [T, HQ, HD],
    in 64-row query tiles; the index tensors contiguous. Returns o."""
    T, HQ, HD = q.shape
    HKV, BS = k_cache.shape[2], k_cache.shape[1]
    work = q_block_work(cu_seqlens, T, BM)
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_attention_kernel[(work.shape[0], HQ)](
        q, k_cache, v_cache, o, work, cu_seqlens, context_lens, block_tables, HD**-0.5 * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride(), *v_cache.stride(), o.stride(0), o.stride(1),
        block_tables.stride(0), HQ // HKV, BS, HD, BLOCK_D=max(16, triton.next_power_of_2(HD)), BM=BM,
        IEEE=q.dtype == torch.float32 or INTERPRET)
    return o
