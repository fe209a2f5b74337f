"""FP8 (e4m3) quantization in Qwen's / DeepSeek's fine-grained format: weights in 128 x 128 blocks,
activations per token per 128 channels ("dynamic": quantized on the fly).

Shape letters (as in ops/common.py, plus): N output features, K input features, T tokens,
NB = ceil(N / 128) and KB = ceil(K / 128) blocks; the last block of a ragged dim is partial.

Weights: w ~= w_fp8 * scale_inv per 128 x 128 block. quantize_weight_blocks follows transformers'
`Fp8Quantize` (the FineGrainedFP8 integration's quantizer): scale = 448 / amax in fp32, w_fp8 =
clamp(w * scale, -448, 448) rounded to nearest even, scale_inv = 1 / scale; a block of zeros gets
scale = scale_inv = 1 (its codes are 0 whatever the scale). Ragged last blocks take their amax over
the elements they hold (transformers' quantizer leaves such tensors in bf16; we extend it). An amax
below AMAX_FLOOR (448 x float32's smallest normal number, 5.3e-36) counts as AMAX_FLOOR, so scale_inv is
normal and scale finite (where transformers' rule gives scale_inv 0 and NaN codes); NaN or infinite
weights are a ValueError.

Activations: per token and group of 128 channels, as vLLM's / SGLang's per_token_group_quant_fp8:
scale = max(amax, 1e-10) / 448, x_fp8 = clamp(x / scale, -448, 448) rounded to nearest even; both
divisions IEEE (fp32: div_rn in the kernel, tensor divisors in the reference on every device). A group
of zeros gets scale 1e-10 / 448 and codes 0. The Triton kernel and the torch reference agree bit for
bit (codes and scales).
"""


import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from metrale_graph import envs

from ..common import INTERPRET

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # the format's block edge (weights) and group size (activations)
ACT_EPS = 1e-10  # floor of an activation group's amax (vLLM's eps)
# floor of a nonzero weight block's amax: its scale_inv then stays a normal fp32 number and its scale finite (below
# it 448 / amax overflows: transformers' rule gives such a block scale_inv 0 and NaN codes where it holds zeros)
AMAX_FLOOR = FP8_MAX * torch.finfo(torch.float32).tiny
SCALE_DTYPES = (torch.float32, torch.bfloat16)  # weight_scale_inv as checkpoints store it
# Triton 3.6's interpreter rounds fp32 -> fp8 casts half-up without carrying into the exponent, and
# truncates fp32 -> bf16; there the kernels round on the bits first (_round_e4m3, round_to), so the
# casts that follow are exact and the CPU suite sees the GPU's numerics.
_ROUND_BITS = tl.constexpr(INTERPRET)


# Debug option: FP8 projections compute with unrounded activations (weight-only FP8: x @ dequantized(w).T),
# set by activation_rounding(False) or METRALE_FP8_ACTIVATIONS=off (metrale_graph.envs, read at import). Read at
# call time by the phase ops (ops/fp8/projection.py, ops/moe), never traced.
_ROUNDING = {"activations": envs.METRALE_FP8_ACTIVATIONS}


def activations_rounded() -> bool:
    """Whether the phase ops round activations to FP8 before an FP8 GEMM (W8A8, the default)."""
    return _ROUNDING["activations"]


@contextlib.contextmanager
def activation_rounding(enabled: bool):
    """Within the block, the phase ops' FP8 projections round activations (W8A8, True: the default) or not
    (False: weight-only, x @ dequantized(w).T; a debug option that isolates the weights' quantization from
    the activations'; on CUDA it dequantizes every weight per call, slowly). Not thread-local."""
    if not isinstance(enabled, bool):
        raise ValueError(f"activation_rounding takes True or False, got {enabled!r}")
    before = _ROUNDING["activations"]
    _ROUNDING["activations"] = enabled
    try:
        yield
    finally:
        _ROUNDING["activations"] = before


def num_blocks(n: int) -> int:
    """Blocks of 128 covering n (ceil)."""
    return -(-n // BLOCK)


def check_block_weight(w: Tensor, scale_inv: Tensor, name: str = "w", where: str = "fp8") -> None:
    """A block-quantized weight [..., N, K] float8_e4m3fn and its scale_inv [..., NB, KB] (fp32 or bf16,
    same device). Metadata only. Raises ValueError naming `name` / `name`_scale_inv."""
    if not isinstance(w, Tensor) or w.dtype != FP8_DTYPE:
        raise ValueError(f"{where}: {name} must be a float8_e4m3fn tensor, got "
                         f"{w.dtype if isinstance(w, Tensor) else type(w).__name__}")
    if w.dim() < 2:
        raise ValueError(f"{where}: {name} must be [..., N, K], got shape {tuple(w.shape)}")
    if not isinstance(scale_inv, Tensor) or scale_inv.dtype not in SCALE_DTYPES:
        raise ValueError(f"{where}: {name}_scale_inv must be float32 or bfloat16, got "
                         f"{scale_inv.dtype if isinstance(scale_inv, Tensor) else type(scale_inv).__name__}")
    N, K = w.shape[-2:]
    expected = (*w.shape[:-2], num_blocks(N), num_blocks(K))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{where}: {name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} "
                         f"(ceil({N}/128), ceil({K}/128)) for {name} of shape {tuple(w.shape)}")
    if scale_inv.device != w.device:
        raise ValueError(f"{where}: {name}_scale_inv is on {scale_inv.device}, {name} on {w.device}")


def _blocks_view(x: Tensor) -> tuple[Tensor, int, int]:
    """x [..., N, K] zero-padded to whole blocks, viewed [..., NB, 128, KB, 128]."""
    N, K = x.shape[-2:]
    NB, KB = num_blocks(N), num_blocks(K)
    if (NB * BLOCK, KB * BLOCK) != (N, K):
        x = torch.nn.functional.pad(x, (0, KB * BLOCK - K, 0, NB * BLOCK - N))
    return x.reshape(*x.shape[:-2], NB, BLOCK, KB, BLOCK), N, K


def _expand_blocks(s: Tensor, N: int, K: int) -> Tensor:
    """Per-block values [..., NB, KB] -> per element [..., N, K]."""
    return s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :N, :K]


def quantize_weight_blocks(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., N, K] (any float dtype) -> (w_fp8 [..., N, K] float8_e4m3fn, scale_inv [..., NB, KB] fp32),
    transformers' Fp8Quantize per block (see the module docstring), ragged blocks included."""
    if not isinstance(w, Tensor) or not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"quantize_weight_blocks: w must be a floating tensor [..., N, K], got "
                         f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
    blocks, N, K = _blocks_view(w.float())
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., NB, KB]
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quantize_weight_blocks: w holds NaN or infinite values, which no block scale represents")
    nonzero = amax > 0
    scale = torch.where(nonzero, FP8_MAX / torch.where(nonzero, amax.clamp_min(AMAX_FLOOR), 1.0), 1.0)
    q = (blocks * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*q.shape[:-4], q.shape[-4] * BLOCK, q.shape[-2] * BLOCK)[..., :N, :K].contiguous()
    return q, (1.0 / scale).float()


def dequantize_weight_blocks(w_fp8: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_fp8 [..., N, K] * scale_inv [..., NB, KB] per block, computed in fp32, cast to dtype."""
    check_block_weight(w_fp8, scale_inv, "w", "dequantize_weight_blocks")
    N, K = w_fp8.shape[-2:]
    return (w_fp8.float() * _expand_blocks(scale_inv.float(), N, K)).to(dtype)


# Activations ------------------------------------------------------------------------------------
def _check_activations(x: Tensor, where: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: x must be a 2-D float32 / bfloat16 / float16 tensor [T, K], got "
                         f"{(x.dtype, tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__}")


def quantize_activations_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """Plain torch: x [T, K] -> (x_fp8 [T, K] float8_e4m3fn, scale [T, KB] fp32), per token per 128
    channels (module docstring). The spec the Triton kernel matches bit for bit."""
    _check_activations(x, "quantize_activations")
    T, K = x.shape
    KB = num_blocks(K)
    xf = torch.nn.functional.pad(x.float(), (0, KB * BLOCK - K)).reshape(T, KB, BLOCK)
    amax = xf.abs().amax(dim=-1).clamp_min(ACT_EPS)
    # a tensor divisor, not the Python number: CUDA's torch divides by a CPU scalar as a multiplication
    # by its reciprocal (one rounding more), which moved scales by an ulp against the kernel's div_rn
    scale = amax / amax.new_full((), FP8_MAX)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(T, KB * BLOCK)[:, :K].contiguous(), scale


def dequantize_activations(x_fp8: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """x_fp8 [T, K] * scale [T, KB] per group, in fp32, cast to dtype."""
    T, K = x_fp8.shape
    return (x_fp8.float() * scale.float().repeat_interleave(BLOCK, dim=-1)[:, :K]).to(dtype)


def fake_quantize_activations(x: Tensor) -> Tensor:
    """x [T, K] -> the fp32 values W8A8 computes with: dequantize(quantize(x)). What the CPU reference
    of every FP8 projection (and its ONNX translation) feeds the dequantized weights."""
    return dequantize_activations(*quantize_activations_ref(x))


@triton.jit
def _round_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value (ties to even), kept in fp32, so that the
    cast to fp8 that follows is exact. Normals: 3 mantissa bits; below 2^-6, multiples of 2^-9 (the
    subnormals), rounded by the fp32 addition of 2^14 whose ulp is 2^-9. The sign is copied on the bits
    (-0 stays -0)."""
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    r = tl.where(a < 0.015625, (a + 16384.0) - 16384.0, normal)
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_e4m3(x, amax):
    """Codes of x [R, C] (fp32) for the per-row amax [R] (fp32, over the row's group): returns
    (codes [R, C] float8e4nv, scale [R] fp32) with quantize_activations_ref's arithmetic."""
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if _ROUND_BITS:
        y = _round_e4m3(y)
    return y.to(tl.float8e4nv), scale


@triton.jit
def round_to(x, dt: tl.constexpr):
    """x (fp32) rounded to dt (ties to even), kept in fp32; in the interpreter on the bits (see _ROUND_BITS)."""
    if _ROUND_BITS and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dt).to(tl.float32)


@triton.jit
def _quantize_activations_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_st, stride_sg, BT: tl.constexpr):
    """One program per BT rows x one group of 128 channels."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    m = (rows < T)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    q, scale = quantize_e4m3(x, tl.max(tl.abs(x), axis=1))
    tl.store(q_ptr + r64[:, None] * K + cols[None, :], q, mask=m)
    tl.store(s_ptr + r64 * stride_st + g * stride_sg, scale, mask=rows < T)


def quantize_activations_triton(x: Tensor, column_major_scales: bool = False,
                                rows: int | None = None) -> tuple[Tensor, Tensor]:
    """quantize_activations_ref in one Triton launch. x [T, K] with unit inner stride (any row stride).
    Returns fresh (x_fp8 [R, K] contiguous, scale [R, KB] fp32), R = rows (default T, at least T): rows
    past T hold zero codes and zero scales (the padding cuBLAS' blockwise GEMM needs, M a multiple of 16).
    With column_major_scales the scale is stored KB-major (strides (1, R)), the layout cuBLAS' 1x128
    blockwise scaling reads."""
    _check_activations(x, "quantize_activations")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, K = x.shape
    R = T if rows is None else rows
    if R < T:
        raise ValueError(f"quantize_activations: rows ({R}) must be at least x's {T} rows")
    KB = num_blocks(K)
    q = torch.empty((R, K), dtype=FP8_DTYPE, device=x.device)
    scale = (torch.empty((KB, R), dtype=torch.float32, device=x.device).t() if column_major_scales
             else torch.empty((R, KB), dtype=torch.float32, device=x.device))
    if R > T:
        q[T:].view(torch.uint8).zero_()
        scale[T:].zero_()
    if T and K:
        BT = 16 if INTERPRET else 32
        _quantize_activations_kernel[(triton.cdiv(T, BT), KB)](x, q, scale, T, K, x.stride(0), scale.stride(0),
                                                               scale.stride(1), BT=BT, num_warps=4)
    return q, scale


def quantize_activations(x: Tensor, column_major_scales: bool = False,
                         rows: int | None = None) -> tuple[Tensor, Tensor]:
    """x [T, K] -> (x_fp8 [R, K], scale [R, KB] fp32), R = rows (default T; rows past T zero, see
    quantize_activations_triton): the Triton kernel on CUDA (and under the interpreter), the torch
    reference otherwise. Same values either way."""
    if x.is_cuda or INTERPRET:
        return quantize_activations_triton(x, column_major_scales, rows)
    q, s = quantize_activations_ref(x)
    if rows is not None and rows > x.shape[0]:
        q = torch.cat([q, q.new_zeros(rows - x.shape[0], q.shape[1])])
        s = torch.cat([s, s.new_zeros(rows - x.shape[0], s.shape[1])])
    return q, (s.t().contiguous().t() if column_major_scales else s)
