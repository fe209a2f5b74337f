"""The phase ops' projections with FP8 weights: a weight's block scales are an argument of its op beside
it (`<name>_s`; an empty tensor when the weight is not FP8, so each op has one schema), checked here; the
CPU references compute an FP8 projection as `linear`, the CUDA paths a layer's projections that read one
input as `project`.

    linear(x [T, K], w [N, K], s) -> [T, N] in x's dtype
        float w (s empty): F.linear(x, w), the bf16 references' own;
        FP8 w (s [NB, KB] fp32): fake_quantize_activations(x) @ dequantize(w, s).T in fp32, rounded once to
        x's dtype (the tensor cores accumulate in fp32 and apply the scales there); with activation
        rounding off (quant.activation_rounding, a debug option) x itself.

`project` runs a list of (w, s) members as few GEMMs as their memory allows: consecutive members that
sit back to back in one buffer (the rank's plan stacks them: sharding.Shards.stacks) and are all FP8 with
their scale grids back to back too, or all floating point, are one GEMM; the others one each. It never
copies a weight.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import check
from .. import gemv
from ..kernels import rows_back_to_back, rows_view
from .linear import block_fp8_linear
from .quant import (BLOCK, FP8_DTYPE, activations_rounded, dequantize_weight_blocks, fake_quantize_activations,
                    num_blocks)


def is_fp8(w: Tensor) -> bool:
    return w.dtype == FP8_DTYPE


def check_weight(w: Tensor, s: Tensor, name: str, dtype: torch.dtype, device, shape=None) -> None:
    """An op's weight `name` [.., N, K] in `dtype` with an empty `name`_s, or float8_e4m3fn with its scales
    `name`_s fp32 [.., ceil(N / 128), ceil(K / 128)] (stacked experts: `parts` grids, see check_experts_weight);
    both on `device`. Metadata only; OpInputError naming them."""
    check(isinstance(w, Tensor) and isinstance(s, Tensor), f"{name} and {name}_s must be tensors")
    check(w.dtype in (dtype, FP8_DTYPE), f"{name} must be {dtype} or torch.float8_e4m3fn, got {w.dtype}")
    check(w.device == device and s.device == device, f"{name} / {name}_s are on {w.device} / {s.device}, "
                                                     f"expected {device}")
    if shape is not None:
        check(tuple(w.shape) == tuple(shape), f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    if not is_fp8(w):
        check(s.numel() == 0, f"{name}_s must be empty for a {w.dtype} {name} (scales go with float8 weights), "
                              f"got shape {tuple(s.shape)}")
        return
    expected = (*w.shape[:-2], num_blocks(w.shape[-2]), num_blocks(w.shape[-1]))
    check(s.dtype == torch.float32, f"{name}_s must be torch.float32, got {s.dtype}")
    check(tuple(s.shape) == expected, f"{name}_s has shape {tuple(s.shape)}, expected {expected} (one scale per "
                                      f"128 x 128 block of {name} {tuple(w.shape)})")


def check_experts_weight(w: Tensor, s: Tensor, name: str, dtype, device, shape, parts: int) -> None:
    """check_weight for stacked experts [EL, rows, K] whose rows are `parts` equal parts (gate, up), each
    with its own grid: s [EL, parts * ceil(rows / parts / 128), ceil(K / 128)]."""
    check(isinstance(w, Tensor) and isinstance(s, Tensor), f"{name} and {name}_s must be tensors")
    check(w.dtype in (dtype, FP8_DTYPE), f"{name} must be {dtype} or torch.float8_e4m3fn, got {w.dtype}")
    check(w.device == device and s.device == device, f"{name} / {name}_s are on {w.device} / {s.device}, "
                                                     f"expected {device}")
    check(tuple(w.shape) == tuple(shape), f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}")
    if not is_fp8(w):
        check(s.numel() == 0, f"{name}_s must be empty for a {w.dtype} {name}, got shape {tuple(s.shape)}")
        return
    EL, rows, K = shape
    expected = (EL, parts * num_blocks(rows // parts), num_blocks(K))
    check(s.dtype == torch.float32, f"{name}_s must be torch.float32, got {s.dtype}")
    check(tuple(s.shape) == expected, f"{name}_s has shape {tuple(s.shape)}, expected {expected}")


def dequantized(w: Tensor, s: Tensor, dtype: torch.dtype = torch.float32, parts: int = 1) -> Tensor:
    """An FP8 weight (parts grids along its rows, as stacked gate|up experts) in `dtype`; a float weight as it is."""
    if not is_fp8(w):
        return w
    if parts == 1:
        return dequantize_weight_blocks(w, s, dtype)
    return torch.cat([dequantize_weight_blocks(wp, sp, dtype) for wp, sp in
                      zip(w.chunk(parts, dim=-2), s.chunk(parts, dim=-2))], dim=-2)


def linear(x: Tensor, w: Tensor, s: Tensor) -> Tensor:
    """The CPU references' projection (module docstring): x [.., K] -> [.., N] in x's dtype."""
    if not is_fp8(w):
        return F.linear(x, w)
    return linear_fp32(x, w, s).to(x.dtype)


def linear_fp32(x: Tensor, w: Tensor, s: Tensor, parts: int = 1) -> Tensor:
    """An FP8 projection in fp32, before its one rounding: fake-quantized x (or x, rounding off) times the
    dequantized weight."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq = fake_quantize_activations(x2) if activations_rounded() and x2.shape[0] else x2.float()
    return (xq @ dequantized(w, s, torch.float32, parts).t()).reshape(*lead, w.shape[-2])


def _runs(members: list[tuple[Tensor, Tensor]]) -> list[list[int]]:
    """Member indices grouped into GEMMs (module docstring)."""
    runs: list[list[int]] = []
    for i, (w, s) in enumerate(members):
        if runs:
            last = runs[-1]
            pw, ps = members[last[-1]]
            same = is_fp8(pw) == is_fp8(w) and (not is_fp8(w) or pw.shape[0] % BLOCK == 0)
            ws = [members[j][0] for j in last] + [w]
            scales = [members[j][1] for j in last] + [s]
            if same and rows_back_to_back(ws) and (not is_fp8(w) or rows_back_to_back(scales)):
                last.append(i)
                continue
        runs.append([i])
    return runs


def project(x: Tensor, members: list[tuple[Tensor, Tensor]], out_dtype=None) -> list[Tensor]:
    """The CUDA paths' projections of x [T, K] (contiguous) by each member (w [N_i, K], s): per member its
    output [T, N_i] in out_dtype (default x's), a column slice of its run's GEMM output (module docstring).
    FP8 runs through block_fp8_linear (W8A8; under activation_rounding(False), the weight-only debug mode, x @
    the dequantized weight), float runs through x @ w.T."""
    out_dtype = out_dtype or x.dtype
    outs: list[Tensor] = [None] * len(members)
    for run in _runs(members):
        ws, ss = [members[i][0] for i in run], [members[i][1] for i in run]
        w = ws[0] if len(ws) == 1 else rows_view(ws)
        if is_fp8(w):
            s = ss[0] if len(ss) == 1 else rows_view(ss)
            y = (block_fp8_linear(x, w, s, out_dtype) if activations_rounded()
                 else x @ dequantize_weight_blocks(w, s, x.dtype).t())
        else:
            y = x @ w.t()
        col = 0
        for i, wi in zip(run, ws):
            outs[i] = y[:, col:col + wi.shape[0]]
            col += wi.shape[0]
    return outs


def project_one(x: Tensor, w: Tensor, s: Tensor, residual: Tensor | None = None) -> Tensor:
    """One projection on the CUDA path, x [T, K] -> fresh [T, N] (+ residual [T, N], added in the FP8 GEMM's
    epilogue or by addmm), in x's dtype."""
    if not is_fp8(w):  # (cuBLAS, or at decode rows the GEMV METRALE_DECODE_GEMV chooses: ops/gemv.py)
        return gemv.linear(x, w, residual)
    if activations_rounded():
        return block_fp8_linear(x, w, s, x.dtype, residual)
    wd = dequantize_weight_blocks(w, s, x.dtype)
    return x @ wd.t() if residual is None else torch.addmm(residual, x, wd.t())
