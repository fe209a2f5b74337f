"""GDN phase 2, the gated delta rule over packed varlen streams, each from its slot's state.

Per value head j (key head j // r, r = HV / H), token by token:
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (q_t * K**-0.5)
with S [K, V] in fp32. The final S of each stream goes back to its slot. A zero-length
stream (padding) leaves its slot unchanged.
"""

import torch
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor

OP = "gdn_recurrence"


@torch.library.custom_op("metrale::gdn_recurrence", mutates_args=("gdn_state",), device_types="cpu")
def gdn_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                   slot_ids: Tensor, gdn_state: Tensor) -> Tensor:
    """Varlen gated delta rule with per-slot recurrent state.

    Args:
        q, k: [T, H, K] L2-normalized queries and keys (model dtype); q is scaled by K**-0.5 here.
        v: [T, HV, V] values (model dtype), HV a multiple of H.
        g: [T, HV] float32 log-decay (<= 0).
        beta: [T, HV] write strength in (0, 1) (model dtype or float32).
        cu_seqlens: [B+1] int32 stream boundaries.
        slot_ids: [B] int32/int64 state slot of each stream.
        gdn_state: [S, HV, K, V] float32 pool. MUTATED: each stream's slot holds its final state.
    Returns:
        o: [T, HV, V] in v's dtype.
    """
    _check(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state)
    return gdn_recurrence_ref(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state)


@gdn_recurrence.register_fake
def _(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state):
    _check(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state)
    return v.new_empty(v.shape)


def _check(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state):
    check_tensor(q, OP, "q", ndim=3)
    T, H, K = q.shape
    check_tensor(k, OP, "k", ndim=3, dtype=q.dtype, device=q.device)
    check(tuple(k.shape) == (T, H, K), OP, f"k has shape {tuple(k.shape)}, q has {(T, H, K)}")
    check_tensor(v, OP, "v", ndim=3, dtype=q.dtype, device=q.device)
    HV, V = v.shape[1], v.shape[2]
    check(v.shape[0] == T and HV % H == 0, OP,
          f"v has shape {tuple(v.shape)}; need {T} tokens and value heads a multiple of {H}")
    check_tensor(g, OP, "g", ndim=2, dtype=torch.float32, device=q.device)
    check(tuple(g.shape) == (T, HV), OP, f"g has shape {tuple(g.shape)}, expected {(T, HV)}")
    check_tensor(beta, OP, "beta", ndim=2, dtype=(q.dtype, torch.float32), device=q.device)
    check(tuple(beta.shape) == (T, HV), OP, f"beta has shape {tuple(beta.shape)}, expected {(T, HV)}")
    check_tensor(cu_seqlens, OP, "cu_seqlens", ndim=1, dtype=torch.int32, device=q.device)
    check_tensor(slot_ids, OP, "slot_ids", ndim=1, dtype=INDEX_DTYPES, device=q.device)
    check(slot_ids.shape[0] + 1 == cu_seqlens.shape[0], OP,
          f"{slot_ids.shape[0]} slot_ids for {cu_seqlens.shape[0] - 1} streams")
    check_tensor(gdn_state, OP, "gdn_state", ndim=4, dtype=torch.float32, device=q.device)
    check(tuple(gdn_state.shape[1:]) == (HV, K, V), OP,
          f"gdn_state slots are {tuple(gdn_state.shape[1:])}, expected {(HV, K, V)}")


def gdn_recurrence_ref(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state):
    """Plain torch, token by token, in fp32 (the spec)."""
    T, H, K = q.shape
    HV = v.shape[1]
    r = HV // H
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    qf = q.float().repeat_interleave(r, dim=1) * K**-0.5  # [T, HV, K]
    kf = k.float().repeat_interleave(r, dim=1)
    vf, bf, decay = v.float(), beta.float(), g.float().exp()
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            continue
        S = gdn_state[slot].clone()  # [HV, K, V]
        for t in range(s, e):
            S = S * decay[t, :, None, None]
            pred = torch.einsum("hk,hkv->hv", kf[t], S)
            delta = (vf[t] - pred) * bf[t, :, None]
            S = S + kf[t, :, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qf[t], S)
        gdn_state[slot] = S
    return o.to(v.dtype)


@gdn_recurrence.register_kernel("cuda")
def _(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state):
    _check(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state)
    return gdn_recurrence_ref(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state)
