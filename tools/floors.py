"""The floor model of tools.bench and tools.bench_ops: the least time a step (or one op) can take on
an H200, from the matrix FLOPs it must do and the bytes it must move (docs/DESIGN.md, "Benchmarks")."""

from __future__ import annotations

# The H200's two ceilings, measured there (docs/DESIGN.md): bf16 dense matrix rate, and device-to-device
# copy bandwidth counting bytes read plus bytes written.
MATMUL_RATE = 790e12
COPY_RATE = 4.3e12


def floor_ms(flops: float, nbytes: float) -> tuple[float, str]:
    """(ms, "compute" or "memory"): the larger of FLOPs at MATMUL_RATE and bytes at COPY_RATE."""
    compute, memory = flops / MATMUL_RATE * 1e3, nbytes / COPY_RATE * 1e3
    return max(compute, memory), "compute" if compute >= memory else "memory"
