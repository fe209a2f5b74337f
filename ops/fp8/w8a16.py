"""Weight-only FP8 linear for decode rows (W8A16, issue 38 item 3): y = x @ dequantize(w).T with x in
bf16 / fp16 / fp32 as it comes (not quantized), w block-quantized (float8_e4m3fn [N, K], scale_inv
[NB, KB], 128 x 128 blocks; quant.py), 1 to W8A16_MAX_ROWS (32) rows.

    w8a16_linear(x [T, K], w_fp8 [N, K], w_scale_inv [NB, KB], out_dtype, residual [T, N] or None)
        -> [T, N] = residual + x @ dequantize(w).T, accumulated in fp32, rounded once to out_dtype

The spec (w8a16_linear_ref): x.float() @ dequantize_weight_blocks(w).T in fp32 (+ residual in fp32), cast to
out_dtype; the weight-only numerics of quant.activation_rounding(False), not the W8A8 ones of
linear.block_fp8_linear_ref (no activation rounding: closer to the bf16 product than W8A8, and different from
it by W8A8's own reach).

Why (the bytes it must move). At 1-32 rows a projection is a read of its weight: the floor is N * K code
bytes + 4 * NB * KB scale bytes + T * K * 2 activation bytes + T * N * out bytes, the codes being all but a
fraction of a percent at the 9B's shapes (4096 x 12288: 50.3 MB of codes, 12 KB of scales, 0.8 MB of
activations at 32 rows), so 4.3 TB/s (the H200's HBM) puts the 4096 x 12288 down projection at 11.7 us and
twice that in bf16. The W8A8 split-K GEMM (linear.py) reached 0.30-0.67x of bf16's bandwidth: per 128-wide
K step each program re-derives the activation group's amax and codes (a max, IEEE divisions and a rounding
per element, the same work in every column tile), and its FP8 dot at 16 rows compiles for sm_90 to fp16
mma.sync after converting every weight byte anyway. Here the activations enter the dot as they are.

The kernel (_w8a16_kernel), one program per (BN columns, part of K):
- K is cut into parts of K_PER channels, a multiple of 128 (w8a16_parts: splitk_parts' rule, linear.py,
  about PER_SM programs per SM of the device at PARTS_BN-wide tiles; 132 SMs on an H200), so that a
  decode-sized weight (a few dozen column tiles) still spreads over every SM. Each program streams its
  [BN, K_PER] slice of codes once, BK = 128 channels per step: one scale block, so one scale per
  128 columns per step (a [BN] vector for BN 256).
- Per step: codes [BN, 128] loaded as bytes, converted in registers to x's dtype (bf16 and fp16 hold every
  e4m3 value exactly: 3 mantissa bits, exponents 2^-9 .. 2^8), the dot with x's [BM, 128] tile accumulated
  in fp32 (products of an 8-bit and a 4-bit significand are exact in fp32), then times the block's scale
  in fp32 into the accumulator: the block's dequantization applied to its partial sum, which is
  scale * sum(code * x) = sum((code * scale) * x) up to fp32 rounding.
- BM (16 or 32 rows, the padded M) is the dot's narrow side. The plain form (SWAP False: x [BM, 128] .
  codes.T) is mma.sync on sm_90; the swapped form (codes [BN, 128] . x.T, the weight's columns on the MMA's
  M side, BN >= 64) lets Triton take Hopper's wgmma with the converted codes as its register operand. The
  autotuner picks between them per (N, K, K_PER, BM, dtypes): BN 64 / 128 / 256, 4 or 8 warps, 3 or 4
  stages (BN 256 at 3 stages: 120 KB of the 227 KB of shared memory at 32 rows; 8 warps with BN >= 128 in
  the swapped form: two warpgroups of 64 rows), pruned by BM and N (_prune). Each program also reads its
  [BM, K_PER] slice of x (from L2: x is at most 32 * K * 2 bytes), (N / BN) times over in all: at 32 rows and
  BN 64 half the bytes of the codes, hence no BN 64 at 32 rows.
- One part (small K): the program adds the residual and stores out_dtype itself. Several: it stores its
  fp32 partial [parts, T, N]; a second kernel sums the parts in part order, adds the residual and rounds
  once: the same sums every call, so graph replays and reruns are exact (no atomics). The partials are
  8 * parts * T * N bytes written and read back, mostly in L2 (50 MB on an H200).
fp32 x (the tests' dtype): the dot in fp32 with input_precision "ieee" (no tf32). Under Triton's
interpreter every dot is fp32 (its bf16 dot is wrong, ops/common.py) and the output rounds with round_to.

Not served: the FP8 MoE experts (experts.py: their grouped GEMMs quantize x and the act; a W8A16 form needs
their A operands in the model dtype and the gate|up epilogue writing it unquantized).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .quant import BLOCK, INTERPRET, check_block_weight, dequantize_weight_blocks, round_to

W8A16_MAX_ROWS = 32  # decode rows: BM 16 or 32
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PARTS_BN = 128  # the column tile w8a16_parts counts programs with (the autotuned BN may differ)
PER_SM = 4  # programs per SM at PARTS_BN-wide tiles (linear.splitk_parts' default)


def w8a16_parts(N: int, K: int, device: torch.device, BN: int = PARTS_BN, per_sm: int = PER_SM) -> tuple[int, int]:
    """(parts, K_PER): K cut into parts of K_PER channels, a multiple of 128 (whole scale blocks), so that
    about per_sm programs per SM stream the weight in BN-wide column tiles; linear.splitk_parts' rule.
    Static: from the shapes and the device only (4 SMs off CUDA)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    KB = -(-K // BLOCK)
    want = max(1, -(-per_sm * sms // -(-N // BN)))
    per = -(-KB // min(KB, want))  # scale blocks per part
    return -(-KB // per), per * BLOCK


def _check(x, w_fp8, w_scale_inv, out_dtype, residual, max_rows=None, where="w8a16_linear"):
    check_block_weight(w_fp8, w_scale_inv, "w", where)
    if w_fp8.dim() != 2:
        raise ValueError(f"{where}: w must be [N, K], got shape {tuple(w_fp8.shape)}")
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: x must be a 2-D bfloat16 / float16 / float32 tensor [T, K], got "
                         f"{(x.dtype, tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__}")
    (T, K), N = x.shape, w_fp8.shape[0]
    if K != w_fp8.shape[1] or x.device != w_fp8.device:
        raise ValueError(f"{where}: x {tuple(x.shape)} on {x.device} does not fit w {tuple(w_fp8.shape)} on "
                         f"{w_fp8.device} (K and the device must agree)")
    if max_rows is not None and T > max_rows:
        raise ValueError(f"{where}: at most {max_rows} rows (decode), got {T}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if residual is not None and (not isinstance(residual, Tensor) or residual.dtype != out_dtype
                                 or tuple(residual.shape) != (T, N) or residual.device != x.device):
        raise ValueError(f"{where}: residual must be {out_dtype} of shape {(T, N)} on {x.device}, got "
                         f"{getattr(residual, 'dtype', type(residual))} {tuple(getattr(residual, 'shape', ()))}")
    return out_dtype


def w8a16_linear_ref(x: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype=None, residual=None) -> Tensor:
    """The spec: x.float() @ dequantize_weight_blocks(w).T in fp32 (+ residual in fp32), cast to out_dtype
    (default x's dtype). Plain torch, any device, any rows."""
    out_dtype = _check(x, w_fp8, w_scale_inv, out_dtype, residual)
    y = x.float() @ dequantize_weight_blocks(w_fp8, w_scale_inv).t()
    return (y if residual is None else y + residual.float()).to(out_dtype)


# (BN, SWAP, warps, stages)
SM90_TILES = ((64, False, 4, 4), (128, False, 4, 4), (128, False, 8, 3), (256, False, 8, 3),
              (64, True, 4, 4), (128, True, 4, 4), (128, True, 8, 3), (256, True, 8, 3))
INTERPRET_TILES = ((64, False, 4, 1),)


def _config(tile):
    BN, swap, warps, stages = tile
    return triton.Config({"BN": BN, "SWAP": swap}, num_warps=warps, num_stages=stages)


def _prune(configs, named_args, **kwargs):
    """Drop tiles much wider than N, BN 64 at 32 rows (each program re-reads its [BM, K_PER] slice of x from
    L2: at BN 64 and 32 rows that is half the bytes of its codes), and the swapped form's 8 warps below BN 128
    (each warpgroup takes 64 rows)."""
    N, BM = named_args["N"], kwargs["BM"]
    keep = [c for c in configs if c.kwargs["BN"] <= max(64, triton.next_power_of_2(N))
            and not (BM > 16 and c.kwargs["BN"] < 128)
            and not (c.kwargs["SWAP"] and c.num_warps == 8 and c.kwargs["BN"] < 128)]
    return keep or configs[:1]


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, ws_ptr, r_ptr, p_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_ws_n, stride_rm,
                  stride_pm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr,
                  IEEE: tl.constexpr, DIRECT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """Part program_id(1) of K ([k_lo, k_lo + K_PER), whole 128-blocks) for BN columns of all M <= BM rows:
    sum over its K steps g of (x[m] . codes[n]) * ws[n // 128, g] in fp32 (module docstring). x: [M, K]
    bf16 / fp16 / fp32 (unit inner stride), w: [N, K] fp8 codes, ws: [NB, KB] fp32 / bf16. DIRECT (one part):
    + r[m, n] with HAS_RESIDUAL, rounded to p's dtype, stored at p[m, n] (row stride stride_pm); else the fp32
    partial at p[part * M + m, n] (stride_pm = N). IEEE: the dot in fp32 (codes and x upcast exactly)."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    rows = tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    r_safe = (rows % M).to(tl.int64)  # rows and columns past the end wrap around; they are never stored
    c_safe = (cols % N).to(tl.int64)
    k_lo = part * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + r_safe[:, None] * stride_xm + (k_lo + k)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + c_safe[:, None] * stride_wn + (k_lo + k)[None, :]  # [BN, BK]: codes row-major, K inner
    ws_ptrs = ws_ptr + (c_safe // 128) * stride_ws_n
    dt = tl.float32 if IEEE else x_ptr.dtype.element_ty
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            mk = k < K - k0
            x = tl.load(x_ptrs, mask=mk[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mk[None, :], other=0.0)
        s = tl.load(ws_ptrs + k0 // 128).to(tl.float32)  # [BN]: the block scale of each column
        x = x.to(dt)
        w = w.to(dt)  # dequantized in registers: exact in bf16 / fp16 / fp32; the scale below, in fp32
        if SWAP:
            if IEEE:
                acc += tl.dot(w, tl.trans(x), input_precision="ieee") * s[:, None]
            else:
                acc += tl.dot(w, tl.trans(x)) * s[:, None]
        else:
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee") * s[None, :]
            else:
                acc += tl.dot(x, tl.trans(w)) * s[None, :]
        x_ptrs += BK
        w_ptrs += BK
    if SWAP:
        acc = tl.trans(acc)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)
    if DIRECT:
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + r64[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ot = p_ptr.dtype.element_ty
        tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], round_to(acc, ot).to(ot), mask=mask)
    else:
        tl.store(p_ptr + (part * M + r64)[:, None] * stride_pm + cols[None, :], acc, mask=mask)


_w8a16_tuned = triton.autotune(
    configs=[_config(t) for t in (INTERPRET_TILES if INTERPRET else SM90_TILES)], key=["N", "K", "K_PER", "BM"],
    prune_configs_by={"early_config_prune": _prune}, cache_results=True)(_w8a16_kernel)


@triton.jit
def _parts_sum_kernel(p_ptr, r_ptr, c_ptr, M, N, PARTS, stride_rm, stride_cm, HAS_RESIDUAL: tl.constexpr,
                      BLOCK_E: tl.constexpr):
    """c[m, n] = the sum of p[part, m, n] in part order (the same sum every call), + r[m, n] with
    HAS_RESIDUAL, rounded once to c's dtype (linear.py's _splitk_sum_kernel)."""
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


def _inner(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def w8a16_linear(x: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, out_dtype=None, residual=None,
                 tiles: tuple | None = None, per_sm: int = PER_SM) -> Tensor:
    """W8A16 (module docstring): x [T, K] bf16 / fp16 / fp32 with T <= W8A16_MAX_ROWS, w_fp8 [N, K]
    float8_e4m3fn, w_scale_inv [NB, KB] fp32 or bf16, residual [T, N] in out_dtype or None -> fresh [T, N]
    in out_dtype (default x's dtype). Mutates nothing. CUDA or the interpreter; elsewhere the reference.
    tiles (BN, SWAP, warps, stages) and per_sm: one fixed launch instead of the autotuned one (tests, the
    benchmark). Bad arguments raise ValueError naming them."""
    out_dtype = _check(x, w_fp8, w_scale_inv, out_dtype, residual, W8A16_MAX_ROWS)
    if tiles is not None and (len(tiles) != 4 or tiles[0] not in (16, 32, 64, 128, 256)):
        raise ValueError(f"w8a16_linear: tiles must be (BN in 16..256, a power of two; SWAP; warps; stages), got "
                         f"{tiles!r}")
    if not (x.is_cuda or INTERPRET):
        return w8a16_linear_ref(x, w_fp8, w_scale_inv, out_dtype, residual)
    (T, K), N = x.shape, w_fp8.shape[0]
    out = torch.empty((T, N), dtype=out_dtype, device=x.device)
    if T == 0 or N == 0 or K == 0:
        if T and N:
            out.zero_() if residual is None else out.copy_(residual)
        return out
    x, w_fp8, w_scale_inv = _inner(x), _inner(w_fp8), _inner(w_scale_inv)
    residual = None if residual is None else _inner(residual)
    parts, k_per = w8a16_parts(N, K, x.device, per_sm=per_sm)
    direct = parts == 1
    partial = out if direct else torch.empty((parts, T, N), dtype=torch.float32, device=x.device)
    args = (x, w_fp8, w_scale_inv, out if residual is None else residual, partial, T, N, K, k_per, x.stride(0),
            w_fp8.stride(0), w_scale_inv.stride(0), 0 if residual is None else residual.stride(0),
            out.stride(0) if direct else N)
    consts = dict(BM=16 if T <= 16 else 32, BK=BLOCK, IEEE=INTERPRET or x.dtype == torch.float32, DIRECT=direct,
                  HAS_RESIDUAL=residual is not None, EVEN_K=K % BLOCK == 0)
    if tiles is None:
        _w8a16_tuned[lambda meta: (triton.cdiv(N, meta["BN"]), parts)](*args, **consts)
    else:
        BN, swap, warps, stages = tiles
        _w8a16_kernel[(triton.cdiv(N, BN), parts)](*args, **consts, BN=BN, SWAP=swap, num_warps=warps,
                                                    num_stages=stages)
    if not direct:
        BLOCK_E = 1024
        _parts_sum_kernel[(triton.cdiv(T * N, BLOCK_E),)](
            partial, out if residual is None else residual, out, T, N, parts,
            0 if residual is None else residual.stride(0), out.stride(0), HAS_RESIDUAL=residual is not None,
            BLOCK_E=BLOCK_E)
    return out
