"""The decode-row GEMM of the dense projections, y = x @ w^T (+ residual), x [M <= 16, K] against a bf16 / fp16
weight w [N, K], in one Triton launch (METRALE_DECODE_GEMV=triton; cuBLAS otherwise, the default).

    y = linear(x, w)              # x @ w.t(), or this kernel where `takes(x, w)`
    y = linear(x, w, residual)    # residual + x @ w.t() (torch.addmm's), the residual added before the one rounding

Why: cuBLAS runs the decode step's narrow projections (N = the hidden size) split-K as three kernels (the GEMM,
`splitKreduce_kernel`, a copy), ~190 of a 9B one-stream step's ~560 device activities on the H100 (5261631), and
the 35B-A3B's projections are a few MB each, where each kernel's ramp and tail count as much as its bytes.

The kernel (benchmarks/kernels/check_gemv.py times it against cuBLAS per projection): one program per (BN
columns, part s of `parts` parts of K), each a pipelined tl.dot loop with the weight tile [BN, BK] as the MMA's
wide side and x [16, BK] the narrow one (wgmma on sm_90). One part stores its columns; with several, each part
stores its fp32 partial sums, takes a ticket from its column tile's counter, and the part that takes the last
ticket sums every part's partial in part order (the same sum whichever part finishes last: a replay equals the
eager call bit for bit, no float atomics), adds the residual, rounds once and resets the counter for the next
call. The counters are one zeroed int32 buffer per device, made on the first call outside a CUDA-graph capture
(inside one, a call before any other makes its own, a memset in the graph); calls on one device run in stream
order, as the engine's do (two streams of one device running this kernel at once would share counters).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from metrale_graph import envs

from .common import INTERPRET

MAX_ROWS = 16  # the kernel's BM: decode rows (a one-stream bucket holds 2 tokens, a k 3 verify 4 a stream)
BACKENDS = envs.choices("METRALE_DECODE_GEMV")
BACKEND = envs.METRALE_DECODE_GEMV  # read at import (tests set the attribute)
_COUNTERS: dict[torch.device, Tensor] = {}
_COUNTER_SIZE = 1 << 14


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, r_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_rm,
                 stride_ym, HAS_RESIDUAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SPLIT: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
    """Program (column tile, part s): acc [BN, BM] = w[cols, part s's K] @ x[:, part s's K]^T in fp32; one part:
    y's columns (+ residual) stored; several: the partial stored, the last part to finish sums them in order.
    IEEE: the dot in fp32 (fp32 operands, and the interpreter, whose 16-bit dots are wrong: ops/moe/gemm.py's _dot)."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    k = tl.arange(0, BK)
    k_lo = s * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + (k_lo + k)[None, :]
    x_ptrs = x_ptr + (rows % M)[None, :].to(tl.int64) * stride_xm + (k_lo + k)[:, None]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        mk = k < k_hi - k0
        w = tl.load(w_ptrs, mask=mk[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=mk[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BK
        x_ptrs += BK
    m_out = (cols < N)[:, None] & (rows < M)[None, :]
    if SPLIT:
        mine = part_ptr + (s * M + rows[None, :]).to(tl.int64) * N + cols[:, None]
        tl.store(mine, acc, mask=m_out)
        tl.debug_barrier()
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if ticket == tl.num_programs(1) - 1:  # the last part of this column tile: every partial is stored
            total = tl.zeros((BN, BM), dtype=tl.float32)
            for p in range(tl.num_programs(1)):
                total += tl.load(part_ptr + (p * M + rows[None, :]).to(tl.int64) * N + cols[:, None], mask=m_out,
                                 other=0.0, cache_modifier=".cg")
            if HAS_RESIDUAL:
                total += tl.load(r_ptr + rows[None, :].to(tl.int64) * stride_rm + cols[:, None], mask=m_out,
                                 other=0.0).to(tl.float32)
            tl.store(y_ptr + rows[None, :].to(tl.int64) * stride_ym + cols[:, None],
                     total.to(y_ptr.dtype.element_ty), mask=m_out)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (a graph replay)
    else:
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + rows[None, :].to(tl.int64) * stride_rm + cols[:, None], mask=m_out,
                           other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[None, :].to(tl.int64) * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=m_out)


def config(N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BN, BK, parts, stages) for an [N, K] weight: columns in tiles of 64, K in parts of whole BK = 128 steps so
    that about two programs per SM stream the weight (a narrow projection's 32-64 column tiles alone leave most
    SMs idle). From the shapes and the device only."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    BN, BK = 64, 128
    tiles, steps = triton.cdiv(N, BN), triton.cdiv(K, BK)
    want = max(1, min(steps, triton.cdiv(2 * sms, tiles)))
    per = triton.cdiv(steps, want)  # BK steps a part
    return BN, BK, triton.cdiv(steps, per), 4


def takes(x: Tensor, w: Tensor) -> bool:
    """Whether linear() runs x @ w^T through this kernel: the backend chosen, decode rows (1-16), a 16-bit float
    weight of x's dtype with unit inner strides, on CUDA (or in Triton's interpreter)."""
    return (BACKEND == "triton" and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and w.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and x.shape[1] == w.shape[1]
            and (x.is_cuda or INTERPRET) and w.device == x.device and w.stride(1) == 1)


def linear(x: Tensor, w: Tensor, residual: Tensor | None = None) -> Tensor:
    """x @ w.t() (+ residual), fresh, in x's dtype: this kernel where takes(x, w) and the residual (if any) is [M, N]
    itself, else cuBLAS (torch.addmm, which also broadcasts a residual). A BACKEND that is neither backend is a
    ValueError naming it."""
    if BACKEND not in BACKENDS:
        raise ValueError(f"METRALE_DECODE_GEMV / ops.gemv.BACKEND must be one of {', '.join(BACKENDS)}, got {BACKEND!r}")
    whole = residual is None or tuple(residual.shape) == (x.shape[0], w.shape[0])
    if not (whole and takes(x, w)):
        return x @ w.t() if residual is None else torch.addmm(residual, x, w.t())
    return gemv(x, w, residual)


def gemv(x: Tensor, w: Tensor, residual: Tensor | None = None, tiles: tuple[int, int, int, int] | None = None) -> Tensor:
    """The kernel itself: x [M <= 16, K] @ w [N, K]^T (+ residual [M, N]), fp32 inside, rounded once; `tiles`:
    (BN, BK, parts, stages) instead of config's (benchmarks/kernels/check_gemv.py tries several)."""
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:  # (the kernel reads its rows as contiguous columns)
        residual = residual.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    if K == 0:
        return y.zero_() if residual is None else y.copy_(residual)
    BN, BK, parts, stages = tiles or config(N, K, x.device)
    k_per = triton.cdiv(triton.cdiv(K, BK), parts) * BK
    parts = triton.cdiv(K, k_per)  # (no empty part)
    tiles = triton.cdiv(N, BN)
    if parts > 1:
        partial = torch.empty((parts, M, N), dtype=torch.float32, device=x.device)
        count = _counters(x.device, tiles)
    else:
        partial = count = y  # (unread)
    r = y if residual is None else residual
    _gemv_kernel[(tiles, parts)](x, w, r, y, partial, count, M, N, K, k_per, x.stride(0), w.stride(0), r.stride(0),
                                 y.stride(0), HAS_RESIDUAL=residual is not None, BM=MAX_ROWS, BN=BN, BK=BK,
                                 SPLIT=parts > 1, STAGES=stages,
                                 IEEE=INTERPRET or x.dtype == torch.float32, num_warps=4)
    return y


def _counters(device: torch.device, n: int) -> Tensor:
    """n zeroed int32 ticket counters the kernel leaves zeroed: the device's shared buffer, made on the first call
    outside a graph capture; inside a capture before that (or past its size), a fresh zeroed one."""
    buf = _COUNTERS.get(device)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        with torch.inference_mode(False):
            buf = _COUNTERS[device] = torch.zeros(_COUNTER_SIZE, dtype=torch.int32, device=device)
    if buf is None or n > buf.numel():
        return torch.zeros(n, dtype=torch.int32, device=device)
    return buf
