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
from .fp8 import projection as fp8
from .registry import OpSpec, Shapes, fp8_weight, metrale_cuda, metrale_fake, metrale_op, rand, register

def _check(a):
    check_tensor(a.o, "o", ndim=3)
    T, HV, V = a.o.shape
    dtype, device = a.o.dtype, a.o.device
    check_tensor(a.out_w, "out_w", ndim=2)
    fp8.check_weight(a.out_w, a.out_s, "out_w", dtype, device)
    D = a.out_w.shape[0]
    if a.residual is not None:
        check_tensor(a.residual, "residual", ndim=2, dtype=dtype, device=device)
        check(tuple(a.residual.shape) == (T, D), f"residual has shape {tuple(a.residual.shape)}, expected {(T, D)}")
    check_tensor(a.z, "z", ndim=2, dtype=dtype, device=device)
    check(tuple(a.z.shape) == (T, HV * V), f"z has shape {tuple(a.z.shape)}, expected {(T, HV * V)}")
    # the gated norm rounds to the activations' dtype before the weight (transformers' order): one dtype
    check_tensor(a.gnorm_w, "gnorm_w", dtype=dtype, device=device)
    check(tuple(a.gnorm_w.shape) == (V,), f"gnorm_w must have shape ({V},), got {tuple(a.gnorm_w.shape)}")
    check(tuple(a.out_w.shape) == (D, HV * V), f"out_w has shape {tuple(a.out_w.shape)}, expected {(D, HV * V)}")


@metrale_op(check=_check)
def gdn_out(o: Tensor, z: Tensor, residual: Optional[Tensor], gnorm_w: Tensor, out_w: Tensor, out_s: Tensor,
            eps: float) -> Tensor:
    """Phase 3 of a Gated DeltaNet layer.

    Args:
        o: [T, HV, V] recurrence output (model dtype).
        z: [T, HV*V] output gate (model dtype).
        residual: [T, D] the layer input, or None (a tensor-parallel rank other than 0: the all-reduce
            after this op adds rank 0's residual once).
        gnorm_w: [V] gated-RMSNorm weight (plain, not zero-centred).
        out_w: [D, HV*V] out projection; out_s: its FP8 block scales (fp32 [ceil(D/128), ceil(HV*V/128)]) where
            it is float8_e4m3fn, else an empty tensor (ops/fp8/projection.py).
        eps: RMSNorm epsilon.
    Returns:
        h [T, D] = residual + out_proj(gated_norm(o, z)), model dtype. Mutates nothing.
    """
    T, HV, V = o.shape
    n = gated_rms_norm(o, z.view(T, HV, V), gnorm_w, eps).reshape(T, HV * V)
    out = fp8.linear(n, out_w, out_s)
    return out if residual is None else (residual + out).contiguous()  # residual + out follows residual's layout


@metrale_fake(gdn_out)
def _(a):
    return a.o.new_empty(a.o.shape[0], a.out_w.shape[0])


def gated_rms_norm(o, z, weight, eps):
    """transformers' Qwen3_5RMSNormGated, op for op: norm in fp32, weight in the input dtype,
    gate in fp32."""
    dtype = o.dtype
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * of.to(dtype)
    return (out * F.silu(z.float())).to(dtype)


@metrale_cuda(gdn_out)
def gdn_out_cuda(a):
    """Triton gated norm; out projection with the residual add in the GEMM epilogue (FP8: W8A8)."""
    n = kernels.gated_rms_norm(a.o, a.z, a.gnorm_w, a.eps)
    return fp8.project_one(n, a.out_w, a.out_s, a.residual)


def example(s: Shapes, dtype, g):
    T, Z = s.T, s.HV * s.V
    return (rand(g, T, s.HV, s.V, dtype=dtype), rand(g, T, Z, dtype=dtype), rand(g, T, s.D, dtype=dtype),
            1 + rand(g, s.V, dtype=dtype, scale=0.2), *fp8_weight(s, g, dtype, s.D, Z), s.eps)


def cost(s: Shapes):
    Z = s.HV * s.V
    return 2 * s.T * Z * s.D, (1 if s.fp8 else 2) * Z * s.D + 2 * s.T * (2 * Z + 2 * s.D)


register(OpSpec(gdn_out, example, cost, cuda=gdn_out_cuda, kernels=("gated_rms",),
                onnx="metrale_graph.onnx.translations:gdn_out"))
