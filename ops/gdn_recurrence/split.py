"""Which CUDA path each stream of a GDN recurrence call takes, from static sizes only (so every
bucket's CUDA graph holds one path; docs/ops.md, "Decode-shaped calls" and "How the GDN op keeps
its chunked path static").

Decode-shaped calls (ops.common.decode_shaped) run the recurrent kernel (recurrent.py) on every
stream. Others are split by lengths read on the device: with several streams, those of at most SHORT
tokens take the recurrent kernel and longer ones the chunked path (our chunked kernels on the packed
tokens, chunked.py; or, for A/B against flash-linear-attention, a varlen function on the aligned
layout, layout.py); a single stream takes the chunked path whole.
"""

from torch import Tensor

from ..checkpoints import keep_end_states_triton
from ..common import decode_shaped
from .chunked import gdn_recurrence_chunked
from .layout import gdn_recurrence_aligned
from .recurrent import gdn_recurrence_recurrent


def use_recurrent(q: Tensor, slot_ids: Tensor) -> bool:
    """The path choice of the CUDA implementation: static sizes (B, T) only (ops.common.decode_shaped)."""
    return decode_shaped(slot_ids.shape[0], q.shape[0])


SHORT = 64


def split_max_len(num_streams: int) -> int:
    """In a call that is not decode-shaped, streams of at most this many tokens take the recurrent kernel
    and longer ones the chunked path: SHORT with several streams; 0 with one (all of it chunked, no
    second launch). Static sizes only."""
    return SHORT if num_streams > 1 else 0


def gdn_recurrence_split(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, varlen_fn=None, keep=None, **chunked):
    """A call that is not decode-shaped: the chunked path over the streams longer than split_max_len(B), then
    the recurrent kernel over the others, into the same output.

    varlen_fn None: our chunked kernels on the packed tokens (gdn_recurrence_chunked, which takes `chunked`:
    checkpoints, config); it neither reads nor writes the short streams' slots. Otherwise varlen_fn on the
    aligned layout (gdn_recurrence_aligned: fla, or a reference in the tests), which writes every slot of
    the batch back (the short streams' unchanged) before the recurrent kernel updates the short streams'
    slots in place and writes their rows of o. Which stream goes where is decided on the device
    (cu_seqlens); shapes depend on (B, T) only.

    keep: (checkpoint_tokens, checkpoint_entries, pool) or None, the op's prefix-caching checkpoints
    (ops/checkpoints.py), with our chunked kernels only: the chunked streams' chunk starts, the short
    streams' every token, and last, the chunked streams' last tokens from the pool of slot states.
    """
    max_len = split_max_len(slot_ids.shape[0])
    if varlen_fn is None:
        o = gdn_recurrence_chunked(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, max_len, keep=keep, **chunked)
    elif chunked or keep is not None:
        raise ValueError(f"gdn_recurrence_split: {', '.join([*chunked, *(['keep'] if keep else [])])} apply to "
                         f"our chunked kernels only, not to varlen_fn {getattr(varlen_fn, '__name__', varlen_fn)!r}")
    else:
        o = gdn_recurrence_aligned(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, varlen_fn, max_len)
    if max_len:
        gdn_recurrence_recurrent(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state, max_len, o, keep=keep)
    if keep is not None:  # the chunked streams' last tokens (the recurrent kernel kept the short streams')
        keep_end_states_triton(cu_seqlens, slot_ids, gdn_state, *keep, longer_than=max_len)
    return o
