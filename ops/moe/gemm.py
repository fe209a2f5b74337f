"""The MoE grouped GEMMs over the aligned pairs (align.py): gate|up with SiLU-and-multiply in its
epilogue, then down with the routing weight in its epilogue. Each program takes one BM-row block (one
expert) and one column tile; blocks of expert -1 return at once."""

import triton
import triton.language as tl
from torch import Tensor

from ..common import INTERPRET
from ..tiles import EVEN_K, _block_pairs, _grouped_tile, _load_cols, _load_rows
from .rounding import _rnd


def _gemm_configs(acc_tiles: int):
    """(BN, BK, warps, stages) candidates; BM is fixed by the alignment (block_m), not tuned."""
    if INTERPRET:
        return [triton.Config({"BN": 32, "BK": 32, "GROUP_M": 8}, num_warps=4)]
    tiles = ((32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 8, 4), (128, 64, 4, 4), (128, 64, 8, 3))
    if acc_tiles == 1:
        tiles += ((256, 64, 8, 3),)
    return [triton.Config({"BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=st) for bn, bk, w, st in tiles]


# fp32's one tile (IEEE dots: the tests' and the references' dtype, not a serving one), as the attention
# kernels keep one (attend.one_config_for_fp32): autotuning compiled every candidate for fp32 at the first
# call of each new shape (17-45 s per prefill shape on an H200, nothing printed). BK 32 and 2 stages keep its
# fp32 tiles within a block's shared memory at BM 128 (the candidates' BK 64 / 128 at 3-4 stages do not).
FP32_CONFIG = triton.Config({"BN": 32, "BK": 32, "GROUP_M": 8}, num_warps=4, num_stages=2)


def _prune(acc_tiles: int):
    """Drop tiles far wider than the problem, and accumulators that cannot stay in registers; with IEEE
    (fp32) dots, FP32_CONFIG alone."""
    def prune(configs, named_args, **kwargs):
        if kwargs.get("IEEE"):
            return [FP32_CONFIG]
        N, K, BM = named_args["N"], named_args["K"], kwargs["BM"]
        keep = [c for c in configs if c.kwargs["BN"] <= max(32, triton.next_power_of_2(N))
                and c.kwargs["BK"] <= max(32, triton.next_power_of_2(K))
                and acc_tiles * BM * c.kwargs["BN"] <= 128 * 128]
        return keep or [min(configs, key=lambda c: c.kwargs["BN"] * c.kwargs["BK"])]
    return prune


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, acc)


# autotuned per (N, K, BM) and dtypes; warmup runs every bucket before capture, so no tuning runs in a graph
@triton.autotune(configs=_gemm_configs(2), key=["N", "K", "BM"], prune_configs_by={"early_config_prune": _prune(2)},
                 cache_results=True)
@triton.heuristics(EVEN_K)
@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, expert_ptr, num_pairs, num_blocks, N, K, stride_x,
                        stride_we, stride_wn, TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """act[p, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n]) for the pairs p = t * TOP_K + j of one block
    (expert e); the gate and up tiles of the same columns are computed side by side."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_blocks, N, BM, BN, GROUP_M)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # blocks past the last group
        return
    pair, valid = _block_pairs(ids_ptr, pid_m, num_pairs, BM)
    token = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + token[:, None] * stride_x + k[None, :]
    g_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[None, :] * stride_wn + k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = _load_rows(x_ptrs, valid, k, K - k0, EVEN_K)
        wg = _load_cols(g_ptrs, k, K - k0, EVEN_K)
        wu = _load_cols(u_ptrs, k, K - k0, EVEN_K)
        gate = _dot(x, wg, gate, IEEE)
        up = _dot(x, wu, up, IEEE)
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    # rounded where transformers rounds: gate and up in the model dtype, silu(gate), the product
    dt = act_ptr.dtype.element_ty
    gate = _rnd(gate, dt)
    y = _rnd(_rnd(gate * tl.sigmoid(gate), dt) * _rnd(up, dt), dt).to(dt)
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * N + cols[None, :], y, mask=valid[:, None] & (cols < N)[None, :])


@triton.autotune(configs=_gemm_configs(1), key=["N", "K", "BM"], prune_configs_by={"early_config_prune": _prune(1)},
                 cache_results=True)
@triton.heuristics(EVEN_K)
@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, y_ptr, ids_ptr, expert_ptr, rw_ptr, num_pairs, num_blocks, N, K, stride_we,
                     stride_wn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """y[p, n] = (act[p] . w[e, n]) * rw[p] for the pairs p of one block (expert e)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_blocks, N, BM, BN, GROUP_M)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair, valid = _block_pairs(ids_ptr, pid_m, num_pairs, BM)
    rows = pair.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    a_ptrs = act_ptr + rows[:, None] * K + k[None, :]
    w_ptrs = w_ptr + e * stride_we + (cols % N).to(tl.int64)[None, :] * stride_wn + k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = _load_rows(a_ptrs, valid, k, K - k0, EVEN_K)
        w = _load_cols(w_ptrs, k, K - k0, EVEN_K)
        acc = _dot(a, w, acc, IEEE)
        a_ptrs += BK
        w_ptrs += BK
    # the expert's output in the model dtype, times the routing weight (model dtype), rounded
    dt = y_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = _rnd(_rnd(acc, dt) * rw[:, None], dt).to(dt)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=valid[:, None] & (cols < N)[None, :])


def gate_up(n: Tensor, w13: Tensor, sorted_ids: Tensor, block_expert: Tensor, top_k: int, BM: int,
            ieee: bool) -> Tensor:
    """act [P, IE] (P = T * top_k, n's dtype): row p = t * top_k + j holds silu(n[t] . gate_e) * (n[t] . up_e)
    for pair p of expert e in the aligned blocks (sorted_ids, block_expert of BM rows); rows of pairs in
    blocks of expert -1 are left unwritten. w13 [EL, 2 * IE, D] with unit inner stride; IEEE: fp32 dots."""
    T, D = n.shape
    IE, P, nblk = w13.shape[1] // 2, T * top_k, block_expert.shape[0]
    act = n.new_empty(P, IE)
    _moe_gate_up_kernel[lambda meta: (nblk * triton.cdiv(IE, meta["BN"]),)](
        n, w13, act, sorted_ids, block_expert, P, nblk, IE, D, n.stride(0), w13.stride(0), w13.stride(1),
        TOP_K=top_k, BM=BM, IEEE=ieee)
    return act


def down(act: Tensor, w2: Tensor, sorted_ids: Tensor, block_expert: Tensor, top_w: Tensor, y: Tensor, BM: int,
         ieee: bool) -> Tensor:
    """y [P, D]: row p = (act[p] . down_e) * top_w[p] for pair p of expert e in the aligned blocks; rows of
    pairs in blocks of expert -1 are left as they are. w2 [EL, D, IE] with unit inner stride. Returns y."""
    P, IE = act.shape
    D, nblk = w2.shape[1], block_expert.shape[0]
    _moe_down_kernel[lambda meta: (nblk * triton.cdiv(D, meta["BN"]),)](
        act, w2, y, sorted_ids, block_expert, top_w.reshape(-1), P, nblk, D, IE, w2.stride(0), w2.stride(1),
        BM=BM, IEEE=ieee)
    return y
