"""ONNX translations of the `metrale::` phase ops: each op rebuilt from standard ONNX operators
(opset 20) with onnxscript, so an exported prefill step runs in plain onnxruntime.

`torch.onnx.export(..., dynamo=True, custom_translation_table=...)` calls a translation with the
op's tensor arguments as ONNX values of static shape (one graph per bucket) and its scalars as
Python values. The ops that mutate a state pool are exported in functional form (see
export.py): their translation returns the op's output followed by the updated pools. Each op's
spec (in its module, metrale_graph.ops.<op>) points at its translation here.

Varlen streams without host sync, as the CPU references (each op's declared function) specify:
- token t belongs to stream seg[t] = the number of streams that end at or before t (zero-length
  streams included); tokens at or past cu_seqlens[B] belong to no stream.
- states are read from the pools as they were before the step (a valid batch gives every
  non-empty stream its own slot and blocks, so this equals the references' stream-by-stream order).
- pool writes (`_write_slots`): each non-empty stream's slot gets its new state (the last such
  stream wins where streams share a slot, as in the references' stream order); zero-length
  streams write nothing; every other slot passes through unchanged.
- the GDN recurrence is an ONNX Loop over streams around a Loop over that stream's tokens (trip
  count = its length, zero for padding), token by token in fp32 like the op's reference.
- paged attention writes each token's K / V at (block, offset) with ScatterND, then every token
  attends over the positions of its stream's block table up to its own position. Tokens in no
  stream (padding) write the null block's current values back, so the null block stays as it is.

Values inside loop bodies get model-unique names: ONNX's single-assignment rule spans subgraphs.

bf16 / fp16 models: values of the model dtype only move (Gather*, Slice, Reshape, Transpose,
Concat, Scatter*, Squeeze / Unsqueeze, Cast), since onnxruntime's CPU kernels lack bf16 for
everything else (Gemm, MatMul, elementwise math, reductions, Where, Expand) and ONNX's Einsum,
Softplus, Cos, Sin and TopK take no bf16 at all. Arithmetic runs on fp32 values (`_up`), rounded to the
model dtype (`_rnd`) wherever the op's CPU reference holds a model-dtype tensor, as a torch op of
that dtype rounds its result; an op's model-dtype outputs are cast down once at the end (`_down`).
For fp32 models these helpers add no nodes.

FP8 models are not exported (export_prefill refuses them): a weight's scales argument (`*_s`) is the
empty tensor of a weight in the model dtype here, and is not read.

Shape letters as in ops/common.py; P = MB*BS key positions per stream.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
import onnxscript.evaluator
from onnxscript import opset20 as op

OPSET = 20
FLOAT, INT64, BOOL = ir.DataType.FLOAT, ir.DataType.INT64, ir.DataType.BOOL
_names = itertools.count()


# helpers
def _const(value, dtype=np.int64):
    return op.Constant(value=ir.tensor(np.asarray(value, dtype=dtype)))


def _cast(x, to: ir.DataType, frm: ir.DataType):
    """Cast x (of dtype `frm`, tracked by the caller) to `to`; no node when they agree."""
    return x if frm == to else op.Cast(x, to=to)


def _up(x):
    """A translation's input (it carries its dtype) as fp32: exact from bf16 / fp16."""
    return _cast(x, FLOAT, x.dtype)


def _rnd(xf, dt: ir.DataType):
    """The fp32 value xf rounded to the model dtype `dt` and kept in fp32 (where a torch op of dtype
    `dt` returns its result); no node for fp32."""
    return xf if dt == FLOAT else op.Cast(op.Cast(xf, to=dt), to=FLOAT)


def _down(xf, dt: ir.DataType):
    """The fp32 value xf as an output of the model dtype `dt` (rounded once)."""
    return _cast(xf, dt, FLOAT)


def _select(cond, a, b, dt: ir.DataType):
    """Where(cond, a, b) on values of dtype `dt` (exact: through fp32, which onnxruntime's CPU Where takes)."""
    return _down(op.Where(cond, _cast(a, FLOAT, dt), _cast(b, FLOAT, dt)), dt)


def _linear(xf, w, dt: ir.DataType):
    """F.linear in the model dtype `dt`: xf [N, in] (fp32, of dt values) @ w[out, in]^T, accumulated in
    fp32 and rounded to dt once; fp32 out."""
    return _rnd(op.Gemm(xf, _up(w), transB=1), dt)


def _silu(x):
    return op.Mul(x, op.Sigmoid(x))


def _swiglu(n, gate_w, up_w, down_w, dt: ir.DataType):
    """down(silu(gate(n)) * up(n)) as torch in dtype `dt` (each op rounds); n fp32, fp32 out."""
    act = _rnd(op.Mul(_rnd(_silu(_linear(n, gate_w, dt)), dt), _linear(n, up_w, dt)), dt)
    return _linear(act, down_w, dt)


def _normalize(xf, eps: float):
    """xf / sqrt(mean(xf^2) + eps) over the last axis (fp32)."""
    ms = op.ReduceMean(op.Mul(xf, xf), _const([-1]), keepdims=1)
    return op.Div(xf, op.Sqrt(op.Add(ms, _const(eps, np.float32))))


def _rms_norm(xf, w, eps: float, dt: ir.DataType):
    """ops.common.rms_norm of xf (fp32, of the model dtype `dt`'s values): zero-centred weight, in fp32,
    rounded to dt; fp32 out."""
    return _rnd(op.Mul(_normalize(xf, eps), op.Add(_up(w), _const(1.0, np.float32))), dt)


def _token_streams(cu, B: int, T: int):
    """cu: [B+1] int64. Returns seg [T] (each token's stream, clamped to B-1), valid [T] bool (the
    token lies inside a stream) and local [T] (its index within the stream)."""
    t = _const(np.arange(T))
    ends = op.Slice(cu, _const([1]), _const([B + 1]))
    seg = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, _const([0])), op.Unsqueeze(t, _const([1]))),
                               to=INT64), _const([1]), keepdims=0)
    valid = op.Less(seg, _const(B))
    seg = op.Min(seg, _const(B - 1))
    return seg, valid, op.Sub(t, op.Gather(cu, seg))


def _stream_bounds(cu, B: int):
    """starts [B], lengths [B] int64 of cu [B+1]."""
    starts = op.Slice(cu, _const([0]), _const([B]))
    return starts, op.Sub(op.Slice(cu, _const([1]), _const([B + 1])), starts)


def _write_slots(pool, slot_ids, new, nonempty, B: int):
    """pool [S, ...] (a graph input: its shape is known) with row slot_ids[b] := new[b] for every
    non-empty stream b (slot_ids [B] int64, new [B, ...], nonempty [B] bool); other rows unchanged."""
    S = pool.shape[0]
    hit = op.And(op.Equal(op.Unsqueeze(slot_ids, _const([1])), _const(np.arange(S)[None])),
                 op.Unsqueeze(nonempty, _const([1])))  # [B, S]
    rank = op.Where(hit, _const(np.arange(1, B + 1)[:, None]), _const(0))  # writer b+1, 0: none
    winner = op.ReduceMax(rank, _const([0]), keepdims=0)  # [S], the last writer
    # row s of (pool ++ new): its own, or row S + b of its last writer b (data movement: any dtype)
    src = op.Where(op.Greater(winner, _const(0)), op.Add(winner, _const(S - 1)), _const(np.arange(S)))
    return op.Gather(op.Concat(pool, new, axis=0), src, axis=0)


def _emit(op_type: str, *inputs, outputs: int, **attrs):
    """Record a node with several outputs in the graph being exported. onnxscript's `op.Loop`
    gives a node one output (Loop's outputs are variadic), so the node is built here and appended
    to the exporter's recorder, as torch.onnx's own translations of torch.cond / scan do."""
    nodes = getattr(onnxscript.evaluator.default(), "nodes", None)
    if not isinstance(nodes, list):
        raise RuntimeError(f"{op_type}: metrale ONNX translations run only inside torch.onnx.export")
    node = ir.Node("", op_type, inputs, attributes=ir.convenience.convert_attributes(attrs),
                   num_outputs=outputs, version=OPSET)
    nodes.append(node)
    return node.outputs


class _Body:
    """An ONNX subgraph (a Loop body) under construction; it may read values of enclosing graphs."""

    def __init__(self, name: str):
        self.name, self.tape = f"{name}_{next(_names)}", ir.tape.Tape()

    def input(self, name: str, dtype: ir.DataType, shape) -> ir.Value:
        return ir.Value(name=f"{self.name}_{name}", type=ir.TensorType(dtype), shape=ir.Shape(shape))

    def __call__(self, op_type: str, *inputs, outputs: int = 1, **attrs):
        values = self.tape.op_multi_out(op_type, list(inputs), attrs or None, num_outputs=outputs, version=OPSET)
        for value in values:  # names unique in the model: ONNX graphs are SSA across subgraphs too
            value.name = f"{self.name}_{next(_names)}"
        return values[0] if outputs == 1 else values

    def graph(self, inputs, outputs) -> ir.Graph:
        """outputs: (value, dtype, shape) triples, typed here as ONNX subgraph outputs must be."""
        values = []
        for k, (value, dtype, shape) in enumerate(outputs):
            value.name, value.dtype, value.shape = f"{self.name}_out{k}", dtype, ir.Shape(shape)
            values.append(value)
        return ir.Graph(inputs, values, nodes=self.tape.nodes, name=self.name)


# the ops
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


def mlp(h, norm_w, gate_w, gate_s, up_w, up_s, down_w, down_s, eps, add_residual=True):
    """ops.mlp: h + down(silu(gate(n)) * up(n)), n = rms_norm(h)."""
    hf, dt = _up(h), h.dtype
    out = _swiglu(_rms_norm(hf, norm_w, eps, dt), gate_w, up_w, down_w, dt)
    return _down(op.Add(hf, out) if add_residual else out, dt)


def _rounded_sum(x, T: int, n: int, D: int, dt: ir.DataType):
    """x [T, n, D] (fp32) summed over axis 1 in order, each partial sum rounded to the model dtype `dt`
    (an ONNX Loop: n may be hundreds of experts); fp32 out."""
    body = _Body("expert_sum")
    e, cond, acc = body.input("e", INT64, []), body.input("cond", BOOL, []), body.input("acc", FLOAT, [T, D])
    total = body("Cast", body("Cast", body("Add", acc, body("Gather", x, e, axis=1)), to=dt), to=FLOAT)
    loop = body.graph([e, cond, acc], [(body("Identity", cond), BOOL, []), (total, FLOAT, [T, D])])
    zeros = op.ConstantOfShape(_const([T, D]), value=ir.tensor(np.zeros(1, np.float32)))
    return _emit("Loop", _const(n), None, zeros, outputs=1, body=loop)[0]


def moe(h, norm_w, router_w, w13, w13_s, w2, w2_s, shared_gate_w, shared_gate_s, shared_up_w, shared_up_s,
        shared_down_w, shared_down_s, shared_expert_gate_w, top_k, norm_topk, eps, first_expert=0, add_residual=True):
    """ops.moe, densely: every expert runs on every token and the routing weights (zero for the experts
    a token did not choose) combine them. Exact, and quadratic in nothing; meant for CPU checks, not
    for speed (T * E expert rows)."""
    T, E, (EL, IE2, _), dt = h.shape[0], router_w.shape[0], w13.shape, h.dtype
    hf = _up(h)
    n = _rms_norm(hf, norm_w, eps, dt)
    probs = op.Softmax(_linear(n, router_w, dt), axis=-1)  # logits in the model dtype, softmax in fp32
    top_w, top_e = op.TopK(probs, _const([top_k]), axis=-1)
    if norm_topk:
        top_w = op.Div(top_w, op.ReduceSum(top_w, _const([-1]), keepdims=1))
    top_w = _rnd(top_w, dt)  # the weights in the model dtype, as transformers
    weights = op.ScatterElements(op.ConstantOfShape(_const([T, E]), value=ir.tensor(np.zeros(1, np.float32))),
                                 top_e, top_w, axis=1)  # [T, E]
    if EL < E:  # this tensor-parallel rank's experts
        weights = op.Slice(weights, _const([first_expert]), _const([first_expert + EL]), _const([1]))
    gate_up = _rnd(op.Einsum(n, _up(w13), equation="td,efd->tef"), dt)  # [T, E, 2 IE]
    gate = op.Slice(gate_up, _const([0]), _const([IE2 // 2]), _const([-1]))
    up = op.Slice(gate_up, _const([IE2 // 2]), _const([IE2]), _const([-1]))
    act = _rnd(op.Mul(_rnd(_silu(gate), dt), up), dt)
    y = _rnd(op.Einsum(act, _up(w2), equation="tei,edi->ted"), dt)  # [T, E, D]
    if dt == FLOAT:
        routed = op.Einsum(weights, y, equation="te,ted->td")
    else:  # as the reference's index_add_ in the model dtype: expert by expert, each sum rounded
        routed = _rounded_sum(_rnd(op.Mul(y, op.Unsqueeze(weights, _const([2]))), dt), T, EL, h.shape[1], dt)
    shared = _swiglu(n, shared_gate_w, shared_up_w, shared_down_w, dt)
    shared = _rnd(op.Mul(_rnd(op.Sigmoid(_linear(n, shared_expert_gate_w, dt)), dt), shared), dt)
    ffn = _rnd(op.Add(routed, shared), dt)
    return _down(op.Add(hf, ffn) if add_residual else ffn, dt)


def _rope(x, cos, sin, R: int, HD: int, dt: ir.DataType):
    """Rotate-half RoPE on the first R channels of each head of x [T, N, HD]; cos, sin [T, 1, R]; all fp32
    holding values of the model dtype `dt`, each product and the sum rounded to it."""
    rot = op.Slice(x, _const([0]), _const([R]), _const([-1]))
    half1, half2 = op.Slice(rot, _const([0]), _const([R // 2]), _const([-1])), op.Slice(
        rot, _const([R // 2]), _const([R]), _const([-1]))
    out = _rnd(op.Add(_rnd(op.Mul(rot, cos), dt), _rnd(op.Mul(op.Concat(op.Neg(half2), half1, axis=-1), sin), dt)),
               dt)
    if R == HD:
        return out
    return op.Concat(out, op.Slice(x, _const([R]), _const([HD]), _const([-1])), axis=-1)


def attn_proj(x, norm_w, q_w, q_s, k_w, k_s, v_w, v_s, q_norm_w, k_norm_w, positions, inv_freq, head_dim, eps):
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
    cos, sin = _rnd(op.Cos(emb), dt), _rnd(op.Sin(emb), dt)
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


# aten ops of the step outside the metrale ops, which torch.onnx's own translations would compute in the
# model dtype: export.py maps aten::<name> to each
def linear(x, w, bias=None):
    """aten::linear (the lm_head): x [..., in] @ w[out, in]^T (+ bias) in fp32, rounded to x's dtype once."""
    dt = x.dtype
    y = op.Gemm(_up(x), _up(w), transB=1) if len(x.shape) == 2 else op.MatMul(_up(x), op.Transpose(_up(w)))
    return _down(y if bias is None else op.Add(y, _up(bias)), dt)


ATEN = {"linear": linear}
