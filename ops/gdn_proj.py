"""GDN phase 1, projections over all stacked tokens: input RMSNorm, qkv / z / b / a
projections, and the gates `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`.

One op because all four projections read the same normalized activations: the CUDA path
reads `x` once.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels
from .common import check, check_tensor, rms_norm
from .registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, norm_weight, rand, register, weight

def _check(a):
    check_tensor(a.x, "x", ndim=2)
    D, HV = a.x.shape[1], a.b_w.shape[0]
    for name, w in (("qkv_w", a.qkv_w), ("z_w", a.z_w), ("b_w", a.b_w), ("a_w", a.a_w)):
        check_tensor(w, name, ndim=2, dtype=a.x.dtype, device=a.x.device)
        check(w.shape[1] == D, f"{name} has {w.shape[1]} input features, x has {D}")
    check(a.a_w.shape[0] == HV, f"a_w has {a.a_w.shape[0]} heads, b_w has {HV}")
    for name, w, n in (("norm_w", a.norm_w, D), ("A_log", a.A_log, HV), ("dt_bias", a.dt_bias, HV)):
        check(tuple(w.shape) == (n,), f"{name} must have shape ({n},), got {tuple(w.shape)}")


@metrale_op(check=_check)
def gdn_proj(x: Tensor, norm_w: Tensor, qkv_w: Tensor, z_w: Tensor, b_w: Tensor, a_w: Tensor,
             A_log: Tensor, dt_bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Phase-1 projections of a Gated DeltaNet layer. The CPU reference: plain torch, matching
    transformers' Qwen3_5GatedDeltaNet op for op.

    Args:
        x: [T, D] hidden states (model dtype), the layer input (before its norm).
        norm_w: [D] zero-centred input RMSNorm weight.
        qkv_w: [C, D] with C = 2*H*K + HV*V; output channels `[q | k | v]`.
        z_w: [HV*V, D] output-gate projection.
        b_w, a_w: [HV, D] beta and decay projections.
        A_log, dt_bias: [HV] decay parameters.
        eps: RMSNorm epsilon.
    Returns:
        qkv [T, C] and z [T, HV*V] in x's dtype; beta [T, HV] in x's dtype;
        g [T, HV] float32 (log-decay, <= 0). Mutates nothing.
    """
    h = rms_norm(x, norm_w, eps)
    qkv = F.linear(h, qkv_w)
    z = F.linear(h, z_w)
    beta = torch.sigmoid(F.linear(h, b_w))
    g = -A_log.float().exp() * F.softplus(F.linear(h, a_w).float() + dt_bias.float())
    return qkv, z, beta, g


@metrale_fake(gdn_proj)
def _(a):
    T, HV = a.x.shape[0], a.b_w.shape[0]
    return (a.x.new_empty(T, a.qkv_w.shape[0]), a.x.new_empty(T, a.z_w.shape[0]), a.x.new_empty(T, HV),
            a.x.new_empty(T, HV, dtype=torch.float32))


@metrale_cuda(gdn_proj)
def gdn_proj_cuda(a):
    """Triton RMSNorm, then one GEMM over the four stacked projections (HybridModel stores them
    back to back, so stacking is free), then both gates in one Triton kernel."""
    C, Z, HV = a.qkv_w.shape[0], a.z_w.shape[0], a.b_w.shape[0]
    y = kernels.rms_norm(a.x, a.norm_w, a.eps) @ kernels.stacked(a.qkv_w, a.z_w, a.b_w, a.a_w).t()
    beta, g = kernels.gdn_gates(y, C + Z, C + Z + HV, a.A_log, a.dt_bias)
    # outputs of a custom op may not alias one another: the two big ones are copied out of y. Not
    # .contiguous(): with T <= 1 a column slice of y is already contiguous and would come back as a view
    fresh = torch.contiguous_format
    return y[:, :C].clone(memory_format=fresh), y[:, C:C + Z].clone(memory_format=fresh), beta, g


def example(s: Shapes, dtype, g):
    HV = s.HV
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), weight(g, s.C, s.D, dtype=dtype),
            weight(g, HV * s.V, s.D, dtype=dtype), weight(g, HV, s.D, dtype=dtype), weight(g, HV, s.D, dtype=dtype),
            torch.empty(HV).uniform_(1, 16, generator=g).log().to(dtype), rand(g, HV, dtype=dtype), s.eps)


def cost(s: Shapes):
    n = s.C + s.HV * s.V + 2 * s.HV
    return 2 * s.T * s.D * n, 2 * (n * s.D + s.T * s.D + s.T * (s.C + s.HV * s.V)) + 8 * s.T * s.HV


register(OpSpec(gdn_proj, example, cost, cuda=gdn_proj_cuda, kernels=("gdn_gates",),
                onnx="metrale_graph.onnx.translations:gdn_proj"))
