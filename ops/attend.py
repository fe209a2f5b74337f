"""The online-softmax step our attention kernels share (paged_attention/prefill.py's 64-row query tiles,
paged_attention/decode.py's split-K tiles, attention_varlen.py's context-merge kernel): one tile of keys
read through the block table, scores in the log2 domain."""

import triton
import triton.language as tl

from .common import INTERPRET

LOG2E = 1.4426950408889634  # scores are scaled by HD**-0.5 * LOG2E, so exp2 gives the softmax's exp


def attention_configs() -> list:
    """The key-tile candidates of the paged-attention kernels (prefill.py, decode.py): BN x warps x stages,
    one under the interpreter."""
    if INTERPRET:
        return [triton.Config({"BN": 32}, num_warps=4)]
    return [triton.Config({"BN": bn}, num_warps=w, num_stages=st)
            for bn in (32, 64) for w in (4, 8) for st in (1, 2, 3)]


def one_config_for_fp32(configs, named_args, **kwargs) -> list:
    """The autotuner's pruning: with IEEE (fp32) dots, the tests' and the references' dtype rather than a
    serving one, one candidate, the smallest in shared memory and in registers per thread (BN 32, 1 stage,
    8 warps: fp32 query and accumulator tiles at head dim 256 are 64 KB each): else each of the twelve is
    compiled for fp32 at the first call, for timings nobody reads (fp32 GPU tests were still compiling after
    290 s on an H200)."""
    if kwargs.get("IEEE"):
        return [min(configs, key=lambda c: (c.kwargs["BN"], c.num_stages, -c.num_warps))]
    return configs


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
