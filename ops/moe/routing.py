"""The MoE router's top-k on the device: reference.select_experts (softmax in fp32, top-k, optional
renormalization, weights in the logits' dtype) in one Triton launch, one program per token."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .rounding import _rnd


@triton.jit
def _moe_route_kernel(logits_ptr, w_ptr, e_ptr, cu_ptr, stride_l, E, LAST, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_E: tl.constexpr, NORM: tl.constexpr, PADDING: tl.constexpr):
    """One program per token: softmax of its E router logits in fp32, the TOP_K largest (descending;
    of equal ones the lowest expert, as torch.topk), renormalized if NORM; weights stored in the
    output's dtype, expert ids as int64. select_experts' torch expression in one launch. PADDING: a row
    at or past cu[LAST] (a padding token) takes expert ids -1 (no expert)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    m = cols < E
    x = tl.load(logits_ptr + row * stride_l + cols, mask=m, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    # probabilities are >= 0; below them a NaN (a padding row's unspecified activations) is -1, a taken
    # expert -2 and a column past E -3: the k ids are distinct and in range, as torch.topk's
    p = tl.where(m, tl.where(p == p, p, -1.0), -3.0)
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_e = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        e = tl.min(tl.where(p == best, cols, BLOCK_E), 0)  # the lowest expert holding the maximum
        top_w = tl.where(ks == j, best, top_w)
        top_e = tl.where(ks == j, e.to(tl.int64), top_e)
        p = tl.where(cols == e, -2.0, p)
    if NORM:
        top_w = top_w / tl.sum(top_w, 0)  # the lanes past TOP_K hold 0
    mk = ks < TOP_K
    tl.store(w_ptr + row * TOP_K + ks, _rnd(top_w, w_ptr.dtype.element_ty), mask=mk)
    if PADDING:
        top_e = tl.where(row < tl.load(cu_ptr + LAST).to(tl.int64), top_e, -1)
    tl.store(e_ptr + row * TOP_K + ks, top_e, mask=mk)


def route_topk(logits: Tensor, top_k: int, norm_topk: bool, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """select_experts in one Triton launch (it is five torch launches: softmax, topk, sum, divide,
    cast): logits [T, E] with unit inner stride -> (weights [T, k] in the logits' dtype, ids [T, k]
    int64). cu_seqlens [B + 1] (the batch's, on the device, any stride): the rows at and past cu_seqlens[-1],
    padding tokens (metrale_graph/batch.py's contract), take expert id -1, which no expert kernel runs (the direct
    kernels skip it, the aligned path's sort puts it in no block)."""
    T, E = logits.shape
    top_w = torch.empty((T, top_k), dtype=logits.dtype, device=logits.device)
    top_e = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T:
        cu = top_e if cu_seqlens is None else cu_seqlens.contiguous()  # (unread without it; read as contiguous)
        _moe_route_kernel[(T,)](logits, top_w, top_e, cu, logits.stride(0), E, cu.shape[0] - 1, TOP_K=top_k,
                                BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                                NORM=norm_topk, PADDING=cu_seqlens is not None)
    return top_w, top_e
