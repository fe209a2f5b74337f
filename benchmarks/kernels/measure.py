"""What the kernel checks share: a CUDA-graph replay's median time, the relative error of an output, a case run
so that its failure is a row instead of the end of the run, and the table cells."""

from __future__ import annotations

import sys
import traceback

import torch

from metrale_graph.tools.report import print_table


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


def short(e: BaseException) -> str:
    """An error's type and first line, at most 160 characters."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:160]


def attempt(fn):
    """(fn(), None), or (None, short(the error)) with the traceback on standard error."""
    try:
        return fn(), None
    except Exception as e:  # every case reports instead of ending the run
        traceback.print_exc(file=sys.stderr)
        return None, short(e)


def fmt_value(v) -> str:
    return f"{v:.2e}" if isinstance(v, float) else str(v)[:60]


def fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def fmt_num(v, digits=0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def titled_table(title: str, headers: list[str], rows: list[list]) -> None:
    print(f"\n{title}")
    print_table(headers, rows)
