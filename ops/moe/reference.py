"""The pieces of metrale::moe's CPU reference, plain torch, op for op as transformers'
Qwen3_5MoeSparseMoeBlock: the router (TopKRouter), the routed experts, the gated shared expert."""

import torch
import torch.nn.functional as F

from ..fp8 import projection as fp8


def route(n, router_w, top_k, norm_topk):
    """transformers' TopKRouter: softmax in fp32, top-k, optional renormalization, weights back in the
    model dtype. Returns (weights [T, k], expert ids [T, k] int64)."""
    return select_experts(F.linear(n, router_w), top_k, norm_topk)


def select_experts(logits, top_k, norm_topk):
    """Router logits [T, E] (model dtype) -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_e = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_e


def shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w, gate_s=None, up_s=None,
                  down_s=None):
    """The gated shared expert; FP8 gate / up / down projections (with their scales) as fp8.linear computes them."""
    empty = n.new_empty(0)
    gate = fp8.linear(n, shared_gate_w, empty if gate_s is None else gate_s)
    up = fp8.linear(n, shared_up_w, empty if up_s is None else up_s)
    out = fp8.linear(F.silu(gate) * up, shared_down_w, empty if down_s is None else down_s)
    return torch.sigmoid(F.linear(n, shared_expert_gate_w)) * out


def routed_experts(n, top_w, top_e, w13, w2, first_expert=0):
    """sum_j w_j * down_e(silu(gate_e(n)) * up_e(n)) over this rank's experts (w13 / w2 hold experts
    first_expert ..), each over the tokens that chose it, in ascending order (a host loop)."""
    out = torch.zeros_like(n)
    for e in torch.unique(top_e).tolist():
        if not first_expert <= e < first_expert + w13.shape[0]:
            continue  # another tensor-parallel rank's expert
        token, slot = torch.where(top_e == e)
        gate, up = F.linear(n[token], w13[e - first_expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e - first_expert]) * top_w[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def routed_experts_fp8(n, top_w, top_e, w13, w13_s, w2, w2_s, first_expert=0):
    """routed_experts with FP8 experts (w13 / w2 float8_e4m3fn with their block scales, gate and up grids in
    turn): each GEMM as fp8.linear computes it (fake-quantized activations, dequantized weights, fp32),
    rounded to n's dtype where the bf16 reference rounds: gate and up, SiLU-mul, the expert's output, the
    product with the routing weight (ops/fp8/experts.py's kernels round there too)."""
    dt = n.dtype
    out = torch.zeros_like(n)
    for e in torch.unique(top_e).tolist():
        if not first_expert <= e < first_expert + w13.shape[0]:
            continue  # another tensor-parallel rank's expert
        le = e - first_expert
        token, slot = torch.where(top_e == e)
        gate, up = fp8.linear_fp32(n[token], w13[le], w13_s[le], parts=2).to(dt).chunk(2, dim=-1)
        y = fp8.linear_fp32(F.silu(gate) * up, w2[le], w2_s[le]).to(dt) * top_w[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
