"""The chunked gated delta rule's reference: plain torch, token by token, in fp32 (what the tests hold the
kernels to)."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import CHUNK


# Reference ------------------------------------------------------------------------------------------
def chunked_gdn_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_aligned: Tensor,
                          h0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Plain torch, token by token, fp32: (o [T_al, HV, V] fp32 (zeros outside every sequence), final
    [N, HV, K, V], starts [NT, HV, K, V]: the state at the start of every chunk of 64 tokens, in
    chunk_indices order)."""
    T, H, K = q.shape
    HV = v.shape[1]
    r = HV // H
    qf = q.float().repeat_interleave(r, dim=1) * K ** -0.5
    kf = k.float().repeat_interleave(r, dim=1)
    vf, bf, decay = v.float(), beta.float(), g.float().exp()
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    final, starts = h0.clone(), []
    bounds = cu_aligned.tolist()
    for n in range(len(bounds) - 1):
        S = h0[n].clone()
        for t in range(bounds[n], bounds[n + 1]):
            if (t - bounds[n]) % CHUNK == 0:
                starts.append(S.clone())
            S = S * decay[t, :, None, None]
            delta = (vf[t] - (kf[t, :, :, None] * S).sum(1)) * bf[t, :, None]
            S = S + kf[t, :, :, None] * delta[:, None, :]
            o[t] = (qf[t, :, :, None] * S).sum(1)
        final[n] = S
    starts = torch.stack(starts) if starts else h0.new_zeros((0,) + tuple(h0.shape[1:]))
    return o, final, starts
