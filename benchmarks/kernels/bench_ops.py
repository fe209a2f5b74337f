"""Per-op benchmark: each metrale:: phase op on the GPU at a model's shape (default the Qwen3.5-9B
shape) for a few token counts, against its floor max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s) (an FP8
preset: its projections' FP8 weights at one byte, every FLOP at the FP8 rate, 1274 TFLOP/s).
Two medians of CUDA-event timings after warmup: called eagerly (triton.testing.do_bench, host
launch overhead included) and replayed from a CUDA graph (do_bench_cudagraph: device time,
which is what a captured prefill pays). Prints a table, optionally writes it as markdown, and
ends with one JSON line.

    python benchmarks/kernels/bench_ops.py [--tokens 512,8192] [--streams 4] [--markdown FILE]
    python benchmarks/kernels/bench_ops.py --decode 1,32,128 [--context 2048]   # decode steps' ops

--decode B,...: instead of prefills, decode-shaped calls: B streams of one new token after --context
cached tokens each (tools.bench's D1 / D32 / D128), where the floor is the states, the cached K/V and
the weights a step reads.
"""

from __future__ import annotations

import argparse
import functools

import torch

from metrale_graph import PRESETS
from metrale_graph.ops import REGISTRY, Shapes, example_args
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import output_file, positive_int, positive_ints
from metrale_graph.tools.floors import floor_ms
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import markdown_table, print_json, print_table, progress_bar

GDN_OPS = ("gdn_proj", "causal_conv1d", "l2norm", "gdn_recurrence", "gdn_out")
ATTENTION_OPS = ("attn_proj", "paged_attention", "attn_out")


def ops_of(cfg) -> list[str]:
    """The registered ops a model of `cfg` runs (no mlp without dense layers, no moe without MoE ones)."""
    skip = set()
    if not cfg.linear_layers:
        skip |= set(GDN_OPS)
    if not cfg.full_layers:
        skip |= set(ATTENTION_OPS)
    if not cfg.moe_layers:
        skip.add("moe")
    if len(cfg.moe_layers) == cfg.num_hidden_layers:
        skip.add("mlp")
    return [name for name in REGISTRY if name not in skip]


def _shapes(cfg, n: int, args) -> Shapes:
    """The call's sizes: with --decode, n one-token streams after --context cached tokens each; else n
    tokens over --streams fresh streams (one slot each)."""
    if args.decode:
        return Shapes.from_config(cfg, [1] * n, [args.context] * n)
    lengths = [n // args.streams] * args.streams
    lengths[-1] += n - sum(lengths)
    return Shapes.from_config(cfg, lengths)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/kernels/bench_ops.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b", choices=list(PRESETS))
    p.add_argument("--tokens", type=positive_ints, default="512,8192", help="comma-separated total token counts")
    p.add_argument("--streams", type=positive_int, default=4, help="streams the tokens are split into")
    p.add_argument("--decode", type=positive_ints, default=None,
                   help="comma-separated stream counts: decode-shaped calls (one new token each) instead of --tokens")
    p.add_argument("--context", type=positive_int, default=2048, help="cached tokens per stream with --decode")
    p.add_argument("--markdown", type=output_file, default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    if args.decode is None and min(args.tokens) < args.streams:
        p.error(f"--tokens {min(args.tokens)} is fewer than --streams {args.streams}: every stream needs a token")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this benchmark needs a CUDA GPU; torch sees none\n")
    import triton.testing

    cfg = PRESETS[args.preset]
    rows, records = [], []
    jobs = [(T, name) for T in (args.decode or args.tokens) for name in ops_of(cfg)]
    for T, name in progress_bar(jobs, desc="ops", unit="op"):
        shapes = _shapes(cfg, T, args)
        inputs = example_args(name, shapes, torch.bfloat16, device="cuda")
        call = functools.partial(REGISTRY[name].op, *inputs)
        eager = triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median")
        with torch.cuda.stream(torch.cuda.Stream()):
            ms = triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median")
        flops, nbytes = REGISTRY[name].cost(shapes)
        # FP8 ops: every FLOP at the FP8 rate (the router's and the GDN gates' bf16 ones too: the floor errs low)
        floor, bound = floor_ms(0.0, nbytes, flops) if shapes.fp8 else floor_ms(flops, nbytes)
        rows.append([name, T, f"{eager:.3f}", f"{ms:.3f}", f"{floor:.3f}", f"{ms / floor:.2f}x", bound,
                     f"{flops / ms / 1e9:.0f}", f"{nbytes / ms / 1e6:.0f}"])
        records.append({"op": name, "tokens": T, "cached": sum(shapes.context), "eager_ms": round(eager, 4),
                        "graph_ms": round(ms, 4), "floor_ms": round(floor, 4)})
        del inputs, call
    headers = ["op", "streams" if args.decode else "tokens", "eager ms", "graph ms", "floor ms", "graph / floor",
               "bound", "TFLOP/s", "GB/s"]
    weights = "FP8 weights, bf16 activations" if cfg.quantization is not None else "bf16"
    what = (f"decode: one new token a stream after {args.context} cached" if args.decode else
            f"{args.streams} streams")
    print(f"\n{args.preset}, {weights}, {what}, {torch.cuda.get_device_name()}")
    print_table(headers, rows)
    if args.markdown:
        write_whole(args.markdown, markdown_table(headers, rows))
    print_json({"tool": "bench_ops", "preset": args.preset, "device": torch.cuda.get_device_name(), **provenance(),
                "ops": records})


if __name__ == "__main__":
    main()
