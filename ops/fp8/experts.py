"""W8A8 block-scaled FP8 grouped GEMMs for the routed experts of a sparse-MoE layer: the FP8 twins of
ops/moe/gemm.py's `_moe_gate_up_kernel` / `_moe_down_kernel`, over the same expert-sorted pairs
(ops/moe/align.py's align_local_pairs) with the same fused epilogues (SiLU-mul; routing weight).

    moe_experts_fp8(x [T, D], top_w [T, k], top_e [T, k], w13 [EL, 2*IE, D], w13_scale [EL, 2*IB, DB],
                    w2 [EL, D, IE], w2_scale [EL, DB, IB]) -> y [T * k, D]

y[t * k + j] = top_w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = top_e[t, j]; rows of the
experts of other tensor-parallel ranks are 0. Weights are float8_e4m3fn, IB = ceil(IE / 128), DB =
ceil(D / 128). w13 holds each expert's gate rows then up rows, and w13_scale the gate's scale grid
then the up's (their checkpoint tensors' grids concatenated), so IE need not be a multiple of 128.
x is quantized once per token (per 128 channels of D); the gate|up kernel quantizes its SiLU-mul
output per pair per 128 channels of IE in its epilogue (one 128-column tile is one group), so the
down kernel reads FP8. Rounding where ops/moe/gemm.py rounds: gate and up in x's dtype, SiLU(gate), the
product; the expert's output, the product with the routing weight.

Blocks of 16 or 32 rows compile for sm_90 (Triton 3.6) to fp16 mma.sync after converting every weight byte,
blocks of 64+ to FP8 wgmma. A swapped form for the small blocks (w . x.T per K step, FP8 wgmma) was within noise
of this one on the 35B-A3B-FP8 on the H200 and was removed (BENCHMARKS.md, FP8).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..tiles import EVEN_K, _block_pairs, _grouped_tile, _load_cols, _load_rows
from .quant import (FP8_DTYPE, INTERPRET, SCALE_DTYPES, dequantize_weight_blocks, fake_quantize_activations,
                    num_blocks, quantize_activations, quantize_e4m3, round_to)

WHERE = "moe_experts_fp8"


def check_experts(x, top_w, top_e, w13, w13_scale, w2, w2_scale, first_expert=0, num_experts=None) -> None:
    """Metadata checks of moe_experts_fp8's arguments; ValueError naming the bad one."""
    def fail(msg):
        raise ValueError(f"{WHERE}: {msg}")
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fail(f"x must be a 2-D float tensor [T, D], got {getattr(x, 'dtype', type(x))} "
             f"{tuple(getattr(x, 'shape', ()))}")
    T, D = x.shape
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, Tensor) or w.dtype != FP8_DTYPE or w.dim() != 3:
            fail(f"{name} must be a 3-D float8_e4m3fn tensor, got {getattr(w, 'dtype', type(w))} "
                 f"{tuple(getattr(w, 'shape', ()))}")
        if w.device != x.device:
            fail(f"{name} is on {w.device}, x on {x.device}")
    EL, IE = w13.shape[0], w2.shape[-1]
    if tuple(w13.shape) != (EL, 2 * IE, D) or tuple(w2.shape) != (EL, D, IE):
        fail(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [EL, 2*IE, D] and [EL, D, IE] with D = {D}")
    IB, DB = num_blocks(IE), num_blocks(D)
    for name, s, shape in (("w13_scale", w13_scale, (EL, 2 * IB, DB)), ("w2_scale", w2_scale, (EL, DB, IB))):
        if not isinstance(s, Tensor) or s.dtype not in SCALE_DTYPES:
            fail(f"{name} must be float32 or bfloat16, got {getattr(s, 'dtype', type(s))}")
        if tuple(s.shape) != shape:
            fail(f"{name} has shape {tuple(s.shape)}, expected {shape} (IE = {IE}, D = {D}, blocks of 128)")
        if s.device != x.device:
            fail(f"{name} is on {s.device}, x on {x.device}")
    if not isinstance(top_e, Tensor) or top_e.dim() != 2 or top_e.shape[0] != T or top_e.dtype not in (
            torch.int32, torch.int64):
        fail(f"top_e must be an int32 / int64 tensor [T={T}, k], got {getattr(top_e, 'dtype', type(top_e))} "
             f"{tuple(getattr(top_e, 'shape', ()))}")
    if not isinstance(top_w, Tensor) or tuple(top_w.shape) != tuple(top_e.shape) or top_w.dtype != x.dtype:
        fail(f"top_w must be {x.dtype} of shape {tuple(top_e.shape)}, got {getattr(top_w, 'dtype', type(top_w))} "
             f"{tuple(getattr(top_w, 'shape', ()))}")
    E = EL if num_experts is None else num_experts
    if not (isinstance(first_expert, int) and 0 <= first_expert and first_expert + EL <= E):
        fail(f"experts {first_expert}..{first_expert + EL - 1} are not among the router's {E}")


def stack_gate_up(gate: Tensor, gate_scale: Tensor, up: Tensor, up_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Per-expert gate / up weights [EL, IE, D] and their scales [EL, IB, DB] -> (w13 [EL, 2*IE, D],
    w13_scale [EL, 2*IB, DB]) in moe_experts_fp8's layout."""
    return torch.cat([gate, up], dim=1), torch.cat([gate_scale, up_scale], dim=1)


def dequantize_gate_up(w13: Tensor, w13_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """w13 [..., 2*IE, D] with its two concatenated scale grids -> [..., 2*IE, D] in dtype."""
    IE, IB = w13.shape[-2] // 2, w13_scale.shape[-2] // 2
    return torch.cat([dequantize_weight_blocks(w13[..., :IE, :], w13_scale[..., :IB, :], dtype),
                      dequantize_weight_blocks(w13[..., IE:, :], w13_scale[..., IB:, :], dtype)], dim=-2)


def moe_experts_fp8_ref(x, top_w, top_e, w13, w13_scale, w2, w2_scale, first_expert=0, num_experts=None):
    """Plain torch, expert by expert: dequantized weights, activations through fake_quantize_activations,
    matmuls in fp32, rounded to x's dtype where the kernels round. Returns y [T * k, D] in x's dtype."""
    check_experts(x, top_w, top_e, w13, w13_scale, w2, w2_scale, first_expert, num_experts)
    T, k = top_e.shape
    dt, IE = x.dtype, w2.shape[-1]
    xq = fake_quantize_activations(x)
    flat_e, flat_w = top_e.reshape(-1), top_w.reshape(-1)
    y = torch.zeros(T * k, x.shape[1], dtype=dt, device=x.device)
    for e in torch.unique(flat_e).tolist():
        if not first_expert <= e < first_expert + w13.shape[0]:
            continue  # another tensor-parallel rank's expert
        pairs = torch.where(flat_e == e)[0]
        le = e - first_expert
        gate_up = xq[pairs // k] @ dequantize_gate_up(w13[le], w13_scale[le]).t()
        act = F.silu(gate_up[:, :IE].to(dt)) * gate_up[:, IE:].to(dt)
        out = (fake_quantize_activations(act) @ dequantize_weight_blocks(w2[le], w2_scale[le]).t()).to(dt)
        y[pairs] = out * flat_w[pairs, None]
    return y


# The kernels ------------------------------------------------------------------------------------
def _configs(tiles):
    """(BN, BK, warps, stages) candidates; BM is fixed by the alignment (block_m), not tuned."""
    if INTERPRET:
        return [triton.Config({"BN": tiles[0][0], "BK": 64, "GROUP_M": 8}, num_warps=4)]
    return [triton.Config({"BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=st) for bn, bk, w, st in tiles]


# gate|up: BN = 128 (one quantization group per tile), two accumulators
_GATE_UP_TILES = ((128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4))
_DOWN_TILES = ((64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (128, 64, 4, 4))


def _prune(configs, named_args, **kwargs):
    """Drop tiles far wider than the problem, and 128-row blocks with 4 warps on wide tiles (their fp32
    accumulators would not stay in registers)."""
    N, K, BM = named_args["N"], named_args["K"], kwargs["BM"]
    keep = [c for c in configs if c.kwargs["BN"] <= max(128, triton.next_power_of_2(N))
            and c.kwargs["BK"] <= max(64, triton.next_power_of_2(K))
            and not (BM >= 128 and c.num_warps < 8 and c.kwargs["BN"] >= 128)]
    return keep or configs[:1]


@triton.autotune(configs=_configs(_GATE_UP_TILES), key=["N", "K", "BM"],
                 prune_configs_by={"early_config_prune": _prune}, cache_results=True)
@triton.heuristics(EVEN_K)
@triton.jit
def _moe_gate_up_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, q_ptr, qs_ptr, ids_ptr, expert_ptr, num_pairs, num_blocks,
                            N, K, stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, stride_qs,
                            TOP_K: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """For the pairs p = t * TOP_K + j of one block (expert e) and 128 columns n (BN = 128: one group):
    act = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n]) rounded in DT, stored quantized: q[p, n] codes,
    qs[p, n // 128] its scale. x: [T, K] fp8 with scales xs [T, KB]; w: [E, 2N, K] fp8 with scales ws
    [E, 2 * NB, KB] (the gate's rows NB, then the up's)."""
    tl.static_assert(BN == 128)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_blocks, N, BM, BN, GROUP_M)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # blocks past the last group
        return
    pair, valid = _block_pairs(ids_ptr, pid_m, num_pairs, BM)
    token = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + token[:, None] * stride_x + k[None, :]
    c_safe = (cols % N).to(tl.int64)
    g_ptrs = w_ptr + e * stride_we + c_safe[None, :] * stride_wn + k[:, None]  # [BK, BN]
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    u_ptrs = g_ptrs + N * stride_wn
    xs_ptrs = xs_ptr + token * stride_xs
    gs_ptr = ws_ptr + e * stride_wse + pid_n * stride_wsn  # this tile's 128 rows are one scale row
    us_ptr = gs_ptr + tl.cdiv(N, 128) * stride_wsn
    for k0 in range(0, K, BK):
        x = _load_rows(x_ptrs, valid, k, K - k0, EVEN_K)
        g = k0 // 128
        sx = tl.load(xs_ptrs + g, mask=valid, other=0.0)
        wg = _load_cols(g_ptrs, k, K - k0, EVEN_K)
        wu = _load_cols(u_ptrs, k, K - k0, EVEN_K)
        gate += tl.dot(x, wg) * (sx * tl.load(gs_ptr + g).to(tl.float32))[:, None]
        up += tl.dot(x, wu) * (sx * tl.load(us_ptr + g).to(tl.float32))[:, None]
        x_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    gate = round_to(gate, DT)
    act = round_to(round_to(gate * tl.sigmoid(gate), DT) * round_to(up, DT), DT)
    in_n = cols < N
    act = tl.where(in_n[None, :], act, 0.0)  # columns past N are not in the group's amax
    q, scale = quantize_e4m3(act, tl.max(tl.abs(act), axis=1))
    rows = pair.to(tl.int64)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=valid[:, None] & in_n[None, :])
    tl.store(qs_ptr + rows * stride_qs + pid_n, scale, mask=valid)


@triton.autotune(configs=_configs(_DOWN_TILES), key=["N", "K", "BM"],
                 prune_configs_by={"early_config_prune": _prune}, cache_results=True)
@triton.heuristics(EVEN_K)
@triton.jit
def _moe_down_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, ids_ptr, expert_ptr, rw_ptr, num_pairs, num_blocks, N,
                         K, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """y[p, n] = (a[p] . w[e, n]) * rw[p] for the pairs p of one block (expert e), rounded in y's dtype.
    a: [P, K] fp8 with scales as [P, KB]; w: [E, N, K] fp8 with scales ws [E, NB, KB]."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_blocks, N, BM, BN, GROUP_M)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    pair, valid = _block_pairs(ids_ptr, pid_m, num_pairs, BM)
    rows = pair.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    c_safe = (cols % N).to(tl.int64)
    k = tl.arange(0, BK)
    a_ptrs = a_ptr + rows[:, None] * K + k[None, :]
    w_ptrs = w_ptr + e * stride_we + c_safe[None, :] * stride_wn + k[:, None]  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    as_ptrs = as_ptr + rows * stride_as
    ws_ptrs = ws_ptr + e * stride_wse + (c_safe // 128) * stride_wsn
    for k0 in range(0, K, BK):
        a = _load_rows(a_ptrs, valid, k, K - k0, EVEN_K)
        g = k0 // 128
        sa = tl.load(as_ptrs + g, mask=valid, other=0.0)
        sw = tl.load(ws_ptrs + g).to(tl.float32)
        w = _load_cols(w_ptrs, k, K - k0, EVEN_K)
        acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
        a_ptrs += BK
        w_ptrs += BK
    dt = y_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    y = round_to(round_to(acc, dt) * rw[:, None], dt).to(dt)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=valid[:, None] & (cols < N)[None, :])


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _inner_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def moe_experts_fp8(x, top_w, top_e, w13, w13_scale, w2, w2_scale, first_expert=0, num_experts=None):
    """The routed experts in FP8 (module docstring): quantize x per token (one launch), sort the pairs by
    expert on the device (align_pairs), grouped gate|up GEMM with SiLU-mul and the act's quantization in
    its epilogue, grouped down GEMM with the routing weight in its epilogue. CUDA or the interpreter
    (the reference otherwise). No host sync; every size follows from T, k and the expert counts, so a
    CUDA graph of it is static. num_experts: the router's E (default EL); with first_expert, the experts
    of this tensor-parallel rank. Returns a fresh y [T * k, D] in x's dtype; mutates nothing."""
    # the bf16 grouped GEMMs' pair sorting and block rows; imported here, as importing ops.fp8 (which the
    # phase ops do) must not import the ops.moe package, registering metrale::moe before the ops before it
    from ..moe.align import align_local_pairs, block_m

    check_experts(x, top_w, top_e, w13, w13_scale, w2, w2_scale, first_expert, num_experts)
    if not (x.is_cuda or INTERPRET):
        return moe_experts_fp8_ref(x, top_w, top_e, w13, w13_scale, w2, w2_scale, first_expert, num_experts)
    T, D = x.shape
    k, EL, IE = top_e.shape[1], w13.shape[0], w2.shape[-1]
    E = EL if num_experts is None else num_experts
    P = T * k
    if P == 0:
        return x.new_empty(0, D)
    BM = block_m(P, EL)
    sorted_ids, block_expert = align_local_pairs(top_e, EL, E, first_expert, BM)
    nblk = block_expert.shape[0]
    w13, w2 = _inner_contiguous(w13), _inner_contiguous(w2)
    w13_scale, w2_scale = _inner_contiguous(w13_scale), _inner_contiguous(w2_scale)
    xq, xs = quantize_activations(x)
    IB = num_blocks(IE)
    act_q = torch.empty((P, IE), dtype=FP8_DTYPE, device=x.device)
    act_s = torch.empty((P, IB), dtype=torch.float32, device=x.device)
    _moe_gate_up_fp8_kernel[(nblk * IB,)](
        xq, xs, w13, w13_scale, act_q, act_s, sorted_ids, block_expert, P, nblk, IE, D, xq.stride(0), xs.stride(0),
        w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act_s.stride(0), TOP_K=k,
        DT=_TL_DTYPES[x.dtype], BM=BM)
    y = x.new_empty(P, D) if EL == E else x.new_zeros(P, D)  # pairs of other ranks' experts: 0
    _moe_down_fp8_kernel[lambda meta: (nblk * triton.cdiv(D, meta["BN"]),)](
        act_q, act_s, w2, w2_scale, y, sorted_ids, block_expert, top_w.reshape(-1), P, nblk, D, IE, act_s.stride(0),
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), BM=BM)
    return y
