"""Full-attention layer, part 1 (token-local): input RMSNorm, q / k / v projections, the
per-head output gate split out of q_proj, q_norm / k_norm, partial rotary embedding.
"""

import torch
from torch import Tensor

from . import gemv, kernels
from .common import check, check_tensor, rms_norm
from .fp8 import projection as fp8
from .registry import OpSpec, Shapes, fp8_weight, metrale_cuda, metrale_fake, metrale_op, norm_weight, rand, register

def _check(a):
    check_tensor(a.x, "x", ndim=2)
    T, D = a.x.shape
    HD = a.head_dim
    check(HD > 0, f"head_dim must be positive, got {HD}")
    for name, w in (("norm_w", a.norm_w), ("q_norm_w", a.q_norm_w), ("k_norm_w", a.k_norm_w)):
        check_tensor(w, name, device=a.x.device)
    check(tuple(a.norm_w.shape) == (D,), f"norm_w must have shape ({D},)")
    for name, w, sc in (("q_w", a.q_w, a.q_s), ("k_w", a.k_w, a.k_s), ("v_w", a.v_w, a.v_s)):
        check_tensor(w, name, ndim=2)
        fp8.check_weight(w, sc, name, a.x.dtype, a.x.device)
        check(w.shape[1] == D and w.shape[0] % HD == 0,
              f"{name} has shape {tuple(w.shape)}; need {D} inputs and a multiple of head_dim {HD} outputs")
    check(a.q_w.shape[0] % (2 * HD) == 0, f"q_w rows {a.q_w.shape[0]} are not heads of 2*{HD} (query | gate)")
    check(a.k_w.shape == a.v_w.shape, f"k_w {tuple(a.k_w.shape)} and v_w {tuple(a.v_w.shape)} differ")
    check(tuple(a.q_norm_w.shape) == (HD,) and tuple(a.k_norm_w.shape) == (HD,),
          f"q_norm_w / k_norm_w must have shape ({HD},)")
    check_tensor(a.positions, "positions", ndim=1, dtype=torch.int64, device=a.x.device)
    check(a.positions.shape[0] == T, f"positions has {a.positions.shape[0]} entries for {T} tokens")
    check_tensor(a.inv_freq, "inv_freq", ndim=1, dtype=torch.float32, device=a.x.device)
    check(2 * a.inv_freq.shape[0] <= HD, f"rotary dim {2 * a.inv_freq.shape[0]} exceeds head_dim {HD}")


@metrale_op(check=_check)
def attn_proj(x: Tensor, norm_w: Tensor, q_w: Tensor, q_s: Tensor, k_w: Tensor, k_s: Tensor, v_w: Tensor,
              v_s: Tensor, q_norm_w: Tensor, k_norm_w: Tensor, positions: Tensor, inv_freq: Tensor, head_dim: int,
              eps: float, rope_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Projections of a gated full-attention layer.

    Args:
        x: [T, D] layer input (model dtype).
        norm_w: [D] zero-centred input RMSNorm weight.
        q_w: [HQ*2*HD, D]; per head, rows `[q_h | gate_h]`.
        k_w, v_w: [HKV*HD, D].
        q_s, k_s, v_s: each weight's FP8 block scales where it is float8_e4m3fn, else an empty tensor
            (ops/fp8/projection.py).
        q_norm_w, k_norm_w: [HD] zero-centred per-head RMSNorm weights.
        positions: [T] int64 absolute position of each token in its stream.
        inv_freq: [R/2] float32 RoPE inverse frequencies; the first R channels of each head rotate
            (rotate-half), the rest pass through (R may be 0: none rotate).
        head_dim: HD.  eps: RMSNorm epsilon.
        rope_scale: the factor on cos and sin (1, or YaRN's attention factor: metrale_graph/rope.py).
    Returns:
        q [T, HQ, HD], k [T, HKV, HD], v [T, HKV, HD], gate [T, HQ*HD], all model dtype.
        Mutates nothing.
    """
    T, HD = x.shape[0], head_dim
    HQ, HKV = q_w.shape[0] // (2 * HD), k_w.shape[0] // HD  # explicit sizes: no -1 with T = 0
    h = rms_norm(x, norm_w, eps)
    qg = fp8.linear(h, q_w, q_s).view(T, HQ, 2 * HD)
    q, gate = qg[..., :HD], qg[..., HD:].clone(memory_format=torch.contiguous_format).view(T, HQ * HD)
    k = fp8.linear(h, k_w, k_s).view(T, HKV, HD)
    v = fp8.linear(h, v_w, v_s).view(T, HKV, HD)
    q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype, rope_scale)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate


@metrale_fake(attn_proj)
def _(a):
    T, HD = a.x.shape[0], a.head_dim
    HQ, HKV = a.q_w.shape[0] // (2 * HD), a.k_w.shape[0] // HD
    return (a.x.new_empty(T, HQ, HD), a.x.new_empty(T, HKV, HD), a.x.new_empty(T, HKV, HD),
            a.x.new_empty(T, HQ * HD))


def rope_cos_sin(positions, inv_freq, dtype, scale: float = 1.0):
    """cos, sin: [T, R] for rotate-half RoPE, computed (and scaled) in fp32 and cast like transformers."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x, cos, sin):
    """x: [T, N, HD]; rotates the first R = cos.shape[-1] channels of every head."""
    R = cos.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    x1, x2 = rot[..., : R // 2], rot[..., R // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], rest], dim=-1)


@metrale_cuda(attn_proj)
def attn_proj_cuda(a):
    """Triton RMSNorm, one GEMM over the stacked q|k|v projections, one Triton kernel for the per-head norm + RoPE
    and the v / gate copies (kernels.attn_heads). With FP8 weights the projections run as fp8.project groups them
    (q|k|v as one W8A8 GEMM when stacked)."""
    T, HD = a.x.shape[0], a.head_dim
    QG, KV = a.q_w.shape[0], a.k_w.shape[0]
    HQ = QG // (2 * HD)
    n = kernels.rms_norm(a.x, a.norm_w, a.eps)
    if not any(fp8.is_fp8(w) for w in (a.q_w, a.k_w, a.v_w)):
        y = gemv.linear(n, kernels.stacked(a.q_w, a.k_w, a.v_w))
        qgy, ky, vy = y[:, :QG], y[:, QG:QG + KV], y[:, QG + KV:]
    else:
        qgy, ky, vy = fp8.project(n, [(a.q_w, a.q_s), (a.k_w, a.k_s), (a.v_w, a.v_s)])
    # q and k normed and rotated, v and the gate copied out of y (outputs may not alias one another), one launch
    return kernels.attn_heads(qgy.view(T, HQ, 2 * HD), ky, vy, a.q_norm_w, a.k_norm_w, a.positions, a.inv_freq, a.eps,
                              a.rope_scale)


def example(s: Shapes, dtype, g):
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(s.context, s.lengths)])
    # transformers' frequencies of rotary dim R (an odd one rotates R + 1 channels); cos and sin scaled by 1.1, a YaRN
    # attention factor (at factor e)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, s.R, 2).float() / s.R))
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), *fp8_weight(s, g, dtype, s.HQ * s.HD * 2, s.D),
            *fp8_weight(s, g, dtype, s.HKV * s.HD, s.D), *fp8_weight(s, g, dtype, s.HKV * s.HD, s.D),
            norm_weight(g, s.HD, dtype), norm_weight(g, s.HD, dtype), positions, inv_freq, s.HD, s.eps, 1.1)


def cost(s: Shapes):
    n = 2 * s.HQ * s.HD + 2 * s.HKV * s.HD
    return 2 * s.T * s.D * n, (1 if s.fp8 else 2) * n * s.D + 2 * (s.T * s.D + s.T * n)


register(OpSpec(attn_proj, example, cost, cuda=attn_proj_cuda, kernels=("attn_heads",),
                onnx="metrale_graph.onnx.translations:attn_proj"))
