"""GPU sweep of the decode step's two state-bound kernels at the Qwen3.5-9B shape, per layer, under CUDA
graph replay (triton.testing.do_bench_cudagraph medians) against their own floor (the bytes they must
move / 4.3 TB/s), for B = 1, 32, 128 one-token streams after --context cached tokens each:

- the GDN recurrence's token-by-token kernel (ops/gdn_recurrence/recurrent.py) over (BV, num_warps) tiles;
  each tile's outputs and states against the default tile's (the K reduction's order may differ: fp32
  rounding only); also on streams of --short tokens each (a split call's short streams: the kernel loops
  over a stream's tokens, so its per-token latency counts there, not only the state traffic);
- paged attention's split-K decode (ops/paged_attention/decode.py) over the number of programs its
  splits aim at (DECODE_PROGRAMS), the whole op (K/V write, splits, merge); outputs against the default's;
  then the split and merge kernels alone with each stream's split (the default) and with the static one
  (decode_split's, every stream), in block tables of --table-keys keys a stream (default: just enough).

Prints a table per kernel and ends with one JSON line (also written to --json).

    . benchmarks/gpu_session.sh setup && python3 benchmarks/kernels/check_decode.py --json "$OUT/decode.json"
"""

from __future__ import annotations

import argparse
import functools

import torch

from metrale_graph import PRESETS
from metrale_graph.ops import REGISTRY, Shapes, example_args
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_int, positive_ints
from metrale_graph.tools.floors import COPY_RATE
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table
from measure import graph_ms, rel

TILES = [(8, 1), (8, 2), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (128, 8)]  # (BV, num_warps)
PROGRAMS = [256, 512, 1024, 2048, 4096]  # paged decode: programs its splits aim at


def sweep_recurrent(cfg, B: int, L: int = 1) -> list[dict]:
    """The recurrent kernel's tiles for B streams of L tokens each (L > 1: the short streams of a split call)."""
    from metrale_graph.ops.gdn_recurrence import gdn_recurrence_recurrent
    from metrale_graph.ops.gdn_recurrence.recurrent import recurrent_tiles

    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    T = B * L
    g = torch.Generator(device="cuda").manual_seed(B)
    qk = torch.nn.functional.normalize(torch.randn(T, 2 * H, K, generator=g, device="cuda"), dim=-1).to(torch.bfloat16)
    q, k = qk[:, :H], qk[:, H:]
    v = torch.randn(T, HV, V, generator=g, device="cuda").to(torch.bfloat16)
    gate = torch.nn.functional.logsigmoid(torch.randn(T, HV, generator=g, device="cuda")) * 0.5
    beta = torch.rand(T, HV, generator=g, device="cuda").to(torch.bfloat16)
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
    slots = torch.arange(B, dtype=torch.int64, device="cuda")
    state0 = torch.randn(B + 1, HV, K, V, generator=g, device="cuda") * 0.1
    floor = (2 * B * HV * K * V * 4 + (2 * T * H * K + 2 * T * HV * V) * 2) / COPY_RATE * 1e3
    default = recurrent_tiles(K, V, B * HV)[1:]
    ref_state = state0.clone()
    ref_o = gdn_recurrence_recurrent(q, k, v, gate, beta, cu, slots, ref_state)
    rows = []
    for tiles in TILES:
        row = {"kernel": "gdn recurrent", "streams": B, "tokens": L, "config": f"BV {tiles[0]}, {tiles[1]} warps",
               "default": tiles == default, "floor_ms": round(floor, 4)}
        try:
            state = state0.clone()
            o = gdn_recurrence_recurrent(q, k, v, gate, beta, cu, slots, state, tiles=tiles)
            row["vs_default"] = max(rel(o, ref_o), rel(state, ref_state))
            state = state0.clone()
            row["graph_ms"] = round(graph_ms(functools.partial(gdn_recurrence_recurrent, q, k, v, gate, beta, cu,
                                                                slots, state, tiles=tiles)), 4)
        except Exception as e:  # noqa: BLE001 (a tile that does not compile: its row says why)
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
    return rows


def sweep_paged(cfg, B: int, context: int, table_keys: int | None = None) -> list[dict]:
    import dataclasses

    from metrale_graph.ops.paged_attention import decode as decode_mod

    shapes = Shapes.from_config(cfg, [1] * B, [context] * B)
    if table_keys:  # wider block tables than the contexts need (a server's max_context)
        shapes = dataclasses.replace(shapes, num_blocks=B * -(-max(table_keys, context + 1) // shapes.BS))
    args = example_args("paged_attention", shapes, torch.bfloat16, device="cuda")
    op = REGISTRY["paged_attention"]
    floor = op.cost(shapes)[1] / COPY_RATE * 1e3
    default, rows, ref = decode_mod.DECODE_PROGRAMS, [], None
    try:
        for n in [default] + [p for p in PROGRAMS if p != default]:
            decode_mod.DECODE_PROGRAMS = n
            row = {"kernel": "paged decode", "streams": B, "config": f"{n} programs", "default": n == default,
                   "floor_ms": round(floor, 4)}
            try:
                out = op.op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
                ref = out if ref is None else ref
                row["vs_default"] = rel(out, ref)
                row["graph_ms"] = round(graph_ms(functools.partial(op.op, *args)), 4)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
    finally:
        decode_mod.DECODE_PROGRAMS = default
    q, k_cache, v_cache, cu, ctx, blocks = args[0], *args[3:8]
    static = decode_mod.decode_split(B, q.shape[0], k_cache.shape[2], blocks.shape[1] * k_cache.shape[1])
    for name, split in (("splits + merge, each stream's split", None), (f"splits + merge, static split {static}", static)):
        row = {"kernel": "paged decode", "streams": B, "config": name, "default": split is None, "floor_ms": round(floor, 4),
               "table_keys": blocks.shape[1] * k_cache.shape[1]}
        try:
            run = functools.partial(decode_mod.paged_attention_decode, q, k_cache, v_cache, cu, ctx, blocks,
                                    torch.empty_like(q), split=split)
            row["vs_default"] = rel(run(), ref) if ref is not None else float("nan")
            row["graph_ms"] = round(graph_ms(run), 4)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/check_decode.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b", choices=list(PRESETS))
    p.add_argument("--streams", type=positive_ints, default="1,32,128")
    p.add_argument("--context", type=positive_int, default=2048)
    p.add_argument("--table-keys", type=positive_int, default=None,
                   help="paged decode: block tables of this many keys a stream (a server's max_context; default: "
                        "just enough for --context + 1)")
    p.add_argument("--short", type=positive_ints, default="16,64",
                   help="also sweep the recurrent kernel on streams of this many tokens each (a split call's short "
                        "streams, at most 64)")
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    if max(args.short) > 64:
        p.error(f"--short: streams of at most 64 tokens take the recurrent kernel, got {max(args.short)}")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this check needs a CUDA GPU; torch sees none\n")
    cfg = PRESETS[args.preset]
    rows = []
    for B in args.streams:
        rows += sweep_recurrent(cfg, B)
        rows += sweep_paged(cfg, B, args.context, args.table_keys)
        for L in args.short:
            rows += sweep_recurrent(cfg, B, L)
        print(f"  swept {B} streams", flush=True)
    table = [[r["kernel"], r["streams"], r.get("tokens", 1), r["config"] + (" (default)" if r["default"] else ""),
              r.get("graph_ms", "-"), r["floor_ms"],
              f"{r['graph_ms'] / r['floor_ms']:.2f}x" if "graph_ms" in r else "-",
              f"{r['vs_default']:.1e}" if "vs_default" in r else "-", r.get("error", "")] for r in rows]
    print(f"\n{args.preset}, one layer, decode after {args.context} cached tokens a stream, "
          f"{torch.cuda.get_device_name()}")
    print_table(["kernel", "streams", "tokens", "config", "graph ms", "floor ms", "/ floor", "vs default", "error"], table)
    record = {"tool": "check_decode", "preset": args.preset, "context": args.context, "table_keys": args.table_keys,
              "device": torch.cuda.get_device_name(), **provenance(argv), "rows": rows}
    if args.json:
        import json

        write_whole(args.json, json.dumps(record, indent=1))
    print_json(record)


if __name__ == "__main__":
    main()
