"""GDN phase 1, causal depthwise conv1d + SiLU over packed varlen streams, each starting
from its slot's conv state (its last W-1 inputs) and leaving the new one there.

A zero-length stream (padding) computes nothing and leaves its slot's state unchanged.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .checkpoints import check_checkpoints, keep_conv_windows, keep_conv_windows_triton, wanted
from .common import INDEX_DTYPES, check, check_tensor, decode_shaped
from .tiles import _stream_of, search_steps
from .registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, rand, register, stream_meta, weight

def _check(a):
    check_tensor(a.x, "x", ndim=2)
    C = a.x.shape[1]
    check_tensor(a.weight, "weight", ndim=2, dtype=a.x.dtype, device=a.x.device)
    check(a.weight.shape[0] == C, f"weight has {a.weight.shape[0]} channels, x has {C}")
    check_tensor(a.cu_seqlens, "cu_seqlens", ndim=1, dtype=torch.int32, device=a.x.device)
    check_tensor(a.slot_ids, "slot_ids", ndim=1, dtype=INDEX_DTYPES, device=a.x.device)
    check(a.slot_ids.shape[0] + 1 == a.cu_seqlens.shape[0],
          f"{a.slot_ids.shape[0]} slot_ids for {a.cu_seqlens.shape[0] - 1} streams")
    check_tensor(a.conv_state, "conv_state", ndim=3, dtype=a.x.dtype, device=a.x.device)
    state = (C, a.weight.shape[1] - 1)
    check(tuple(a.conv_state.shape[1:]) == state, f"conv_state slots are {tuple(a.conv_state.shape[1:])}, expected {state}")
    check_checkpoints(a.checkpoint_tokens, a.checkpoint_entries, a.checkpoint_conv_states, a.x.device, state, a.x.dtype)


@metrale_op(mutates_args=("conv_state", "checkpoint_conv_states"), check=_check)
def causal_conv1d(x: Tensor, weight: Tensor, cu_seqlens: Tensor, slot_ids: Tensor, conv_state: Tensor,
                  checkpoint_tokens: Optional[Tensor] = None, checkpoint_entries: Optional[Tensor] = None,
                  checkpoint_conv_states: Optional[Tensor] = None) -> Tensor:
    """Varlen causal conv1d with per-slot state, then SiLU. The CPU reference: plain torch, one stream
    at a time (a host loop).

    Args:
        x: [T, C] packed pre-conv channels (model dtype).
        weight: [C, W] depthwise kernel (no bias).
        cu_seqlens: [B+1] int32, stream b is tokens cu_seqlens[b]:cu_seqlens[b+1].
        slot_ids: [B] int32/int64, the conv-state slot of each stream.
        conv_state: [S, C, W-1] pool, x's dtype. MUTATED: each stream's slot receives the
            last W-1 inputs of (old state ++ stream tokens).
        checkpoint_tokens, checkpoint_entries: [NC] int64, or None; checkpoint_conv_states: [P+1, C, W-1]
            pool. MUTATED: entry checkpoint_entries[i] receives the last W-1 inputs up to token
            checkpoint_tokens[i] (prefix caching, ops/checkpoints.py).
    Returns:
        y: [T, C], x's dtype: `silu(conv(state ++ x))` per stream.
    """
    C, W = weight.shape
    if wanted(checkpoint_tokens):  # before the states move on
        keep_conv_windows(x, cu_seqlens, slot_ids, conv_state, checkpoint_tokens, checkpoint_entries,
                          checkpoint_conv_states)
    y = x.new_empty(x.shape)  # contiguous whatever x's layout, as the fake and the CUDA path
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            continue
        window = torch.cat([conv_state[slot], x[s:e].t()], dim=1)  # [C, W-1+L]
        out = F.conv1d(window[None], weight[:, None, :], groups=C)[0]  # [C, L]
        y[s:e] = F.silu(out).t()
        conv_state[slot] = window[:, window.shape[1] - (W - 1):]
    return y


@metrale_fake(causal_conv1d)
def _(a):
    return a.x.new_empty(a.x.shape)  # contiguous whatever x's layout, as the CUDA path's and the reference's


@triton.jit
def _conv1d_kernel(x_ptr, w_ptr, y_ptr, state_ptr, cu_ptr, slot_ptr, T, C, B, stride_x, stride_s0, stride_s1,
                   stride_s2, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = t < T, c < C
    b = tl.where(mt, _stream_of(cu_ptr, t, B, STEPS), B)
    valid = mt & (b < B)  # tokens past cu_seqlens[-1] belong to no stream: output 0
    bb = tl.minimum(b, B - 1)
    start = tl.load(cu_ptr + bb, mask=valid, other=0)
    slot = tl.load(slot_ptr + bb, mask=valid, other=0).to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        u = t - (W - 1) + j  # the input this tap reads: a token of the stream, or its conv state
        in_x = valid & (u >= start)
        in_s = valid & (u < start)
        xv = tl.load(x_ptr + u.to(tl.int64)[:, None] * stride_x + c[None, :],
                     mask=in_x[:, None] & mc[None, :], other=0.0)
        s_idx = (W - 1) + u - start
        sv = tl.load(state_ptr + slot[:, None] * stride_s0 + c[None, :] * stride_s1 + s_idx[:, None] * stride_s2,
                     mask=in_s[:, None] & mc[None, :], other=0.0)
        wj = tl.load(w_ptr + c * W + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv1d_state_kernel(x_ptr, state_ptr, cu_ptr, slot_ptr, C, stride_x, stride_s0, stride_s1, stride_s2,
                         W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    start, end = tl.load(cu_ptr + b), tl.load(cu_ptr + b + 1)
    if end > start:  # a zero-length (padding) stream leaves its slot alone
        slot = tl.load(slot_ptr + b).to(tl.int64)
        i = tl.arange(0, WP)
        mi = i < W - 1
        u = end - (W - 1) + i  # the last W-1 inputs of (old state ++ stream)
        in_x = mi & (u >= start)
        in_s = mi & (u < start)
        base = state_ptr + slot * stride_s0 + c[:, None] * stride_s1
        xv = tl.load(x_ptr + u.to(tl.int64)[None, :] * stride_x + c[:, None], mask=mc[:, None] & in_x[None, :],
                     other=0.0)
        sv = tl.load(base + (i + (end - start))[None, :] * stride_s2, mask=mc[:, None] & in_s[None, :], other=0.0)
        tl.store(base + i[None, :] * stride_s2, (xv + sv).to(state_ptr.dtype.element_ty),
                 mask=mc[:, None] & mi[None, :])


DECODE_MAX_WIDTH = 4  # the one-launch decode kernel holds a channel's window in registers: up to 3 inputs


@triton.jit
def _tap(zero, w_ptr, c, mc, W: tl.constexpr, j: tl.constexpr):
    """Tap j's weights of channels c in fp32; `zero` (fp32 zeros of c's shape) for j >= W."""
    if j < W:
        return tl.load(w_ptr + c * W + j, mask=mc, other=0.0).to(tl.float32)
    return zero


@triton.jit(do_not_specialize=["T"])
def _conv1d_decode_kernel(x_ptr, w_ptr, y_ptr, state_ptr, cu_ptr, slot_ptr, T, C, B, stride_x, stride_s0, stride_s1,
                          stride_s2, W: tl.constexpr, BC: tl.constexpr):
    """Program (b, channel tile): stream b's tokens one by one, each thread holding its channels' window (the last
    W - 1 <= 3 inputs: s0 the oldest) in registers, loaded from the slot's state, shifted by every token and stored
    back as the new state by the thread that loaded it (no thread reads what another writes); program (B, tile)
    zeroes the rows past cu_seqlens[B]. The taps are summed in the order of the two-kernel path (oldest first)."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    if b == B:  # rows that belong to no stream: 0, as the other path writes them
        last = tl.load(cu_ptr + B).to(tl.int64)
        for i in range(0, T - last):
            tl.store(y_ptr + (last + i) * C + c, tl.zeros([BC], dtype=y_ptr.dtype.element_ty), mask=mc)
    else:
        slot = tl.load(slot_ptr + b).to(tl.int64)  # (issued with the bounds: the chain is bounds or slot, then state)
        start, end = tl.load(cu_ptr + b), tl.load(cu_ptr + b + 1)
        zero = tl.zeros([BC], dtype=tl.float32)
        # the window's taps (oldest first) and the token's own, the last
        w0, w1, w2 = _tap(zero, w_ptr, c, mc, W, 0), _tap(zero, w_ptr, c, mc, W, 1), _tap(zero, w_ptr, c, mc, W, 2)
        wt = _tap(zero, w_ptr, c, mc, W, W - 1)
        if end > start:  # a zero-length (padding) stream reads and writes nothing
            base = state_ptr + slot * stride_s0 + c * stride_s1
            s0, s1, s2 = zero, zero, zero
            if W > 1:
                s0 = tl.load(base, mask=mc, other=0.0).to(tl.float32)
            if W > 2:
                s1 = tl.load(base + stride_s2, mask=mc, other=0.0).to(tl.float32)
            if W > 3:
                s2 = tl.load(base + 2 * stride_s2, mask=mc, other=0.0).to(tl.float32)
            t0 = start.to(tl.int64)
            for i in range(0, end - start):  # token t0 + i: the window's inputs, then itself (the last tap)
                xt = tl.load(x_ptr + (t0 + i) * stride_x + c, mask=mc, other=0.0).to(tl.float32)
                acc = zero
                if W > 1:
                    acc += s0 * w0
                if W > 2:
                    acc += s1 * w1
                if W > 3:
                    acc += s2 * w2
                acc += xt * wt
                y = acc * tl.sigmoid(acc)
                tl.store(y_ptr + (t0 + i) * C + c, y.to(y_ptr.dtype.element_ty), mask=mc)
                if W == 2:  # the window moves on by one input
                    s0 = xt
                if W == 3:
                    s0, s1 = s1, xt
                if W == 4:
                    s0, s1, s2 = s1, s2, xt
            # the new state: the last W - 1 inputs of (old state ++ stream), model-dtype values held exactly in fp32
            if W > 1:
                tl.store(base, s0.to(state_ptr.dtype.element_ty), mask=mc)
            if W > 2:
                tl.store(base + stride_s2, s1.to(state_ptr.dtype.element_ty), mask=mc)
            if W > 3:
                tl.store(base + 2 * stride_s2, s2.to(state_ptr.dtype.element_ty), mask=mc)


def causal_conv1d_triton(x, weight, cu_seqlens, slot_ids, conv_state):
    """No host sync. Decode-shaped calls (ops.common.decode_shaped) of width up to DECODE_MAX_WIDTH: one launch, a
    program per (stream, channel tile) that runs the stream's few tokens and writes its new state. Others: two
    launches, the conv over all tokens (reading old states; each token's stream found by a search of cu_seqlens in
    the kernel), then the state update per stream. Grid sizes follow from T, C and B alone."""
    T, C = x.shape
    W = weight.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    B = slot_ids.shape[0]
    # index tensors of any strides (the kernels index them as contiguous); the state pool is read and
    # written through its strides (it is mutated in place: no copy)
    cu_seqlens, slot_ids = cu_seqlens.contiguous(), slot_ids.contiguous()
    y = torch.empty((T, C), dtype=x.dtype, device=x.device)
    BT, BC = 32, 128
    if decode_shaped(B, T) and W <= DECODE_MAX_WIDTH:
        _conv1d_decode_kernel[(B + 1, triton.cdiv(C, BC))](
            x, weight, y, conv_state, cu_seqlens, slot_ids, T, C, B, x.stride(0), *conv_state.stride(), W=W, BC=BC)
        return y
    if T:  # (each token's stream found in the kernel: tiles._stream_of)
        _conv1d_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](
            x, weight, y, conv_state, cu_seqlens, slot_ids, T, C, B, x.stride(0), *conv_state.stride(),
            W=W, BT=BT, BC=BC, STEPS=search_steps(B))
    if B and W > 1:  # with W = 1 there is no state
        _conv1d_state_kernel[(B, triton.cdiv(C, BC))](
            x, conv_state, cu_seqlens, slot_ids, C, x.stride(0), *conv_state.stride(), W=W,
            WP=triton.next_power_of_2(W - 1), BC=BC)
    return y


@metrale_cuda(causal_conv1d)
def causal_conv1d_cuda(a):
    if wanted(a.checkpoint_tokens):  # before the states move on
        keep_conv_windows_triton(a.x, a.cu_seqlens, a.slot_ids, a.conv_state, a.checkpoint_tokens,
                                 a.checkpoint_entries, a.checkpoint_conv_states)
    return causal_conv1d_triton(*a[:5])


def example(s: Shapes, dtype, g):
    cu, slots, _, _ = stream_meta(s, g)
    return (rand(g, s.T, s.C, dtype=dtype), weight(g, s.C, s.W, dtype=dtype), cu, slots,
            rand(g, s.num_slots + 1, s.C, s.W - 1, dtype=dtype))


def cost(s: Shapes):
    return 2 * s.T * s.C * s.W, 2 * 2 * s.T * s.C


register(OpSpec(causal_conv1d, example, cost, cuda=causal_conv1d_cuda, kernels=("conv1d", "_keep_windows_kernel"),
                onnx="metrale_graph.onnx.translations:causal_conv1d"))
