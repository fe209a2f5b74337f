"""The feed-forward half of a layer with a dense MLP: post-attention RMSNorm, gate / up
projections, SiLU-and-multiply, down projection, residual add:

    out = h + down(silu(gate(n)) * up(n)),   n = rms_norm(h)

Token-local: no stream metadata. (MoE layers run metrale::moe here instead.)
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels
from .common import check, check_tensor, rms_norm
from .registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, norm_weight, rand, register, weight

def _check(a):
    check_tensor(a.h, "h", ndim=2)
    D = a.h.shape[1]
    check(tuple(a.norm_w.shape) == (D,), f"norm_w must have shape ({D},), got {tuple(a.norm_w.shape)}")
    I = a.gate_w.shape[0]
    for name, w, shape in (("gate_w", a.gate_w, (I, D)), ("up_w", a.up_w, (I, D)), ("down_w", a.down_w, (D, I))):
        check_tensor(w, name, ndim=2, dtype=a.h.dtype, device=a.h.device)
        check(tuple(w.shape) == shape, f"{name} has shape {tuple(w.shape)}, expected {shape} (hidden size {D})")


@metrale_op(check=_check)
def mlp(h: Tensor, norm_w: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, eps: float,
        add_residual: bool = True) -> Tensor:
    """Dense MLP block with its norm and residual.

    Args:
        h: [T, D] the residual stream after the mixer (model dtype).
        norm_w: [D] zero-centred post-attention RMSNorm weight.
        gate_w, up_w: [I, D]; down_w: [D, I].
        eps: RMSNorm epsilon.
        add_residual: False on tensor-parallel ranks other than 0 (the all-reduce after this op adds
            rank 0's residual once).
    Returns:
        [T, D] the layer output (h + ..., or only the MLP's output), h's dtype. Mutates nothing.
    """
    n = rms_norm(h, norm_w, eps)
    out = F.linear(F.silu(F.linear(n, gate_w)) * F.linear(n, up_w), down_w)
    return (h + out if add_residual else out).contiguous()  # h + out follows h's layout


@metrale_fake(mlp)
def _(a):
    return a.h.new_empty(a.h.shape)  # contiguous whatever h's layout, as the CUDA path's and the reference's


@metrale_cuda(mlp)
def mlp_cuda(a):
    """Triton norm, one gate|up GEMM over the stacked weights, fused SiLU-mul, and the down GEMM with
    the residual add in its epilogue (addmm)."""
    act = kernels.silu_mul(kernels.rms_norm(a.h, a.norm_w, a.eps) @ kernels.stacked(a.gate_w, a.up_w).t())
    return torch.addmm(a.h, act, a.down_w.t()) if a.add_residual else act @ a.down_w.t()


def example(s: Shapes, dtype, g):
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), weight(g, s.I, s.D, dtype=dtype),
            weight(g, s.I, s.D, dtype=dtype), weight(g, s.D, s.I, dtype=dtype), s.eps)


def cost(s: Shapes):
    return 2 * s.T * 3 * s.D * s.I, 2 * (3 * s.D * s.I + 2 * s.T * s.D)


register(OpSpec(mlp, example, cost, cuda=mlp_cuda, onnx="metrale_graph.onnx.translations:mlp"))
