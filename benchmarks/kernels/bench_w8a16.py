"""The weight-only FP8 GEMM (ops/fp8/w8a16.py, METRALE_FP8_DECODE=w8a16) against the W8A8 decode GEMM and bf16
cuBLAS at the 9B's projection shapes on a GPU (issue 38, item 3: FP8 decode GEMMs at >= 3.5 TB/s).

Times under CUDA-graph replay (measure.graph_ms), bf16 x and out, at each (N, K) and row count:
  bf16        x @ w.T (cuBLAS), the bf16 weight;
  w8a8        block_fp8_linear as the model calls it by default (the split-K GEMM up to 16 rows, cuBLAS'
              blockwise GEMM above);
  w8a16       w8a16_linear, autotuned (the config the autotuner took is printed);
  w8a16 BN.. (--sweep) each sm_90 tile of w8a16.SM90_TILES at 2 / 4 / 8 programs per SM.
Each one's achieved TB/s is its floor bytes over its time: the codes (bf16: the weight), the scales, x and
the output, once; beside it the fraction of the H200's 4.3 TB/s, and its error against w8a16_linear_ref
(bf16 and w8a8 are other products: their error is the quantization's, not a bug).

    python benchmarks/kernels/bench_w8a16.py [--rows 1,8,32] [--sweep] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from measure import attempt, graph_ms, rel

from metrale_graph.ops import fp8
from metrale_graph.ops.fp8 import w8a16
from metrale_graph.tools.provenance import provenance

SHAPES = [(24576, 4096), (4096, 12288), (16448, 4096), (4096, 4096)]  # the 9B's (N, K): sweep_fp8_decode's SHAPES
HBM_TB_S = 4.3  # the H200's HBM3e bandwidth


def floor_bytes(name: str, M: int, N: int, K: int) -> int:
    weight = 2 * N * K if name == "bf16" else N * K + 4 * fp8.num_blocks(N) * fp8.num_blocks(K)
    return weight + 2 * M * K + 2 * M * N


def candidates(x, wb, q, s, sweep: bool) -> dict:
    M = x.shape[0]
    cands = {"bf16": lambda: x @ wb.t(), "w8a8": lambda: fp8.block_fp8_linear(x, q, s, torch.bfloat16),
             "w8a16": lambda: w8a16.w8a16_linear(x, q, s, torch.bfloat16)}
    if sweep:
        N = q.shape[0]
        configs = w8a16._prune(w8a16._w8a16_tuned.configs, {"N": N}, BM=16 if M <= 16 else 32)
        for cfg in configs:
            tiles = (cfg.kwargs["BN"], cfg.kwargs["SWAP"], cfg.num_warps, cfg.num_stages)
            for per_sm in (2, 4, 8):
                name = f"w8a16 BN{tiles[0]}{' swap' if tiles[1] else ''} w{tiles[2]} s{tiles[3]} x{per_sm}"
                cands[name] = (lambda t=tiles, p=per_sm: w8a16.w8a16_linear(x, q, s, torch.bfloat16, tiles=t, per_sm=p))
    return cands


def main(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/bench_w8a16.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32", help="decode rows, comma-separated, each 1-32")
    p.add_argument("--sweep", action="store_true", help="also every sm_90 tile at 2 / 4 / 8 programs per SM")
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows: comma-separated integers, got {args.rows!r}")
    if not all(1 <= r <= w8a16.W8A16_MAX_ROWS for r in rows_list):
        p.error(f"--rows: decode rows from 1 to {w8a16.W8A16_MAX_ROWS}, got {args.rows}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_w8a16: needs a CUDA GPU")
    dev = torch.device("cuda")
    recs = []
    for N, K in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        wb = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        q, s = fp8.quantize_weight_blocks(wb)
        for M in rows_list:
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            ref = w8a16.w8a16_linear_ref(x, q, s, torch.float32)
            line = []
            for name, fn in candidates(x, wb, q, s, args.sweep).items():
                out, error = attempt(fn)  # a config that does not compile or launch: a row, not the end
                ms, error = (None, error) if error else attempt(lambda: graph_ms(fn))
                if error:
                    recs.append({"N": N, "K": K, "M": M, "name": name, "error": error})
                    continue
                nbytes = floor_bytes(name, M, N, K)
                rec = {"N": N, "K": K, "M": M, "name": name, "us": ms * 1e3, "TB_s": nbytes / ms / 1e9,
                       "of_hbm": nbytes / ms / 1e9 / HBM_TB_S, "rel_err": rel(out.float(), ref)}
                if name == "w8a16":
                    best = w8a16._w8a16_tuned.best_config
                    rec["config"] = f"BN{best.kwargs['BN']} SWAP {best.kwargs['SWAP']} w{best.num_warps} s{best.num_stages}"
                recs.append(rec)
                if " " not in name:
                    line.append(f"{name} {rec['us']:.1f} us {rec['TB_s']:.2f} TB/s ({rec['of_hbm']:.0%})")
            mine = [r for r in recs if r["N"] == N and r["K"] == K and r["M"] == M and "us" in r
                    and r["name"].startswith("w8a16")]
            best = min(mine, key=lambda r: r["us"], default=None)
            tail = f"; best w8a16 {best['name']} {best['us']:.1f} us {best['TB_s']:.2f} TB/s" if best else ""
            auto = next((r.get("config") for r in mine if r["name"] == "w8a16"), None)
            print(f"{N}x{K} M={M}: " + ", ".join(line) + f" [autotuned {auto}]" + tail, flush=True)
            x = None  # freed (the candidates' lambdas close over it)
        wb = q = s = None
    out = {"tool": "bench_w8a16", **provenance(argv), "device": torch.cuda.get_device_name(), "records": recs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps({"records": len(recs), "errors": sum("error" in r for r in recs)}))


if __name__ == "__main__":
    main()
