"""Sweep of the decode-shaped FP8 GEMM's tiles on a GPU (issue 26: FP8 decode should approach 2x bf16).

At D1 the 9B-FP8 preset spent 3.71 of its 5.6 ms of device time in `_block_fp8_splitk_kernel` (9e87066,
bench --profile), about 1.9 TB/s on the FP8 weights, and at D32 3.44 ms in cuBLAS' blockwise GEMM. This
tool's first run (9e87066, benchmarks/h200-fp8-decode-sweep.json) chose a GEMV form for one row and
128-column tiles (f340188); its second (755f071, benchmarks/h200-fp8-decode-sweep-755f071.json) and an A/B
at 0a36b93 (benchmarks/h200-fp8-gemv-ab-0a36b93.json) did not find the GEMV faster again, so the linear
takes the split-K kernel at one row too. It times, under CUDA-graph replay at the 9B's projection shapes:
  auto        block_fp8_linear as the model calls it (its backend and tiles);
  gemv        the one-row GEMV below (_block_fp8_gemv_kernel) at each (BN, programs per SM, warps, stages);
  gemv2d      the GEMV's DEFER form: its multiply-adds kept in a [BN, 128] accumulator, reduced once at
              the end (no cross-thread reduction per K step);
  splitk      ops/fp8's split-K GEMM (FP8 tensor-core dot, 16 or 32 rows) at each tile;
  cublas      the quantizer + torch._scaled_mm blockwise, and bf16 x @ w.T.
(Its runs at 755f071 also timed a swapped split-K form, the weight's columns on the MMA's M side so that
Hopper's FP8 wgmma takes it; it lost the 9B-FP8's decode steps and was removed: BENCHMARKS.md, FP8.) It
prints each one's effective TB/s on the weight bytes, the best per shape, and a JSON line.

    python benchmarks/kernels/sweep_fp8_decode.py [--rows 1,4,16,32] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from metrale_graph.ops import fp8
from metrale_graph.ops.fp8.linear import _block_fp8_splitk_kernel, _splitk_sum_kernel, splitk_parts
from metrale_graph.ops.fp8.quant import quantize_e4m3
from metrale_graph.tools.provenance import provenance

SHAPES = [(24576, 4096), (4096, 12288), (16448, 4096), (4096, 4096)]  # the 9B's (N, K): check_fp8's SHAPES_9B


@triton.jit
def _block_fp8_gemv_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, p_ptr, N, K, K_PER, stride_as_g, stride_bn, stride_bs_n,
                           BN: tl.constexpr, BK: tl.constexpr, QUANT_A: tl.constexpr, DEFER: tl.constexpr = False):
    """A one-row form of ops/fp8's split-K GEMM (a candidate; the linear launches the split-K kernel at one row
    too, ops/fp8/linear.py SPLITK_BN says why): p[part, 0, n] as _block_fp8_splitk_kernel's for a single row
    a, each group's dot as fp32 multiply-adds (codes times codes: exact products) instead of a tensor-core dot
    padded to 16 rows. DEFER: the products, scaled per group, summed in a [BN, BK] accumulator and reduced
    over K once after the loop instead of at every K step."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    c_safe = (cols % N).to(tl.int64)
    k_lo = part * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    k = tl.arange(0, BK)
    b_ptrs = b_ptr + c_safe[:, None] * stride_bn + (k_lo + k)[None, :]  # [BN, BK]
    bs_ptrs = bs_ptr + (c_safe // 128) * stride_bs_n
    if DEFER:
        acc2 = tl.zeros((BN, BK), dtype=tl.float32)
    else:
        acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        mk = k < k_hi - k0
        g = k0 // 128
        if QUANT_A:
            x = tl.load(a_ptr + k0 + k, mask=mk, other=0.0).to(tl.float32)[None, :]
            a, sa = quantize_e4m3(x, tl.max(tl.abs(x), axis=1))
            a = a.to(tl.float32)
        else:
            a = tl.load(a_ptr + k0 + k, mask=mk, other=0.0).to(tl.float32)[None, :]
            sa = tl.load(as_ptr + g * stride_as_g + tl.zeros((1,), dtype=tl.int32))
        b = tl.load(b_ptrs, mask=mk[None, :], other=0.0).to(tl.float32)
        if DEFER:
            acc2 += b * (a * (sa * tl.load(bs_ptrs + g).to(tl.float32))[:, None])
        else:
            acc += tl.sum(b * a, axis=1) * sa * tl.load(bs_ptrs + g).to(tl.float32)
        b_ptrs += BK
    if DEFER:
        acc = tl.sum(acc2, axis=1)
    tl.store(p_ptr + part * N + cols, acc, mask=cols < N)


def _launch(x, w, s, BN, per_sm, rows, kernel):
    """A run() of one candidate: `kernel(grid, partial)` launches its partials, then the ops' fixed-order
    sum kernel rounds them to bf16."""
    T, K = x.shape
    N = w.shape[0]
    parts, k_per = splitk_parts(N, K, x.device, BN, per_sm)
    partial = torch.empty((parts, T, N), dtype=torch.float32, device=x.device)
    out = torch.empty((T, N), dtype=torch.bfloat16, device=x.device)

    def run():
        kernel((triton.cdiv(N, BN), parts), partial, k_per)
        _splitk_sum_kernel[(triton.cdiv(T * N, 1024),)](partial, out, out, T, N, parts, 0, out.stride(0),
                                                       HAS_RESIDUAL=False, BLOCK_E=1024)
        return out
    return run


def splitk(x, w, s, BM, BN, per_sm, warps, stages):
    T, K = x.shape
    N = w.shape[0]
    return _launch(x, w, s, BN, per_sm, T, lambda grid, p, k_per: _block_fp8_splitk_kernel.fn[grid](
        x, x, w, s, p, T, N, K, k_per, x.stride(0), 0, 0, w.stride(0), s.stride(0), BM=BM, BN=BN, BK=128,
        QUANT_A=True, num_warps=warps, num_stages=stages))


def gemv(x, w, s, BN, per_sm, warps, stages, two_d=False):
    _, K = x.shape
    N = w.shape[0]
    return _launch(x, w, s, BN, per_sm, 1, lambda grid, p, k_per: _block_fp8_gemv_kernel[grid](
        x, x, w, s, p, N, K, k_per, 0, w.stride(0), s.stride(0), BN=BN, BK=128, QUANT_A=True, DEFER=two_d,
        num_warps=warps, num_stages=stages))


def bench(fn):
    fn()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/sweep_fp8_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_fp8_decode: needs a CUDA GPU")
    rows_list = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= 32 for r in rows_list):
        p.error(f"--rows: decode rows from 1 to 32, got {args.rows}")
    dev = torch.device("cuda")
    recs = []
    for N, K in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        wb = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        q, s = fp8.quantize_weight_blocks(wb)
        for M in rows_list:
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            ref = fp8.block_fp8_linear_ref(x, q, s, torch.float32)
            cands = {"bf16": lambda: x @ wb.t(),
                     "auto": lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16)}
            if M >= 16:
                cands["cublas"] = lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16, backend="cublas")
            BM = 16 if M <= 16 else 32
            if M == 1:
                for BN, per_sm, (w, st) in itertools.product((64, 128), (2, 4, 8), ((4, 3), (4, 4), (8, 3))):
                    cands[f"gemv BN{BN} x{per_sm} w{w} s{st}"] = gemv(x, q, s, BN, per_sm, w, st)
                for BN, per_sm, (w, st) in itertools.product((32, 64, 128), (2, 4, 8), ((4, 3), (8, 3))):
                    cands[f"gemv2d BN{BN} x{per_sm} w{w} s{st}"] = gemv(x, q, s, BN, per_sm, w, st, two_d=True)
            for BN, per_sm, (w, st) in itertools.product((64, 128), (4, 8), ((4, 3), (4, 4), (8, 3))):
                cands[f"splitk BM{BM} BN{BN} x{per_sm} w{w} s{st}"] = splitk(x, q, s, BM, BN, per_sm, w, st)
            best = None
            for name, fn in cands.items():
                try:
                    out = fn()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = bench(fn)
                except Exception as e:  # a config that does not compile or launch: recorded, not fatal
                    recs.append({"N": N, "K": K, "M": M, "name": name, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                nbytes = (2 if name == "bf16" else 1) * N * K
                rec = {"N": N, "K": K, "M": M, "name": name, "us": ms * 1e3, "TB_s": nbytes / ms / 1e9,
                       "rel_err": err}
                recs.append(rec)
                if name != "bf16" and err < 0.05 and (best is None or ms * 1e3 < best["us"]):
                    best = rec
            base = {r["name"]: r for r in recs if r["N"] == N and r["K"] == K and r["M"] == M and "us" in r}
            print(f"{N}x{K} M={M}: bf16 {base['bf16']['us']:.1f} us ({base['bf16']['TB_s']:.2f} TB/s), auto "
                  f"{base['auto']['us']:.1f} us ({base['auto']['TB_s']:.2f}), best {best['name']} {best['us']:.1f} us "
                  f"({best['TB_s']:.2f} TB/s, err {best['rel_err']:.1e})", flush=True)
            x = None  # freed (the candidates' lambdas close over it: no del)
        wb = q = s = None
    out = {"tool": "sweep_fp8_decode", **provenance(argv), "device": torch.cuda.get_device_name(), "records": recs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({"records": len(recs)}))


if __name__ == "__main__":
    main()
