"""W8A8 block-scaled FP8 linear: y = x @ w.T with w block-quantized (128 x 128, scale_inv) and x
quantized on the fly per token per 128 channels (see quant.py).

    block_fp8_linear(x [T, K], w_fp8 [N, K], w_scale_inv [NB, KB], out_dtype, residual [T, N] or None)
        -> [T, N] = residual + x @ w.T

CUDA (auto_backend chooses): decode rows (T <= SPLITK_MAX_ROWS) take the split-K Triton GEMM, which
quantizes x itself; more rows are quantized (one Triton launch) and take cuBLAS'
blockwise FP8 GEMM (torch._scaled_mm, 1x128 activation scales x 128x128 weight scales) where
cublas_blockwise_ok says the shapes allow it, else the one-pass Triton GEMM. Each 128-channel K step's
partial product is scaled by its activation and weight scales into an fp32 accumulator. (A swapped form of
the split-K GEMM, which Triton compiles to Hopper's FP8 wgmma, lost the 9B-FP8's D1 and D32 steps on the H200
and was removed: BENCHMARKS.md, FP8.) CPU (and the spec every path is tested against): block_fp8_linear_ref,
the dequantized weights times the fake-quantized activations in fp32, cast to out_dtype. Shape letters:
quant.py.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from metrale_graph import envs

from .quant import (BLOCK, INTERPRET, check_block_weight, dequantize_weight_blocks, fake_quantize_activations,
                    quantize_activations, quantize_e4m3, round_to)
from .w8a16 import W8A16_MAX_ROWS, w8a16_linear

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BACKENDS = ("auto", "cublas", "triton", "splitk", "w8a16")  # w8a16: weight-only, ops/fp8/w8a16.py
# Which GEMM "auto" gives decode rows on CUDA: "splitk" (the default: the split-K GEMM up to SPLITK_MAX_ROWS, cuBLAS
# above) or "w8a16" (the weight-only GEMM up to W8A16_MAX_ROWS). Read at import from METRALE_FP8_DECODE
# (metrale_graph.envs); set linear.DECODE_GEMM before a step is compiled or captured.
DECODE_GEMMS = envs.choices("METRALE_FP8_DECODE")
DECODE_GEMM = envs.METRALE_FP8_DECODE


def _check(x: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype, residual, where: str):
    check_block_weight(w_fp8, w_scale_inv, "w", where)
    if w_fp8.dim() != 2:
        raise ValueError(f"{where}: w must be [N, K], got shape {tuple(w_fp8.shape)}")
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: x must be a 2-D bfloat16 / float16 / float32 tensor [T, K], got "
                         f"{(x.dtype, tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__}")
    if x.shape[1] != w_fp8.shape[1]:
        raise ValueError(f"{where}: x has {x.shape[1]} channels, w has K = {w_fp8.shape[1]}")
    if x.device != w_fp8.device:
        raise ValueError(f"{where}: x is on {x.device}, w on {w_fp8.device}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if residual is not None and (not isinstance(residual, Tensor) or residual.dtype != out_dtype
                                 or tuple(residual.shape) != (x.shape[0], w_fp8.shape[0])
                                 or residual.device != x.device):
        raise ValueError(f"{where}: residual must be {out_dtype} of shape {(x.shape[0], w_fp8.shape[0])} on "
                         f"{x.device}, got {getattr(residual, 'dtype', type(residual))} "
                         f"{tuple(getattr(residual, 'shape', ()))}")
    return out_dtype


def block_fp8_linear_ref(x: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype=None, residual=None) -> Tensor:
    """The spec: fake_quantize_activations(x) @ dequantize_weight_blocks(w).T in fp32 (+ residual in fp32),
    cast to out_dtype (default x's dtype). Plain torch, any device."""
    out_dtype = _check(x, w_fp8, w_scale_inv, out_dtype, residual, "block_fp8_linear")
    y = fake_quantize_activations(x) @ dequantize_weight_blocks(w_fp8, w_scale_inv).t()
    return (y if residual is None else y + residual.float()).to(out_dtype)


CUBLAS_MIN_ROWS = 16  # cuBLAS' blockwise FP8 GEMM takes M in multiples of 16 (auto_backend: above SPLITK_MAX_ROWS)


def cublas_blockwise_ok(N: int, K: int, device: torch.device, out_dtype=torch.bfloat16) -> bool:
    """Whether block_fp8_linear's auto backend takes cuBLAS for an [N, K] weight: Hopper or later, a bf16
    or fp32 output, N a multiple of 128 (whole weight-scale blocks; cuBLAS refuses N not a multiple of
    16) and K a multiple of 512 (KB = K / 128 a multiple of 4). On an H200 (torch 2.11, cuBLAS 13) K of
    128, 384 and 4224 (KB 1, 3, 33) were accepted and gave wrong results, and a weight-scale row stride
    padded to 4 was refused, so those K take the Triton GEMM; M is padded to a multiple of 16
    (block_fp8_linear). Static sizes only (capture-safe)."""
    return (device.type == "cuda" and not INTERPRET and out_dtype in (torch.bfloat16, torch.float32)
            and torch.cuda.get_device_capability(device) >= (9, 0) and N % BLOCK == 0 and K % (4 * BLOCK) == 0)


def block_fp8_gemm_cublas(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype) -> Tensor:
    """torch._scaled_mm blockwise: x_fp8 [T, K] row-major, x_scale [T, KB] fp32 with strides (1, T) (as
    quantize_activations(..., column_major_scales=True) makes it), w_fp8 [N, K] row-major, w_scale_inv
    [NB, KB] fp32 with unit inner stride, passed as its transpose (bf16, or another inner stride, is
    converted first; a row stride padded to a multiple of 4 is kept). Raises what torch raises for
    shapes it refuses."""
    ws = w_scale_inv if w_scale_inv.dtype == torch.float32 else w_scale_inv.float()
    ws = ws if ws.stride(-1) == 1 else ws.contiguous()
    return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=ws.t(), out_dtype=out_dtype)


def _configs():
    if INTERPRET:
        return [triton.Config({"BN": 32, "BK": 64, "GROUP_M": 8}, num_warps=4)]
    # (BN, BK, warps, stages); BN 32 keeps more SMs busy at decode sizes (a few row blocks)
    tiles = ((32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (256, 128, 8, 3))
    return [triton.Config({"BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s) for bn, bk, w, s in tiles]


def _prune(configs, named_args, **kwargs):
    """Drop tiles far wider than the problem, and narrow tiles for many rows."""
    N, K, BM = named_args["N"], named_args["K"], kwargs["BM"]
    keep = [c for c in configs if c.kwargs["BN"] <= max(64, triton.next_power_of_2(N))
            and c.kwargs["BK"] <= max(64, triton.next_power_of_2(K)) and not (BM >= 64 and c.kwargs["BN"] < 64)]
    return keep or configs[:1]


def gemm_block_m(M: int) -> int:
    """Rows per program of the Triton GEMM for M rows (static: part of its autotune key)."""
    if INTERPRET:
        return 16
    return 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128


@triton.autotune(configs=_configs(), key=["N", "K", "BM"], prune_configs_by={"early_config_prune": _prune},
                 cache_results=True)
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0})
@triton.jit
def _block_fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, r_ptr, c_ptr, M, N, K, stride_am, stride_as_m, stride_as_g,
                           stride_bn, stride_bs_n, stride_rm, stride_cm, HAS_RESIDUAL: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """c[m, n] = sum over K steps of (a[m] . b[n]) * as[m, g] * bs[n // 128, g], g = k0 // 128 (BK divides
    128), plus r[m, n] with HAS_RESIDUAL, rounded once to c's dtype. a: [M, K] fp8, as: [M, KB] fp32 (any
    strides), b: [N, K] fp8, bs: [NB, KB] (fp32 / bf16). The fp8 dot runs as is in the interpreter too
    (it upcasts fp8 operands exactly)."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    r_safe = (rows % M).to(tl.int64)  # rows and columns past the end wrap around; they are never stored
    c_safe = (cols % N).to(tl.int64)
    k = tl.arange(0, BK)
    a_ptrs = a_ptr + r_safe[:, None] * stride_am + k[None, :]
    b_ptrs = b_ptr + c_safe[None, :] * stride_bn + k[:, None]  # [BK, BN]
    as_ptrs = as_ptr + r_safe * stride_as_m
    bs_ptrs = bs_ptr + (c_safe // 128) * stride_bs_n
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            mk = k < K - k0
            a = tl.load(a_ptrs, mask=mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mk[:, None], other=0.0)
        g = k0 // 128
        sa = tl.load(as_ptrs + g * stride_as_g)
        sb = tl.load(bs_ptrs + g).to(tl.float32)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BK
        b_ptrs += BK
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + r64[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = c_ptr.dtype.element_ty
    tl.store(c_ptr + r64[:, None] * stride_cm + cols[None, :], round_to(acc, dt).to(dt), mask=mask)


def _operands(x_fp8: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype, residual):
    """The Triton GEMMs' fresh output [T, N], whether it is already the answer (no rows, columns or K: zeros
    or the residual), and the weight, its scales and the residual with unit inner strides."""
    T, K = x_fp8.shape
    N = w_fp8.shape[0]
    out = torch.empty((T, N), dtype=out_dtype, device=x_fp8.device)
    if T == 0 or N == 0 or K == 0:
        if T and N:
            out.zero_() if residual is None else out.copy_(residual)
        return out, True, w_fp8, w_scale_inv, residual
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    w_fp8 = w_fp8 if w_fp8.stride(-1) == 1 else w_fp8.contiguous()
    w_scale_inv = w_scale_inv if w_scale_inv.stride(-1) == 1 else w_scale_inv.contiguous()
    return out, False, w_fp8, w_scale_inv, residual


def block_fp8_gemm_triton(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype,
                          residual=None) -> Tensor:
    """The Triton block-scaled GEMM: x_fp8 [T, K] (unit inner stride), x_scale [T, KB] fp32 (any strides),
    w_fp8 [N, K], w_scale_inv [NB, KB] (fp32 / bf16), residual [T, N] out_dtype or None -> fresh [T, N]."""
    T, K = x_fp8.shape
    N = w_fp8.shape[0]
    out, empty, w_fp8, w_scale_inv, residual = _operands(x_fp8, w_fp8, w_scale_inv, out_dtype, residual)
    if empty:
        return out
    BM = gemm_block_m(T)
    _block_fp8_gemm_kernel[lambda meta: (triton.cdiv(T, BM) * triton.cdiv(N, meta["BN"]),)](
        x_fp8, x_scale, w_fp8, w_scale_inv, out if residual is None else residual, out, T, N, K, x_fp8.stride(0),
        x_scale.stride(0), x_scale.stride(1), w_fp8.stride(0), w_scale_inv.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), HAS_RESIDUAL=residual is not None, BM=BM)
    return out


# SPLITK_BN: columns per program of the split-K GEMM (benchmarks/kernels/sweep_fp8_decode.py on the H200, 9e87066:
# 128 beat 64 at every 9B shape at M 16). One row takes this kernel too. The sweep's one-row GEMV form (fp32
# multiply-adds, benchmarks/kernels/sweep_fp8_decode.py) was the linear's from f340188 to 0a36b93: summed over the
# 9B's four shapes at one row it took 152.7 us on the H200 (755f071 sweep, `auto`), where this kernel's best
# 4-programs-per-SM tile per shape took 109.2 (0a36b93 A/B, benchmarks/h200-fp8-gemv-ab-0a36b93.json). Graphs never
# take one row either: a one-stream bucket holds two tokens (capture/runner.py), and at two rows this kernel beat a
# two-row GEMV 1.1-1.7x
SPLITK_BN = 128
SPLITK_MAX_ROWS = 16  # the split-K GEMM's rows: decode-shaped calls (one 16-row tile)


def splitk_parts(N: int, K: int, device: torch.device, BN: int = SPLITK_BN, per_sm: int = 4) -> tuple[int, int]:
    """(parts, K_PER) of the split-K GEMM for an [N, K] weight in tiles of BN columns: K cut into parts of
    K_PER channels (a multiple of 128, so a part holds whole scale groups) so that about `per_sm` programs
    per SM stream the weight (at decode sizes one program per column tile leaves most SMs idle or
    latency-bound). Static: from the shapes and the device only."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    KB = -(-K // BLOCK)
    want = max(1, -(-per_sm * sms // -(-N // BN)))
    per = -(-KB // min(KB, want))  # scale groups per part
    return -(-KB // per), per * BLOCK


@triton.autotune(configs=[triton.Config({}, num_warps=4, num_stages=3)] if INTERPRET else
                 [triton.Config({}, num_warps=w, num_stages=st) for w, st in ((4, 3), (4, 4), (4, 5), (8, 3), (2, 4))],
                 key=["N", "K", "K_PER", "BM"], cache_results=True)
@triton.jit
def _block_fp8_splitk_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, p_ptr, M, N, K, K_PER, stride_am, stride_as_m, stride_as_g,
                             stride_bn, stride_bs_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             QUANT_A: tl.constexpr):
    """Part program_id(1) of K ([k_lo, k_lo + K_PER), whole 128-groups) for BN columns of all M <= BM rows:
    p[part, m, n] = sum over its K steps of (a[m] . b[n]) * as[m, g] * bs[n // 128, g] in fp32. a, as,
    b, bs as _block_fp8_gemm_kernel's; p: [parts, M, N] fp32. QUANT_A: a is the unquantized activations
    (bf16 / fp16 / fp32, as_ptr unread), each K step (one 128-group, BK = 128) quantized in registers with
    quantize_activations' arithmetic (quantize_e4m3): the same codes and scales, one launch and one round
    trip through memory fewer."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    rows = tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    r_safe = (rows % M).to(tl.int64)
    c_safe = (cols % N).to(tl.int64)
    k_lo = part * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    k = tl.arange(0, BK)
    a_ptrs = a_ptr + r_safe[:, None] * stride_am + (k_lo + k)[None, :]  # [BM, BK]
    b_ptrs = b_ptr + c_safe[None, :] * stride_bn + (k_lo + k)[:, None]  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    as_ptrs = as_ptr + r_safe * stride_as_m
    bs_ptrs = bs_ptr + (c_safe // 128) * stride_bs_n
    for k0 in range(k_lo, k_hi, BK):
        mk = k < k_hi - k0
        g = k0 // 128
        if QUANT_A:
            x = tl.load(a_ptrs, mask=mk[None, :], other=0.0).to(tl.float32)
            a, sa = quantize_e4m3(x, tl.max(tl.abs(x), axis=1))
        else:
            a = tl.load(a_ptrs, mask=mk[None, :], other=0.0)
            sa = tl.load(as_ptrs + g * stride_as_g)
        sb = tl.load(bs_ptrs + g).to(tl.float32)
        b = tl.load(b_ptrs, mask=mk[:, None], other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BK
        b_ptrs += BK
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(p_ptr + (part * M + rows).to(tl.int64)[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _splitk_sum_kernel(p_ptr, r_ptr, c_ptr, M, N, PARTS, stride_rm, stride_cm, HAS_RESIDUAL: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """c[m, n] = sum over the parts of p[part, m, n], in part order (the same sum every call: replays are
    exact), plus r[m, n] with HAS_RESIDUAL, rounded once to c's dtype."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    inside = e < M * N
    m = (e // N).to(tl.int64)
    n = e % N
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for part in range(0, PARTS):
        acc += tl.load(p_ptr + part * M * N + e, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + m * stride_rm + n, mask=inside, other=0.0).to(tl.float32)
    dt = c_ptr.dtype.element_ty
    tl.store(c_ptr + m * stride_cm + n, round_to(acc, dt).to(dt), mask=inside)


def block_fp8_gemm_splitk(x_fp8: Tensor, x_scale: Tensor | None, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype,
                          residual=None) -> Tensor:
    """The split-K block-scaled GEMM for decode-shaped calls (T <= SPLITK_MAX_ROWS): K in parts
    (splitk_parts), each part's fp32 partial product stored, then summed in a fixed order with the
    residual and rounded once (as
    block_fp8_gemm_triton). Arguments and result as block_fp8_gemm_triton's;
    x_scale None: x_fp8 is the unquantized activations (unit inner stride), quantized inside the GEMM
    (the same codes and scales as quantize_activations: the same result bit for bit)."""
    T, K = x_fp8.shape
    N = w_fp8.shape[0]
    if T > SPLITK_MAX_ROWS:
        raise ValueError(f"block_fp8_gemm_splitk: at most {SPLITK_MAX_ROWS} rows, got {T}")
    out, empty, w_fp8, w_scale_inv, residual = _operands(x_fp8, w_fp8, w_scale_inv, out_dtype, residual)
    if empty:
        return out
    quant = x_scale is None
    if quant and x_fp8.stride(-1) != 1:
        x_fp8 = x_fp8.contiguous()
    parts, k_per = splitk_parts(N, K, x_fp8.device)
    partial = torch.empty((parts, T, N), dtype=torch.float32, device=x_fp8.device)
    scale = x_fp8 if quant else x_scale  # (unread when quant)
    _block_fp8_splitk_kernel[(triton.cdiv(N, SPLITK_BN), parts)](
        x_fp8, scale, w_fp8, w_scale_inv, partial, T, N, K, k_per, x_fp8.stride(0), scale.stride(0),
        scale.stride(1), w_fp8.stride(0), w_scale_inv.stride(0), BM=SPLITK_MAX_ROWS, BN=SPLITK_BN,
        BK=128, QUANT_A=quant)
    BLOCK_E = 1024
    _splitk_sum_kernel[(triton.cdiv(T * N, BLOCK_E),)](
        partial, out if residual is None else residual, out, T, N, parts,
        0 if residual is None else residual.stride(0), out.stride(0), HAS_RESIDUAL=residual is not None,
        BLOCK_E=BLOCK_E)
    return out


def auto_backend(T: int, N: int, K: int, device: torch.device, out_dtype=torch.bfloat16) -> str:
    """The GEMM block_fp8_linear's "auto" takes for T rows of an [N, K] weight on `device`: on CUDA the
    split-K GEMM for decode rows (T <= SPLITK_MAX_ROWS: faster than the one-pass GEMM and cuBLAS at
    three of the 9B's four shapes on the H200, up to 2.7x; benchmarks/kernels/check_fp8.py perf), cuBLAS above where
    cublas_blockwise_ok, else the one-pass Triton GEMM; in the interpreter the one-pass GEMM; elsewhere
    the reference. With DECODE_GEMM "w8a16" (METRALE_FP8_DECODE=w8a16) the weight-only GEMM takes the rows up to
    W8A16_MAX_ROWS instead, on CUDA and in the interpreter. A DECODE_GEMM that is neither is a ValueError naming it."""
    if DECODE_GEMM not in DECODE_GEMMS:
        raise ValueError(f"METRALE_FP8_DECODE / linear.DECODE_GEMM must be one of {', '.join(DECODE_GEMMS)}, "
                         f"got {DECODE_GEMM!r}")
    if DECODE_GEMM == "w8a16" and 0 < T <= W8A16_MAX_ROWS and (device.type == "cuda" or INTERPRET):
        return "w8a16"  # weight-only decode rows (the interpreter too, for the CPU tests)
    if device.type != "cuda":
        return "triton" if INTERPRET else "reference"
    if 0 < T <= SPLITK_MAX_ROWS:
        return "splitk"
    if T >= CUBLAS_MIN_ROWS and cublas_blockwise_ok(N, K, device, out_dtype):
        return "cublas"
    return "triton"


def block_fp8_linear(x: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype=None, residual=None,
                     backend: str = "auto") -> Tensor:
    """W8A8 block-scaled linear (module docstring): x [T, K] bf16 / fp16 / fp32, w_fp8 [N, K] float8_e4m3fn,
    w_scale_inv [NB, KB] fp32 or bf16, residual [T, N] in out_dtype or None -> fresh [T, N] in out_dtype
    (default x's dtype). Mutates nothing. The Triton GEMM adds the residual in its epilogue (one rounding,
    as the reference); cuBLAS' output is rounded, then the residual added (a second rounding).
    backend: "auto" (auto_backend), "cublas", "triton", "splitk" (the split-K Triton GEMM, T <=
    SPLITK_MAX_ROWS; CUDA or the interpreter); on a CPU
    without the interpreter every backend is the reference. cuBLAS runs on T rounded up to a multiple of 16
    (zero rows, sliced off). Bad arguments raise ValueError naming them."""
    out_dtype = _check(x, w_fp8, w_scale_inv, out_dtype, residual, "block_fp8_linear")
    if backend not in BACKENDS:
        raise ValueError(f"block_fp8_linear: backend must be one of {BACKENDS}, got {backend!r}")
    if not (x.is_cuda or INTERPRET):
        return block_fp8_linear_ref(x, w_fp8, w_scale_inv, out_dtype, residual)
    T = x.shape[0]
    if backend == "auto":
        backend = auto_backend(T, *w_fp8.shape, x.device, out_dtype)
    if backend == "cublas" and T > 0 and x.is_cuda:
        rows = -(-T // CUBLAS_MIN_ROWS) * CUBLAS_MIN_ROWS
        x_fp8, x_scale = quantize_activations(x, column_major_scales=True, rows=rows)
        out = block_fp8_gemm_cublas(x_fp8, x_scale, w_fp8, w_scale_inv, out_dtype)[:T]
        return out if residual is None else out.add_(residual)
    if backend == "w8a16":  # x not quantized: weight-only numerics (w8a16_linear_ref), at most W8A16_MAX_ROWS rows
        return w8a16_linear(x, w_fp8, w_scale_inv, out_dtype, residual)
    if backend == "splitk":
        if T > SPLITK_MAX_ROWS:
            raise ValueError(f"block_fp8_linear: the splitk backend takes at most {SPLITK_MAX_ROWS} rows, got {T}")
        return block_fp8_gemm_splitk(x, None, w_fp8, w_scale_inv, out_dtype, residual)  # x quantized inside
    x_fp8, x_scale = quantize_activations(x)
    return block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale_inv, out_dtype, residual)
