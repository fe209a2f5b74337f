"""Prefill attention (calls that are not decode-shaped) through a library kernel for the new tokens,
plus a Triton kernel for each stream's cached context, merged by log-sum-exp.

metrale::paged_attention's contract (ops/paged_attention): stream b's new tokens, rows
cu_seqlens[b]:cu_seqlens[b+1] of q / k / v, sit at positions context_lens[b] + i and attend causally
to the stream's cached context (positions [0, context_lens[b]) of its blocks in the paged pools) and
to themselves. Split at the context boundary, that is

  (a) the new queries over the new keys, causal: for one stream cuDNN's dense kernel
      (aten._scaled_dot_product_cudnn_attention), else FlashAttention-2 varlen
      (aten._flash_attention_forward), both returning o_a and the log-sum-exp;
  (b) the same queries over the cached context: non-causal (all of it precedes every new token), a
      Triton kernel over the paged pools, GQA-packed (the GROUP query heads of one KV head share
      each K/V tile), which also forms its log-sum-exp, and
  (c) merges its result into o_a in place: o = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b).

(b) and (c) are one kernel (`_context_merge_kernel`): a program attends one query tile of one
stream with context over that context and merges into o_a's rows; streams without context keep
o_a as it is. Its other programs zero the rows of spare tokens (past cu_seqlens[-1], in no
stream: the library kernels leave them unwritten, and the contract wants them finite).

The new tokens' K / V are read from k / v, the context from the pools: nothing is written to the
pools, so this runs before or after the op's KV write. Sizes are static for a bucket
(B, T): no host sync, no data-dependent shapes. Zero-length streams (padding) anywhere; spare
tokens per batch.py's padding contract (their q / k / v rows finite: the library kernels multiply masked
keys' values by 0); cu_seqlens[0] == 0 (as batch.py packs).

Backends: "cudnn_fa2" (the op's: cuDNN dense for one stream, FlashAttention-2 varlen for several), "fa2"
(FlashAttention-2 for every call: the op's choice where the dense kernel was not measured, other head dims
or GPUs) and "reference" (plain torch for part (a): the tests' oracle). On the H200 (torch 2.11,
benchmarks/h200-attention-varlen-ops.json) cuDNN's varlen kernel failed under CUDA graph capture at every
multi-stream bucket, so the backends on it ("cudnn", "cudnn_varlen") were removed, and so was "fa2_paged"
(one FlashAttention call over the pools): that torch's FlashAttention takes no block table, and it needs
256-token blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from .common import INTERPRET
from .attend import LOG2E, _attend_tile
from .tiles import _tile_of

# Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.6.0): there the kernel takes its
# fp32 path on upcast tiles (as ops/paged_attention's kernels do)
BACKENDS = ("cudnn_fa2", "fa2", "reference")
DEFAULT_BACKEND = "cudnn_fa2"
CONTEXT_ROWS = 64  # (query, head) rows per context program: QB queries x GROUP heads
STREAM_CHUNK = 64  # streams looked at per vector step when a program finds its stream


@dataclass(frozen=True)
class LseLayout:
    """Where lse_a[row, head] lives: packed, at head * stride_h + row * stride_t (row: the packed token);
    padded, at stream * stride_b + head * stride_h + i * stride_t (i: the token's index in its stream).
    `to_log2` converts its units to log2 (LOG2E for natural logarithms)."""
    padded: bool
    stride_b: int
    stride_h: int
    stride_t: int
    to_log2: float = LOG2E


def lse_layout(lse: Tensor, kind: str) -> LseLayout:
    """The layout of a library kernel's log-sum-exp. kind: "token_major" ([T, HQ(, 1)]: the reference's),
    "head_major" ([HQ, T]: FlashAttention varlen; [1, HQ, T(, 1)]: cuDNN dense, one stream starting at
    row 0) or "padded" ([B, HQ, max_q]: FlashAttention before its packed LSE)."""
    if kind == "token_major":
        return LseLayout(False, 0, lse.stride(1), lse.stride(0))
    if kind == "head_major":
        lead = 0 if lse.dim() == 2 else 1  # [HQ, T] or [1, HQ, T(, 1)]
        return LseLayout(False, 0, lse.stride(lead), lse.stride(lead + 1))
    if kind == "padded":
        return LseLayout(True, lse.stride(0), lse.stride(1), lse.stride(2))
    raise ValueError(f"unknown LSE layout {kind!r}; expected token_major, head_major or padded")


def context_queries(group: int) -> tuple[int, int]:
    """(QB, BLOCK_M): queries per context program and its rows QB * GROUP padded to a power of two."""
    qb = max(1, CONTEXT_ROWS // group)
    return qb, max(16, triton.next_power_of_2(qb * group))


def context_config(block_d: int) -> tuple[int, int, int]:
    """(BN, num_warps, num_stages) of the context kernel for a padded head dim. Fixed, not autotuned: the
    kernel's work depends on the batch's contexts (none in a fresh bucket's warmup call), which an
    autotuner keyed on static sizes would never see. Head dims above 128: the fastest of a sweep on the
    H200 at HD 256 (4 x 512 new after 2048 cached: 0.319 ms, against 0.466 for BN 64, 8 warps)."""
    if INTERPRET:
        return 32, 4, 1
    return (32, 4, 2) if block_d > 128 else (64, 4, 3)


@triton.jit
def _context_merge_kernel(q_ptr, k_cache, v_cache, o_ptr, lse_ptr, cu_ptr, ctx_ptr, bt_ptr, qk_scale, lse_to_log2,
                          B, T, NW, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
                          stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, lse_sb, lse_sh, lse_st, stride_bt,
                          GROUP, QB, BS, HD, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
                          CH: tl.constexpr, LSE_PADDED: tl.constexpr, IEEE: tl.constexpr):
    """Grid (NW + cdiv(T, QB), HKV). Programs w < NW: query tile w of the streams with context (QB queries
    x the GROUP query heads of KV head program_id(1)), attended over the context and merged into o's rows.
    Programs w >= NW: zero o's rows of spare tokens among rows (w - NW) * QB + [0, QB)."""
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    j = r // GROUP
    head = kvh * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    md = d < HD
    if w < NW:
        b, tile = _tile_of(cu_ptr, ctx_ptr, w, B, QB, CH, True)  # tiles of the streams with cached context
        if b < B:  # else: a work tile past the batch's
            start = tl.load(cu_ptr + b)
            L = tl.load(cu_ptr + b + 1) - start
            ctx = tl.load(ctx_ptr + b)
            qi = tile * QB + j  # query index within the stream
            mq = (j < QB) & (qi < L)
            rows = (start + qi).to(tl.int64)
            m2 = mq[:, None] & md[None, :]
            q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=m2,
                        other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            q_pos = ctx + qi  # every context key (position < ctx) is before every query: the causal mask passes
            full = (ctx // BN) * BN  # tiles wholly below ctx need no mask
            for n0 in range(0, full, BN):
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, ctx, q_pos, d,
                                             md, qk_scale, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
                                             stride_vs, stride_vh, stride_vd, stride_bt, BS, BN, False, IEEE, False)
            for n0 in range(full, ctx, BN):
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache, v_cache, bt_ptr, b, kvh, n0, ctx, q_pos, d,
                                             md, qk_scale, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb,
                                             stride_vs, stride_vh, stride_vd, stride_bt, BS, BN, True, IEEE, False)
            if LSE_PADDED:
                lse_off = b.to(tl.int64) * lse_sb + head * lse_sh + qi.to(tl.int64) * lse_st
            else:
                lse_off = head * lse_sh + rows * lse_st
            lse_new = tl.load(lse_ptr + lse_off, mask=mq, other=0.0) * lse_to_log2
            o_off = rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
            o_new = tl.load(o_ptr + o_off, mask=m2, other=0.0).to(tl.float32)
            # log2-sum-exp of the context part: m_i + log2(l_i); acc is its unnormalized output
            top = tl.maximum(lse_new, m_i + tl.log2(l_i))
            w_new = tl.exp2(lse_new - top)
            w_ctx = tl.exp2(m_i - top)
            out = (o_new * w_new[:, None] + acc * w_ctx[:, None]) / (w_new + w_ctx * l_i)[:, None]
            tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=m2)
    else:
        rows = ((w - NW) * QB + j).to(tl.int64)
        spare = (j < QB) & (rows >= tl.load(cu_ptr + B)) & (rows < T)
        tl.store(o_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], dtype=o_ptr.dtype.element_ty), mask=spare[:, None] & md[None, :])


def context_merge(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor, context_lens: Tensor,
                  block_tables: Tensor, o: Tensor, lse: Tensor, layout: LseLayout,
                  config: tuple[int, int, int] | None = None) -> Tensor:
    """Parts (b) and (c): o [T, HQ, HD] (model dtype, last dim contiguous) holds the new tokens' causal
    attention over themselves and `lse` its log-sum-exp (fp32, `layout`). MUTATED: o's rows of streams
    with context become the attention over context and new tokens; rows of spare tokens become 0; the
    other rows are left as they are. The pools are only read. config: (BN, num_warps, num_stages), default
    `context_config`. Returns o."""
    T, HQ, HD = q.shape
    HKV, BS = k_cache.shape[2], k_cache.shape[1]
    B = cu_seqlens.shape[0] - 1
    if T == 0:
        return o
    if o.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"q and o need a contiguous last dim, got strides {q.stride()} / {o.stride()}")
    GROUP = HQ // HKV
    QB, BLOCK_M = context_queries(GROUP)
    NW = min(triton.cdiv(T, QB) + B, T)  # >= the query tiles of the streams with context, any lengths
    cu_seqlens, context_lens, block_tables = (x.contiguous() for x in (cu_seqlens, context_lens, block_tables))
    BLOCK_D = max(16, triton.next_power_of_2(HD))
    BN, num_warps, num_stages = config or context_config(BLOCK_D)
    _context_merge_kernel[(NW + triton.cdiv(T, QB), HKV)](
        q, k_cache, v_cache, o, lse, cu_seqlens, context_lens, block_tables, HD**-0.5 * LOG2E, layout.to_log2,
        B, T, NW, q.stride(0), q.stride(1), *k_cache.stride(), *v_cache.stride(), o.stride(0), o.stride(1),
        layout.stride_b, layout.stride_h, layout.stride_t, block_tables.stride(0), GROUP, QB, BS, HD,
        BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BN=BN, CH=STREAM_CHUNK, LSE_PADDED=layout.padded,
        IEEE=q.dtype == torch.float32 or INTERPRET, num_warps=num_warps, num_stages=num_stages)
    return o


# (a): the new tokens over themselves ---------------------------------------------------------------
def new_tokens_attention_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """Plain torch, one stream at a time (host sync), fp32: (o [T, HQ, HD], lse [T, HQ] natural log) of
    each stream's new queries over its new keys, causal; spare rows 0."""
    T, HQ, HD = q.shape
    group = HQ // k.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.zeros((T, HQ), dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        keys, vals = (x[s:e].float().repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), keys) * HD**-0.5
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lse[s:e] = scores.logsumexp(-1).transpose(0, 1)
        o[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
    return o, lse


def _cudnn_dense(q, k, v):
    """One stream at rows [0, L), spare rows after it: causal over all T rows leaves the stream's rows exact
    (spare keys come after every real query; their rows must be finite, as the padding contract has them:
    masked scores still multiply their values by 0)."""
    def as_bhsd(x):  # [1, H, T, HD] strided views, no copy
        return x.unsqueeze(0).transpose(1, 2)

    out = torch.ops.aten._scaled_dot_product_cudnn_attention(as_bhsd(q), as_bhsd(k), as_bhsd(v), None, True, 0.0,
                                                             True, False, scale=q.shape[2] ** -0.5)
    return out[0][0].transpose(0, 1), out[1], "head_major"


def _fa2_varlen(q, k, v, cu_seqlens):
    T = q.shape[0]
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, T, T, 0.0, True, False,
                                                  scale=q.shape[2] ** -0.5)
    lse = out[1]
    return out[0], lse, "head_major" if lse.dim() == 2 else "padded"


def varlen_supported(q: Tensor, backend: str | None = None) -> bool:
    """Whether `backend`'s library kernel takes q's dtype and head dim (static facts only): half
    precision, HD a multiple of 8 up to 256, on CUDA ("reference": anything)."""
    if (backend or DEFAULT_BACKEND) == "reference":
        return True
    HD = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and HD % 8 == 0 and HD <= 256


def varlen_prefill_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor,
                             context_lens: Tensor, block_tables: Tensor, backend: str | None = None) -> Tensor:
    """metrale::paged_attention's attention for calls that are not decode-shaped, without its KV write.

    Args: as metrale::paged_attention (q [T, HQ, HD], k / v [T, HKV, HD] the new tokens, pools
    [NB, BS, HKV, HD], cu_seqlens [B+1] int32 with cu_seqlens[0] == 0, context_lens [B] int32,
    block_tables [B, MB]); bf16 or fp16, HD % 8 == 0 and <= 256 for the library kernels.
    backend: part (a) by "cudnn_fa2" (one-stream buckets cuDNN dense, others FlashAttention-2 varlen), "fa2"
    (FlashAttention-2 varlen) or "reference" (plain torch, host sync: tests); default DEFAULT_BACKEND.
    Returns o [T, HQ, HD] in q's dtype; rows of spare tokens 0. Reads the pools, writes nothing else.
    """
    backend = backend or DEFAULT_BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    T, HQ, HD = q.shape
    B = cu_seqlens.shape[0] - 1
    if T == 0 or B == 0:
        return torch.zeros_like(q)
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    if backend == "reference":
        o, lse = new_tokens_attention_ref(q, k, v, cu_seqlens)
        o, kind = o.to(q.dtype), "token_major"
    elif backend == "fa2" or B > 1:
        o, lse, kind = _fa2_varlen(q, k, v, cu_seqlens)
    else:  # "cudnn_fa2", one stream
        o, lse, kind = _cudnn_dense(q, k, v)
    if o.stride(2) != 1:
        o = o.contiguous()
    return context_merge(q, k_cache, v_cache, cu_seqlens, context_lens, block_tables, o, lse, lse_layout(lse, kind))
