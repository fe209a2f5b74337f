"""The gated delta rule token by token, straight on the state pool: the GDN recurrence's CUDA path for
decode-shaped calls (ops.common.decode_shaped), and for the short streams of a split call (split.py).

One program per (stream, value head, V tile of BV columns) holds its [K, BV] slice of the state in
registers: it loads it from the stream's pool row, runs the rule over the stream's tokens (a loop
bounded by cu_seqlens, read on the device), writes each token's output, and stores the slice back
into the same pool row. No layout, no gather / scatter, one launch; its grid (B, HV, cdiv(V, BV))
follows from shapes. Each program reads and writes only its own slice of its own slot, and slots of
non-empty streams are distinct, so updating the pool in place is safe. A zero-length stream's
programs return before touching anything, and so do those of streams longer than max_len (a split
call: the chunked path has computed them; decode-shaped calls pass T, taking every stream).
"""

import torch
import triton
import triton.language as tl

from ..checkpoints import token_entries


# max_len is not specialized on: one compiled kernel whatever the bucket's T
@triton.jit(do_not_specialize=["max_len"])
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, cu_ptr, slot_ptr, ck_map_ptr, ck_ptr,
                          scale, R, K, V, max_len, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh, stride_s0, stride_s1,
                          stride_s2, stride_s3, stride_c0, stride_c1, stride_c2, stride_c3, BK: tl.constexpr,
                          BV: tl.constexpr, CK: tl.constexpr):
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
        if CK:  # checkpoints: after token t, entry ck_map[t] of the pool ck receives the state (-1: none)
            p_ck = (ck_ptr + hv * stride_c1 + kk[:, None].to(tl.int64) * stride_c2
                    + vv[None, :].to(tl.int64) * stride_c3)
        for t in range(start, end):
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
            if CK:
                entry = tl.load(ck_map_ptr + t)
                if entry >= 0:
                    tl.store(p_ck + entry * stride_c0, S, mask=m_s)
            p_q += stride_qt
            p_k += stride_kt
            p_v += stride_vt
            p_g += stride_gt
            p_b += stride_bt
            p_o += stride_ot
        tl.store(p_s, S, mask=m_s)


WIDE_PROGRAMS = 2048  # (stream, value head) pairs from which the wide tile fills the GPU (H200: 132 SMs)


def recurrent_tiles(K: int, V: int, pairs: int = 0) -> tuple[int, int, int]:
    """(BK, BV, num_warps) of the recurrent kernel for a call of `pairs` (stream, value head) pairs: the
    whole key dim (masked to a power of two) by 32 value columns over 2 warps, or by 64 over 4 warps once
    the pairs alone give WIDE_PROGRAMS programs (twice the warps for a key dim past 128). Measured on an
    H200 at the 9B shape, one token per stream after 2048 (benchmarks/kernels/check_decode.py, per layer): fla's
    fused_recurrent tile (BV 8, one warp) took 3.8 / 85 / 544 us at 1 / 32 / 128 streams, BV 32 over 2
    warps 3.1 / 43 / 165, BV 64 over 4 warps 3.7 / 42 / 150 against a state-traffic floor of 1 / 31 /
    126: the state's rows are read and written in 128- and 256-byte runs instead of 32-byte ones."""
    BK = max(16, triton.next_power_of_2(K))
    wide = pairs >= WIDE_PROGRAMS
    return BK, min(64 if wide else 32, triton.next_power_of_2(V)), (4 if wide else 2) * (1 if BK <= 128 else 2)


def gdn_recurrence_recurrent(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, max_len=None, o=None, keep=None,
                             tiles=None):
    """The gated delta rule token by token, each stream from and back into its pool row (one launch,
    no host sync). Exact for any lengths; sequential in each stream's length.

    Streams longer than `max_len` (default: none) are left alone: their slots and output rows are not
    touched. `o` (default: a fresh [T, HV, V] in v's dtype) receives the other streams' rows.
    keep: (checkpoint_tokens, checkpoint_entries, pool) or None (ops/checkpoints.py): pool[entry] receives
    the state after its token, for the tokens of the streams this call takes (one entry per token).
    tiles: (BV, num_warps) instead of recurrent_tiles' choice (benchmarks/kernels/check_decode.py's sweep; BV a power
    of two).
    """
    T, H, K = q.shape
    HV, V = v.shape[1:]
    B = slot_ids.shape[0]
    if tiles is not None and not (len(tiles) == 2 and all(isinstance(t, int) and t > 0 and t & (t - 1) == 0
                                                          for t in tiles)):
        raise ValueError(f"gdn_recurrence_recurrent: tiles must be (BV, num_warps), two powers of two, got {tiles!r}")
    if o is None:
        o = torch.empty((T, HV, V), dtype=v.dtype, device=v.device)  # rows of tokens in no stream: unspecified
    if T == 0 or B == 0:
        return o
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    cu_seqlens, slot_ids = cu_seqlens.contiguous(), slot_ids.contiguous()  # indexed as contiguous; the pool by strides
    BK, BV, warps = recurrent_tiles(K, V, B * HV)
    if tiles is not None:
        BV, warps = tiles
    if keep is not None:
        ck_map, pool = token_entries(keep[0], keep[1], T), keep[2]
    else:
        ck_map, pool = cu_seqlens, gdn_state  # unread stand-ins
    _gdn_recurrent_kernel[(B, HV, triton.cdiv(V, BV))](
        q, k, v, g, beta, o, gdn_state, cu_seqlens, slot_ids, ck_map, pool, K**-0.5, HV // H, K, V,
        T if max_len is None else max_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), *gdn_state.stride(), *pool.stride(),
        BK=BK, BV=BV, CK=keep is not None, num_warps=warps)
    return o
