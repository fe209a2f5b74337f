"""ONNX translations of the Gated DeltaNet mixer's ops: its projections, the causal conv, the l2norm, the
recurrence (a Loop over streams around a Loop over tokens) and the output; translations.py says how the
varlen streams and the state pools are handled.

Shape letters as in ops/common.py.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset20 as op

from .builders import (BOOL, FLOAT, INT64, _Body, _cast, _const, _down, _emit, _linear, _normalize, _rms_norm, _rnd,
                       _select, _silu, _stream_bounds, _token_streams, _up, _write_slots)


def gdn_proj(x, norm_w, qkv_w, qkv_s, z_w, z_s, b_w, b_s, a_w, a_s, A_log, dt_bias, eps):
    """ops.gdn_proj: (qkv [T, C], z [T, HV*V], beta [T, HV]) in x's dtype, g [T, HV] fp32."""
    dt = x.dtype
    h = _rms_norm(_up(x), norm_w, eps, dt)
    beta = op.Sigmoid(_linear(h, b_w, dt))
    a = op.Add(_linear(h, a_w, dt), _up(dt_bias))
    g = op.Mul(op.Neg(op.Exp(_up(A_log))), op.Softplus(a))
    return _down(_linear(h, qkv_w, dt), dt), _down(_linear(h, z_w, dt), dt), _down(beta, dt), g


def causal_conv1d(x, weight, cu_seqlens, slot_ids, conv_state):
    """ops.causal_conv1d, functional: returns (y [T, C], conv_state [S, C, W-1] updated).

    Tap j of token t (local index i in its stream) reads the stream's input i - (W-1) + j, or for
    a negative index the slot's old state column i + j."""
    (T, C), W, B, dt = x.shape, weight.shape[1], slot_ids.shape[0], x.dtype
    if W < 2:
        raise ValueError(f"metrale::causal_conv1d: the ONNX translation needs a kernel of width >= 2, got {W}")
    if T == 0:  # no token: y is empty and every slot keeps its state (the gathers below would index an empty x)
        return op.Identity(x), op.Identity(conv_state)
    cu, slots = op.Cast(cu_seqlens, to=INT64), op.Cast(slot_ids, to=INT64)
    seg, _, local = _token_streams(cu, B, T)
    taps = np.arange(W)
    src = op.Add(op.Unsqueeze(local, _const([1])), _const(taps - (W - 1)))  # [T, W] local index read
    rows = op.Clip(op.Add(_const(np.arange(T)[:, None]), _const(taps - (W - 1))), _const(0), _const(T - 1))
    from_x = op.Transpose(op.Gather(x, rows, axis=0), perm=[0, 2, 1])  # [T, C, W]
    cols = op.Min(op.Add(op.Unsqueeze(local, _const([1])), _const(taps)), _const(W - 2))  # [T, W]
    old = op.Gather(conv_state, op.Gather(slots, seg), axis=0)  # [T, C, W-1]
    from_state = op.GatherElements(old, op.Expand(op.Unsqueeze(cols, _const([1])), _const([T, C, W])), axis=2)
    window = op.Where(op.Unsqueeze(op.GreaterOrEqual(src, _const(0)), _const([1])), _cast(from_x, FLOAT, dt),
                      _cast(from_state, FLOAT, dt))
    conv = _rnd(op.ReduceSum(op.Mul(window, _up(weight)), _const([2]), keepdims=0), dt)  # F.conv1d's, in dt
    y = _down(_silu(conv), dt)

    # new state of stream b: last W-1 inputs of (old state ++ its tokens)
    starts, lengths = _stream_bounds(cu, B)
    keep = np.arange(W - 1)
    src = op.Add(op.Unsqueeze(lengths, _const([1])), _const(keep - (W - 1)))  # [B, W-1]
    rows = op.Clip(op.Add(op.Unsqueeze(starts, _const([1])), src), _const(0), _const(T - 1))
    from_x = op.Transpose(op.Gather(x, rows, axis=0), perm=[0, 2, 1])  # [B, C, W-1]
    cols = op.Min(op.Add(op.Unsqueeze(lengths, _const([1])), _const(keep)), _const(W - 2))
    from_state = op.GatherElements(op.Gather(conv_state, slots, axis=0),
                                   op.Expand(op.Unsqueeze(cols, _const([1])), _const([B, C, W - 1])), axis=2)
    new = _select(op.Unsqueeze(op.GreaterOrEqual(src, _const(0)), _const([1])), from_x, from_state, dt)
    return y, _write_slots(conv_state, slots, new, op.Greater(lengths, _const(0)), B)


def l2norm(x):
    """ops.l2norm: x / sqrt(sum(x^2) + 1e-6) per head in fp32."""
    xf = _up(x)
    ss = op.ReduceSum(op.Mul(xf, xf), _const([-1]), keepdims=1)
    return _down(op.Div(xf, op.Sqrt(op.Add(ss, _const(1e-6, np.float32)))), x.dtype)


def gdn_recurrence(q, k, v, g, beta, cu_seqlens, slot_ids, gdn_state):
    """ops.gdn_recurrence, functional: returns (o [T, HV, V], gdn_state [S, HV, K, V] updated)."""
    (T, H, K), (HV, V), B = q.shape, v.shape[1:], slot_ids.shape[0]
    cu, slots = op.Cast(cu_seqlens, to=INT64), op.Cast(slot_ids, to=INT64)

    def per_value_head(t, shape):  # [T, H, K] -> value head j reads key head j // r
        t = _up(t)
        if HV != H:
            t = op.Expand(op.Unsqueeze(t, _const([2])), _const([T, H, HV // H, K]))
        return op.Reshape(t, _const(shape))

    # per-token operands, shaped so the step is batched matmuls over value heads
    q_row = op.Mul(per_value_head(q, [T, HV, 1, K]), _const(K**-0.5, np.float32))
    k_row, k_col = per_value_head(k, [T, HV, 1, K]), per_value_head(k, [T, HV, K, 1])
    v_row = op.Reshape(_up(v), _const([T, HV, 1, V]))
    decay = op.Reshape(op.Exp(_up(g)), _const([T, HV, 1, 1]))
    b_t = op.Reshape(_up(beta), _const([T, HV, 1, 1]))
    one = _const(1)

    outer = _Body("gdn_stream")
    s_b, cond_b = outer.input("b", INT64, []), outer.input("cond", BOOL, [])
    o_buf = outer.input("o", FLOAT, [T, HV, 1, V])
    start, end = outer("Gather", cu, s_b), outer("Gather", cu, outer("Add", s_b, one))

    inner = _Body("gdn_token")
    i, cond_i, S_in = inner.input("i", INT64, []), inner.input("cond", BOOL, []), inner.input("S", FLOAT, [HV, K, V])
    t = inner("Add", i, start)
    S = inner("Mul", S_in, inner("Gather", decay, t))  # S = exp(g) * S
    pred = inner("MatMul", inner("Gather", k_row, t), S)  # S^T k  [HV, 1, V]
    delta = inner("Mul", inner("Sub", inner("Gather", v_row, t), pred), inner("Gather", b_t, t))
    S = inner("Add", S, inner("MatMul", inner("Gather", k_col, t), delta))  # S += k delta^T
    o_t = inner("MatMul", inner("Gather", q_row, t), S)  # S^T q  [HV, 1, V]
    token_loop = inner.graph([i, cond_i, S_in], [
        (inner("Identity", cond_i), BOOL, []), (S, FLOAT, [HV, K, V]), (o_t, FLOAT, [HV, 1, V])])

    S0 = outer("Gather", gdn_state, outer("Gather", slots, s_b), axis=0)
    S_final, o_stream = outer("Loop", outer("Sub", end, start), None, S0, outputs=2, body=token_loop)
    rows = outer("Unsqueeze", outer("Range", start, end, one), _const([1]))
    stream_loop = outer.graph([s_b, cond_b, o_buf], [
        (outer("Identity", cond_b), BOOL, []), (outer("ScatterND", o_buf, rows, o_stream), FLOAT, [T, HV, 1, V]),
        (S_final, FLOAT, [HV, K, V])])

    o0 = op.ConstantOfShape(_const([T, HV, 1, V]), value=ir.tensor(np.zeros(1, np.float32)))
    o, finals = _emit("Loop", _const(B), None, o0, outputs=2, body=stream_loop)
    _, lengths = _stream_bounds(cu, B)
    o = _down(op.Reshape(o, _const([T, HV, V])), v.dtype)
    return o, _write_slots(gdn_state, slots, finals, op.Greater(lengths, _const(0)), B)


def gdn_out(o, z, residual, gnorm_w, out_w, out_s, eps):
    """ops.gdn_out: gated RMSNorm (as transformers' Qwen3_5RMSNormGated), out_proj, residual."""
    (T, HV, V), dt = o.shape, o.dtype
    of = _normalize(_up(o), eps)
    n = _rnd(op.Mul(_up(gnorm_w), _rnd(of, dt)), dt)  # plain weight, applied in the model dtype
    n = op.Mul(n, _silu(op.Reshape(_up(z), _const([T, HV, V]))))  # the gate in fp32
    out = _linear(op.Reshape(_rnd(n, dt), _const([T, HV * V])), out_w, dt)
    return _down(out if residual is None else op.Add(_up(residual), out), dt)
