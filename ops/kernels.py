"""Triton kernels for the token-local pieces shared by several phase ops (RMSNorm variants,
per-head norm + RoPE, L2 norm, SiLU-and-multiply), and the stacked-weights GEMM operand.

Each kernel works on rows; every launcher returns fresh tensors (never aliases its inputs).
All of them also run on the CPU under TRITON_INTERPRET=1, which is how the CPU suite
tests them. Shape letters: see ops/common.py.
"""

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


# names of the kernels several ops share (the profile reports them as one group)
SHARED_KERNELS = ("rms_norm", "silu_mul")


def _rows(x: Tensor) -> Tensor:
    """2-D view with unit inner stride (copy only when the last dim is strided)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _vec(*xs: Tensor) -> tuple[Tensor, ...]:
    """1-D parameters (weights, positions, frequencies) as the kernels index them: contiguous (a no-op when
    they are; a strided view is copied)."""
    return tuple(x.contiguous() for x in xs)


# RMSNorm (zero-centred weight) -------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (xf * rstd * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`x * rsqrt(mean(x^2) + eps) * (1 + w)` over the last dim, fp32 inside."""
    x2, (weight,) = _rows(x), _vec(weight)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    N = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, N, x2.stride(0), eps, BLOCK=triton.next_power_of_2(N))
    return y.view(x.shape)


# Gated RMSNorm of the GDN output: rmsnorm(o) * w * silu(z), plain w ---------------------------
@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    o = tl.load(o_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / N + eps)
    # transformers rounds the normalized value to the weight's dtype, then the product too
    dtype = w.dtype
    n = ((o * rstd).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (n * z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """o: [T, HV, V], z: [T, HV*V] -> [T, HV*V]; per value head."""
    V = o.shape[-1]
    o2, z2, (weight,) = o.reshape(-1, V).contiguous(), z.reshape(-1, V).contiguous(), _vec(weight)
    y = torch.empty_like(o2)
    _gated_rms_norm_kernel[(o2.shape[0],)](o2, z2, weight, y, V, eps, BLOCK=triton.next_power_of_2(V))
    return y.view(z.shape)


# L2 norm per head ------------------------------------------------------------------------------
@triton.jit
def _l2norm_kernel(x_ptr, y_ptr, NH, K, stride_t, stride_h, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, h = row // NH, row % NH
    cols = tl.arange(0, BLOCK)
    m = cols < K
    x = tl.load(x_ptr + t * stride_t + h * stride_h + cols, mask=m, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=0) + eps)
    tl.store(y_ptr + row * K + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def l2norm(x: Tensor, eps: float) -> Tensor:
    """x: [T, N, K] (any strides with unit inner stride) -> contiguous [T, N, K]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, NH, K = x.shape
    y = torch.empty((T, NH, K), dtype=x.dtype, device=x.device)
    if T:
        _l2norm_kernel[(T * NH,)](x, y, NH, K, x.stride(0), x.stride(1), eps, BLOCK=triton.next_power_of_2(K))
    return y


# Per-head RMSNorm + partial rotate-half RoPE (attention q / k) ---------------------------------
@triton.jit
def _norm_rope_head(src, w_ptr, pos_ptr, inv_freq_ptr, dst, t, HD, HALF, eps, scale, BLOCK: tl.constexpr):
    """dst[:HD] := one head src[:HD] (token t), RMS-normed with (1 + w), then its first 2 * HALF channels rotated
    (cos and sin times `scale`)."""
    cols = tl.arange(0, BLOCK)
    m = cols < HD
    x = tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
    dtype = dst.dtype.element_ty
    n = x * rstd * (1.0 + w)  # fp32 throughout, one rounding at the store
    # rotate the first 2*HALF channels: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Each channel
    # reads its partner in the other half (a second, gathering load), so HALF can be any size.
    rot = cols < 2 * HALF
    first = cols < HALF
    partner = tl.where(first, cols + HALF, cols - HALF)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    n_partner = xp * rstd * (1.0 + wp)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    ang = pos * tl.load(inv_freq_ptr + tl.where(first, cols, cols - HALF), mask=rot, other=0.0)
    rotated = n * (tl.cos(ang) * scale) + tl.where(first, -n_partner, n_partner) * (tl.sin(ang) * scale)
    tl.store(dst + cols, tl.where(rot, rotated, n).to(dtype), mask=m)


@triton.jit
def _attn_heads_kernel(qg_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, q_ptr, ko_ptr, vo_ptr, gate_ptr,
                       HQ, HKV, HD, HALF, stride_qg_t, stride_qg_h, stride_k_t, stride_v_t, eps, scale,
                       BLOCK: tl.constexpr):
    """Program (t, j): q head j (j < HQ) or k head j - HQ normed and rotated; then the copies, a head each: the
    gate (qg's second half of head j - HQ - HKV) and v (head j - 2 HQ - HKV)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j < HQ:
        _norm_rope_head(qg_ptr + t * stride_qg_t + j * stride_qg_h, qw_ptr, pos_ptr, inv_freq_ptr,
                        q_ptr + (t * HQ + j) * HD, t, HD, HALF, eps, scale, BLOCK)
    elif j < HQ + HKV:
        _norm_rope_head(k_ptr + t * stride_k_t + (j - HQ) * HD, kw_ptr, pos_ptr, inv_freq_ptr,
                        ko_ptr + (t * HKV + j - HQ) * HD, t, HD, HALF, eps, scale, BLOCK)
    elif j < 2 * HQ + HKV:
        cols = tl.arange(0, BLOCK)
        h = j - HQ - HKV
        vals = tl.load(qg_ptr + t * stride_qg_t + h * stride_qg_h + HD + cols, mask=cols < HD)
        tl.store(gate_ptr + (t * HQ + h) * HD + cols, vals, mask=cols < HD)
    else:
        cols = tl.arange(0, BLOCK)
        h = j - 2 * HQ - HKV
        vals = tl.load(v_ptr + t * stride_v_t + h * HD + cols, mask=cols < HD)
        tl.store(vo_ptr + (t * HKV + h) * HD + cols, vals, mask=cols < HD)


def attn_heads(qg: Tensor, k: Tensor, v: Tensor, q_norm_w: Tensor, k_norm_w: Tensor, positions: Tensor,
               inv_freq: Tensor, eps: float, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The attention projection's four outputs in one launch (a norm + RoPE kernel for q, one for k and two copies
    took four): from qg [T, HQ, 2 HD] (each head's query, then its gate), k [T, HKV * HD] and v [T, HKV * HD] (column slices of
    the projection's output: unit inner stride, rows of any stride), fresh contiguous q [T, HQ, HD] and k
    [T, HKV, HD] (per-head zero-centred RMSNorm, then rotate-half RoPE on the first R = 2 * len(inv_freq)
    channels at each token's position, any even R <= HD, cos and sin times `scale`), v [T, HKV, HD] and gate
    [T, HQ * HD] copied."""
    T, HQ, HD = qg.shape[0], qg.shape[1], qg.shape[2] // 2
    HKV = k.shape[1] // HD
    qw, kw, positions, inv_freq = _vec(q_norm_w, k_norm_w, positions, inv_freq)
    q = qg.new_empty(T, HQ, HD)
    k_out, v_out, gate = k.new_empty(T, HKV, HD), v.new_empty(T, HKV, HD), qg.new_empty(T, HQ * HD)
    if T:
        _attn_heads_kernel[(T, 2 * (HQ + HKV))](
            qg, k, v, qw, kw, positions, inv_freq, q, k_out, v_out, gate, HQ, HKV, HD, inv_freq.shape[0],
            qg.stride(0), qg.stride(1), k.stride(0), v.stride(0), eps, scale, BLOCK=triton.next_power_of_2(HD))
    return q, k_out, v_out, gate


# SiLU(a) * b over [T, 2I] rows holding [a | b] -------------------------------------------------
@triton.jit
def _silu_mul_kernel(ab_ptr, y_ptr, I, stride_ab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    a = tl.load(ab_ptr + row * stride_ab + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(ab_ptr + row * stride_ab + I + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * I + cols, (a * tl.sigmoid(a) * b).to(y_ptr.dtype.element_ty), mask=m)


# GDN gates: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); qkv and z copied out beside them -----
@triton.jit
def _gdn_gates_split_kernel(src_ptr, gates_ptr, qkv_ptr, z_ptr, A_ptr, dt_ptr, beta_ptr, g_ptr, stride_src,
                            stride_gates, b_off, a_off, C, Z, HV, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (row, 0): the row's gates from gates' columns b_off.. and a_off..; program (row, j > 0): columns
    (j - 1) * BLOCK.. of src's first C + Z, into qkv (the first C) and z (the next Z)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 0:
        h = tl.arange(0, BLOCK_H)
        m = h < HV
        b = tl.load(gates_ptr + row * stride_gates + b_off + h, mask=m, other=0.0).to(tl.float32)
        a = tl.load(gates_ptr + row * stride_gates + a_off + h, mask=m, other=0.0).to(tl.float32)
        x = a + tl.load(dt_ptr + h, mask=m, other=0.0).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus, threshold 20
        g = -tl.exp(tl.load(A_ptr + h, mask=m, other=0.0).to(tl.float32)) * softplus
        tl.store(beta_ptr + row * HV + h, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=m)
        tl.store(g_ptr + row * HV + h, g, mask=m)
    else:
        cols = (part - 1) * BLOCK + tl.arange(0, BLOCK)
        vals = tl.load(src_ptr + row * stride_src + cols, mask=cols < C + Z)  # (not x: a branch's names keep one type)
        tl.store(qkv_ptr + row * C + cols, vals, mask=cols < C)
        tl.store(z_ptr + row * Z + (cols - C), vals, mask=(cols >= C) & (cols < C + Z))


def gdn_gates_split(src: Tensor, C: int, Z: int, gates: Tensor, b_col: int, a_col: int, A_log: Tensor,
                    dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The GDN projection's four outputs in one launch (the torch expressions take eight to ten, and copying qkv
    and z out of a stacked GEMM's output two more): qkv [T, C] and z [T, Z], fresh copies of src's columns 0..C
    and C..C + Z; beta = sigmoid(b) in src's dtype and g = -exp(A_log) * softplus(a + dt_bias) in float32 (fp32
    inside), b and a [T, HV] the columns b_col.. and a_col.. of gates (src itself where one GEMM made all four).
    src and gates with unit inner stride."""
    T, HV = src.shape[0], A_log.shape[0]
    A_log, dt_bias = _vec(A_log, dt_bias)
    qkv, z = src.new_empty(T, C), src.new_empty(T, Z)
    beta = torch.empty((T, HV), dtype=src.dtype, device=src.device)
    g = torch.empty((T, HV), dtype=torch.float32, device=src.device)
    if T:
        BLOCK = 1024
        _gdn_gates_split_kernel[(T, 1 + triton.cdiv(C + Z, BLOCK))](
            src, gates, qkv, z, A_log, dt_bias, beta, g, src.stride(0), gates.stride(0), b_col, a_col, C, Z, HV,
            BLOCK=BLOCK, BLOCK_H=triton.next_power_of_2(HV))
    return qkv, z, beta, g


def silu_mul(ab: Tensor) -> Tensor:
    """ab: [T, 2I] with unit inner stride (rows may be a column slice of a wider GEMM output)
    -> contiguous silu(ab[:, :I]) * ab[:, I:]."""
    ab = _rows(ab)
    T, I2 = ab.shape
    y = ab.new_empty(T, I2 // 2)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(I2 // 2, 1024))](ab, y, I2 // 2, ab.stride(0), BLOCK=1024)
    return y


def side_by_side(*cols: Tensor) -> Tensor:
    """The column-wise concatenation of [T, N_i] tensors (unit inner stride). Free (a view) when they
    are column slices of one buffer, back to back with one row stride, as a stacked GEMM's outputs are;
    otherwise a concatenated copy. Two separate allocations that merely happen to sit next to each
    other in memory are copied: a view across them would reach outside the first one's storage."""
    first = cols[0]
    T, size = first.shape[0], first.element_size()
    storage, ptr, n = first.untyped_storage().data_ptr(), first.data_ptr(), 0
    for c in cols:
        if not (c.dim() == 2 and c.shape[0] == T and c.dtype == first.dtype and c.stride(-1) == 1
                and (T <= 1 or c.stride(0) == first.stride(0))
                and c.untyped_storage().data_ptr() == storage and c.data_ptr() == ptr + n * size):
            return torch.cat(cols, dim=1)
        n += c.shape[1]
    row = first.stride(0) if T > 1 else n
    end = (first.storage_offset() + (T - 1) * row + n) * size if T else 0
    if end > first.untyped_storage().nbytes():  # storages that share a base pointer (numpy, DLPack)
        return torch.cat(cols, dim=1)
    return first.as_strided((T, n), (row, 1))


def rows_back_to_back(parts: list[Tensor]) -> bool:
    """Whether the tensors [N_i, ...] (one trailing shape) sit back to back, rows after rows, in one storage,
    each contiguous, so that rows_view of them fits that storage (two storages that share a base pointer,
    numpy's or DLPack's, may not hold it)."""
    first = parts[0]
    row, ptr, offset = math.prod(first.shape[1:]) * first.element_size(), first.data_ptr(), 0
    storage = first.untyped_storage().data_ptr()
    for p in parts:
        if not (p.is_contiguous() and p.shape[1:] == first.shape[1:] and p.untyped_storage().data_ptr() == storage
                and p.data_ptr() == ptr + offset):
            return False
        offset += p.shape[0] * row
    return first.storage_offset() * first.element_size() + offset <= first.untyped_storage().nbytes()


def rows_view(parts: list[Tensor]) -> Tensor:
    """The row-wise concatenation of tensors rows_back_to_back holds for, as a view of the first one's storage."""
    rows = sum(p.shape[0] for p in parts)
    return parts[0].as_strided((rows, *parts[0].shape[1:]), parts[0].stride())


def stacked(*weights: Tensor) -> Tensor:
    """The row-wise concatenation of weights [N_i, D] as one GEMM operand [sum N_i, D]. Free (a view)
    when they already sit back to back in one buffer, as HybridModel stores each layer's
    projections; otherwise a concatenated copy."""
    return rows_view(weights) if rows_back_to_back(weights) else torch.cat(weights)
