"""The feed-forward half of a layer with a dense MLP: post-attention RMSNorm, gate / up
projections, SiLU-and-multiply, down projection, residual add:

    out = h + down(silu(gate(n)) * up(n)),   n = rms_norm(h)

Token-local: no stream metadata. (MoE layers run metrale::moe here instead.)
"""

import torch.nn.functional as F
from torch import Tensor

from . import gemv, kernels
from .common import check, check_tensor, rms_norm
from .fp8 import projection as fp8
from .registry import OpSpec, Shapes, fp8_weight, metrale_cuda, metrale_fake, metrale_op, norm_weight, rand, register

def _check(a):
    check_tensor(a.h, "h", ndim=2)
    D = a.h.shape[1]
    check_tensor(a.norm_w, "norm_w", device=a.h.device)
    check(tuple(a.norm_w.shape) == (D,), f"norm_w must have shape ({D},), got {tuple(a.norm_w.shape)}")
    I = a.gate_w.shape[0]
    for name, w, sc, shape in (("gate_w", a.gate_w, a.gate_s, (I, D)), ("up_w", a.up_w, a.up_s, (I, D)),
                               ("down_w", a.down_w, a.down_s, (D, I))):
        check_tensor(w, name, ndim=2)
        check(tuple(w.shape) == shape, f"{name} has shape {tuple(w.shape)}, expected {shape} (hidden size {D})")
        fp8.check_weight(w, sc, name, a.h.dtype, a.h.device)


@metrale_op(check=_check)
def mlp(h: Tensor, norm_w: Tensor, gate_w: Tensor, gate_s: Tensor, up_w: Tensor, up_s: Tensor, down_w: Tensor,
        down_s: Tensor, eps: float, add_residual: bool = True) -> Tensor:
    """Dense MLP block with its norm and residual.

    Args:
        h: [T, D] the residual stream after the mixer (model dtype).
        norm_w: [D] zero-centred post-attention RMSNorm weight.
        gate_w, up_w: [I, D]; down_w: [D, I].
        gate_s, up_s, down_s: each weight's FP8 block scales where it is float8_e4m3fn, else an empty
            tensor (ops/fp8/projection.py).
        eps: RMSNorm epsilon.
        add_residual: False on tensor-parallel ranks other than 0 (the all-reduce after this op adds
            rank 0's residual once).
    Returns:
        [T, D] the layer output (h + ..., or only the MLP's output), h's dtype. Mutates nothing.
    """
    n = rms_norm(h, norm_w, eps)
    out = fp8.linear(F.silu(fp8.linear(n, gate_w, gate_s)) * fp8.linear(n, up_w, up_s), down_w, down_s)
    return (h + out if add_residual else out).contiguous()  # h + out follows h's layout


@metrale_fake(mlp)
def _(a):
    return a.h.new_empty(a.h.shape)  # contiguous whatever h's layout, as the CUDA path's and the reference's


@metrale_cuda(mlp)
def mlp_cuda(a):
    """Triton norm, one gate|up GEMM over the stacked weights, fused SiLU-mul, and the down GEMM with
    the residual add in its epilogue (addmm; FP8: in the W8A8 GEMM's)."""
    n = kernels.rms_norm(a.h, a.norm_w, a.eps)
    if not any(fp8.is_fp8(w) for w in (a.gate_w, a.up_w, a.down_w)):
        act = kernels.silu_mul(gemv.linear(n, kernels.stacked(a.gate_w, a.up_w)))
        return gemv.linear(act, a.down_w, a.h if a.add_residual else None)
    gate, up = fp8.project(n, [(a.gate_w, a.gate_s), (a.up_w, a.up_s)])
    act = kernels.silu_mul(kernels.side_by_side(gate, up))  # a view where gate | up ran as one GEMM
    h = a.h if a.h.stride(-1) == 1 else a.h.contiguous()
    return fp8.project_one(act, a.down_w, a.down_s, h if a.add_residual else None)


def example(s: Shapes, dtype, g):
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), *fp8_weight(s, g, dtype, s.I, s.D),
            *fp8_weight(s, g, dtype, s.I, s.D), *fp8_weight(s, g, dtype, s.D, s.I), s.eps)


def cost(s: Shapes):
    return 2 * s.T * 3 * s.D * s.I, (1 if s.fp8 else 2) * 3 * s.D * s.I + 2 * 2 * s.T * s.D


register(OpSpec(mlp, example, cost, cuda=mlp_cuda, onnx="metrale_graph.onnx.translations:mlp"))
