"""Snapshots of a HybridCache (cache.py): a copy of everything it holds, and that copy put back in place.

Everything is every device tensor (`cache.state_tensors()`: the slot pools, KV pools, block tables, the
checkpoint pools and the step's targets, the MTP head's KV pools) and the host bookkeeping: the contexts
(`context_lens`, `mtp_context_lens`) and `cache.slot_blocks` (each slot's blocks, tokens and chain hashes, the
MTP head's notes per block; the prefix index: ref counts, labels, checkpoint entries). Tests and benchmarks use
snapshots to run one workload from the same state again.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSnapshot:
    """HybridCache.snapshot(): the cache it is of (a weak reference), copies of its state_tensors() and of its
    host bookkeeping (contexts, blocks, prefix index, tokens, chain hashes)."""
    cache: weakref.ref
    tensors: list[torch.Tensor]
    host: tuple


def take(cache) -> CacheSnapshot:
    """A copy of everything `cache` holds (module docstring)."""
    return CacheSnapshot(weakref.ref(cache), [t.clone() for t in cache.state_tensors()],
                         copy.deepcopy((cache.context_lens, cache.mtp_context_lens, cache.slot_blocks)))


def put_back(cache, snapshot: CacheSnapshot) -> None:
    """Put `cache` back to a snapshot() of itself (in place: captured graphs stay valid). Anything else
    (a snapshot of another cache, even of the same geometry) raises ValueError before anything is
    copied. If a copy fails midway, every slot is reset and every kept prefix forgotten (the pools'
    contents are then unknown) and the error propagates."""
    if not isinstance(snapshot, CacheSnapshot) or snapshot.cache() is not cache:
        got = "a snapshot of another cache" if isinstance(snapshot, CacheSnapshot) else type(snapshot).__name__
        raise ValueError(f"the snapshot is not of this cache (restore takes a snapshot() of this very cache, got "
                         f"{got}); nothing was restored")
    with cache.exclusive():
        try:
            cache.verify_targets_held = None  # (the targets come back with the snapshot's tensors)
            for t, s in zip(cache.state_tensors(), snapshot.tensors):
                t.copy_(s)
        except BaseException:
            cache.slot_blocks.index.clear()
            cache._reset(list(range(cache.num_slots)))
            raise
        ctx, mtp_ctx, cache.slot_blocks = copy.deepcopy(snapshot.host)
        cache.context_lens[:], cache.mtp_context_lens[:] = ctx, mtp_ctx
