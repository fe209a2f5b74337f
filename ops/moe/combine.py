"""The last MoE kernel: per token, the routed experts' sum, the gated shared expert and the residual."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .rounding import _rnd


@triton.jit
def _moe_combine_kernel(h_ptr, n_ptr, seg_w_ptr, y_ptr, shared_ptr, out_ptr, D, stride_h, TOP_K: tl.constexpr,
                        BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """out[t] = h[t] + (sum_j y[t * TOP_K + j] + sigmoid(n[t] . seg_w) * shared[t]), one program per token:
    the shared-expert gate's dot product, the pair sum in fp32 in a fixed order (deterministic, no
    atomics), then rounded as transformers rounds its terms."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    dt = out_ptr.dtype.element_ty
    n = tl.load(n_ptr + t * D + cols, mask=m, other=0.0).to(tl.float32)
    logit = _rnd(tl.sum(n * tl.load(seg_w_ptr + cols, mask=m, other=0.0).to(tl.float32), 0), dt)
    sig = _rnd(tl.sigmoid(logit), dt)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * D + cols, mask=m, other=0.0).to(tl.float32)
    shared = _rnd(sig * tl.load(shared_ptr + t * D + cols, mask=m, other=0.0).to(tl.float32), dt)
    ffn = _rnd(_rnd(acc, dt) + shared, dt)
    if ADD_RESIDUAL:
        ffn = _rnd(tl.load(h_ptr + t * stride_h + cols, mask=m, other=0.0).to(tl.float32) + ffn, dt)
    tl.store(out_ptr + t * D + cols, ffn.to(dt), mask=m)


def combine_outputs(h: Tensor, n: Tensor, shared_expert_gate_w: Tensor, y: Tensor, shared: Tensor, top_k: int,
                    add_residual: bool) -> Tensor:
    """out [T, D] in h's dtype: (h +) sum_j y[t * top_k + j] + sigmoid(n[t] . shared_expert_gate_w) * shared[t].
    h with unit inner stride, n / y / shared contiguous, shared_expert_gate_w [1, D] with unit inner stride."""
    T, D = h.shape
    out = torch.empty((T, D), dtype=h.dtype, device=h.device)
    block = triton.next_power_of_2(D)
    _moe_combine_kernel[(T,)](h, n, shared_expert_gate_w, y, shared, out, D, h.stride(0), TOP_K=top_k, BLOCK=block,
                              ADD_RESIDUAL=add_residual, num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return out
