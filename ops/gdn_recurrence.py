"""GDN phase 2, the gated delta rule over packed varlen streams, each from its slot's state.

Per value head j (key head j // r, r = HV / H), token by token:
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T (q_t * K**-0.5)
with S [K, V] in fp32. The final S of each stream goes back to its slot. A zero-length
stream (padding) leaves its slot unchanged.
"""

import os

import torch
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor
from .registry import OpSpec, Shapes, metrale_op, rand, register, stream_meta

OP = "gdn_recurrence"


@metrale_op("gdn_recurrence", mutates_args=("gdn_state",))
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


# CUDA path: flash-linear-attention's chunked kernels on a chunk-aligned layout -------------------
#
# fla 0.6.0's varlen chunked gated delta rule replays exactly in a CUDA graph only if the
# number of sequences and the total chunk count sum(ceil(len_i / 64)) stay fixed, its chunk
# indices come in explicitly (its own preparation syncs with the host) and its identity-keyed
# tensor cache is off (a captured graph would keep stale offsets). So every call lays the T
# tokens out chunk-aligned in a buffer of NT = ceil(T/64) + B chunks, an upper bound of the
# chunk count that depends on shapes alone: stream b starts at a multiple of 64, identity
# tokens (g = 0, beta = 0, k = q = v = 0, which leave a state unchanged) fill the gaps, and one
# absorber sequence from the scratch-state zero takes the chunks left over. Sequences: B + 1;
# chunks: NT; both fixed for a bucket. All index math runs on the device.
CHUNK = 64


def aligned_layout(cu_seqlens: Tensor, num_tokens: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """Device-side chunk-aligned layout of T packed tokens.

    Returns dest [T] int64 (the aligned row of each token; T_al for tokens in no stream),
    cu_aligned [B+2] int64 (B streams + the absorber), chunk_indices [NT, 2] int64 rows
    (sequence, chunk within sequence), and T_al = 64 * NT with NT = ceil(T / 64) + B.
    """
    B = cu_seqlens.shape[0] - 1
    dev = cu_seqlens.device
    NT = -(-num_tokens // CHUNK) + B
    T_al = NT * CHUNK
    cu = cu_seqlens.long()
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    # device ops only (a scalar written into a CUDA tensor is a host-to-device copy, not capturable)
    chunk_off = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0), counts.new_full((1,), NT)])
    t = torch.arange(num_tokens, device=dev)
    b = torch.searchsorted(cu[1:], t, right=True)
    bc = b.clamp(max=max(B - 1, 0))
    dest = torch.where(b < B, chunk_off[bc] * CHUNK + t - cu[bc], T_al)
    c = torch.arange(NT, device=dev)
    seq = torch.searchsorted(chunk_off, c, right=True) - 1
    chunk_indices = torch.stack([seq, c - chunk_off[seq]], 1)
    return dest, chunk_off * CHUNK, chunk_indices, T_al


def gdn_recurrence_aligned(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, varlen_fn):
    """Gather states, lay tokens out chunk-aligned, run `varlen_fn`, scatter states and outputs back.

    varlen_fn(q, k, v, g, beta, cu_aligned, chunk_indices, h0) -> (o [T_al, HV, V], final [B+1, HV, K, V])
    computes the gated delta rule over aligned sequences (q unscaled, scale K**-0.5 inside).
    """
    T, H, K = q.shape
    HV, V = v.shape[1:]
    B = slot_ids.shape[0]
    dest, cu_al, chunk_indices, T_al = aligned_layout(cu_seqlens, T)

    def aligned(x):
        buf = x.new_zeros((T_al + 1,) + tuple(x.shape[1:]))  # + a dump row for tokens in no stream
        buf.index_copy_(0, dest, x)
        return buf[:T_al]

    h0 = torch.cat([gdn_state.index_select(0, slot_ids), gdn_state.new_zeros(1, HV, K, V)])
    o_al, final = varlen_fn(aligned(q), aligned(k), aligned(v), aligned(g), aligned(beta), cu_al, chunk_indices, h0)
    gdn_state.index_copy_(0, slot_ids, final[:B])
    return o_al.index_select(0, dest.clamp(max=T_al - 1))  # rows of tokens in no stream: unspecified


_fla_fwd = None


def fla_varlen(q, k, v, g, beta, cu_aligned, chunk_indices, h0):
    """flash-linear-attention 0.6.0's forward, called below its autograd wrapper (which is
    compile-disabled and prepares chunk indices on the host)."""
    global _fla_fwd
    if _fla_fwd is None:
        os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")
        import fla.utils
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

        # fla reads this module attribute on every call, so this holds even if fla was imported first
        fla.utils.FLA_DISABLE_TENSOR_CACHE = True
        _fla_fwd = chunk_gated_delta_rule_fwd
    _, o, _, final, _, _ = _fla_fwd(
        q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=q.shape[-1] ** -0.5,
        initial_state=h0, output_final_state=True, cu_seqlens=cu_aligned, chunk_indices=chunk_indices)
    return o[0], final


@gdn_recurrence.register_kernel("cuda")
def gdn_recurrence_cuda(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state):
    _check(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state)
    return gdn_recurrence_aligned(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, fla_varlen)


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
    """Chunked form, chunk 64: kk^T, w / u, state update and read, intra-chunk output."""
    per = 2 * (192 * s.K + 128 * s.V + 3 * s.K * s.V)
    return (s.T * s.HV * per,
            2 * (s.T * 2 * s.H * s.K + 2 * s.T * s.HV * s.V) + 6 * s.T * s.HV + 8 * s.B * s.HV * s.K * s.V)


# fla 0.6.0's chunk kernels, by name
FLA_KERNELS = ("chunk_", "recompute_w_u", "solve_tril", "merge_16x16", "kkt")
register(OpSpec(gdn_recurrence, gdn_recurrence_ref, example, cost, cuda=gdn_recurrence_cuda, kernels=FLA_KERNELS,
                onnx="metrale_graph.onnx.translations:gdn_recurrence"))
