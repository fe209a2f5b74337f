"""The W8A8 FP8 routed experts' direct decode form (ops/moe/direct.py's, for FP8 weights, taken by its shape rule):
one row per token-expert pair, no sort nor alignment, the numerics of experts.py's grouped GEMMs.

- `_moe_direct_gate_up_fp8_kernel`, one program per (pair, column tile of BN | 128 columns): the FP8 codes of the
  token's row (x quantized once per token per 128 channels) against the pair's expert's gate and up rows, each
  128-channel group's products (exact in fp32) scaled by the token's and the weight block's scales, summed in
  fp32, to gu [P, 2 * IE] (fp32, unrounded: the grouped kernel's accumulators);
- `_moe_direct_act_fp8_kernel`, one program per (pair, 128-column group): gate and up rounded in x's dtype,
  SiLU-mul rounded, quantized per 128 columns (experts.py's epilogue) to act codes and scales;
- `_moe_direct_down_fp8_kernel`, one program per (pair, column tile): the act codes against the expert's down
  rows, scaled per group, times the routing weight, rounded as experts.py; zero rows for other ranks' experts.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .experts import _TL_DTYPES, _inner_contiguous, check_experts
from .quant import FP8_DTYPE, INTERPRET, num_blocks, quantize_activations, quantize_e4m3, round_to


def _configs():
    """(BN, BK, warps): BN divides 128 (a tile's rows share one weight scale row); a K step may span scale groups
    (each element takes its group's scales). Triton does not pipeline loads that feed no dot, so wide K steps
    keep more bytes in flight (one byte a code). The interpreter's BK 256 crosses groups."""
    if INTERPRET:
        return [triton.Config({"BN": 16, "BK": 256}, num_warps=4)]
    tiles = ((8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 128, 4), (32, 256, 8), (64, 128, 8))
    return [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=3) for bn, bk, w in tiles]


_EVEN_K = {"EVEN_K": lambda a: a["K"] % a["BK"] == 0}


@triton.jit
def _scaled_products(acc, w_ptrs, x_ptrs, xs_ptrs, ws_ptrs, k, k_left, EVEN_K: tl.constexpr):
    """acc [BN, BK] += w [BN, BK] * x [BK] * (xs * ws) [BK] in fp32, the codes' products (exact) times the scales
    of each column's 128-group (xs_ptrs / ws_ptrs [BK]: per column; the columns k < k_left, EVEN_K: all)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs)
        s = tl.load(xs_ptrs) * tl.load(ws_ptrs).to(tl.float32)
    else:
        m = k < k_left
        w = tl.load(w_ptrs, mask=m[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m, other=0.0)
        s = tl.load(xs_ptrs, mask=m, other=0.0) * tl.load(ws_ptrs, mask=m, other=0.0).to(tl.float32)
    return acc + (w.to(tl.float32) * x.to(tl.float32)[None, :]) * s[None, :]


@triton.autotune(configs=_configs(), key=["N", "K", "P"], cache_results=True)
@triton.heuristics(_EVEN_K)
@triton.jit
def _moe_direct_gate_up_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, gu_ptr, e_ptr, P, first_expert, EL, N, K,
                                   stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn,
                                   TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """gu[p, n] = x[t] . w[e, n] and gu[p, N + n] = x[t] . w[e, N + n] (dequantized per block, fp32) for pair p =
    t * TOP_K + j of expert e; rows of other ranks' pairs unwritten."""
    num_n = tl.cdiv(N, BN)
    pair = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    cols = pid_n * BN + tl.arange(0, BN)
    e = tl.load(e_ptr + pair).to(tl.int64) - first_expert
    if (e >= 0) & (e < EL):
        token = (pair // TOP_K).to(tl.int64)
        k = tl.arange(0, BK)
        x_ptrs = x_ptr + token * stride_x + k
        g_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]  # [BN, BK]
        u_ptrs = g_ptrs + N * stride_wn
        gs_ptr = ws_ptr + e * stride_wse + (pid_n * BN // 128) * stride_wsn  # the tile's one scale row
        us_ptr = gs_ptr + tl.cdiv(N, 128) * stride_wsn
        gate = tl.zeros((BN, BK), dtype=tl.float32)
        up = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            g = (k0 + k) // 128  # each column's scale group
            xs_ptrs = xs_ptr + token * stride_xs + g
            gate = _scaled_products(gate, g_ptrs, x_ptrs, xs_ptrs, gs_ptr + g, k, K - k0, EVEN_K)
            up = _scaled_products(up, u_ptrs, x_ptrs, xs_ptrs, us_ptr + g, k, K - k0, EVEN_K)
            x_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        row = gu_ptr + pair.to(tl.int64) * 2 * N
        tl.store(row + cols, tl.sum(gate, axis=1), mask=cols < N)
        tl.store(row + N + cols, tl.sum(up, axis=1), mask=cols < N)


@triton.jit
def _moe_direct_act_fp8_kernel(gu_ptr, q_ptr, qs_ptr, e_ptr, first_expert, EL, N, stride_qs, DT: tl.constexpr):
    """act = silu(gate) * up of one pair's 128 columns (one group), rounded in DT as experts.py, quantized: codes
    q[p, n], scale qs[p, n // 128]; other ranks' pairs skipped."""
    pair = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    e = tl.load(e_ptr + pair).to(tl.int64) - first_expert
    if (e >= 0) & (e < EL):
        cols = grp * 128 + tl.arange(0, 128)
        in_n = cols < N
        gate = round_to(tl.load(gu_ptr + pair * 2 * N + cols, mask=in_n, other=0.0), DT)
        up = tl.load(gu_ptr + pair * 2 * N + N + cols, mask=in_n, other=0.0)
        act = round_to(round_to(gate * tl.sigmoid(gate), DT) * round_to(up, DT), DT)
        act = tl.where(in_n, act, 0.0)[None, :]  # [1, 128]: one row, one group
        q, scale = quantize_e4m3(act, tl.max(tl.abs(act), axis=1))
        tl.store(q_ptr + pair * N + cols[None, :], q, mask=in_n[None, :])
        tl.store(qs_ptr + pair * stride_qs + grp + tl.arange(0, 1), scale)


@triton.autotune(configs=_configs(), key=["N", "K", "P"], cache_results=True)
@triton.heuristics(_EVEN_K)
@triton.jit
def _moe_direct_down_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, e_ptr, rw_ptr, P, first_expert, EL, N, K,
                                stride_as, stride_we, stride_wn, stride_wse, stride_wsn, BN: tl.constexpr,
                                BK: tl.constexpr, EVEN_K: tl.constexpr):
    """y[p, n] = (a[p] . w[e, n]) * rw[p] (codes dequantized per block) for pair p of expert e, rounded in y's
    dtype as experts.py; 0 for other ranks' pairs."""
    num_n = tl.cdiv(N, BN)
    pair = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    cols = pid_n * BN + tl.arange(0, BN)
    row = pair.to(tl.int64)
    e = tl.load(e_ptr + pair).to(tl.int64) - first_expert
    dt = y_ptr.dtype.element_ty
    y = tl.zeros((BN,), dtype=tl.float32)
    if (e >= 0) & (e < EL):
        k = tl.arange(0, BK)
        a_ptrs = a_ptr + row * K + k
        w_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]
        ws_row = ws_ptr + e * stride_wse + (pid_n * BN // 128) * stride_wsn
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            g = (k0 + k) // 128
            acc = _scaled_products(acc, w_ptrs, a_ptrs, as_ptr + row * stride_as + g, ws_row + g, k, K - k0, EVEN_K)
            a_ptrs += BK
            w_ptrs += BK
        rw = tl.load(rw_ptr + row).to(tl.float32)
        y = round_to(round_to(tl.sum(acc, axis=1), dt) * rw, dt)
    tl.store(y_ptr + row * N + cols, y.to(dt), mask=cols < N)


def moe_experts_fp8_direct(x: Tensor, top_w: Tensor, top_e: Tensor, w13: Tensor, w13_scale: Tensor, w2: Tensor,
                           w2_scale: Tensor, first_expert: int = 0, num_experts: int | None = None) -> Tensor:
    """experts.moe_experts_fp8's result (y [T * k, D], x's dtype, zero rows for other ranks' experts) in the
    direct form: x quantized per token, then three launches (module docstring). CUDA or the interpreter."""
    check_experts(x, top_w, top_e, w13, w13_scale, w2, w2_scale, first_expert, num_experts)
    T, D = x.shape
    k, EL, IE = top_e.shape[1], w13.shape[0], w2.shape[-1]
    P = T * k
    y = x.new_empty(P, D)
    if P == 0:
        return y
    w13, w2 = _inner_contiguous(w13), _inner_contiguous(w2)
    w13_scale, w2_scale = _inner_contiguous(w13_scale), _inner_contiguous(w2_scale)
    xq, xs = quantize_activations(x)
    e = top_e.reshape(-1).contiguous()
    gu = torch.empty((P, 2 * IE), dtype=torch.float32, device=x.device)
    _moe_direct_gate_up_fp8_kernel[lambda meta: (P * triton.cdiv(IE, meta["BN"]),)](
        xq, xs, w13, w13_scale, gu, e, P, first_expert, EL, IE, D, xq.stride(0), xs.stride(0), w13.stride(0),
        w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), TOP_K=k)
    IB = num_blocks(IE)
    act_q = torch.empty((P, IE), dtype=FP8_DTYPE, device=x.device)
    act_s = torch.empty((P, IB), dtype=torch.float32, device=x.device)
    _moe_direct_act_fp8_kernel[(P, IB)](gu, act_q, act_s, e, first_expert, EL, IE, act_s.stride(0),
                                        DT=_TL_DTYPES[x.dtype])
    _moe_direct_down_fp8_kernel[lambda meta: (P * triton.cdiv(D, meta["BN"]),)](
        act_q, act_s, w2, w2_scale, y, e, top_w.reshape(-1).contiguous(), P, first_expert, EL, D, IE,
        act_s.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1))
    return y
