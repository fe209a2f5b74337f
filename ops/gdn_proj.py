"""GDN phase 1, projections over all stacked tokens: input RMSNorm, qkv / z / b / a
projections, and the gates `beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`.

One op because all four projections read the same normalized activations: the CUDA path
reads `x` once.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from . import gemv, kernels
from .common import check, check_tensor, rms_norm
from .fp8 import projection as fp8
from .registry import (OpSpec, Shapes, fp8_weight, metrale_cuda, metrale_fake, metrale_op, no_scale, norm_weight, rand,
                       register, weight)

def _check(a):
    check_tensor(a.x, "x", ndim=2)
    D, HV = a.x.shape[1], a.b_w.shape[0]
    for name, w, sc in (("qkv_w", a.qkv_w, a.qkv_s), ("z_w", a.z_w, a.z_s), ("b_w", a.b_w, a.b_s),
                        ("a_w", a.a_w, a.a_s)):
        check_tensor(w, name, ndim=2)
        fp8.check_weight(w, sc, name, a.x.dtype, a.x.device)
        check(w.shape[1] == D, f"{name} has {w.shape[1]} input features, x has {D}")
    check(a.a_w.shape[0] == HV, f"a_w has {a.a_w.shape[0]} heads, b_w has {HV}")
    for name, w, n in (("norm_w", a.norm_w, D), ("A_log", a.A_log, HV), ("dt_bias", a.dt_bias, HV)):
        check_tensor(w, name, device=a.x.device)
        check(tuple(w.shape) == (n,), f"{name} must have shape ({n},), got {tuple(w.shape)}")


@metrale_op(check=_check)
def gdn_proj(x: Tensor, norm_w: Tensor, qkv_w: Tensor, qkv_s: Tensor, z_w: Tensor, z_s: Tensor, b_w: Tensor,
             b_s: Tensor, a_w: Tensor, a_s: Tensor, A_log: Tensor, dt_bias: Tensor,
             eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Phase-1 projections of a Gated DeltaNet layer. The CPU reference: plain torch, matching
    transformers' Qwen3_5GatedDeltaNet op for op.

    Args:
        x: [T, D] hidden states (model dtype), the layer input (before its norm).
        norm_w: [D] zero-centred input RMSNorm weight.
        qkv_w: [C, D] with C = 2*H*K + HV*V; output channels `[q | k | v]`.
        z_w: [HV*V, D] output-gate projection.
        b_w, a_w: [HV, D] beta and decay projections.
        qkv_s, z_s, b_s, a_s: each weight's FP8 block scales, fp32 [ceil(N/128), ceil(D/128)], where the
            weight is float8_e4m3fn; an empty tensor where it is in x's dtype (ops/fp8/projection.py).
        A_log, dt_bias: [HV] decay parameters.
        eps: RMSNorm epsilon.
    Returns:
        qkv [T, C] and z [T, HV*V] in x's dtype; beta [T, HV] in x's dtype;
        g [T, HV] float32 (log-decay, <= 0). Mutates nothing.
    """
    h = rms_norm(x, norm_w, eps)
    qkv = fp8.linear(h, qkv_w, qkv_s)
    z = fp8.linear(h, z_w, z_s)
    beta = torch.sigmoid(fp8.linear(h, b_w, b_s))
    g = -A_log.float().exp() * F.softplus(fp8.linear(h, a_w, a_s).float() + dt_bias.float())
    return qkv, z, beta, g


@metrale_fake(gdn_proj)
def _(a):
    T, HV = a.x.shape[0], a.b_w.shape[0]
    return (a.x.new_empty(T, a.qkv_w.shape[0]), a.x.new_empty(T, a.z_w.shape[0]), a.x.new_empty(T, HV),
            a.x.new_empty(T, HV, dtype=torch.float32))


@metrale_cuda(gdn_proj)
def gdn_proj_cuda(a):
    """Triton RMSNorm, then one GEMM over the four stacked projections (HybridModel stores them
    back to back, so stacking is free), then one Triton kernel for both gates and the copies of qkv and z out of
    the GEMM's output (outputs of a custom op may not alias one another). With FP8 weights the projections run
    as fp8.project groups them (qkv | z as one W8A8 GEMM, b | a as one bf16 GEMM)."""
    C, Z, HV = a.qkv_w.shape[0], a.z_w.shape[0], a.b_w.shape[0]
    n = kernels.rms_norm(a.x, a.norm_w, a.eps)
    if not any(fp8.is_fp8(w) for w in (a.qkv_w, a.z_w, a.b_w, a.a_w)):
        y = gemv.linear(n, kernels.stacked(a.qkv_w, a.z_w, a.b_w, a.a_w))
        return kernels.gdn_gates_split(y, C, Z, y, C + Z, C + Z + HV, a.A_log, a.dt_bias)
    qkv, z, b, a_ = fp8.project(n, [(a.qkv_w, a.qkv_s), (a.z_w, a.z_s), (a.b_w, a.b_s), (a.a_w, a.a_s)])
    # the kernel reads qkv | z and b | a as columns of one tensor each: views where they ran as one GEMM
    return kernels.gdn_gates_split(kernels.side_by_side(qkv, z), C, Z, kernels.side_by_side(b, a_), 0, HV, a.A_log,
                                   a.dt_bias)


def example(s: Shapes, dtype, g):
    """With s.fp8, qkv_w and z_w FP8 (b_w and a_w in dtype, as Qwen's FP8 checkpoints keep them)."""
    HV = s.HV
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), *fp8_weight(s, g, dtype, s.C, s.D),
            *fp8_weight(s, g, dtype, HV * s.V, s.D), weight(g, HV, s.D, dtype=dtype), no_scale(),
            weight(g, HV, s.D, dtype=dtype), no_scale(),
            torch.empty(HV).uniform_(1, 16, generator=g).log().to(dtype), rand(g, HV, dtype=dtype), s.eps)


def cost(s: Shapes):
    n = s.C + s.HV * s.V + 2 * s.HV
    return 2 * s.T * s.D * n, 2 * (n * s.D + s.T * s.D + s.T * (s.C + s.HV * s.V)) + 8 * s.T * s.HV


register(OpSpec(gdn_proj, example, cost, cuda=gdn_proj_cuda, kernels=("gdn_gates",),
                onnx="metrale_graph.onnx.translations:gdn_proj"))
