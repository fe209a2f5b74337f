"""The MoE decode path without alignment: each token-expert pair is its own row. For calls with few pairs
(decode) the aligned path's sort, its two alignment launches and BM-row blocks holding one real row each cost
more than the expert GEMMs' own work; here no sort, no alignment:

- `_moe_direct_gate_up_kernel`, one program per (pair, column tile): the pair's expert's gate and up rows
  of the tile against the token's normed row (a matrix-vector product: fp32 products summed in fp32),
  SiLU-and-multiply in the epilogue, into act [P, IE] at the pair's row;
- `_moe_direct_down_kernel`, one program per (pair, column tile): act's row against the expert's down
  projection, times the routing weight, into y [P, D] at the pair's row; then the aligned path's combine.

Pairs of other tensor-parallel ranks' experts (first_expert, EL < E) get zero rows of y. The roundings are
gemm.py's (gate and up, SiLU, the product, the expert output, the weighted output). fp32 products of
bf16 / fp16 values are exact and fp32 ones are IEEE, as the aligned kernels' IEEE dots: no tf32 anywhere.

When (`takes_direct`, shapes only, so a bucket's graph stays static): P = T * top_k <= MAX_PAIRS and 4 * P <= E;
the aligned path otherwise. Each pair reads its expert's weights on its own, so an expert chosen by two pairs is
read twice (the aligned path reads it once); over E experts the expected repeats among P pairs are about
P^2 / (2E), at most P / 8 with 4P <= E: at most ~1/8 more weight bytes than the aligned path. Measured on the
H200 at 820b41b (BENCHMARKS.md, MoE): the 35B-A3B's D1 (8 pairs of 256 experts) took 4.24 ms of device time
direct against 4.46 aligned with the counting sort (4.69 with torch.sort). Above 64 pairs the aligned path's
blocks start to hold several rows of an expert (D32: 256 pairs over 256 experts), and 64 pairs of one expert each
already fill 64 x (IE / BN) programs. Tests force the aligned path at decode shapes by setting MAX_PAIRS to 0.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..common import INTERPRET
from .rounding import _rnd

MAX_PAIRS = 64


def takes_direct(num_pairs: int, num_experts: int) -> bool:
    """Whether a call of num_pairs = T * top_k pairs over the router's num_experts takes the direct path (see
    the module's note)."""
    return 0 < num_pairs <= MAX_PAIRS and 4 * num_pairs <= num_experts


# (BN, BK, warps) candidates, bf16 / fp16 (benchmarks/kernels/check_moe_direct.py times each): at the 35B-A3B's D1
# (8 pairs; gate|up 512 columns of 2048, down 2048 of 512) BN 16 gives 256 gate|up and 1024 down programs over the
# 132 SMs. Triton does not pipeline loads that feed no dot: the bytes in flight are one K step's tile (BK 512: 8
# 16-byte loads a thread of gate|up's 8 x 512 x 2), so wide K steps stand in for stages.
CANDIDATES = ((4, 512, 4), (8, 512, 4), (8, 256, 4), (16, 512, 8), (16, 256, 4), (16, 128, 4), (32, 128, 4),
              (32, 256, 8), (64, 128, 8), (64, 64, 4))
# the tiles taken, (BN, BK, warps), from check_moe_direct's table on the H100 (83a7f07, HISTORY.md): gate|up 8 x 512
# over 4 warps (13.96 us at 8 pairs, within 1% of the best at 32), down 32 x 128 over 4 (8.29 us at 8 pairs, 24.1 at
# 32: the best at both); fp32 (tests, not a serving dtype) one tile, as gemm.py's. They replace an autotuner over
# the candidates, whose choice ran no faster in the 35B-A3B's D1 step (0.523 against 0.531 ms of gate|up over 20
# layers) and cost every warmup a tuning run per shape.
GATE_UP_TILE, DOWN_TILE, FP32_TILE = (8, 512, 4), (32, 128, 4), (16, 64, 4)


def tile(kind: str, N: int, K: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BN, BK, warps) of kind 'gate_up' / 'down' for an [N, K] expert matrix of dtype, shapes only (a bucket's
    graph stays static): the measured tile, BN and BK cut to the problem's powers of two (a tile far wider than
    the matrix only masks); the interpreter a small one."""
    if INTERPRET:
        return 16, 32, 4
    bn, bk, warps = FP32_TILE if dtype == torch.float32 else GATE_UP_TILE if kind == "gate_up" else DOWN_TILE
    return min(bn, max(4, triton.next_power_of_2(N))), min(bk, max(64, triton.next_power_of_2(K))), warps


@triton.jit
def _expert_of(e_ptr, pair, first_expert, EL):
    """(the pair's local expert id as int64, whether this rank holds it)."""
    e = tl.load(e_ptr + pair).to(tl.int64) - first_expert
    return e, (e >= 0) & (e < EL)


@triton.jit
def _row_dot(acc, w_ptrs, x_ptrs, k, k_left, EVEN_K: tl.constexpr):
    """acc [BN, BK] += w [BN, BK] * x [BK] in fp32 (the columns k < k_left; EVEN_K: all): the products of one K
    step, summed over K by the caller once at the end (no cross-thread reduction per step)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(k < k_left)[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k < k_left, other=0.0)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _moe_direct_gate_up_kernel(x_ptr, w_ptr, act_ptr, e_ptr, P, first_expert, EL, N, K, stride_x, stride_we,
                               stride_wn, TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                               EVEN_K: tl.constexpr, FP32: tl.constexpr):
    """act[p, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n]) for pair p = t * TOP_K + j of expert e (the
    program's pair and column tile, pair-major); pairs of other ranks' experts leave their row unwritten."""
    num_n = tl.cdiv(N, BN)
    pair = tl.program_id(0) // num_n
    cols = (tl.program_id(0) % num_n) * BN + tl.arange(0, BN)
    e, mine = _expert_of(e_ptr, pair, first_expert, EL)
    if mine:
        token = (pair // TOP_K).to(tl.int64)
        k = tl.arange(0, BK)
        x_ptrs = x_ptr + token * stride_x + k
        g_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]  # [BN, BK]
        u_ptrs = g_ptrs + N * stride_wn
        gate = tl.zeros((BN, BK), dtype=tl.float32)
        up = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            gate = _row_dot(gate, g_ptrs, x_ptrs, k, K - k0, EVEN_K)
            up = _row_dot(up, u_ptrs, x_ptrs, k, K - k0, EVEN_K)
            x_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        dt = act_ptr.dtype.element_ty  # rounded as gemm.py's _moe_gate_up_kernel
        gate = _rnd(tl.sum(gate, axis=1), dt)
        up = tl.sum(up, axis=1)
        y = _rnd(_rnd(gate * tl.sigmoid(gate), dt) * _rnd(up, dt), dt).to(dt)
        tl.store(act_ptr + pair.to(tl.int64) * N + cols, y, mask=cols < N)


@triton.jit
def _moe_direct_down_kernel(act_ptr, w_ptr, y_ptr, e_ptr, rw_ptr, P, first_expert, EL, N, K, stride_we, stride_wn,
                            BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, FP32: tl.constexpr):
    """y[p, n] = (act[p] . w[e, n]) * rw[p] for pair p of expert e; 0 for pairs of other ranks' experts."""
    num_n = tl.cdiv(N, BN)
    pair = tl.program_id(0) // num_n
    cols = (tl.program_id(0) % num_n) * BN + tl.arange(0, BN)
    row = pair.to(tl.int64)
    e, mine = _expert_of(e_ptr, pair, first_expert, EL)
    dt = y_ptr.dtype.element_ty
    y = tl.zeros((BN,), dtype=tl.float32)
    if mine:
        k = tl.arange(0, BK)
        a_ptrs = act_ptr + row * K + k
        w_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[:, None] * stride_wn + k[None, :]
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            acc = _row_dot(acc, w_ptrs, a_ptrs, k, K - k0, EVEN_K)
            a_ptrs += BK
            w_ptrs += BK
        rw = tl.load(rw_ptr + row).to(tl.float32)  # rounded as gemm.py's _moe_down_kernel
        y = _rnd(_rnd(tl.sum(acc, axis=1), dt) * rw, dt)
    tl.store(y_ptr + row * N + cols, y.to(dt), mask=cols < N)


def direct_experts(n: Tensor, top_w: Tensor, top_e: Tensor, w13: Tensor, w2: Tensor, first_expert: int) -> Tensor:
    """y [P, D] (P = T * top_k, n's dtype): row p = t * top_k + j holds the weighted output of token t's j-th
    expert, (down_e(silu(gate_e(n[t])) * up_e(n[t]))) * top_w[t, j], or 0 where this rank does not hold the
    expert (w13 [EL, 2 * IE, D] and w2 [EL, D, IE], unit inner stride, experts first_expert .. + EL - 1).
    n [T, D] contiguous; top_w [T, k] in n's dtype, top_e [T, k] expert ids (int32 / int64), both contiguous."""
    T, D = n.shape
    top_k = top_e.shape[1]
    EL, IE = w13.shape[0], w13.shape[1] // 2
    P = T * top_k
    y = n.new_empty(P, D)
    if P == 0:
        return y
    act = n.new_empty(P, IE)
    e = top_e.reshape(-1)
    fp32 = n.dtype == torch.float32
    bn, bk, warps = tile("gate_up", IE, D, n.dtype)
    _moe_direct_gate_up_kernel[(P * triton.cdiv(IE, bn),)](
        n, w13, act, e, P, first_expert, EL, IE, D, n.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k, BN=bn,
        BK=bk, EVEN_K=D % bk == 0, FP32=fp32, num_warps=warps)
    bn, bk, warps = tile("down", D, IE, n.dtype)
    _moe_direct_down_kernel[(P * triton.cdiv(D, bn),)](
        act, w2, y, e, top_w.reshape(-1), P, first_expert, EL, D, IE, w2.stride(0), w2.stride(1), BN=bn, BK=bk,
        EVEN_K=IE % bk == 0, FP32=fp32, num_warps=warps)
    return y
