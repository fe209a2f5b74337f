"""Full-attention layer, part 3, the mixer's output (token-local): output gate
`o * sigmoid(gate)`, o_proj, residual add. (The feed-forward half follows as metrale::mlp or
metrale::moe.)
"""

from typing import Optional

import torch
from torch import Tensor

from .common import check, check_tensor
from .fp8 import projection as fp8
from .registry import OpSpec, Shapes, fp8_weight, metrale_cuda, metrale_fake, metrale_op, rand, register

def _check(a):
    check_tensor(a.o, "o", ndim=3)
    T, HQ, HD = a.o.shape
    dtype, device = a.o.dtype, a.o.device
    check_tensor(a.gate, "gate", ndim=2, dtype=dtype, device=device)
    check(tuple(a.gate.shape) == (T, HQ * HD), f"gate has shape {tuple(a.gate.shape)}, expected {(T, HQ * HD)}")
    check_tensor(a.o_w, "o_w", ndim=2)
    fp8.check_weight(a.o_w, a.o_s, "o_w", dtype, device)
    D = a.o_w.shape[0]
    if a.residual is not None:
        check_tensor(a.residual, "residual", ndim=2, dtype=dtype, device=device)
        check(tuple(a.residual.shape) == (T, D), f"residual has shape {tuple(a.residual.shape)}, expected {(T, D)}")
    check(tuple(a.o_w.shape) == (D, HQ * HD), f"o_w has shape {tuple(a.o_w.shape)}, expected {(D, HQ * HD)}")


@metrale_op(check=_check)
def attn_out(o: Tensor, gate: Tensor, residual: Optional[Tensor], o_w: Tensor, o_s: Tensor) -> Tensor:
    """Output of a gated full-attention layer.

    Args:
        o: [T, HQ, HD] attention output; gate: [T, HQ*HD] (model dtype).
        residual: [T, D] the layer input, or None (a tensor-parallel rank other than 0).
        o_w: [D, HQ*HD]; o_s: its FP8 block scales where it is float8_e4m3fn, else an empty tensor
            (ops/fp8/projection.py).
    Returns:
        h [T, D] = residual + o_proj(o * sigmoid(gate)), model dtype. Mutates nothing.
    """
    T, HQ, HD = o.shape  # explicit sizes: reshape(T, -1) is ambiguous when T = 0
    out = fp8.linear(o.reshape(T, HQ * HD) * torch.sigmoid(gate), o_w, o_s)
    return out if residual is None else (residual + out).contiguous()  # residual + out follows residual's layout


@metrale_fake(attn_out)
def _(a):
    return a.o.new_empty(a.o.shape[0], a.o_w.shape[0])


@metrale_cuda(attn_out)
def attn_out_cuda(a):
    """o_proj with the residual add in the GEMM epilogue (FP8: W8A8)."""
    T, HQ, HD = a.o.shape
    gated = a.o.reshape(T, HQ * HD) * torch.sigmoid(a.gate)
    return fp8.project_one(gated, a.o_w, a.o_s, a.residual)


def example(s: Shapes, dtype, g):
    T, N = s.T, s.HQ * s.HD
    return (rand(g, T, s.HQ, s.HD, dtype=dtype), rand(g, T, N, dtype=dtype), rand(g, T, s.D, dtype=dtype),
            *fp8_weight(s, g, dtype, s.D, N))


def cost(s: Shapes):
    N = s.HQ * s.HD
    return 2 * s.T * N * s.D, (1 if s.fp8 else 2) * N * s.D + 2 * s.T * (2 * N + 2 * s.D)


register(OpSpec(attn_out, example, cost, cuda=attn_out_cuda,
                onnx="metrale_graph.onnx.translations:attn_out"))
