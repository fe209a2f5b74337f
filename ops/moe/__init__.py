"""The feed-forward half of a sparse-MoE layer (Qwen3.5-MoE, Qwen3.6, Qwen3-Next): post-attention
RMSNorm, router, top-k experts, shared expert, residual add:

    n = rms_norm(h)
    p = softmax(n @ router_w.T) in fp32;  w, e = top_k(p);  w /= sum(w) if norm_topk;  w in h's dtype
    out = h + sum_j w_j * down_e(silu(gate_e(n)) * up_e(n)) + sigmoid(n @ shared_expert_gate_w.T) * shared(n)

Token-local: no stream metadata. Routing is data-dependent, shapes are not: the CUDA path
sorts token-expert pairs by expert on the device into buffers whose sizes follow from T,
top_k and the number of experts alone, so a bucket's CUDA graph is static.

Here: the op (its CPU reference is the spec, its pieces in reference.py), its check, fake, CUDA path
and spec. The CUDA path: the router's top-k (routing.py), the pairs aligned to grouped-GEMM blocks
(align.py), the grouped GEMMs (gemm.py), the combine (combine.py).
"""

import torch
from torch import Tensor

from .. import kernels
from ..common import INTERPRET, check, check_tensor, rms_norm
from ..registry import OpSpec, Shapes, metrale_cuda, metrale_fake, metrale_op, norm_weight, rand, register, weight
from .align import align_pairs, block_m
from .combine import combine_outputs
from .gemm import down, gate_up
from .reference import route, routed_experts, shared_expert
from .routing import route_topk


def _check(a):
    check_tensor(a.h, "h", ndim=2)
    D = a.h.shape[1]
    check(tuple(a.norm_w.shape) == (D,), f"norm_w must have shape ({D},), got {tuple(a.norm_w.shape)}")
    E, EL, IE, IS = a.router_w.shape[0], a.w13.shape[0], a.w2.shape[-1], a.shared_down_w.shape[-1]
    first = a.first_expert
    check(isinstance(first, int) and 0 <= first and first + EL <= E,
          f"experts {first}..{first + EL - 1} are not among the router's {E}")
    for name, shape in (("router_w", (E, D)), ("w13", (EL, 2 * IE, D)), ("w2", (EL, D, IE)),
                        ("shared_gate_w", (IS, D)), ("shared_up_w", (IS, D)), ("shared_down_w", (D, IS)),
                        ("shared_expert_gate_w", (1, D))):
        w = getattr(a, name)
        check_tensor(w, name, ndim=len(shape), dtype=a.h.dtype, device=a.h.device)
        check(tuple(w.shape) == shape, f"{name} has shape {tuple(w.shape)}, expected {shape}")
    check(isinstance(a.top_k, int) and 1 <= a.top_k <= E, f"top_k must be in 1..{E} (the experts), got {a.top_k}")


@metrale_op(check=_check)
def moe(h: Tensor, norm_w: Tensor, router_w: Tensor, w13: Tensor, w2: Tensor, shared_gate_w: Tensor,
        shared_up_w: Tensor, shared_down_w: Tensor, shared_expert_gate_w: Tensor, top_k: int, norm_topk: bool,
        eps: float, first_expert: int = 0, add_residual: bool = True) -> Tensor:
    """Sparse MoE block with its norm and residual. The CPU reference: plain torch, op for op as
    transformers' Qwen3_5MoeSparseMoeBlock (experts in ascending order, each over the tokens that
    chose it: a host loop).

    Args:
        h: [T, D] the residual stream after the mixer (model dtype).
        norm_w: [D] zero-centred post-attention RMSNorm weight.
        router_w: [E, D] router.
        w13: [EL, 2*IE, D] each expert's gate rows then up rows (transformers' experts.gate_up_proj)
            for experts first_expert .. first_expert + EL - 1 (EL = E without tensor parallelism).
        w2: [EL, D, IE] each of those experts' down projection (experts.down_proj).
        shared_gate_w, shared_up_w: [IS, D]; shared_down_w: [D, IS]: the shared expert.
        shared_expert_gate_w: [1, D] the shared expert's sigmoid gate.
        top_k: experts per token (1..E). norm_topk: renormalize the top-k weights to sum 1.
        eps: RMSNorm epsilon.
        first_expert, add_residual: tensor parallelism. Experts split across ranks: this rank computes
            its EL experts (from first_expert) for every token that routes to them (the router still
            sees all E). Split within each expert (the default, first_expert 0): w13 / w2 hold this
            rank's IE slice of every expert. Either way only rank 0 adds the residual, and the
            all-reduce after the op sums the ranks.
    Returns:
        [T, D] the layer output (h + ..., or without h), h's dtype. Mutates nothing.
    """
    n = rms_norm(h, norm_w, eps)
    top_w, top_e = route(n, router_w, top_k, norm_topk)
    ffn = (routed_experts(n, top_w, top_e, w13, w2, first_expert)
           + shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w))
    return (h + ffn if add_residual else ffn).contiguous()  # h + ffn follows h's layout


@metrale_fake(moe)
def _(a):
    return a.h.new_empty(a.h.shape)  # contiguous whatever h's layout, as the CUDA path's and the reference's


def _inner_contiguous(w: Tensor) -> Tensor:
    return w if w.stride(-1) == 1 else w.contiguous()


@metrale_cuda(moe)
def moe_cuda(a):
    """Triton norm; one GEMM for the projections of the normed input (shared gate | shared up | router:
    free when the model stores them back to back in that order); routing as transformers, in one kernel
    (route_topk); pairs sorted by expert on the device (align_pairs); grouped GEMM gate|up with SiLU-mul
    in its epilogue; grouped GEMM down with the routing weight in its epilogue; one combine kernel (the
    shared-expert gate's dot product, pair sum, gated shared expert, residual). No host sync; every size
    follows from T, top_k and E. (The one-row shared-expert gate stays out of the GEMM: it would make the
    output rows 2 * IS + E + 1 wide, unaligned for cuBLAS.)"""
    h, top_k, first_expert = a.h, a.top_k, a.first_expert
    T, D = h.shape
    E, EL, IS = a.router_w.shape[0], a.w13.shape[0], a.shared_down_w.shape[-1]
    if T == 0:
        return torch.empty_like(h, memory_format=torch.contiguous_format)
    h = h if h.stride(-1) == 1 else h.contiguous()
    n = kernels.rms_norm(h, a.norm_w, a.eps)  # [T, D] contiguous
    dense = n @ kernels.stacked(a.shared_gate_w, a.shared_up_w, a.router_w).t()  # [T, 2IS + E]
    shared = kernels.silu_mul(dense[:, :2 * IS]) @ a.shared_down_w.t()  # [T, D]
    top_w, top_e = route_topk(dense[:, 2 * IS:2 * IS + E], top_k, a.norm_topk)

    P = T * top_k
    if EL < E:  # tensor parallelism: other ranks' experts go to a group of their own, whose blocks are skipped
        top_e = top_e - first_expert
        top_e = torch.where((top_e >= 0) & (top_e < EL), top_e, EL)
    BM = block_m(P, EL)
    sorted_ids, block_expert = align_pairs(top_e, EL + (EL < E), BM)
    if EL < E:
        block_expert = torch.where(block_expert == EL, -1, block_expert)
    ieee = h.dtype == torch.float32 or INTERPRET
    act = gate_up(n, _inner_contiguous(a.w13), sorted_ids, block_expert, top_k, BM, ieee)
    y = h.new_empty(P, D) if EL == E else h.new_zeros(P, D)  # pairs of other ranks' experts: 0
    down(act, _inner_contiguous(a.w2), sorted_ids, block_expert, top_w, y, BM, ieee)
    return combine_outputs(h, n, _inner_contiguous(a.shared_expert_gate_w), y, shared, top_k, a.add_residual)


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


register(OpSpec(moe, example, cost, cuda=moe_cuda,
                kernels=("_moe_route", "_moe_align", "_moe_gate_up", "_moe_down", "_moe_combine"),
                onnx="metrale_graph.onnx.translations:moe"))
