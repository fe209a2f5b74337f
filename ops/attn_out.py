"""Full-attention layer, part 3, the mixer's output (token-local): output gate
`o * sigmoid(gate)`, o_proj, residual add. (The feed-forward half follows as metrale::mlp or
metrale::moe.)
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import check, check_tensor
from .registry import OpSpec, Shapes, metrale_op, rand, register, weight

OP = "attn_out"


@metrale_op("attn_out")
def attn_out(o: Tensor, gate: Tensor, residual: Optional[Tensor], o_w: Tensor) -> Tensor:
    """Output of a gated full-attention layer.

    Args:
        o: [T, HQ, HD] attention output; gate: [T, HQ*HD] (model dtype).
        residual: [T, D] the layer input, or None (a tensor-parallel rank other than 0).
        o_w: [D, HQ*HD].
    Returns:
        h [T, D] = residual + o_proj(o * sigmoid(gate)), model dtype. Mutates nothing.
    """
    _check(o, gate, residual, o_w)
    return attn_out_ref(o, gate, residual, o_w)


@attn_out.register_fake
def _(o, gate, residual, o_w):
    _check(o, gate, residual, o_w)
    return o.new_empty(o.shape[0], o_w.shape[0])


def _check(o, gate, residual, o_w):
    check_tensor(o, OP, "o", ndim=3)
    T, HQ, HD = o.shape
    check_tensor(gate, OP, "gate", ndim=2, dtype=o.dtype, device=o.device)
    check(tuple(gate.shape) == (T, HQ * HD), OP, f"gate has shape {tuple(gate.shape)}, expected {(T, HQ * HD)}")
    check_tensor(o_w, OP, "o_w", ndim=2, dtype=o.dtype, device=o.device)
    D = o_w.shape[0]
    if residual is not None:
        check_tensor(residual, OP, "residual", ndim=2, dtype=o.dtype, device=o.device)
        check(tuple(residual.shape) == (T, D), OP, f"residual has shape {tuple(residual.shape)}, expected {(T, D)}")
    check(tuple(o_w.shape) == (D, HQ * HD), OP, f"o_w has shape {tuple(o_w.shape)}, expected {(D, HQ * HD)}")


def attn_out_ref(o, gate, residual, o_w):
    T, HQ, HD = o.shape  # explicit sizes: reshape(T, -1) is ambiguous when T = 0
    out = F.linear(o.reshape(T, HQ * HD) * torch.sigmoid(gate), o_w)
    return out if residual is None else (residual + out).contiguous()  # residual + out follows residual's layout


@attn_out.register_kernel("cuda")
def attn_out_cuda(o, gate, residual, o_w):
    """o_proj with the residual add in the GEMM epilogue."""
    _check(o, gate, residual, o_w)
    T, HQ, HD = o.shape
    gated = o.reshape(T, HQ * HD) * torch.sigmoid(gate)
    return gated @ o_w.t() if residual is None else torch.addmm(residual, gated, o_w.t())


def example(s: Shapes, dtype, g):
    T, N = s.T, s.HQ * s.HD
    return (rand(g, T, s.HQ, s.HD, dtype=dtype), rand(g, T, N, dtype=dtype), rand(g, T, s.D, dtype=dtype),
            weight(g, s.D, N, dtype=dtype))


def cost(s: Shapes):
    N = s.HQ * s.HD
    return 2 * s.T * N * s.D, 2 * (N * s.D + s.T * (2 * N + 2 * s.D))


register(OpSpec(attn_out, attn_out_ref, example, cost, cuda=attn_out_cuda,
                onnx="metrale_graph.onnx.translations:attn_out"))
