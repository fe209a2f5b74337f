"""Torch-op equivalents of our device-side index kernels, the tests' oracles: the GDN recurrence's
chunk-aligned layout (ops/gdn_recurrence/layout.py) and the MoE pair alignment (ops/moe/align.py).
About twenty launches each where the kernels make one to three."""

import torch
from torch import Tensor

from metrale_graph.ops.gdn_recurrence.layout import CHUNK, num_chunks
from metrale_graph.ops.moe.align import align_size


def aligned_layout(cu_seqlens: Tensor, num_tokens: int, short: int = 0) -> tuple[Tensor, Tensor, Tensor, int]:
    """The chunk-aligned layout of the T packed tokens of the streams longer than `short`, in torch ops
    (layout.chunk_layout's cu_aligned and chunk_indices, plus each token's aligned row).

    Returns dest [T] int64 (the aligned row of each token; T_al for tokens in no stream or in a
    stream of at most `short` tokens), cu_aligned [B+2] int64 (B streams, those of at most `short`
    tokens at length 0, + the absorber), chunk_indices [NT, 2] int64 rows (sequence, chunk within
    sequence), and T_al = 64 * NT with NT = ceil(T / 64) + min(B, T // (short + 1)): each stream
    in the layout adds at most one partial chunk, and at most T // (short + 1) streams are longer
    than `short`.
    """
    B = cu_seqlens.shape[0] - 1
    dev = cu_seqlens.device
    NT = num_chunks(B, num_tokens, short)
    T_al = NT * CHUNK
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    laid = lengths > short  # the streams in the layout
    counts = torch.where(laid, lengths + CHUNK - 1, 0) // CHUNK
    # device ops only (a scalar written into a CUDA tensor is a host-to-device copy, not capturable)
    chunk_off = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0), counts.new_full((1,), NT)])
    t = torch.arange(num_tokens, device=dev)
    b = torch.searchsorted(cu[1:], t, right=True)  # B for tokens past the last stream
    bc = b.clamp(max=max(B - 1, 0))
    in_layout = torch.cat([laid, laid.new_zeros(1)])[b]
    dest = torch.where(in_layout, chunk_off[bc] * CHUNK + t - cu[bc], T_al)
    c = torch.arange(NT, device=dev)
    seq = torch.searchsorted(chunk_off, c, right=True) - 1
    chunk_indices = torch.stack([seq, c - chunk_off[seq]], 1)
    return dest, chunk_off * CHUNK, chunk_indices, T_al


def align_pairs_torch(top_e: Tensor, num_experts: int, block: int) -> tuple[Tensor, Tensor]:
    """align.align_pairs in plain torch ops: (sorted_ids, block_expert). Negative ids (padding rows' pairs) fall
    in no block, as the kernels' sort puts them before expert 0's group."""
    P, E, dev = top_e.numel(), num_experts, top_e.device
    nblk = align_size(P, E, block)
    experts, order = torch.sort(top_e.reshape(-1).to(torch.int32), stable=True)
    first = torch.searchsorted(experts, torch.arange(E + 1, device=dev, dtype=torch.int32)).long()  # group bounds
    padded = (first[1:] - first[:-1] + block - 1) // block * block
    start = torch.zeros(E + 1, dtype=torch.int64, device=dev)  # padded group bounds in sorted rows
    start[1:] = torch.cumsum(padded, 0)
    experts = experts.long()
    mine = experts >= 0
    e = experts[mine]
    dest = start[e] + torch.arange(P, device=dev)[mine] - first[e]  # sorted row of each sorted pair of an expert
    sorted_ids = torch.full((nblk * block,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order[mine].to(torch.int32))
    owner = torch.searchsorted(start[1:], torch.arange(nblk, device=dev) * block, right=True)  # E: past the end
    return sorted_ids, torch.where(owner < E, owner, -1).to(torch.int32)
