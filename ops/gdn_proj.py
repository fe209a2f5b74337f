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
from .registry import OpSpec, Shapes, metrale_op, norm_weight, rand, register, weight

OP = "gdn_proj"


@metrale_op("gdn_proj")
def gdn_proj(x: Tensor, norm_w: Tensor, qkv_w: Tensor, z_w: Tensor, b_w: Tensor, a_w: Tensor,
             A_log: Tensor, dt_bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Phase-1 projections of a Gated DeltaNet layer.

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
    _check(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias)
    return gdn_proj_ref(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias, eps)


@gdn_proj.register_fake
def _(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias, eps):
    _check(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias)
    T, HV = x.shape[0], b_w.shape[0]
    return (x.new_empty(T, qkv_w.shape[0]), x.new_empty(T, z_w.shape[0]), x.new_empty(T, HV),
            x.new_empty(T, HV, dtype=torch.float32))


def _check(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias):
    check_tensor(x, OP, "x", ndim=2)
    D, HV = x.shape[1], b_w.shape[0]
    for name, w in (("qkv_w", qkv_w), ("z_w", z_w), ("b_w", b_w), ("a_w", a_w)):
        check_tensor(w, OP, name, ndim=2, dtype=x.dtype, device=x.device)
        check(w.shape[1] == D, OP, f"{name} has {w.shape[1]} input features, x has {D}")
    check(a_w.shape[0] == HV, OP, f"a_w has {a_w.shape[0]} heads, b_w has {HV}")
    for name, w, n in (("norm_w", norm_w, D), ("A_log", A_log, HV), ("dt_bias", dt_bias, HV)):
        check(tuple(w.shape) == (n,), OP, f"{name} must have shape ({n},), got {tuple(w.shape)}")


def gdn_proj_ref(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias, eps):
    """Plain torch, matching transformers' Qwen3_5GatedDeltaNet op for op."""
    h = rms_norm(x, norm_w, eps)
    qkv = F.linear(h, qkv_w)
    z = F.linear(h, z_w)
    beta = torch.sigmoid(F.linear(h, b_w))
    g = -A_log.float().exp() * F.softplus(F.linear(h, a_w).float() + dt_bias.float())
    return qkv, z, beta, g


@gdn_proj.register_kernel("cuda")
def gdn_proj_cuda(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias, eps):
    """Triton RMSNorm, then one GEMM over the four stacked projections (HybridModel stores them
    back to back, so stacking is free), then both gates in one Triton kernel."""
    _check(x, norm_w, qkv_w, z_w, b_w, a_w, A_log, dt_bias)
    C, Z, HV = qkv_w.shape[0], z_w.shape[0], b_w.shape[0]
    y = kernels.rms_norm(x, norm_w, eps) @ kernels.stacked(qkv_w, z_w, b_w, a_w).t()
    beta, g = kernels.gdn_gates(y, C + Z, C + Z + HV, A_log, dt_bias)
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


register(OpSpec(gdn_proj, gdn_proj_ref, example, cost, cuda=gdn_proj_cuda, kernels=("gdn_gates",),
                onnx="metrale_graph.onnx.translations:gdn_proj"))
