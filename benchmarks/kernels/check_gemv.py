"""The decode step's dense projections (1-16 rows against a bf16 weight) under cuBLAS against an experimental
Triton GEMV of our own, per projection of a preset, under CUDA-graph replay: is there a kernel that reads the
weights closer to the HBM rate than cuBLAS does at decode, in one launch?

Why look: at the 9B's D1 the step's cuBLAS GEMMs take ~90% of the device time, and cuBLAS runs the narrow
ones (down, out, o_proj: N = 4096) split-K as three kernels (the GEMM, `splitKreduce_kernel`, `memcpy32_post`:
~190 of a 9B step's ~560 device activities, H100 5261631); the 35B-A3B's projections are a few MB each, where a
kernel's ramp and tail count.

Ours is ops/gemv.py's kernel (METRALE_DECODE_GEMV=triton; its docstring has the form): y [M, N] = x [M, K] @
w [N, K]^T in one launch, one program per (BN columns, part s of S parts of K), the parts summed in order by the
last part to finish. Timed at the tiles ops.gemv.config chooses ("default") and at each (BN, BK, S, stages) here.

Per case, us a call and the rate its weight bytes give, each over R copies of the weight in turn (R x the
weight past the 50 MB L2): cuBLAS (`x @ w.t()`), ours at its default tiles and at each (BN, BK, S, stages); the
output against cuBLAS's (relative error). Prints a table per preset and one JSON line (also written to --json).

    . benchmarks/gpu_session.sh setup && python3 benchmarks/kernels/check_gemv.py --json "$OUT/gemv.json"
"""

from __future__ import annotations

import argparse
import math

import torch

from metrale_graph import PRESETS
from metrale_graph.ops import gemv
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_ints
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table
from measure import attempt, graph_ms, rel

L2_PAST = 160e6  # bytes a timed call's weight copies add up to (at least one copy)
TILES = [(64, 128, 4), (128, 128, 4), (64, 256, 3), (128, 64, 4)]  # (BN, BK, stages)
PARTS = (1, 2, 4, 8, 16)


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
    default = gemv.config(N, K, x.device)
    for tiles in dict.fromkeys([default] + [(BN, BK, p, st) for BN, BK, st in TILES for p in PARTS if p * BK <= K]):
        BN, BK, parts, stages = tiles
        out, err = attempt(lambda: rel(gemv.gemv(x, ws[0], None, tiles), ref))
        ms = None
        if err is None:
            ms, err = attempt(lambda: graph_ms(lambda: [gemv.gemv(x, w, None, tiles) for w in ws]) / copies)
        us, tb = _cell(ms, nbytes)
        tried.append({"BN": BN, "BK": BK, "parts": parts, "stages": stages, "default": tiles == default and not tried,
                      "us": us, "TB_s": tb, "vs_cublas": out if err is None else None, "error": err})
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
                b, d = r["best"] or {}, r["ours"][0] if r["ours"] else {}
                print(f"  {preset} {name} M {M}: cuBLAS {r['cublas_us']} us, ours default {d.get('us')} us, best "
                      f"{b.get('us')} us", flush=True)  # each row as it comes: a call's time limit keeps those done
    heads = ["preset", "projection", "N x K", "M", "MB", "cuBLAS us", "TB/s", "default us", "best us", "TB/s",
             "BN/BK/parts/stages", "vs cuBLAS"]
    table = []
    for r in rows:
        b = r["best"] or {}
        d = r["ours"][0] if r["ours"] and r["ours"][0]["default"] else {}
        table.append([r["preset"], r["projection"], f"{r['N']} x {r['K']}", r["M"], r["weight_MB"], r["cublas_us"] or "-",
                      r["cublas_TB_s"] or "-", d.get("us") or "-", b.get("us", "-"), b.get("TB_s", "-"),
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
