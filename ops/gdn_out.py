"""GDN phase 3, the mixer's output: gated RMSNorm per value head (`rmsnorm(o) * w * silu(z)`,
plain `w`), out projection, residual add. (The layer's feed-forward half follows as its own op,
metrale::mlp or metrale::moe.)

Token-local: nothing here needs stream metadata.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels
from .common import check, check_tensor
from .registry import OpSpec, Shapes, metrale_op, rand, register, weight

OP = "gdn_out"


@metrale_op("gdn_out")
def gdn_out(o: Tensor, z: Tensor, residual: Optional[Tensor], gnorm_w: Tensor, out_w: Tensor, eps: float) -> Tensor:
    """Phase 3 of a Gated DeltaNet layer.

    Args:
        o: [T, HV, V] recurrence output (model dtype).
        z: [T, HV*V] output gate (model dtype).
        residual: [T, D] the layer input, or None (a tensor-parallel rank other than 0: the all-reduce
            after this op adds rank 0's residual once).
        gnorm_w: [V] gated-RMSNorm weight (plain, not zero-centred).
        out_w: [D, HV*V] out projection.
        eps: RMSNorm epsilon.
    Returns:
        h [T, D] = residual + out_proj(gated_norm(o, z)), model dtype. Mutates nothing.
    """
    _check(o, z, residual, gnorm_w, out_w)
    return gdn_out_ref(o, z, residual, gnorm_w, out_w, eps)


@gdn_out.register_fake
def _(o, z, residual, gnorm_w, out_w, eps):
    _check(o, z, residual, gnorm_w, out_w)
    return o.new_empty(o.shape[0], out_w.shape[0])


def _check(o, z, residual, gnorm_w, out_w):
    check_tensor(o, OP, "o", ndim=3)
    T, HV, V = o.shape
    check_tensor(out_w, OP, "out_w", ndim=2, dtype=o.dtype, device=o.device)
    D = out_w.shape[0]
    if residual is not None:
        check_tensor(residual, OP, "residual", ndim=2, dtype=o.dtype, device=o.device)
        check(tuple(residual.shape) == (T, D), OP, f"residual has shape {tuple(residual.shape)}, expected {(T, D)}")
    check_tensor(z, OP, "z", ndim=2, dtype=o.dtype, device=o.device)
    check(tuple(z.shape) == (T, HV * V), OP, f"z has shape {tuple(z.shape)}, expected {(T, HV * V)}")
    # the gated norm rounds to the activations' dtype before the weight (transformers' order): one dtype
    check_tensor(gnorm_w, OP, "gnorm_w", dtype=o.dtype, device=o.device)
    check(tuple(gnorm_w.shape) == (V,), OP, f"gnorm_w must have shape ({V},), got {tuple(gnorm_w.shape)}")
    check(tuple(out_w.shape) == (D, HV * V), OP, f"out_w has shape {tuple(out_w.shape)}, expected {(D, HV * V)}")


def gated_rms_norm(o, z, weight, eps):
    """transformers' Qwen3_5RMSNormGated, op for op: norm in fp32, weight in the input dtype,
    gate in fp32."""
    dtype = o.dtype
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * of.to(dtype)
    return (out * F.silu(z.float())).to(dtype)


def gdn_out_ref(o, z, residual, gnorm_w, out_w, eps):
    T, HV, V = o.shape
    n = gated_rms_norm(o, z.view(T, HV, V), gnorm_w, eps).reshape(T, HV * V)
    out = F.linear(n, out_w)
    return out if residual is None else (residual + out).contiguous()  # residual + out follows residual's layout


@gdn_out.register_kernel("cuda")
def gdn_out_cuda(o, z, residual, gnorm_w, out_w, eps):
    """Triton gated norm; out projection with the residual add in the GEMM epilogue."""
    _check(o, z, residual, gnorm_w, out_w)
    n = kernels.gated_rms_norm(o, z, gnorm_w, eps)
    return n @ out_w.t() if residual is None else torch.addmm(residual, n, out_w.t())


def example(s: Shapes, dtype, g):
    T, Z = s.T, s.HV * s.V
    return (rand(g, T, s.HV, s.V, dtype=dtype), rand(g, T, Z, dtype=dtype), rand(g, T, s.D, dtype=dtype),
            1 + rand(g, s.V, dtype=dtype, scale=0.2), weight(g, s.D, Z, dtype=dtype), s.eps)


def cost(s: Shapes):
    Z = s.HV * s.V
    return 2 * s.T * Z * s.D, 2 * (Z * s.D + s.T * (2 * Z + 2 * s.D))


register(OpSpec(gdn_out, gdn_out_ref, example, cost, cuda=gdn_out_cuda, kernels=("gated_rms",),
                onnx="metrale_graph.onnx.translations:gdn_out"))
