"""GDN phase 3: gated RMSNorm per value head (`rmsnorm(o) * w * silu(z)`, plain `w`),
out projection, residual add, post-attention RMSNorm, MLP, residual add.

One op for the whole tail of the layer: everything after the recurrence is token-local,
so nothing here needs stream metadata.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels
from .common import check, check_mlp, check_tensor, mlp_residual

OP = "gdn_out"


@torch.library.custom_op("metrale::gdn_out", mutates_args=(), device_types="cpu")
def gdn_out(o: Tensor, z: Tensor, residual: Tensor, gnorm_w: Tensor, out_w: Tensor, post_norm_w: Tensor,
            gate_w: Tensor, up_w: Tensor, down_w: Tensor, eps: float) -> Tensor:
    """Phase 3 of a Gated DeltaNet layer.

    Args:
        o: [T, HV, V] recurrence output (model dtype).
        z: [T, HV*V] output gate (model dtype).
        residual: [T, D] the layer input.
        gnorm_w: [V] gated-RMSNorm weight (plain, not zero-centred).
        out_w: [D, HV*V]; post_norm_w: [D] (zero-centred);
        gate_w, up_w: [I, D]; down_w: [D, I].
        eps: RMSNorm epsilon.
    Returns:
        [T, D] the layer output, model dtype. Mutates nothing.
    """
    _check(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w)
    return gdn_out_ref(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w, eps)


@gdn_out.register_fake
def _(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w, eps):
    _check(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w)
    return torch.empty_like(residual)


def _check(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w):
    check_tensor(o, OP, "o", ndim=3)
    T, HV, V = o.shape
    check_tensor(residual, OP, "residual", ndim=2, dtype=o.dtype, device=o.device)
    D = residual.shape[1]
    check(residual.shape[0] == T, OP, f"residual has {residual.shape[0]} tokens, o has {T}")
    check_tensor(z, OP, "z", ndim=2, dtype=o.dtype, device=o.device)
    check(tuple(z.shape) == (T, HV * V), OP, f"z has shape {tuple(z.shape)}, expected {(T, HV * V)}")
    check(tuple(gnorm_w.shape) == (V,), OP, f"gnorm_w must have shape ({V},), got {tuple(gnorm_w.shape)}")
    check(tuple(out_w.shape) == (D, HV * V), OP, f"out_w has shape {tuple(out_w.shape)}, expected {(D, HV * V)}")
    check_mlp(OP, D, post_norm_w, gate_w, up_w, down_w)


def gated_rms_norm(o, z, weight, eps):
    """transformers' Qwen3_5RMSNormGated, op for op: norm in fp32, weight in the input dtype,
    gate in fp32."""
    dtype = o.dtype
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * of.to(dtype)
    return (out * F.silu(z.float())).to(dtype)


def gdn_out_ref(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w, eps):
    T, HV, V = o.shape
    n = gated_rms_norm(o, z.view(T, HV, V), gnorm_w, eps).reshape(T, HV * V)
    h = residual + F.linear(n, out_w)
    return mlp_residual(h, post_norm_w, gate_w, up_w, down_w, eps)


@gdn_out.register_kernel("cuda")
def gdn_out_cuda(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w, eps):
    """Triton gated norm; out projection with the residual add in the GEMM epilogue; MLP tail."""
    _check(o, z, residual, gnorm_w, out_w, post_norm_w, gate_w, up_w, down_w)
    h = torch.addmm(residual, kernels.gated_rms_norm(o, z, gnorm_w, eps), out_w.t())
    return kernels.mlp_residual(h, post_norm_w, gate_w, up_w, down_w, eps)
