"""The feed-forward half of a sparse-MoE layer (Qwen3.5-MoE, Qwen3.6, Qwen3-Next): post-attention
RMSNorm, router, top-k experts, shared expert, residual add:

    n = rms_norm(h)
    p = softmax(n @ router_w.T) in fp32;  w, e = top_k(p);  w /= sum(w) if norm_topk;  w in h's dtype
    out = h + sum_j w_j * down_e(silu(gate_e(n)) * up_e(n)) + sigmoid(n @ shared_expert_gate_w.T) * shared(n)

Token-local: no stream metadata (cu_seqlens, optional, only marks the padding rows). Routing is
data-dependent, shapes are not: the CUDA path sorts token-expert pairs by expert on the device into
buffers whose sizes follow from T, top_k and the number of experts alone, so a bucket's CUDA graph is
static.

Here: the op (its CPU reference is the spec, its pieces in reference.py), its check, fake, CUDA path
and spec. The CUDA path: the router's top-k (routing.py), the pairs aligned to grouped-GEMM blocks
(align.py), the grouped GEMMs (gemm.py), the combine (combine.py); calls of few pairs (decode) skip the sort
and alignment for one row per pair (direct.py: its shape rule, measured faster at the 35B-A3B's D1).
(torch._grouped_mm, once a second backend of the bf16 experts, was 1.17-1.28x slower than gemm.py at every
35B-A3B workload on the H200 and was removed: BENCHMARKS.md, MoE.)
"""

import contextlib

import torch
from torch import Tensor

from metrale_graph import envs

from .. import gemv, kernels
from ..common import INTERPRET, check, check_tensor, rms_norm
from ..fp8 import projection as fp8
from ..fp8.experts import moe_experts_fp8
from ..fp8.experts_direct import moe_experts_fp8_direct
from ..registry import (OpSpec, Shapes, fp8_weight, metrale_cuda, metrale_fake, metrale_op, norm_weight, rand,
                        register, weight)
from .align import align_local_pairs, block_m
from . import direct
from .combine import combine_outputs
from .gemm import down, gate_up
from .reference import route, routed_experts, routed_experts_fp8, shared_expert
from .routing import route_topk

# the shared expert beside the routed ones on a second CUDA stream (METRALE_MOE_SHARED_STREAM; read at import, tests
# set the attribute): forked from the op's stream after the normed input (and, in bf16, the GEMM that also makes the
# router's logits), joined before the combine; the same kernels on the same inputs, so the same output bit for bit.
# Meanwhile the op's stream runs the routing and the routed experts, none of which shares state with the shared
# expert's kernels (ops/gemv.py's ticket counters: only the side stream runs a GEMV between fork and join)
SHARED_STREAM = envs.METRALE_MOE_SHARED_STREAM
_side_streams: dict[int, torch.cuda.Stream] = {}


def _fork(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(the op's stream, the device's side stream, which now waits for the op's work so far)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    main, side = torch.cuda.current_stream(index), _side_streams[index]
    side.wait_stream(main)
    return main, side


def _check(a):
    check_tensor(a.h, "h", ndim=2)
    D = a.h.shape[1]
    check_tensor(a.norm_w, "norm_w", device=a.h.device)
    check(tuple(a.norm_w.shape) == (D,), f"norm_w must have shape ({D},), got {tuple(a.norm_w.shape)}")
    E, EL, IE, IS = a.router_w.shape[0], a.w13.shape[0], a.w2.shape[-1], a.shared_down_w.shape[-1]
    first = a.first_expert
    check(isinstance(first, (int, torch.SymInt)) and 0 <= first and first + EL <= E,  # (SymInt: traced dynamic)
          f"experts {first}..{first + EL - 1} are not among the router's {E}")
    for name, shape in (("router_w", (E, D)), ("shared_expert_gate_w", (1, D))):
        w = getattr(a, name)
        check_tensor(w, name, ndim=len(shape), dtype=a.h.dtype, device=a.h.device)
        check(tuple(w.shape) == shape, f"{name} has shape {tuple(w.shape)}, expected {shape}")
    for name, shape in (("w13", (EL, 2 * IE, D)), ("w2", (EL, D, IE))):
        check_tensor(getattr(a, name), name, ndim=3)
        fp8.check_experts_weight(getattr(a, name), getattr(a, name + "_s"), name, a.h.dtype, a.h.device, shape,
                                 2 if name == "w13" else 1)
    check(fp8.is_fp8(a.w13) == fp8.is_fp8(a.w2), f"w13 is {a.w13.dtype} and w2 {a.w2.dtype}: the experts' "
                                                  "projections are FP8 together or not at all")
    for name, shape in (("shared_gate_w", (IS, D)), ("shared_up_w", (IS, D)), ("shared_down_w", (D, IS))):
        w = getattr(a, name)
        check_tensor(w, name, ndim=2)
        fp8.check_weight(w, getattr(a, name[:-2] + "_s"), name, a.h.dtype, a.h.device, shape)
    check(isinstance(a.top_k, (int, torch.SymInt)) and 1 <= a.top_k <= E,
          f"top_k must be in 1..{E} (the experts), got {a.top_k}")
    if a.cu_seqlens is not None:
        check_tensor(a.cu_seqlens, "cu_seqlens", ndim=1, dtype=torch.int32, device=a.h.device)
        check(a.cu_seqlens.shape[0] >= 1, "cu_seqlens must hold at least one offset (B + 1 for B streams), got none")


@metrale_op(check=_check)
def moe(h: Tensor, norm_w: Tensor, router_w: Tensor, w13: Tensor, w13_s: Tensor, w2: Tensor, w2_s: Tensor,
        shared_gate_w: Tensor, shared_gate_s: Tensor, shared_up_w: Tensor, shared_up_s: Tensor,
        shared_down_w: Tensor, shared_down_s: Tensor, shared_expert_gate_w: Tensor, top_k: int, norm_topk: bool,
        eps: float, first_expert: int = 0, add_residual: bool = True, cu_seqlens: Tensor | None = None) -> Tensor:
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
        w13_s, w2_s, shared_gate_s, shared_up_s, shared_down_s: the FP8 block scales of the weight before
            each, where it is float8_e4m3fn (w13_s [EL, 2 * ceil(IE/128), ceil(D/128)]: the gate's grid, then
            the up's; w2_s [EL, ceil(D/128), ceil(IE/128)]), else an empty tensor (ops/fp8/projection.py).
            The router and the shared expert's gate stay in h's dtype.
        shared_expert_gate_w: [1, D] the shared expert's sigmoid gate.
        top_k: experts per token (1..E). norm_topk: renormalize the top-k weights to sum 1.
        eps: RMSNorm epsilon.
        first_expert, add_residual: tensor parallelism. Experts split across ranks: this rank computes
            its EL experts (from first_expert) for every token that routes to them (the router still
            sees all E). Split within each expert (the default, first_expert 0): w13 / w2 hold this
            rank's IE slice of every expert. Either way only rank 0 adds the residual, and the
            all-reduce after the op sums the ranks.
        cu_seqlens: [B + 1] int32, the step's (metrale_graph/batch.py), or None: the rows of h at and past
            cu_seqlens[-1] are padding, their output rows unspecified; the CUDA path
            runs no expert for them (a one-stream bucket's second row read 8 more experts' weights).
    Returns:
        [T, D] the layer output (h + ..., or without h), h's dtype. Mutates nothing.
    """
    n = rms_norm(h, norm_w, eps)
    top_w, top_e = route(n, router_w, top_k, norm_topk)
    routed = (routed_experts_fp8(n, top_w, top_e, w13, w13_s, w2, w2_s, first_expert) if fp8.is_fp8(w13)
              else routed_experts(n, top_w, top_e, w13, w2, first_expert))
    ffn = routed + shared_expert(n, shared_gate_w, shared_up_w, shared_down_w, shared_expert_gate_w, shared_gate_s,
                                 shared_up_s, shared_down_s)
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
    shared_fp8 = any(fp8.is_fp8(w) for w in (a.shared_gate_w, a.shared_up_w, a.shared_down_w))
    if not shared_fp8:
        dense = gemv.linear(n, kernels.stacked(a.shared_gate_w, a.shared_up_w, a.router_w))  # [T, 2IS + E]
        side = _fork(h.device) if SHARED_STREAM else None
        with torch.cuda.stream(side[1]) if side else contextlib.nullcontext():
            shared = gemv.linear(kernels.silu_mul(dense[:, :2 * IS]), a.shared_down_w)  # [T, D]
        logits = dense[:, 2 * IS:2 * IS + E]
    else:  # FP8 shared expert: its gate | up one W8A8 GEMM where stacked, the router a GEMM of its own
        side = _fork(h.device) if SHARED_STREAM else None
        with torch.cuda.stream(side[1]) if side else contextlib.nullcontext():
            gate, up = fp8.project(n, [(a.shared_gate_w, a.shared_gate_s), (a.shared_up_w, a.shared_up_s)])
            shared = fp8.project_one(kernels.silu_mul(kernels.side_by_side(gate, up)), a.shared_down_w,
                                     a.shared_down_s)
        logits = n @ a.router_w.t()
    # padding rows (at and past cu_seqlens[-1]) take expert id -1: the direct kernels skip their pairs, the sort
    # puts them before expert 0's group, in no block (their rows of y are not written: padding rows' unspecified)
    top_w, top_e = route_topk(logits, top_k, a.norm_topk, a.cu_seqlens)
    P = T * top_k

    w13, w2 = _inner_contiguous(a.w13), _inner_contiguous(a.w2)
    if fp8.is_fp8(w13) and fp8.activations_rounded():  # W8A8 grouped GEMMs (their own pair alignment) or direct
        experts = moe_experts_fp8_direct if direct.takes_direct(P, E) else moe_experts_fp8
        y = experts(n, top_w, top_e, w13, a.w13_s, w2, a.w2_s, first_expert, E)
        return _combine(a, h, n, y, shared, side)
    if fp8.is_fp8(w13):  # weight-only debug mode: the experts dequantized, the bf16 kernels
        w13, w2 = fp8.dequantized(w13, a.w13_s, h.dtype, parts=2), fp8.dequantized(w2, a.w2_s, h.dtype)
    if direct.takes_direct(P, E):  # decode: one row per pair, no alignment
        y = direct.direct_experts(n, top_w, top_e, w13, w2, first_expert)
        return _combine(a, h, n, y, shared, side)
    BM = block_m(P, EL)
    sorted_ids, block_expert = align_local_pairs(top_e, EL, E, first_expert, BM)
    ieee = h.dtype == torch.float32 or INTERPRET
    act = gate_up(n, w13, sorted_ids, block_expert, top_k, BM, ieee)
    y = h.new_empty(P, D) if EL == E else h.new_zeros(P, D)  # pairs of other ranks' experts: 0
    down(act, w2, sorted_ids, block_expert, top_w, y, BM, ieee)
    return _combine(a, h, n, y, shared, side)


def _combine(a, h: Tensor, n: Tensor, y: Tensor, shared: Tensor, side) -> Tensor:
    """combine_outputs, after the side stream's shared expert (when forked) has joined the op's stream. Its tensors
    were made on the side stream and are freed on the op's: the side stream's next work waits for the op's stream
    (the next fork) before their memory is used again."""
    if side is not None:
        side[0].wait_stream(side[1])
    return combine_outputs(h, n, _inner_contiguous(a.shared_expert_gate_w), y, shared, a.top_k, a.add_residual)


def example(s: Shapes, dtype, g):
    """With s.fp8 the experts and the shared expert FP8 (the router and the shared expert's gate in dtype)."""
    return (rand(g, s.T, s.D, dtype=dtype), norm_weight(g, s.D, dtype), weight(g, s.E, s.D, dtype=dtype),
            *fp8_weight(s, g, dtype, s.E, 2 * s.IE, s.D, parts=2), *fp8_weight(s, g, dtype, s.E, s.D, s.IE),
            *fp8_weight(s, g, dtype, s.IS, s.D), *fp8_weight(s, g, dtype, s.IS, s.D),
            *fp8_weight(s, g, dtype, s.D, s.IS), weight(g, 1, s.D, dtype=dtype), s.TOPK, True, s.eps)


def cost(s: Shapes):
    """Active FLOPs (router, top-k experts, shared expert), and bytes: the weights of the experts a
    batch can touch (at most min(E, T * top_k)), the dense weights, activations in and out."""
    T, D = s.T, s.D
    flops = 2 * T * (s.E * D + s.TOPK * 3 * D * s.IE + 3 * D * s.IS + D)
    touched = min(s.E, T * s.TOPK)
    wb = 1 if s.fp8 else 2  # bytes per converted weight element (the experts, the shared expert)
    return flops, wb * (touched * 3 * D * s.IE + 3 * s.IS * D) + 2 * ((s.E + 1) * D + 2 * T * D)


register(OpSpec(moe, example, cost, cuda=moe_cuda,
                kernels=("_moe_route", "_moe_align", "_moe_count_sort", "_moe_gate_up", "_moe_down", "_moe_direct_gate_up",
                         "_moe_direct_act", "_moe_direct_down", "_moe_combine"),
                onnx="metrale_graph.onnx.translations:moe"))
