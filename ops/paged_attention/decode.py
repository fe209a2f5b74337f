"""The paged attention's split-K (flash-decoding) kernels, for decode-shaped calls
(ops.common.decode_shaped; why: docs/ops.md, "Decode-shaped calls").

A program takes a tile of QB consecutive queries of one stream times the GROUP query heads that share
one KV head (QB * GROUP <= 16 rows where GROUP allows: a [16, HD] x [HD, BN] dot, each key tile read
once for all of them) and one split of a stream's keys; the grid is (work tiles, HKV, NS splits), all
static: work tiles NW = min(cdiv(T, QB) + B, T) >= the (stream, query tile) pairs of any batch of the bucket
(each program finds its pair from cu_seqlens on the device; surplus programs return); NS =
cdiv(MB * BS, SL), MB the block table's width (a static dim), SL from `decode_split`. The split length
itself is the stream's, read on the device: SL_b = the least multiple of SPLIT_ALIGN >= cdiv(keys_b, NS) for
the stream's keys_b = context + new tokens (`stream_split`), so a stream spreads over all NS splits however
short its context is against the table (a static SL would leave a 2048-token context in a 262144-key table
2 busy splits of 1024 keys), and SL_b <= SL, so it never needs more than NS. Each program writes its rows'
partial softmax state (running max m, sum l, unnormalized acc, log2 domain) for its split; a second kernel,
one program per (token, query head), merges the splits that hold keys for that token (cdiv(position + 1,
SL_b) of them, every one non-empty: split s starts at key s * SL_b <= position) into the output. Tokens in
no stream are skipped (their rows: unspecified). An explicit `split` fixes SL_b = split for every stream.
"""

import torch
import triton
import triton.language as tl

from ..common import INTERPRET
from ..tiles import _stream_of, _tile_of, search_steps
from ..attend import LOG2E, _attend_tile, attention_configs, one_config_for_fp32

DECODE_PROGRAMS = 1024  # splits are chosen to give about this many programs (H200: 132 SMs, ~8 each)
SPLIT_ALIGN = 64  # split lengths are multiples of every key tile BN
_ALIGN = tl.constexpr(SPLIT_ALIGN)  # kernels read only constexpr globals
STREAM_CHUNK = 64  # streams looked at per vector step when a program finds its stream
MERGE_SPLITS = 16  # splits merged per vector step


def decode_queries(group: int) -> tuple[int, int]:
    """(QB, BLOCK_M): queries per work tile, and the tile's rows QB * GROUP padded to a power of two
    (at least 16, tl.dot's least M)."""
    qb = max(1, 16 // group)
    return qb, max(16, triton.next_power_of_2(qb * group))


def stream_split(keys: int, num_splits: int) -> int:
    """SL_b, a stream's keys per split (what the kernels compute on the device; tests and tools mirror it): the
    least multiple of SPLIT_ALIGN that covers `keys` in `num_splits` splits."""
    per = -(-keys // num_splits)
    return max(SPLIT_ALIGN, -(-per // SPLIT_ALIGN) * SPLIT_ALIGN)


@triton.jit
def _stream_split(keys, SL, NS, DYNAMIC: tl.constexpr):
    """stream_split on the device (DYNAMIC), else the fixed SL."""
    if DYNAMIC:
        return tl.maximum(_ALIGN, tl.cdiv(tl.cdiv(keys, NS), _ALIGN) * _ALIGN)
    else:
        return SL


def decode_split(num_streams: int, num_tokens: int, num_kv_heads: int, max_keys: int) -> int:
    """Keys per split, a multiple of SPLIT_ALIGN, from static sizes only: enough splits that the busy
    programs (about one work tile per stream and KV head) number about DECODE_PROGRAMS for a context of
    max_keys = MB * BS, the most a stream's block table holds. It fixes NS = cdiv(max_keys, SL), the splits (and
    partials) allocated; each stream then cuts its own keys into up to NS splits (`stream_split`)."""
    tiles = max(1, min(num_streams, num_tokens)) * num_kv_heads
    splits = max(1, -(-DECODE_PROGRAMS // tiles))
    per = -(-max(max_keys, 1) // splits)
    return max(SPLIT_ALIGN, -(-per // SPLIT_ALIGN) * SPLIT_ALIGN)


@triton.autotune(configs=attention_configs(), key=["HD", "GROUP", "QB", "SL", "IEEE"],
                 prune_configs_by={"early_config_prune": one_config_for_fp32}, cache_results=True)
@triton.jit
def _paged_decode_kernel(q_ptr, k_cache, v_cache, m_ptr, l_ptr, acc_ptr, cu_ptr, ctx_ptr, bt_ptr, qk_scale, B,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs,
                         stride_vh, stride_vd, stride_bt,
                         GROUP, QB, SL, NS, HQ, BS, HD, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BN: tl.constexpr, CH: tl.constexpr, IEEE: tl.constexpr, DYNAMIC: tl.constexpr):
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    b, tile = _tile_of(cu_ptr, ctx_ptr, tl.program_id(0), B, QB, CH, False)
    if b < B:  # else: a work tile past the batch's
        start = tl.load(cu_ptr + b)
        L = tl.load(cu_ptr + b + 1) - start
        ctx = tl.load(ctx_ptr + b)
        hi = ctx + tl.minimum(tile * QB + QB, L)  # keys the tile's queries see: positions [0, hi)
        sl = _stream_split(ctx + L, SL, NS, DYNAMIC)
        lo = sp * sl
        if lo < hi:  # else: the split lies past every query of the tile
            end = tl.minimum(lo + sl, hi)
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
                               stride_oh, BLOCK_D: tl.constexpr, SC: tl.constexpr, STEPS: tl.constexpr,
                               DYNAMIC: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = _stream_of(cu_ptr, t, B, STEPS)  # (B: a token in no stream)
    if b < B:  # else: a token in no stream
        ctx = tl.load(ctx_ptr + b)
        start = tl.load(cu_ptr + b)
        pos = ctx + t - start
        sl = _stream_split(ctx + tl.load(cu_ptr + b + 1) - start, SL, NS, DYNAMIC)
        n = (pos + sl) // sl  # splits holding keys [0, pos]: each has at least one
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
    per split of every stream (a multiple of SPLIT_ALIGN); default: each stream's `stream_split` over the
    NS splits that `decode_split` of the static sizes gives."""
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
        IEEE=q.dtype == torch.float32 or INTERPRET, DYNAMIC=split is None)
    _paged_decode_merge_kernel[(T, HQ)](o, m, l, acc, cu_seqlens, context_lens, B, SL, NS, HQ, HD, o.stride(0),
                                        o.stride(1), BLOCK_D=BLOCK_D, SC=MERGE_SPLITS, STEPS=search_steps(B),
                                        DYNAMIC=split is None)
    return o
