"""The chunked gated delta rule's two Triton kernels: the intra-chunk pass and the state pass with the output
(the package docstring has the math and what each writes; launch.py launches them).

Shape letters as in the package docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64
_C = tl.constexpr(CHUNK)  # kernels read only constexpr globals

# tl.sum / tl.cumsum are jit functions, and Triton's interpreter re-patches the language on every jit call
# (~10 ms); the reduction / scan with their combine function is the same op compiled, and the interpreter
# runs it as np.sum / np.cumsum.
_SUM = tl.standard._sum_combine


# Kernel 1: intra-chunk ------------------------------------------------------------------------------
# The solve, on the whole [64, 64] tile (wgmma-sized dots, no sub-tiles): X = (I + A)^-1 of the
# block-diagonal part of A in blocks of SB rows by forward substitution (all blocks at once: their rows
# live in disjoint columns, so one reduction extracts row i of every block), then doublings: with X the
# inverse of the block-diagonal part D in blocks of s, and L the part of A in the lower-left s x s
# quadrant of every 2s block, (D + L)^-1 = X - X L X exactly (L X L = 0). Every X is a principal block
# of T itself, so nothing grows and cancels (a power series of A does, binomially, for repeated keys).
@triton.jit(do_not_specialize=["NT"])
def _gdn_chunk_intra_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, bos_ptr, eos_ptr, idx_ptr, gc_ptr, tm_ptr, aqk_ptr,
                            first_ptr, NT, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh,
                            stride_bt, stride_bh, R: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                            SB: tl.constexpr, LOG_SB: tl.constexpr, PREC: tl.constexpr, DOT_T: tl.constexpr):
    hv = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    seq = tl.load(idx_ptr + 2 * c)
    within = tl.load(idx_ptr + 2 * c + 1)
    if (hv == 0) & (within == 0):
        tl.store(first_ptr + seq, c)  # each sequence's first chunk row, for the state pass
    t0 = tl.load(bos_ptr + seq).to(tl.int64) + _C * within
    L = tl.load(eos_ptr + seq).to(tl.int64) - t0  # this chunk's rows in its sequence (> 64 before its last)
    h = hv // R
    rows = tl.arange(0, _C)
    valid = rows < L
    kk = tl.arange(0, BK)
    m_qk = valid[:, None] & (kk < K)[None, :]
    tok = t0 + rows
    g = tl.load(g_ptr + tok * stride_gt + hv * stride_gh, mask=valid, other=0.0).to(tl.float32)
    gc = tl.associative_scan(g, 0, _SUM)  # identity rows past the sequence keep the last row's value
    beta = tl.load(beta_ptr + tok * stride_bt + hv * stride_bh, mask=valid, other=0.0).to(tl.float32)
    out = (hv * NT + c) * _C  # this chunk's first row in the [HV, NT, C, ...] buffers
    tl.store(gc_ptr + out + rows, gc)
    q = tl.load(q_ptr + h * stride_qh + tok[:, None] * stride_qt + kk[None, :], mask=m_qk, other=0.0)
    k = tl.load(k_ptr + h * stride_kh + tok[:, None] * stride_kt + kk[None, :], mask=m_qk, other=0.0)
    kt = tl.trans(k.to(DOT_T))
    kkt = tl.dot(k.to(DOT_T), kt, input_precision=PREC)
    qk = tl.dot(q.to(DOT_T), kt, input_precision=PREC)
    both = valid[:, None] & valid[None, :]
    diff = gc[:, None] - gc[None, :]
    causal = (rows[:, None] >= rows[None, :]) & both
    aqk = tl.where(causal, qk * tl.exp(tl.where(causal, diff, 0.0)), 0.0) * scale
    tl.store(aqk_ptr + (out + rows)[:, None] * _C + rows[None, :], aqk.to(aqk_ptr.dtype.element_ty))
    strict = (rows[:, None] > rows[None, :]) & both
    A = tl.where(strict, kkt * tl.exp(tl.where(strict, diff, 0.0)), 0.0) * beta[:, None]

    # Row i of a block's M = (I + A_block)^-1 is e_i + sum_{j<i} (-A_ij) M_j. As [blocks, SB, 64] tiles
    # (a dot's layout gives each warp whole blocks of rows), both sums run within a warp: the extraction
    # of every block's row i, and, on M kept transposed (Mt = M^T, column i written at step i), the sum
    # over j along a row.
    NB: tl.constexpr = _C // SB
    same = (rows // SB)[:, None] == (rows // SB)[None, :]
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    Ad = tl.reshape(tl.where(same, A, 0.0), [NB, SB, _C])
    Mt = tl.reshape(eye, [NB, SB, _C])
    eye3 = tl.reshape(eye, [NB, SB, _C])
    sub = tl.arange(0, SB)
    target = tl.arange(0, NB) * SB  # the column of each block's row i: its first column + i
    for i in range(1, SB):
        a = tl.reduce(tl.where((sub == i)[None, :, None], -Ad, 0.0), 1, _SUM)  # [NB, 64]: -A_ij of row i
        col = tl.reduce(Mt * a[:, None, :], 2, _SUM)  # [NB, SB]: sum_j M_jc a_j for each c of the block
        Mt = tl.where(rows[None, None, :] == (target + i)[:, None, None], col[:, :, None] + eye3, Mt)
    X = tl.trans(tl.reshape(Mt, [_C, _C]))
    for lvl in tl.static_range(LOG_SB, 6):
        bs = rows // (1 << lvl)
        quad = ((bs[:, None] - bs[None, :]) == 1) & ((bs % 2) == 1)[:, None]
        X = X - tl.dot(X, tl.dot(tl.where(quad, A, 0.0), X, input_precision=PREC), input_precision=PREC)
    X = X * beta[None, :]  # T diag(beta)
    tl.store(tm_ptr + (out + rows)[:, None] * _C + rows[None, :], X.to(tm_ptr.dtype.element_ty))


# Kernel 2: the state pass with the output -----------------------------------------------------------
# Sequence n's state is read from h0[slot] and written to ht[slot] (slot = n, or slots[n] with POOL: h0 and
# ht are then one state pool, updated in place). With POOL an empty sequence reads and writes no state, and
# the last sequence's programs (the spare one, empty) zero the output rows from its start to T instead.
# G value heads a program (1 or 2, G dividing R): the G heads of one key head side by side as the columns of
# one [K, G * BV] state tile (column j: head hv0 + j // BV, value column iv * BV + j % BV), so k and q are loaded
# once for all of them and k S, q S and the update are one dot of G * BV columns; T and Aqk, per head, are G dots
# each, every column taking its own head's. Per column the products are those of G = 1.
@triton.jit(do_not_specialize=["NT", "T"])
def _gdn_chunk_state_kernel(q_ptr, k_ptr, v_ptr, gc_ptr, tm_ptr, aqk_ptr, first_ptr, h0_ptr, ht_ptr, slot_ptr, o_ptr,
                            bos_ptr, eos_ptr, ck_idx_ptr, ck_dest_ptr, ck_ptr, NT, T, scale, stride_qt, stride_qh, stride_kt,
                            stride_kh, stride_vt, stride_vh, stride_h0n, stride_h0h, stride_h0k, stride_h0v,
                            stride_htn, stride_hth, stride_htk, stride_htv, stride_c0, stride_c1, stride_c2,
                            stride_c3, R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            P: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BLOCK_P: tl.constexpr,
                            PREC: tl.constexpr, DOT_T: tl.constexpr, POOL: tl.constexpr, G: tl.constexpr = 1):
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    hv0 = (pid // NV) * G
    iv = pid % NV
    n = tl.program_id(1)
    h = hv0 // R
    bos = tl.load(bos_ptr + n).to(tl.int64)
    eos = tl.load(eos_ptr + n).to(tl.int64)
    num_chunks = (eos - bos + _C - 1) // _C
    c0 = tl.load(first_ptr + n, mask=num_chunks > 0, other=0)  # written by the intra kernel

    rows = tl.arange(0, _C)
    kk = tl.arange(0, BK)
    cols = tl.arange(0, G * BV)
    hv = hv0 + cols // BV  # each column's value head
    vv = iv * BV + cols % BV
    mk, mv = kk < K, vv < V
    m_s = mk[:, None] & mv[None, :]
    if POOL:
        slot = tl.load(slot_ptr + n, mask=num_chunks > 0, other=0).to(tl.int64)
        m_io = m_s & (num_chunks > 0)  # an empty sequence's slot is neither read nor written
    else:
        slot = n.to(tl.int64)
        m_io = m_s
    S = tl.load(h0_ptr + slot * stride_h0n + hv[None, :] * stride_h0h + kk[:, None] * stride_h0k
                + vv[None, :] * stride_h0v, mask=m_io, other=0.0)
    q_ptr += h * stride_qh
    k_ptr += h * stride_kh
    v_cols = v_ptr + hv * stride_vh + vv
    o_cols = o_ptr + hv * V + vv
    if P > 0:
        ck_chunks = tl.load(ck_idx_ptr + tl.arange(0, BLOCK_P), mask=tl.arange(0, BLOCK_P) < P, other=-1)
    for i in range(num_chunks):
        c = c0 + i
        if P > 0:  # checkpoints: the state at the start of chunk c (rare: test all P only on a hit)
            if tl.reduce((ck_chunks == c).to(tl.int32), 0, _SUM) > 0:
                p_ck = ck_ptr + hv[None, :] * stride_c1 + kk[:, None] * stride_c2 + vv[None, :] * stride_c3
                for p in range(P):
                    if tl.load(ck_idx_ptr + p) == c:  # into entry ck_dest[p] of the checkpoint buffer
                        tl.store(p_ck + tl.load(ck_dest_ptr + p) * stride_c0, S, mask=m_s)
        t0 = bos + i * _C
        valid = rows < eos - t0
        tok = t0 + rows
        m_k = valid[:, None] & mk[None, :]
        buf = (hv0 * NT + c) * _C  # the first head's chunk rows in the [HV, NT, C, ...] buffers
        k = tl.load(k_ptr + tok[:, None] * stride_kt + kk[None, :], mask=m_k, other=0.0).to(DOT_T)
        v = tl.load(v_cols[None, :] + tok[:, None] * stride_vt, mask=valid[:, None] & mv[None, :], other=0.0)
        tmat = tl.load(tm_ptr + (buf + rows)[:, None] * _C + rows[None, :]).to(DOT_T)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + kk[None, :], mask=m_k, other=0.0).to(DOT_T)
        aqk = tl.load(aqk_ptr + (buf + rows)[:, None] * _C + rows[None, :]).to(DOT_T)
        if G == 1:
            gc = tl.load(gc_ptr + buf + rows)[:, None]  # [C, 1]: one head's cumulative decay
            g_last = tl.load(gc_ptr + buf + _C - 1)
        else:  # [C, G * BV] and [G * BV]: each column its head's
            gc = tl.load(gc_ptr + ((hv * NT + c) * _C)[None, :] + rows[:, None])
            g_last = tl.load(gc_ptr + (hv * NT + c) * _C + _C - 1)[None, :]
        # k S -> T resid -> k^T v_new is the chain from one chunk's state to the next; q S and Aqk v_new
        # feed only the output (and the update's dot takes the decayed state as its accumulator).
        Sb = S.to(q_ptr.dtype.element_ty).to(DOT_T)
        kS = tl.dot(k, Sb, input_precision=PREC)
        qS = tl.dot(q, Sb, input_precision=PREC)
        # v_new = T diag(beta) (v - G (k S)): each row's delta with the earlier rows' writes folded in
        resid = (v.to(tl.float32) - tl.exp(gc) * kS).to(q_ptr.dtype.element_ty).to(DOT_T)
        v_new = tl.dot(tmat, resid, input_precision=PREC)
        if G == 2:  # the second head's columns through its own T
            tmat2 = tl.load(tm_ptr + (buf + NT * _C + rows)[:, None] * _C + rows[None, :]).to(DOT_T)
            v_new = tl.where((cols < BV)[None, :], v_new, tl.dot(tmat2, resid, input_precision=PREC))
        decayed = (v_new * tl.exp(g_last - gc)).to(q_ptr.dtype.element_ty).to(DOT_T)
        S = tl.dot(tl.trans(k), decayed, S * tl.exp(g_last), input_precision=PREC)
        v_new_t = v_new.to(q_ptr.dtype.element_ty).to(DOT_T)
        qS = (scale * tl.exp(gc)) * qS
        o = tl.dot(aqk, v_new_t, qS, input_precision=PREC)
        if G == 2:
            aqk2 = tl.load(aqk_ptr + (buf + NT * _C + rows)[:, None] * _C + rows[None, :]).to(DOT_T)
            o = tl.where((cols < BV)[None, :], o, tl.dot(aqk2, v_new_t, qS, input_precision=PREC))
        tl.store(o_cols[None, :] + tok[:, None] * (HV * V), o.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None] & mv[None, :])
    tl.store(ht_ptr + slot * stride_htn + hv[None, :] * stride_hth + kk[:, None] * stride_htk
             + vv[None, :] * stride_htv, S, mask=m_io)
    if POOL:  # the spare sequence's programs: rows [bos, T) (tokens in no stream) of these heads' V tile = 0
        spare = tl.where(n == tl.num_programs(1) - 1, (T - bos + _C - 1) // _C, 0)
        zeros = tl.zeros([_C, G * BV], dtype=o_ptr.dtype.element_ty)
        for i in range(spare):
            tok = bos + i * _C + rows
            tl.store(o_cols[None, :] + tok[:, None] * (HV * V), zeros, mask=(tok < T)[:, None] & mv[None, :])
