"""The decode step's dense projections (1-16 rows against a bf16 weight) under cuBLAS against an experimental
Triton GEMV of our own, per projection of a preset, under CUDA-graph replay: is there a kernel that reads the
weights closer to the HBM rate than cuBLAS does at decode, in one launch?

Why look: at the 9B's D1 the step's cuBLAS GEMMs take ~90% of the device time, and cuBLAS runs the narrow
ones (down, out, o_proj: N = 4096) split-K as three kernels (the GEMM, `splitKreduce_kernel`, `memcpy32_post`:
~190 of a 9B step's ~560 device activities, H100 5261631); the 35B-A3B's projections are a few MB each, where a
kernel's ramp and tail count.

The experimental kernel (`_gemv_kernel`, here only): y [M, N] = x [M, K] @ w [N, K]^T, one program per (BN
columns, part s of S parts of K), each a pipelined tl.dot loop (the weight tile [BN, BK] the MMA's wide side,
x [BM = 16, BK] the narrow one: Hopper's wgmma takes the weight from shared memory through TMA-less pipelined
loads); with S > 1 each part stores its fp32 partial sums, takes a ticket from the column tile's counter, and
the part that takes the last ticket sums the S partials in part order (the same sum whichever part arrives last:
replays are exact, no float atomics), rounds once and resets the counter for the next call. One launch a
projection.

Per case, us a call and the rate its weight bytes give, each over R copies of the weight in turn (R x the
weight past the 50 MB L2): cuBLAS (`x @ w.t()`) and each (BN, BK, S, stages) of ours; the output against
cuBLAS's (relative error). Prints a table per preset and one JSON line (also written to --json).

    . benchmarks/gpu_session.sh setup && python3 benchmarks/kernels/check_gemv.py --json "$OUT/gemv.json"
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from metrale_graph import PRESETS
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_ints
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table
from measure import attempt, graph_ms, rel

L2_PAST = 160e6  # bytes a timed call's weight copies add up to (at least one copy)
TILES = [(64, 128, 4), (128, 128, 4), (64, 256, 3), (128, 64, 4)]  # (BN, BK, stages)
PARTS = (1, 2, 4, 8, 16)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr):
    """Program (column tile, part s): acc [BN, BM] = w[cols, ks] @ x[:, ks]^T over its K part; one part: y's
    columns stored; several: the partial stored and the last part to finish sums them in part order."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    k = tl.arange(0, BK)
    k_lo = s * K_PER
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + (k_lo + k)[None, :]
    x_ptrs = x_ptr + rows[None, :].to(tl.int64) * stride_xm + (k_lo + k)[:, None]
    m_x = (rows < M)[None, :]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for _ in tl.range(0, K_PER, BK, num_stages=STAGES):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, mask=m_x, other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BK
        x_ptrs += BK
    out = y_ptr + rows[None, :].to(tl.int64) * stride_ym + cols[:, None]
    m_out = (cols < N)[:, None] & m_x
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
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=m_out)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (a graph replay)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_out)


class Gemv:
    """Our kernel for x [M, K] (M <= 16) against w [N, K] at one (BN, BK, parts, stages): the buffers it keeps."""

    def __init__(self, M: int, N: int, K: int, BN: int, BK: int, parts: int, stages: int, device):
        if K % (parts * BK):
            raise ValueError(f"K {K} is not a multiple of parts x BK = {parts} x {BK}")
        self.M, self.N, self.K, self.BN, self.BK, self.parts, self.stages = M, N, K, BN, BK, parts, stages
        self.part = torch.empty(parts * M * N if parts > 1 else 1, dtype=torch.float32, device=device)
        self.count = torch.zeros(triton.cdiv(N, BN), dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _gemv_kernel[(triton.cdiv(self.N, self.BN), self.parts)](
            x, w, y, self.part, self.count, self.M, self.N, self.K, self.K // self.parts, x.stride(0), w.stride(0),
            y.stride(0), BM=16, BN=self.BN, BK=self.BK, SPLIT=self.parts > 1, STAGES=self.stages, num_warps=4)
        return y


def projections(cfg) -> list[tuple[str, int, int]]:
    """(name, N, K) of a preset's decode projections (the fused ones as the model stores them)."""
    D = cfg.hidden_size
    out = [("gdn in (qkv|z|b|a)", cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads, D),
           ("gdn out", D, cfg.value_dim),
           ("attn q|gate|k|v", 2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim, D),
           ("attn o", D, cfg.num_attention_heads * cfg.head_dim)]
    if cfg.num_experts:
        out += [("shared gate|up|router", 2 * cfg.shared_expert_intermediate_size + cfg.num_experts, D),
                ("shared down", D, cfg.shared_expert_intermediate_size)]
    else:
        out += [("mlp gate|up", 2 * cfg.intermediate_size, D), ("mlp down", D, cfg.intermediate_size)]
    return out + [("lm head", cfg.vocab_size, D)]


def measure(name: str, N: int, K: int, M: int, device="cuda") -> dict:
    g = torch.Generator(device=device).manual_seed(N + K + M)
    nbytes = N * K * 2
    copies = math.ceil(L2_PAST / nbytes)  # (1 for a weight past L2_PAST itself)
    ws = [(torch.randn(N, K, generator=g, device=device) * K ** -0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(M, K, generator=g, device=device).to(torch.bfloat16)
    ys = [torch.empty(M, N, dtype=torch.bfloat16, device=device) for _ in ws]
    ref = x @ ws[0].t()
    row = {"projection": name, "N": N, "K": K, "M": M, "weight_MB": round(nbytes / 1e6, 1), "copies": copies}
    ms, err = attempt(lambda: graph_ms(lambda: [torch.matmul(x, w.t(), out=y) for w, y in zip(ws, ys)]) / copies)
    row["cublas_us"], row["cublas_TB_s"], row["cublas_error"] = _cell(ms, nbytes) + (err,)
    tried = []
    for BN, BK, stages in TILES:
        for parts in PARTS:
            if K % (parts * BK):
                continue
            kern, err = attempt(lambda: Gemv(M, N, K, BN, BK, parts, stages, device))
            if err is None:
                out, err = attempt(lambda: rel(kern(x, ws[0], ys[0]), ref))
            ms = None
            if err is None:
                ms, err = attempt(lambda: graph_ms(lambda: [kern(x, w, y) for w, y in zip(ws, ys)]) / copies)
            us, tb = _cell(ms, nbytes)
            tried.append({"BN": BN, "BK": BK, "parts": parts, "stages": stages, "us": us, "TB_s": tb,
                          "vs_cublas": out if err is None else None, "error": err})
    row["ours"] = tried
    timed = [t for t in tried if t["us"] is not None]
    row["best"] = min(timed, key=lambda t: t["us"]) if timed else None
    return row


def _cell(ms, nbytes) -> tuple:
    if ms is None:
        return None, None
    return round(ms * 1e3, 2), round(nbytes / (ms * 1e-3) / 1e12, 2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_gemv.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    bf16 = [n for n, c in PRESETS.items() if c.quantization is None]
    p.add_argument("--presets", default="qwen3.5-9b,qwen3.5-35b-a3b", help=f"comma-separated, out of {', '.join(bf16)}")
    p.add_argument("--rows", type=positive_ints, default="1,4,16", help="decode rows (at most 16)")
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    presets = [s for s in args.presets.split(",") if s]
    bad = [s for s in presets if s not in PRESETS or PRESETS[s].quantization is not None]
    if bad or not presets:
        p.error(f"--presets: {', '.join(bad) or 'none given'} (bf16 presets only)")
    if any(m > 16 for m in args.rows):
        p.error("--rows: at most 16 (the kernel's BM)")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU; torch sees none\n")
    rows = []
    for preset in presets:
        for name, N, K in projections(PRESETS[preset]):
            for M in args.rows:
                r = measure(name, N, K, M)
                r["preset"] = preset
                rows.append(r)
                print(f"  {preset} {name} M {M}", flush=True)
    heads = ["preset", "projection", "N x K", "M", "MB", "cuBLAS us", "TB/s", "ours us", "TB/s", "BN/BK/parts/stages",
             "vs cuBLAS"]
    table = []
    for r in rows:
        b = r["best"] or {}
        table.append([r["preset"], r["projection"], f"{r['N']} x {r['K']}", r["M"], r["weight_MB"], r["cublas_us"] or "-",
                      r["cublas_TB_s"] or "-", b.get("us", "-"), b.get("TB_s", "-"),
                      f"{b['BN']}/{b['BK']}/{b['parts']}/{b['stages']}" if b else "-",
                      f"{b['vs_cublas']:.1e}" if b.get("vs_cublas") is not None else "-"])
    print(f"\ndecode projections, bf16, CUDA-graph replay, {torch.cuda.get_device_name()}")
    print_table(heads, table)
    record = {"tool": "check_gemv", "device": torch.cuda.get_device_name(), **provenance(argv), "rows": rows}
    if args.json:
        import json

        write_whole(args.json, json.dumps(record, indent=1))
    print_json(record)


if __name__ == "__main__":
    main()
