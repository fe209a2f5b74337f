"""Full-attention layer, part 3 (token-local): output gate `o * sigmoid(gate)`, o_proj,
residual add, post-attention RMSNorm, MLP, residual add.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kernels
from .common import check, check_mlp, check_tensor, mlp_residual

OP = "attn_out"


@torch.library.custom_op("metrale::attn_out", mutates_args=(), device_types="cpu")
def attn_out(o: Tensor, gate: Tensor, residual: Tensor, o_w: Tensor, post_norm_w: Tensor, gate_w: Tensor,
             up_w: Tensor, down_w: Tensor, eps: float) -> Tensor:
    """Tail of a gated full-attention layer.

    Args:
        o: [T, HQ, HD] attention output; gate: [T, HQ*HD] (model dtype).
        residual: [T, D] the layer input.
        o_w: [D, HQ*HD]; post_norm_w: [D] zero-centred; gate_w, up_w: [I, D]; down_w: [D, I].
        eps: RMSNorm epsilon.
    Returns:
        [T, D] the layer output (model dtype). Mutates nothing.
    """
    _check(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w)
    return attn_out_ref(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w, eps)


@attn_out.register_fake
def _(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w, eps):
    _check(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w)
    return torch.empty_like(residual)


def _check(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w):
    check_tensor(o, OP, "o", ndim=3)
    T, HQ, HD = o.shape
    check_tensor(gate, OP, "gate", ndim=2, dtype=o.dtype, device=o.device)
    check(tuple(gate.shape) == (T, HQ * HD), OP, f"gate has shape {tuple(gate.shape)}, expected {(T, HQ * HD)}")
    check_tensor(residual, OP, "residual", ndim=2, dtype=o.dtype, device=o.device)
    D = residual.shape[1]
    check(residual.shape[0] == T, OP, f"residual has {residual.shape[0]} tokens, o has {T}")
    check(tuple(o_w.shape) == (D, HQ * HD), OP, f"o_w has shape {tuple(o_w.shape)}, expected {(D, HQ * HD)}")
    check_mlp(OP, D, post_norm_w, gate_w, up_w, down_w)


def attn_out_ref(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w, eps):
    h = residual + F.linear(o.reshape(gate.shape) * torch.sigmoid(gate), o_w)
    return mlp_residual(h, post_norm_w, gate_w, up_w, down_w, eps)


@attn_out.register_kernel("cuda")
def attn_out_cuda(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w, eps):
    """o_proj with the residual add in the GEMM epilogue, then the Triton / cuBLAS MLP tail."""
    _check(o, gate, residual, o_w, post_norm_w, gate_w, up_w, down_w)
    h = torch.addmm(residual, o.reshape(gate.shape) * torch.sigmoid(gate), o_w.t())
    return kernels.mlp_residual(h, post_norm_w, gate_w, up_w, down_w, eps)
