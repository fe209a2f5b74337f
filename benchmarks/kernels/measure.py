"""What the kernel checks share: a CUDA-graph replay's median time and the relative error of an output."""

from __future__ import annotations

import torch


def graph_ms(call) -> float:
    """The median ms of `call` replayed in a CUDA graph (triton.testing.do_bench_cudagraph), after one eager call
    (autotuning and library set-up happen before the capture)."""
    import triton.testing

    call()
    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (a zero reference counts as 1e-30)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
