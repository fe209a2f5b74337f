"""ONNX translations of the feed-forward ops: the dense MLP and the MoE block (densely: every expert on
every token); translations.py says what a translation is.

Shape letters as in ops/common.py.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset20 as op

from .builders import BOOL, FLOAT, INT64, _Body, _const, _down, _emit, _linear, _rms_norm, _rnd, _silu, _swiglu, _up


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
        shared_down_w, shared_down_s, shared_expert_gate_w, top_k, norm_topk, eps, first_expert=0, add_residual=True,
        cu_seqlens=None):
    """ops.moe, densely: every expert runs on every token and the routing weights (zero for the experts
    a token did not choose) combine them. Exact, and quadratic in nothing; meant for CPU checks, not
    for speed (T * E expert rows). cu_seqlens (padding rows' marks, for the CUDA path) is not read."""
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
