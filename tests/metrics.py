"""Comparing an op or a model with its reference: relative norm error, tolerances, the MoE rows whose
routing rounding cannot flip, the interpreter's bf16 rounding, and the custom-op contract checks
(outputs, aliasing)."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:  # nothing to compare (and no norm to divide by)
        return
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative norm error {err:.3e} > {tol:.1e}"


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # each op vs its reference on upcast inputs

# fp32's unit roundoff: one rounding moves a value by at most this much, relatively.
FP32_UNIT_ROUNDOFF = 2.0 ** -24  # 6.0e-8


def fp32_model_bound(config, tokens: int) -> float:
    """How far two fp32 computations of one model's logits may differ when they differ only in the order of
    their sums (transformers' code against ours, or one BLAS against another machine's: another vector width
    or blocking). A sum of K terms of unit size can move by K * u relative under a reordering (its worst
    case; u: fp32's unit roundoff), and each layer adds its own. K is the model's longest contraction: the
    hidden size, the MLP, expert and shared-expert sizes, or the stream's tokens (attention, the recurrence).
    So: longest contraction x layers x u. The tiny configs of the suite give 3e-5 to 1e-4; what such tests
    catch (a wrong weight, a missed scale, a stale state) moves logits by 1e-3 and more."""
    sizes = [config.hidden_size, tokens] + [getattr(config, f, None) or 0 for f in (
        "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")]
    return max(sizes) * config.num_hidden_layers * FP32_UNIT_ROUNDOFF

# A token's routing is decided when its k-th and (k+1)-th router logits (the upcast reference's) differ
# by more than one ulp of the model dtype at that magnitude (closer logits may round to one value, a
# tie topk breaks either way) plus twice what the model-dtype input of the router may move a logit
# (bf16: normed input rounded, logits of std ~1).
ROUTING_SLACK = {torch.float32: 1e-5, torch.bfloat16: 6e-3}
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7}


def moe_decided_rows(args, dtype) -> torch.Tensor:
    """[T] bool: the tokens of metrale::moe's arguments whose top-k experts the upcast reference picks
    with a margin no rounding in `dtype` can undo. Routing is discontinuous: a token on a near tie may
    take either expert, both right, their outputs one expert's weighted output apart (measured: bf16
    routing breaks 9 of 384 tokens' ties otherwise than fp32 at 256 experts, top 8); those tokens are
    left out of the comparison."""
    import torch.nn.functional as F

    from metrale_graph.ops.common import rms_norm

    from metrale_graph.ops import REGISTRY, declaration

    a = declaration(REGISTRY["moe"].op).Args(*args)
    h, norm_w, router_w, top_k, eps = (a.h.detach().cpu().float(), a.norm_w.cpu().float(), a.router_w.cpu().float(),
                                      a.top_k, a.eps)
    if top_k == router_w.shape[0]:
        return torch.ones(h.shape[0], dtype=torch.bool)
    logits = F.linear(rms_norm(h, norm_w, eps), router_w)
    top = logits.topk(top_k + 1, dim=-1).values
    kth, next_ = top[:, top_k - 1], top[:, top_k]
    _, exponent = torch.frexp(torch.maximum(kth.abs(), next_.abs()))
    ulp = torch.ldexp(torch.ones_like(kth), exponent - 1 - MANTISSA_BITS[dtype])
    return kth - next_ > ulp + ROUTING_SLACK[dtype]


def compared_rows(name, args, dtype):
    """Rows of an op's outputs to compare with its reference (None: all); see moe_decided_rows."""
    return moe_decided_rows(args, dtype) if name == "moe" else None


def round_bf16_to_nearest(monkeypatch) -> None:
    """Triton's interpreter casts fp32 to bf16 by truncation; the GPU rounds to nearest even. Truncation's
    bias adds up over the sums of a chunked kernel (measured: 4x the GPU's rounding error), so round like
    the GPU (for this test, through monkeypatch). No interpreter: nothing to correct."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    convert = interpreter._convert_float

    def rounded(data, src, dst, rounding_mode):
        if rounding_mode is None and src == tl.float32 and dst == tl.bfloat16:
            bits = data.astype(np.float32).view(np.uint32).astype(np.uint64)
            return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return convert(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", rounded)


def upcast(args):
    """Floating-point tensors in fp32; FP8 weights (float8_e4m3fn, their scales fp32 already) as they are."""
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float8_e4m3fn
            else a for a in args]


def clone_args(args, device):
    return [a.clone().to(device) if isinstance(a, torch.Tensor) else a for a in args]


def outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _shares_memory(a, b):
    """Same storage (what torch's custom-op alias check compares: empty views count too), or, for
    non-empty tensors, the same storage address."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa._cdata == sb._cdata or (a.numel() > 0 and b.numel() > 0 and sa.data_ptr() == sb.data_ptr())


def assert_no_aliasing(name, outputs, inputs):
    """No output shares memory with another output or with any input (custom-op contract)."""
    inputs = [a for a in inputs if isinstance(a, torch.Tensor)]
    for i, o in enumerate(outputs):
        for j, other in enumerate(outputs[i + 1:], i + 1):
            assert not _shares_memory(o, other), f"{name}: outputs {i} and {j} share memory"
        for j, a in enumerate(inputs):
            assert not _shares_memory(o, a), f"{name}: output {i} shares memory with tensor input {j}"
