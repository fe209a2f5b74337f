"""The pieces of metrale::moe's CPU reference, plain torch, op for op as transformers'
Qwen3_5MoeSparseMoeBlock: the router (TopKRouter), the routed experts, the gated shared expert."""

import torch
import torch.nn.functional as F


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


def shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w):
    out = F.linear(F.silu(F.linear(n, shared_gate_w)) * F.linear(n, shared_up_w), shared_down_w)
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
