"""Prefix caching's state checkpoints inside the GDN ops (metrale_graph/prefix_cache.py has the why).

A step may ask the GDN ops to keep the state after some of its tokens: `checkpoint_tokens` [NC] int64
(packed token index t: the state after token t of t's stream; -1: none) and `checkpoint_entries` [NC]
int64 (the entry of the checkpoint pool it goes to; the pool's last entry, the scratch one, for -1).
NC is fixed for a cache, so a bucket's graph stays static; which tokens is data. `causal_conv1d` keeps
the last W-1 inputs up to t (`checkpoint_conv_states` [P+1, C, W-1]), `gdn_recurrence` the recurrent
state after t (`checkpoint_states` [P+1, HV, K, V] fp32). The CPU references keep any token, and so do
the CUDA conv and the recurrent GDN kernel (token_entries); the chunked GDN path keeps the states at a
stream's chunk boundaries (t - start + 1 a multiple of 64, chunk_rows) and at its last token
(keep_end_states), which is what the prefill protocol asks for (HybridCache.plan_checkpoints). At most one
entry per token on CUDA.
"""

import torch
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor


def check_checkpoints(tokens, entries, states, device, shape: tuple[int, ...], dtype) -> None:
    """All three absent, or all three given: tokens / entries [NC] int64, states [P+1, *shape] of `dtype`."""
    given = [x is not None for x in (tokens, entries, states)]
    check(all(given) or not any(given), "checkpoint_tokens, checkpoint_entries and the checkpoint pool come together")
    if not any(given):
        return
    check_tensor(tokens, "checkpoint_tokens", ndim=1, dtype=torch.int64, device=device)
    check_tensor(entries, "checkpoint_entries", ndim=1, dtype=INDEX_DTYPES, device=device)
    check(tokens.shape == entries.shape, f"{tokens.shape[0]} checkpoint_tokens for {entries.shape[0]} entries")
    check_tensor(states, "checkpoint pool", ndim=len(shape) + 1, dtype=dtype, device=device)
    check(tuple(states.shape[1:]) == tuple(shape) and states.shape[0] >= 1,
          f"checkpoint pool entries are {tuple(states.shape)}, expected [P+1, {', '.join(map(str, shape))}]")


def wanted(tokens: Tensor | None) -> bool:
    """Whether a call keeps any checkpoint (static: the buffer's size, never its data)."""
    return tokens is not None and tokens.numel() > 0


def targets(tokens: Tensor, entries: Tensor, cu_seqlens: Tensor, scratch: int):
    """Per checkpoint: its stream b, token t (0 for none), how many of the stream's tokens it follows r
    (0 for none) and its entry (`scratch` for none); device ops only."""
    B = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    valid = tokens >= 0
    t = tokens.clamp(min=0)
    b = torch.searchsorted(cu[1:], t, right=True).clamp(max=max(B - 1, 0))
    valid = valid & (t < cu[-1])
    r = torch.where(valid, t - cu[b] + 1, 0)
    dest = torch.where(valid, entries.long(), scratch)
    return b, t, r, dest


def keep_conv_windows(x: Tensor, cu_seqlens: Tensor, slot_ids: Tensor, conv_state: Tensor, tokens: Tensor,
                      entries: Tensor, pool: Tensor) -> None:
    """pool[entry] = the last W-1 inputs up to each checkpoint token (its stream's, or the slot's old conv
    state before the stream starts). Runs before the conv updates conv_state; torch ops on any device."""
    T, C = x.shape
    W1 = conv_state.shape[2]
    if W1 == 0:
        return
    b, t, _, dest = targets(tokens, entries, cu_seqlens, pool.shape[0] - 1)
    start = cu_seqlens.long()[b]
    u = t[:, None] - (W1 - 1) + torch.arange(W1, device=x.device)  # [NC, W-1]: the inputs kept
    from_x = x[u.clamp(0, max(T - 1, 0))].transpose(1, 2)  # [NC, C, W-1]
    col = (u - start[:, None] + W1).clamp(0, W1 - 1)
    old = conv_state[slot_ids.long()[b]]  # [NC, C, W-1]
    from_state = old.gather(2, col[:, None, :].expand(-1, C, -1))
    window = torch.where((u >= start[:, None])[:, None, :], from_x, from_state)
    pool.index_copy_(0, dest, window.to(pool.dtype))


def keep_end_states(cu_seqlens: Tensor, slot_ids: Tensor, gdn_state: Tensor, tokens: Tensor, entries: Tensor,
                    pool: Tensor, longer_than: int = 0) -> None:
    """pool[entry] = the slot's state, for the checkpoints at the last token of a stream of more than
    `longer_than` tokens (after the pool of slot states holds the streams' final states; a split call's
    shorter streams had theirs kept by the recurrent kernel); the others' entries untouched. Device ops only."""
    b, _, r, dest = targets(tokens, entries, cu_seqlens, pool.shape[0] - 1)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    at_end = (r > 0) & (r == lengths[b]) & (r > longer_than)
    dest = torch.where(at_end, dest, pool.shape[0] - 1)
    pool.index_copy_(0, dest, gdn_state[slot_ids.long()[b]])


def chunk_rows(tokens: Tensor, entries: Tensor, cu_seqlens: Tensor, cu_aligned: Tensor, short: int, scratch: int):
    """For the chunked GDN path (ops/gdn_recurrence/chunked.py): per checkpoint, the chunk row at whose
    start its state is (stream b's chunk i is row cu_aligned[b] // 64 + i), -1 where it is not a chunk
    start inside a stream the chunked path takes (longer than `short` tokens; a stream's last token is
    keep_end_states' job), and its entry (`scratch` for none). Device ops only."""
    b, _, r, dest = targets(tokens, entries, cu_seqlens, scratch)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n = lengths[b] if lengths.numel() else torch.zeros_like(r)
    inner = (r > 0) & (r % 64 == 0) & (r < n) & (n > short)
    rows = torch.where(inner, cu_aligned[b] // 64 + r // 64, -1)
    return rows, dest


def token_entries(tokens: Tensor, entries: Tensor, num_tokens: int) -> Tensor:
    """[T] int64: the checkpoint entry that wants the state after packed token t, -1 for none (the
    recurrent kernel's per-token lookup; one entry per token). Device ops only."""
    T = num_tokens
    valid = (tokens >= 0) & (tokens < T)
    out = torch.full((T + 1,), -1, dtype=torch.int64, device=tokens.device)
    out.index_copy_(0, torch.where(valid, tokens, T), torch.where(valid, entries.long(), -1))
    return out[:T]
