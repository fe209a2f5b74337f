"""The GDN recurrence's chunked path: our chunked kernels (ops/gdn_chunked/) straight on the packed
tokens and the state pool. docs/ops.md, "How the GDN op keeps its chunked path static".

Three launches, every size from (B, T): one program computes the bounds and chunk rows of the
M = layout.num_long(B, T, short) sequences that can be longer than `short` (layout.chunk_layout_compact:
the j-th such stream's chunks of 64 tokens from its first token, NT = layout.num_chunks(B, T, short) rows,
those after every stream's naming the empty spare sequence M), then the intra-chunk kernel and the state
pass over those M + 1 sequences. The state pass reads each stream's initial state from
gdn_state[slot_ids[b]] and writes its final state back there; streams of at most `short` tokens
(left to the recurrent kernel, split.py) and zero-length streams are empty sequences, whose slots it
neither reads nor writes; the spare sequence's programs zero the output rows of tokens in no stream.
"""

import torch
from torch import Tensor

from ..checkpoints import chunk_rows
from ..gdn_chunked import ChunkConfig, chunked_gdn_pool_forward
from .layout import chunk_layout_compact


def gdn_recurrence_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                           slot_ids: Tensor, gdn_state: Tensor, short: int = 0, o: Tensor | None = None,
                           checkpoint_chunks: Tensor | None = None, checkpoints: Tensor | None = None,
                           config: ChunkConfig | None = None, keep=None) -> Tensor:
    """metrale::gdn_recurrence's arguments: the streams longer than `short` tokens through the chunked
    kernels, from and into their pool rows (no host sync, no copies of tokens or states).

    Returns o [T, HV, V] in v's dtype (`o` if given: contiguous, written in place): rows of the chunked
    streams' tokens, and 0 in the rows of tokens in no stream (past cu_seqlens[B]); the rows of streams of at
    most `short` tokens are left as they are, and their slots untouched, for the caller to compute.
    MUTATED: gdn_state rows of the chunked streams' slots.

    checkpoint_chunks [P] int64 / checkpoints [P, HV, K, V] fp32 (internal, not in the op's schema): entry p
    receives the state at the start of chunk row checkpoint_chunks[p] (-1: none), where stream b's chunk i
    (tokens cu_seqlens[b] + 64 i onwards) is row cu_aligned[b] // 64 + i of
    chunk_layout_compact(cu_seqlens, slot_ids, T, short)'s cu_aligned (chunk_layout_bounds'). config:
    default_config(layout.num_long(B, T, short) + 1, HV, V).
    keep: (checkpoint_tokens, checkpoint_entries, pool) or None, the op's prefix-caching checkpoints
    (ops/checkpoints.py): pool[entry] receives the state after its token where that token ends a chunk
    inside a stream this path takes (chunk_rows); instead of checkpoint_chunks / checkpoints.
    """
    T = q.shape[0]
    if o is None:
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if T == 0:
        return o
    cu_aligned, bounds, slots, chunk_indices = chunk_layout_compact(cu_seqlens.contiguous(), slot_ids.contiguous(),
                                                                    T, short)
    entries = None
    if keep is not None:
        if checkpoints is not None:
            raise ValueError("gdn_recurrence_chunked: keep or checkpoint_chunks / checkpoints, not both")
        tokens, wanted_entries, checkpoints = keep
        checkpoint_chunks, entries = chunk_rows(tokens, wanted_entries, cu_seqlens, cu_aligned, short,
                                                checkpoints.shape[0] - 1)
    return chunked_gdn_pool_forward(q, k, v, g, beta, bounds, chunk_indices, gdn_state, slots, o,
                                    checkpoint_chunks=checkpoint_chunks, checkpoints=checkpoints, config=config,
                                    checkpoint_entries=entries)
