"""GDN phase 1, causal depthwise conv1d + SiLU over packed varlen streams, each starting
from its slot's conv state (its last W-1 inputs) and leaving the new one there.

A zero-length stream (padding) computes nothing and leaves its slot's state unchanged.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor

OP = "causal_conv1d"


@torch.library.custom_op("metrale::causal_conv1d", mutates_args=("conv_state",), device_types="cpu")
def causal_conv1d(x: Tensor, weight: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
                  conv_state: Tensor) -> Tensor:
    """Varlen causal conv1d with per-slot state, then SiLU.

    Args:
        x: [T, C] packed pre-conv channels (model dtype).
        weight: [C, W] depthwise kernel (no bias).
        cu_seqlens: [B+1] int32, stream b is tokens cu_seqlens[b]:cu_seqlens[b+1].
        slot_ids: [B] int32/int64, the conv-state slot of each stream.
        conv_state: [S, C, W-1] pool, x's dtype. MUTATED: each stream's slot receives the
            last W-1 inputs of (old state ++ stream tokens).
    Returns:
        y: [T, C], x's dtype: `silu(conv(state ++ x))` per stream.
    """
    _check(x, weight, cu_seqlens, slot_ids, conv_state)
    return causal_conv1d_ref(x, weight, cu_seqlens, slot_ids, conv_state)


@causal_conv1d.register_fake
def _(x, weight, cu_seqlens, slot_ids, conv_state):
    _check(x, weight, cu_seqlens, slot_ids, conv_state)
    return torch.empty_like(x)


def _check(x, weight, cu_seqlens, slot_ids, conv_state):
    check_tensor(x, OP, "x", ndim=2)
    C = x.shape[1]
    check_tensor(weight, OP, "weight", ndim=2, dtype=x.dtype, device=x.device)
    check(weight.shape[0] == C, OP, f"weight has {weight.shape[0]} channels, x has {C}")
    check_tensor(cu_seqlens, OP, "cu_seqlens", ndim=1, dtype=torch.int32, device=x.device)
    check_tensor(slot_ids, OP, "slot_ids", ndim=1, dtype=INDEX_DTYPES, device=x.device)
    check(slot_ids.shape[0] + 1 == cu_seqlens.shape[0], OP,
          f"{slot_ids.shape[0]} slot_ids for {cu_seqlens.shape[0] - 1} streams")
    check_tensor(conv_state, OP, "conv_state", ndim=3, dtype=x.dtype, device=x.device)
    check(tuple(conv_state.shape[1:]) == (C, weight.shape[1] - 1), OP,
          f"conv_state slots are {tuple(conv_state.shape[1:])}, expected {(C, weight.shape[1] - 1)}")


def causal_conv1d_ref(x, weight, cu_seqlens, slot_ids, conv_state):
    """Plain torch, one stream at a time (host loop: the CPU reference)."""
    C, W = weight.shape
    y = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            continue
        window = torch.cat([conv_state[slot], x[s:e].t()], dim=1)  # [C, W-1+L]
        out = F.conv1d(window[None], weight[:, None, :], groups=C)[0]  # [C, L]
        y[s:e] = F.silu(out).t()
        conv_state[slot] = window[:, window.shape[1] - (W - 1):]
    return y


@causal_conv1d.register_kernel("cuda")
def _(x, weight, cu_seqlens, slot_ids, conv_state):
    _check(x, weight, cu_seqlens, slot_ids, conv_state)
    return causal_conv1d_ref(x, weight, cu_seqlens, slot_ids, conv_state)
