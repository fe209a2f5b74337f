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

On CUDA each piece is one launch whatever NC is, and a checkpoint that keeps nothing (token -1, past the streams,
or not at a stream end for keep_end_states_triton) costs its program a load or two and writes nothing:
keep_conv_windows_triton, keep_end_states_triton and token_entries find each checkpoint's stream on the device
(_stream_bounds). The torch versions (the CPU op's, and the tests' reference) move every one of the NC entries,
dumping the none-targets into the scratch entry; run in every GDN layer of every step, that was 0.09 ms a GDN
layer of the speculative engine's decode step on an H100 (NC sized for its verify entries), 0.29 at 32 streams x
2 drafts. copy_rows moves the accepted verify states into their slots (capture/speculative.py).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INDEX_DTYPES, check, check_tensor
from .tiles import _stream_of, search_steps


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
    if W1 == 0 or T == 0:  # no state, or no token: every checkpoint keeps nothing (and x has no row to gather)
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


@triton.jit
def _stream_bounds(cu_ptr, t, B, STEPS: tl.constexpr):
    """The stream b of packed token t (tiles._stream_of, searchsorted(cu[1:], t, right), clamped to B - 1) and
    its bounds."""
    b = tl.minimum(_stream_of(cu_ptr, t, B, STEPS), B - 1)
    return b, tl.load(cu_ptr + b).to(tl.int64), tl.load(cu_ptr + b + 1).to(tl.int64)


@triton.jit
def _copy_row_block(src_ptr, s, dst_ptr, d, N, BLOCK: tl.constexpr):
    """Block program_id(1) of the N elements at element offset s of src into offset d of dst (offsets int64)."""
    off = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = off < N
    tl.store(dst_ptr + d + off, tl.load(src_ptr + s + off, mask=m).to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _keep_windows_kernel(x_ptr, cu_ptr, slot_ptr, state_ptr, tok_ptr, ent_ptr, pool_ptr, B, C, stride_xt, stride_xc,
                         stride_s0, stride_s1, stride_s2, stride_p0, stride_p1, stride_p2, W1: tl.constexpr,
                         BW: tl.constexpr, STEPS: tl.constexpr, BC: tl.constexpr):
    i = tl.program_id(0)
    t = tl.load(tok_ptr + i)
    if (t >= 0) & (t < tl.load(cu_ptr + B)):  # a checkpoint that keeps nothing costs its program two loads
        b, start, _ = _stream_bounds(cu_ptr, t, B, STEPS)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        dest = tl.load(ent_ptr + i).to(tl.int64)
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        jj = tl.arange(0, BW)
        u = t - (W1 - 1) + jj  # the inputs kept: the stream's own from `start` on, the slot's old state before
        mc, mj = cc < C, jj < W1
        in_x = u >= start
        from_x = tl.load(x_ptr + u[None, :] * stride_xt + cc[:, None] * stride_xc,
                         mask=mc[:, None] & (mj & in_x)[None, :], other=0.0)
        col = u - start + W1
        from_s = tl.load(state_ptr + slot * stride_s0 + cc[:, None] * stride_s1 + col[None, :] * stride_s2,
                         mask=mc[:, None] & (mj & (u < start))[None, :], other=0.0)
        window = tl.where(in_x[None, :], from_x, from_s.to(from_x.dtype))
        tl.store(pool_ptr + dest * stride_p0 + cc[:, None] * stride_p1 + jj[None, :] * stride_p2,
                 window.to(pool_ptr.dtype.element_ty), mask=mc[:, None] & mj[None, :])


def keep_conv_windows_triton(x: Tensor, cu_seqlens: Tensor, slot_ids: Tensor, conv_state: Tensor, tokens: Tensor,
                             entries: Tensor, pool: Tensor) -> None:
    """keep_conv_windows in one launch (the CUDA path): a program per checkpoint and block of channels,
    computing its stream on the device; checkpoints that keep nothing write nothing (the torch version
    writes them to the scratch entry)."""
    T, C = x.shape
    W1, B, NC = conv_state.shape[2], slot_ids.shape[0], tokens.shape[0]
    if W1 == 0 or B == 0 or NC == 0 or T == 0:
        return
    BC = min(256, triton.next_power_of_2(C))
    _keep_windows_kernel[(NC, triton.cdiv(C, BC))](
        x, cu_seqlens.contiguous(), slot_ids.contiguous(), conv_state, tokens.contiguous(), entries.contiguous(),
        pool, B, C, x.stride(0), x.stride(1), *conv_state.stride(), *pool.stride(), W1=W1,
        BW=triton.next_power_of_2(W1), STEPS=search_steps(B), BC=BC, num_warps=4)


@triton.jit
def _keep_end_states_kernel(state_ptr, cu_ptr, slot_ptr, tok_ptr, ent_ptr, pool_ptr, B, N, longer_than, stride_s0,
                            stride_p0, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    t = tl.load(tok_ptr + i)
    if (t >= 0) & (t < tl.load(cu_ptr + B)):
        b, start, end = _stream_bounds(cu_ptr, t, B, STEPS)
        r = t - start + 1
        if (r == end - start) & (r > longer_than):  # a stream's last token, of a stream that long
            slot = tl.load(slot_ptr + b).to(tl.int64)
            dest = tl.load(ent_ptr + i).to(tl.int64)
            _copy_row_block(state_ptr, slot * stride_s0, pool_ptr, dest * stride_p0, N, BLOCK)


def keep_end_states_triton(cu_seqlens: Tensor, slot_ids: Tensor, gdn_state: Tensor, tokens: Tensor, entries: Tensor,
                           pool: Tensor, longer_than: int = 0) -> None:
    """keep_end_states in one launch (the CUDA path): only the checkpoints at a kept stream end read and
    write a state (the torch version copies every checkpoint's slot state, into the scratch entry for the
    others: NC states each way whatever the step keeps). Falls back to it for states whose entries are not
    contiguous."""
    B, NC = slot_ids.shape[0], tokens.shape[0]
    if B == 0 or NC == 0:
        return
    if not (gdn_state[0].is_contiguous() and pool[0].is_contiguous()):
        keep_end_states(cu_seqlens, slot_ids, gdn_state, tokens, entries, pool, longer_than)
        return
    N, BLOCK = gdn_state[0].numel(), 4096
    _keep_end_states_kernel[(NC, triton.cdiv(N, BLOCK))](
        gdn_state, cu_seqlens.contiguous(), slot_ids.contiguous(), tokens.contiguous(), entries.contiguous(), pool,
        B, N, longer_than, gdn_state.stride(0), pool.stride(0), STEPS=search_steps(B), BLOCK=BLOCK,
        num_warps=4)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, index_ptr, n, N, skip, stride_src, stride_dst, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    d = tl.load(index_ptr + i)
    if d != skip:
        _copy_row_block(src_ptr, tl.load(index_ptr + n + i) * stride_src, dst_ptr, d * stride_dst, N, BLOCK)


def copy_rows(dst: Tensor, src: Tensor, index: Tensor, skip: int = -1) -> None:
    """dst[index[0, i]] = src[index[1, i]] for each column i of index [2, n] int64 whose row index[0, i] is not
    `skip` (padding, left alone): the accepted verify states into their slots (capture/speculative.py), each row read once
    and written once in one launch (index_select then index_copy_ moved them twice). Rows must not overlap
    between dst and src. Torch ops where a row is not contiguous."""
    if index.dtype != torch.int64 or index.dim() != 2 or index.shape[0] != 2:
        raise ValueError(f"copy_rows: index must be int64 [2, n] (row offsets are int64 in the kernel), got "
                         f"{index.dtype} {tuple(index.shape)}")
    n = index.shape[1]
    if n == 0:
        return
    if not (dst[0].is_contiguous() and src[0].is_contiguous()) or dst.dtype != src.dtype:
        dst.index_copy_(0, index[0], src.index_select(0, index[1]).to(dst.dtype))  # (padding rows copied too)
        return
    N, BLOCK = dst[0].numel(), 4096
    if N == 0:  # (a conv window of width 1 keeps no inputs: [S, C, 0] pools)
        return
    _copy_rows_kernel[(n, triton.cdiv(N, BLOCK))](src, dst, index.contiguous(), n, N, skip, src.stride(0),
                                                  dst.stride(0), BLOCK=BLOCK, num_warps=4)


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


@triton.jit
def _token_entries_kernel(tok_ptr, ent_ptr, out_ptr, T, NC, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for s in range(0, T, BLOCK):
        tl.store(out_ptr + s + offs, tl.full((BLOCK,), -1, tl.int64), mask=s + offs < T)
    tl.debug_barrier()  # one program: its -1s land before the entries over them
    for s in range(0, NC, BLOCK):
        m = s + offs < NC
        t = tl.load(tok_ptr + s + offs, mask=m, other=-1)
        e = tl.load(ent_ptr + s + offs, mask=m, other=-1).to(tl.int64)
        tl.store(out_ptr + t, e, mask=m & (t >= 0) & (t < T))


def token_entries(tokens: Tensor, entries: Tensor, num_tokens: int) -> Tensor:
    """[T] int64: the checkpoint entry that wants the state after packed token t, -1 for none (the
    recurrent kernel's per-token lookup; one entry per token). One launch of one program (it ran as four
    torch ops in every GDN layer of every step)."""
    out = torch.empty((num_tokens,), dtype=torch.int64, device=tokens.device)
    if num_tokens:
        _token_entries_kernel[(1,)](tokens.contiguous(), entries.contiguous(), out, num_tokens, tokens.shape[0],
                                    BLOCK=1024, num_warps=4)
    return out
