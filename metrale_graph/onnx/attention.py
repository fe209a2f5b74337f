"""ONNX translations of the gated full-attention mixer's ops: its projections with RoPE, paged attention
(K / V written at (block, offset), each token over its stream's block table) and the output;
translations.py says how the varlen streams and the state pools are handled.

Shape letters as in ops/common.py; P = MB*BS key positions per stream.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset20 as op

from .builders import FLOAT, INT64, _cast, _const, _down, _linear, _rms_norm, _rnd, _token_streams, _up


def _rope(x, cos, sin, R: int, HD: int, dt: ir.DataType):
    """Rotate-half RoPE on the first R channels of each head of x [T, N, HD]; cos, sin [T, 1, R]; all fp32
    holding values of the model dtype `dt`, each product and the sum rounded to it. R 0: x as it is."""
    if R == 0:
        return x
    rot = op.Slice(x, _const([0]), _const([R]), _const([-1]))
    half1, half2 = op.Slice(rot, _const([0]), _const([R // 2]), _const([-1])), op.Slice(
        rot, _const([R // 2]), _const([R]), _const([-1]))
    out = _rnd(op.Add(_rnd(op.Mul(rot, cos), dt), _rnd(op.Mul(op.Concat(op.Neg(half2), half1, axis=-1), sin), dt)),
               dt)
    if R == HD:
        return out
    return op.Concat(out, op.Slice(x, _const([R]), _const([HD]), _const([-1])), axis=-1)


def attn_proj(x, norm_w, q_w, q_s, k_w, k_s, v_w, v_s, q_norm_w, k_norm_w, positions, inv_freq, head_dim, eps,
              rope_scale):
    """ops.attn_proj: q [T, HQ, HD], k, v [T, HKV, HD], gate [T, HQ*HD]."""
    T, HD, dt = x.shape[0], head_dim, x.dtype
    HQ, HKV, R = q_w.shape[0] // (2 * HD), k_w.shape[0] // HD, 2 * inv_freq.shape[0]
    h = _rms_norm(_up(x), norm_w, eps, dt)
    qg = op.Reshape(_linear(h, q_w, dt), _const([T, HQ, 2 * HD]))
    q = op.Slice(qg, _const([0]), _const([HD]), _const([-1]))
    gate = op.Reshape(op.Slice(qg, _const([HD]), _const([2 * HD]), _const([-1])), _const([T, HQ * HD]))
    k = op.Reshape(_linear(h, k_w, dt), _const([T, HKV, HD]))
    v = op.Reshape(_linear(h, v_w, dt), _const([T, HKV, HD]))
    q, k = _rms_norm(q, q_norm_w, eps, dt), _rms_norm(k, k_norm_w, eps, dt)
    freqs = op.Mul(op.Unsqueeze(op.Cast(positions, to=FLOAT), _const([1])), op.Unsqueeze(_up(inv_freq), _const([0])))
    emb = op.Unsqueeze(op.Concat(freqs, freqs, axis=-1), _const([1]))  # [T, 1, R]
    cos, sin = op.Cos(emb), op.Sin(emb)
    if rope_scale != 1.0:  # YaRN's attention factor, in fp32 before the rounding (as transformers scales)
        cos, sin = op.Mul(cos, _const(rope_scale, np.float32)), op.Mul(sin, _const(rope_scale, np.float32))
    cos, sin = _rnd(cos, dt), _rnd(sin, dt)
    q, k = _rope(q, cos, sin, R, HD, dt), _rope(k, cos, sin, R, HD, dt)
    return _down(q, dt), _down(k, dt), _down(v, dt), _down(gate, dt)


def paged_attention(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables):
    """ops.paged_attention, functional: returns (o [T, HQ, HD], k_cache, v_cache updated).

    Token t of stream b sits at position p = context_lens[b] + (t - cu_seqlens[b]), block
    block_tables[b, p // BS], offset p % BS. Tokens outside every stream write into the null block
    (the pool's last block)."""
    (T, HQ, HD), HKV, dt = q.shape, k.shape[1], q.dtype
    NB, BS = k_cache.shape[0], k_cache.shape[1]
    B, MB = block_tables.shape
    P, r = MB * BS, HQ // HKV
    cu = op.Cast(cu_seqlens, to=INT64)
    seg, valid, local = _token_streams(cu, B, T)
    pos = op.Add(op.Gather(op.Cast(context_lens, to=INT64), seg), local)  # [T]
    blocks = op.Gather(op.Cast(block_tables, to=INT64), seg, axis=0)  # [T, MB] each token's block table
    col = op.Unsqueeze(op.Min(op.Div(pos, _const(BS)), _const(MB - 1)), _const([1]))
    block = op.Where(valid, op.Squeeze(op.GatherElements(blocks, col, axis=1), _const([1])), _const(NB - 1))
    where = op.Concat(op.Unsqueeze(block, _const([1])), op.Unsqueeze(op.Mod(pos, _const(BS)), _const([1])), axis=1)
    # tokens in no stream write back what the null block holds: row t of (new ++ old), else row T + t
    src = op.Where(valid, _const(np.arange(T)), _const(np.arange(T, 2 * T)))
    k_cache = op.ScatterND(k_cache, where, op.Gather(op.Concat(k, op.GatherND(k_cache, where), axis=0), src, axis=0))
    v_cache = op.ScatterND(v_cache, where, op.Gather(op.Concat(v, op.GatherND(v_cache, where), axis=0), src, axis=0))

    def context(cache, perm):  # the P positions of each token's stream, fp32
        kv = op.Reshape(op.Gather(cache, blocks, axis=0), _const([T, P, HKV, HD]))
        return op.Transpose(_cast(kv, FLOAT, dt), perm=perm)

    qf = op.Reshape(_up(q), _const([T, HKV, r, HD]))  # query head h uses KV head h // r
    scores = op.Mul(op.MatMul(qf, context(k_cache, [0, 2, 3, 1])), _const(HD**-0.5, np.float32))  # [T, HKV, r, P]
    causal = op.LessOrEqual(_const(np.arange(P)[None]), op.Unsqueeze(pos, _const([1])))  # [T, P]
    causal = op.Reshape(causal, _const([T, 1, 1, P]))
    probs = op.Softmax(op.Where(causal, scores, _const(-np.inf, np.float32)), axis=-1)
    o = op.MatMul(probs, context(v_cache, [0, 2, 1, 3]))  # [T, HKV, r, HD]
    return _down(op.Reshape(o, _const([T, HQ, HD])), dt), k_cache, v_cache


def attn_out(o, gate, residual, o_w, o_s):
    """ops.attn_out: o * sigmoid(gate), o_proj, residual."""
    (T, HQ, HD), dt = o.shape, o.dtype
    gated = _rnd(op.Mul(op.Reshape(_up(o), _const([T, HQ * HD])), _rnd(op.Sigmoid(_up(gate)), dt)), dt)
    out = _linear(gated, o_w, dt)
    return _down(out if residual is None else op.Add(_up(residual), out), dt)
