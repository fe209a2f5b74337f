"""The building blocks of the ONNX translations (translations.py says what a translation is): constants,
casts, the fp32 arithmetic on model-dtype values, the varlen streams' token indices and pool writes, and
nodes the exporter's recorder takes directly (`_emit`, a Loop body `_Body`).

Values inside loop bodies get model-unique names: ONNX's single-assignment rule spans subgraphs.

bf16 / fp16 models: values of the model dtype only move (Gather*, Slice, Reshape, Transpose,
Concat, Scatter*, Squeeze / Unsqueeze, Cast), since onnxruntime's CPU kernels lack bf16 for
everything else (Gemm, MatMul, elementwise math, reductions, Where, Expand) and ONNX's Einsum,
Softplus, Cos, Sin and TopK take no bf16 at all. Arithmetic runs on fp32 values (`_up`), rounded to the
model dtype (`_rnd`) wherever the op's CPU reference holds a model-dtype tensor, as a torch op of
that dtype rounds its result; an op's model-dtype outputs are cast down once at the end (`_down`).
For fp32 models these helpers add no nodes.
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
