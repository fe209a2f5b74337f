"""GDN phase 2, the gated delta rule over packed varlen streams, each from its slot's state.

Per value head j (key head j // r, r = HV / H), token by token:
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (q_t * K**-0.5)
with S [K, V] in fp32. The final S of each stream goes back to its slot. A zero-length
stream (padding) leaves its slot unchanged.

Here: the op (its CPU reference, token by token, is the spec), its check, fake, CUDA path and spec.
The CUDA path: split.py picks per stream between the recurrent kernel (recurrent.py) and the chunked
path: our chunked kernels (ops/gdn_chunked/) on the packed tokens and the pool (chunked.py), or with
CHUNKED_BACKEND "fla" flash-linear-attention's (fla_adapter.py) on a chunk-aligned layout (layout.py),
kept as the GPU tests' second opinion and for A/B timing.
"""

import torch
from torch import Tensor

from typing import Optional

from metrale_graph import envs

from ..checkpoints import check_checkpoints, wanted
from ..common import INDEX_DTYPES, check, check_tensor, decode_shaped
from ..registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, rand, register, stream_meta
from ..gdn_chunked import supported_head_dims
from .fla_adapter import fla_varlen
from .recurrent import gdn_recurrence_recurrent
from .split import gdn_recurrence_split, split_max_len, use_recurrent


def _check(a):
    check_tensor(a.q, "q", ndim=3)
    T, H, K = a.q.shape
    check(H > 0 and K > 0, f"q must have heads of a positive size, got shape {tuple(a.q.shape)}")
    dtype, device = a.q.dtype, a.q.device
    check_tensor(a.k, "k", ndim=3, dtype=dtype, device=device)
    check(tuple(a.k.shape) == (T, H, K), f"k has shape {tuple(a.k.shape)}, q has {(T, H, K)}")
    check_tensor(a.v, "v", ndim=3, dtype=dtype, device=device)
    HV, V = a.v.shape[1], a.v.shape[2]
    check(a.v.shape[0] == T and HV % H == 0,
          f"v has shape {tuple(a.v.shape)}; need {T} tokens and value heads a multiple of {H}")
    check_tensor(a.g, "g", ndim=2, dtype=torch.float32, device=device)
    check(tuple(a.g.shape) == (T, HV), f"g has shape {tuple(a.g.shape)}, expected {(T, HV)}")
    check_tensor(a.beta, "beta", ndim=2, dtype=(dtype, torch.float32), device=device)
    check(tuple(a.beta.shape) == (T, HV), f"beta has shape {tuple(a.beta.shape)}, expected {(T, HV)}")
    check_tensor(a.cu_seqlens, "cu_seqlens", ndim=1, dtype=torch.int32, device=device)
    check_tensor(a.slot_ids, "slot_ids", ndim=1, dtype=INDEX_DTYPES, device=device)
    check(a.slot_ids.shape[0] + 1 == a.cu_seqlens.shape[0],
          f"{a.slot_ids.shape[0]} slot_ids for {a.cu_seqlens.shape[0] - 1} streams")
    check_tensor(a.gdn_state, "gdn_state", ndim=4, dtype=torch.float32, device=device)
    check(tuple(a.gdn_state.shape[1:]) == (HV, K, V),
          f"gdn_state slots are {tuple(a.gdn_state.shape[1:])}, expected {(HV, K, V)}")
    check_checkpoints(a.checkpoint_tokens, a.checkpoint_entries, a.checkpoint_states, device, (HV, K, V),
                      torch.float32)


@metrale_op(mutates_args=("gdn_state", "checkpoint_states"), check=_check)
def gdn_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                   slot_ids: Tensor, gdn_state: Tensor, checkpoint_tokens: Optional[Tensor] = None,
                   checkpoint_entries: Optional[Tensor] = None, checkpoint_states: Optional[Tensor] = None) -> Tensor:
    """Varlen gated delta rule with per-slot recurrent state. The CPU reference (the spec): plain
    torch, token by token, in fp32.

    Args:
        q, k: [T, H, K] L2-normalized queries and keys (model dtype); q is scaled by K**-0.5 here.
        v: [T, HV, V] values (model dtype), HV a multiple of H.
        g: [T, HV] float32 log-decay (<= 0).
        beta: [T, HV] write strength in (0, 1) (model dtype or float32).
        cu_seqlens: [B+1] int32 stream boundaries.
        slot_ids: [B] int32/int64 state slot of each stream.
        gdn_state: [S, HV, K, V] float32 pool. MUTATED: each stream's slot holds its final state.
        checkpoint_tokens, checkpoint_entries: [NC] int64, or None; checkpoint_states: [P+1, HV, K, V]
            float32 pool. MUTATED: entry checkpoint_entries[i] receives the state after token
            checkpoint_tokens[i] (prefix caching, ops/checkpoints.py).
    Returns:
        o: [T, HV, V] in v's dtype.
    """
    T, H, K = q.shape
    HV = v.shape[1]
    r = HV // H
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    qf = q.float().repeat_interleave(r, dim=1) * K**-0.5  # [T, HV, K]
    kf = k.float().repeat_interleave(r, dim=1)
    vf, bf, decay = v.float(), beta.float(), g.float().exp()
    bounds = cu_seqlens.tolist()
    keep = {}  # token -> checkpoint entries that want the state after it
    if wanted(checkpoint_tokens):
        for t, entry in zip(checkpoint_tokens.tolist(), checkpoint_entries.tolist()):
            if 0 <= t < bounds[-1]:
                keep.setdefault(t, []).append(entry)
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
            for entry in keep.get(t, ()):
                checkpoint_states[entry] = S
        gdn_state[slot] = S
    return o.to(v.dtype)


@metrale_fake(gdn_recurrence)
def _(a):
    return a.v.new_empty(a.v.shape)


# The chunked path of calls that are not decode-shaped: "triton" (ours, ops/gdn_chunked/) or "fla"
# (flash-linear-attention 0.6.0 on the aligned layout). Read at import from METRALE_GDN_CHUNKED
# (metrale_graph.envs); the module attribute may be set at run time (before a bucket is captured: a graph keeps
# the path it holds).
CHUNKED_BACKENDS = envs.choices("METRALE_GDN_CHUNKED")
CHUNKED_BACKEND = envs.METRALE_GDN_CHUNKED


def chunked_backend(K: int, V: int, device=None) -> str:
    """The chunked path's backend for key / value head dims K, V on `device`: CHUNKED_BACKEND, except "fla"
    where our kernels do not take the head dims (gdn_chunked.supported_head_dims: above 256; on a GPU a K
    that is not a multiple of 16 from 16 up). ValueError naming METRALE_GDN_CHUNKED for another name."""
    if CHUNKED_BACKEND not in CHUNKED_BACKENDS:
        raise ValueError(f"METRALE_GDN_CHUNKED / gdn_recurrence.CHUNKED_BACKEND must be one of "
                         f"{', '.join(CHUNKED_BACKENDS)}, got {CHUNKED_BACKEND!r}")
    return CHUNKED_BACKEND if supported_head_dims(K, V, device) else "fla"


@metrale_cuda(gdn_recurrence)
def gdn_recurrence_cuda(a):
    """Decode-shaped calls: the recurrent kernel on every stream; others: gdn_recurrence_split, its chunked
    path by chunked_backend (ours on the packed tokens, or fla on the aligned layout)."""
    keep = (a.checkpoint_tokens, a.checkpoint_entries, a.checkpoint_states) if wanted(a.checkpoint_tokens) else None
    if use_recurrent(a.q, a.slot_ids):
        return gdn_recurrence_recurrent(*a[:8], keep=keep)
    if chunked_backend(a.q.shape[2], a.v.shape[2], a.q.device) == "fla":
        if keep is not None:
            raise NotImplementedError(
                "metrale::gdn_recurrence: prefix-caching checkpoints inside the step need our chunked kernels "
                f"(METRALE_GDN_CHUNKED=triton, head dims up to 256; here {CHUNKED_BACKEND!r}, K {a.q.shape[2]}, "
                f"V {a.v.shape[2]}); use checkpoint_interval=0")
        return gdn_recurrence_split(*a[:8], fla_varlen)
    return gdn_recurrence_split(*a[:8], keep=keep)


def example(s: Shapes, dtype, g):
    cu, slots, _, _ = stream_meta(s, g)
    T, H, HV = s.T, s.H, s.HV
    qk = torch.nn.functional.normalize(torch.randn(T, 2 * H, s.K, generator=g), dim=-1).to(dtype)
    q, k = qk[:, :H], qk[:, H:]  # strided views, as the model passes them
    if T == 0:  # except when empty: opcheck's input clone sizes an empty strided view at < 0 elements
        q, k = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
    return (q, k, rand(g, T, HV, s.V, dtype=dtype), -torch.rand(T, HV, generator=g) * 0.5,
            torch.rand(T, HV, generator=g).to(dtype), cu, slots,
            torch.randn(s.num_slots + 1, HV, s.K, s.V, generator=g) * 0.1)


def cost(s: Shapes):
    """Per token: the chunked form, chunk 64 (kk^T, w / u, state update and read, intra-chunk output), or
    for the recurrent kernel's tokens (decode-shaped calls; otherwise streams of <= split_max_len(B)
    tokens) decay, S^T k, the rank-1 update and S^T q. Each slot of a non-empty stream is read and written
    once (by whichever path takes the stream)."""
    decode = decode_shaped(s.B, s.T)
    T_rec = sum(n for n in s.lengths if decode or n <= split_max_len(s.B))
    per_rec, per_chunked = 2 * (3 * s.K * s.V), 2 * (192 * s.K + 128 * s.V + 3 * s.K * s.V)
    streams = sum(n > 0 for n in s.lengths)
    return (s.HV * (T_rec * per_rec + (s.T - T_rec) * per_chunked),
            2 * (s.T * 2 * s.H * s.K + 2 * s.T * s.HV * s.V) + 6 * s.T * s.HV + 8 * streams * s.HV * s.K * s.V)


# fla 0.6.0's chunk kernels, by name ("chunk_" also names our layout kernel and our chunked kernels)
FLA_KERNELS = ("chunk_", "recompute_w_u", "solve_tril", "merge_16x16", "kkt")
OWN_KERNELS = ("_gdn_chunk_intra_kernel", "_gdn_chunk_state_kernel", "_chunk_layout_kernel", "_keep_end_states_kernel",
               "_token_entries_kernel", "_aligned_copy_kernel",
               "gdn_recurrent")
register(OpSpec(gdn_recurrence, example, cost, cuda=gdn_recurrence_cuda,
                kernels=FLA_KERNELS + OWN_KERNELS,
                onnx="metrale_graph.onnx.translations:gdn_recurrence"))
