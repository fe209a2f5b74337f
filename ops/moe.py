"""The feed-forward half of a sparse-MoE layer (Qwen3.5-MoE, Qwen3.6, Qwen3-Next): post-attention
RMSNorm, router, top-k experts, shared expert, residual add:

    n = rms_norm(h)
    p = softmax(n @ router_w.T) in fp32;  w, e = top_k(p);  w /= sum(w) if norm_topk;  w in h's dtype
    out = h + sum_j w_j * down_e(silu(gate_e(n)) * up_e(n)) + sigmoid(n @ shared_expert_gate_w.T) * shared(n)

Token-local: no stream metadata. Routing is data-dependent, shapes are not: the CUDA path
sorts token-expert pairs by expert on the device into buffers whose sizes follow from T,
top_k and the number of experts alone, so a bucket's CUDA graph is static.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import check, check_tensor, rms_norm
from .registry import OpSpec, Shapes, metrale_op, norm_weight, rand, register, weight

OP = "moe"


@metrale_op("moe")
def moe(h: Tensor, norm_w: Tensor, router_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_w: Tensor,
        shared_up_w: Tensor, shared_down_w: Tensor, shared_expert_gate_w: Tensor, top_k: int, norm_topk: bool,
        eps: float) -> Tensor:
    """Sparse MoE block with its norm and residual.

    Args:
        h: [T, D] the residual stream after the mixer (model dtype).
        norm_w: [D] zero-centred post-attention RMSNorm weight.
        router_w: [E, D] router.
        w13: [E, 2*IE, D] each expert's gate rows then up rows (transformers' experts.gate_up_proj).
        w2: [E, D, IE] each expert's down projection (experts.down_proj).
        shared_gate_w, shared_up_w: [IS, D]; shared_down_w: [D, IS]: the shared expert.
        shared_expert_gate_w: [1, D] the shared expert's sigmoid gate.
        top_k: experts per token (1..E). norm_topk: renormalize the top-k weights to sum 1.
        eps: RMSNorm epsilon.
    Returns:
        [T, D] the layer output, h's dtype. Mutates nothing.
    """
    _check(h, norm_w, router_w, w13, w2, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w, top_k)
    return moe_ref(h, norm_w, router_w, w13, w2, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w,
                   top_k, norm_topk, eps)


@moe.register_fake
def _(h, norm_w, router_w, w13, w2, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w, top_k,
      norm_topk, eps):
    _check(h, norm_w, router_w, w13, w2, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w, top_k)
    return torch.empty_like(h)


def _check(h, norm_w, router_w, w13, w2, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w, top_k):
    check_tensor(h, OP, "h", ndim=2)
    D = h.shape[1]
    check(tuple(norm_w.shape) == (D,), OP, f"norm_w must have shape ({D},), got {tuple(norm_w.shape)}")
    E, IE, IS = router_w.shape[0], w2.shape[-1], shared_down_w.shape[-1]
    for name, w, shape in (("router_w", router_w, (E, D)), ("w13", w13, (E, 2 * IE, D)), ("w2", w2, (E, D, IE)),
                           ("shared_gate_w", shared_gate_w, (IS, D)), ("shared_up_w", shared_up_w, (IS, D)),
                           ("shared_down_w", shared_down_w, (D, IS)),
                           ("shared_expert_gate_w", shared_expert_gate_w, (1, D))):
        check_tensor(w, OP, name, ndim=len(shape), dtype=h.dtype, device=h.device)
        check(tuple(w.shape) == shape, OP, f"{name} has shape {tuple(w.shape)}, expected {shape}")
    check(isinstance(top_k, int) and 1 <= top_k <= E, OP, f"top_k must be in 1..{E} (the experts), got {top_k}")


def route(n, router_w, top_k, norm_topk):
    """transformers' TopKRouter: softmax in fp32, top-k, optional renormalization, weights back in the
    model dtype. Returns (weights [T, k], expert ids [T, k] int64)."""
    logits = F.linear(n, router_w)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_e = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_e


def shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w):
    out = F.linear(F.silu(F.linear(n, shared_gate_w)) * F.linear(n, shared_up_w), shared_down_w)
    return torch.sigmoid(F.linear(n, shared_expert_gate_w)) * out


def moe_ref(h, norm_w, router_w, w13, w2, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w, top_k,
            norm_topk, eps):
    """Plain torch, op for op as transformers' Qwen3_5MoeSparseMoeBlock: experts in ascending order,
    each over the tokens that chose it (a host loop: the CPU reference)."""
    n = rms_norm(h, norm_w, eps)
    top_w, top_e = route(n, router_w, top_k, norm_topk)
    out = torch.zeros_like(n)
    for e in torch.unique(top_e).tolist():
        token, slot = torch.where(top_e == e)
        gate, up = F.linear(n[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * top_w[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return h + (out + shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w))


def example(s: Shapes, dtype, g):
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), weight(g, s.E, s.D, dtype=dtype),
            weight(g, s.E, 2 * s.IE, s.D, dtype=dtype), weight(g, s.E, s.D, s.IE, dtype=dtype),
            weight(g, s.IS, s.D, dtype=dtype), weight(g, s.IS, s.D, dtype=dtype), weight(g, s.D, s.IS, dtype=dtype),
            weight(g, 1, s.D, dtype=dtype), s.TOPK, True, s.eps)


def cost(s: Shapes):
    """Active FLOPs (router, top-k experts, shared expert), and bytes: the weights of the experts a
    batch can touch (at most min(E, T * top_k)), the dense weights, activations in and out."""
    T, D = s.T, s.D
    flops = 2 * T * (s.E * D + s.TOPK * 3 * D * s.IE + 3 * D * s.IS + D)
    touched = min(s.E, T * s.TOPK)
    return flops, 2 * (touched * 3 * D * s.IE + (s.E + 3 * s.IS + 1) * D + 2 * T * D)


register(OpSpec(moe, moe_ref, example, cost, kernels=("moe",), onnx="metrale_graph.onnx.translations:moe"))
