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
from .registry import OpSpec, Shapes, metrale_op, norm_weight, rand, register, weight

OP = "mlp"


@metrale_op("mlp")
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
    _check(h, norm_w, gate_w, up_w, down_w)
    return mlp_ref(h, norm_w, gate_w, up_w, down_w, eps, add_residual)


@mlp.register_fake
def _(h, norm_w, gate_w, up_w, down_w, eps, add_residual=True):
    _check(h, norm_w, gate_w, up_w, down_w)
    return h.new_empty(h.shape)  # contiguous whatever h's layout, as the CUDA path's and the reference's


def _check(h, norm_w, gate_w, up_w, down_w):
    check_tensor(h, OP, "h", ndim=2)
    D = h.shape[1]
    check(tuple(norm_w.shape) == (D,), OP, f"norm_w must have shape ({D},), got {tuple(norm_w.shape)}")
    I = gate_w.shape[0]
    for name, w, shape in (("gate_w", gate_w, (I, D)), ("up_w", up_w, (I, D)), ("down_w", down_w, (D, I))):
        check_tensor(w, OP, name, ndim=2, dtype=h.dtype, device=h.device)
        check(tuple(w.shape) == shape, OP, f"{name} has shape {tuple(w.shape)}, expected {shape} (hidden size {D})")


def mlp_ref(h, norm_w, gate_w, up_w, down_w, eps, add_residual=True):
    n = rms_norm(h, norm_w, eps)
    out = F.linear(F.silu(F.linear(n, gate_w)) * F.linear(n, up_w), down_w)
    return (h + out if add_residual else out).contiguous()  # h + out follows h's layout


@mlp.register_kernel("cuda")
def mlp_cuda(h, norm_w, gate_w, up_w, down_w, eps, add_residual=True):
    """Triton norm, one gate|up GEMM over the stacked weights, fused SiLU-mul, and the down GEMM with
    the residual add in its epilogue (addmm)."""
    _check(h, norm_w, gate_w, up_w, down_w)
    act = kernels.silu_mul(kernels.rms_norm(h, norm_w, eps) @ kernels.stacked(gate_w, up_w).t())
    return torch.addmm(h, act, down_w.t()) if add_residual else act @ down_w.t()


def example(s: Shapes, dtype, g):
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), weight(g, s.I, s.D, dtype=dtype),
            weight(g, s.I, s.D, dtype=dtype), weight(g, s.D, s.I, dtype=dtype), s.eps)


def cost(s: Shapes):
    return 2 * s.T * 3 * s.D * s.I, 2 * (3 * s.D * s.I + 2 * s.T * s.D)


register(OpSpec(mlp, mlp_ref, example, cost, cuda=mlp_cuda, onnx="metrale_graph.onnx.translations:mlp"))
