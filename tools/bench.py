"""End-to-end benchmark: the workloads of docs/benchmarking.md on one model shape (default the Qwen3.5-9B
shape, random bf16 weights, full depth), side by side in one process with the same weights: the
peer (transformers with flash-linear-attention kernels, eager), ours eager, ours compiled, ours
compiled + CUDA graphs. W1-W7 are prefill / mixed steps; D1, D32 and D128 are decode steps (one new
token per stream after 2048 cached, time per step including host work). Median of CUDA-event
timings after warmup, next to each workload's two floors (tools/floors.py): floor, max(FLOPs /
790 TFLOP/s, bytes / 4.3 TB/s) over the whole step, and phase floor, the sum of that max over the
step's phases (projections, recurrence, attention, MLP or experts, head), which cannot overlap.
Bytes are the weights a step reads (the embedding's looked-up rows; for MoE presets the experts its
tokens touch in expectation), the cached K/V read and new K/V written, the GDN and conv states read
and written. With graphs, the GPU-busy fraction: the union of the step's device intervals
(torch.profiler over replays) over its wall time. `--generate` adds an end-to-end generation run (32
prompts of 512 tokens, 256 new tokens each) against transformers' generate. Prints a table, writes
JSON and markdown if asked, and ends with one JSON line. This module is the command (its flags, the plan of a
run, the model and the output); what runs and how a run is printed is tools/bench_runs.py. It needs a CUDA GPU
(without one it says so and exits with code 1).

With `--tp N` (launched by torchrun, one GPU per rank, NCCL) our three variants run tensor-parallel
and the floor is that of N GPUs; the peer runs on one GPU and is left out. `--baseline FILE`, the
JSON of a one-GPU run of the same preset, adds each workload's speed-up over one GPU.

    python -m metrale_graph.tools.bench [--preset qwen3.5-9b] [--workloads W1,W2,...] [--repeat 10] [--json FILE]
    torchrun --nproc-per-node 2 -m metrale_graph.tools.bench --tp 2 --variants graphs --baseline one_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import torch

from metrale_graph import PRESETS, HybridModel
from metrale_graph.tools import bench_speculative
from metrale_graph.tools.bench_runs import bench_decode_loop, bench_generate, bench_record, render, run_workloads, title
from metrale_graph.tools.distributed import end_tensor_parallel, start_run
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import add_moe_parallel_arg, names_of, output_file, positive_int, seed
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import ends_quietly, format_table, print_json
from metrale_graph.tools.workloads import WORKLOADS, Workload, fitting_workloads, workload_floor

VARIANTS = ("peer", "eager", "compiled", "graphs")


def read_baseline(path: str, preset: str, layers: int) -> dict[str, float]:
    """workload -> graphs ms of a one-GPU `--json` run of the same preset and depth (ValueError else)."""
    try:
        with open(path) as f:
            record = json.load(f)
        rows = {r["workload"]: r["graphs_ms"] for r in record["results"] if "graphs_ms" in r}
        same = (record.get("tp", 1), record["preset"], record["layers"]) == (1, preset, layers)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read baseline {path}: {e!r}") from None
    if not same:
        raise ValueError(f"baseline {path} is a run of {record['preset']} ({record['layers']} layers, tp "
                         f"{record.get('tp', 1)}); expected one GPU of {preset} ({layers} layers)")
    if not rows:
        raise ValueError(f"baseline {path} holds no graphs timings (run it with the graphs variant)")
    bad = {w: ms for w, ms in rows.items()
           if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < float("inf")}
    if bad:  # the speed-up divides by them at the end of the run
        raise ValueError(f"baseline {path}: graphs_ms must be positive numbers of milliseconds, got {bad}")
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b", choices=list(PRESETS), metavar="PRESET",
                   help=f"the model shape, random bf16 weights: {', '.join(PRESETS)} (default qwen3.5-9b)")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="fewer layers than the preset (quick runs; at most the preset's; default: all of them)")
    p.add_argument("--workloads", type=names_of(WORKLOADS), default=None,
                   help=f"out of {', '.join(WORKLOADS)} (default: all that fit the preset's "
                        "max_position_embeddings)")
    p.add_argument("--variants", type=names_of(VARIANTS), default=None,
                   help=f"out of {', '.join(VARIANTS)} (default: all; without the peer under --tp)")
    p.add_argument("--repeat", type=positive_int, default=10, help="timed runs per variant (median; default 10)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random weights and inputs (default 0)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: torchrun --nproc-per-node N -m metrale_graph.tools.bench --tp N "
                        "(one GPU each; default 1)")
    add_moe_parallel_arg(p)
    p.add_argument("--baseline", default=None,
                   help="JSON of a one-GPU run (--json) of the same preset: adds the speed-up over one GPU")
    p.add_argument("--generate", action="store_true",
                   help="also time end-to-end generation (32 prompts x 512 tokens, 256 new each) against the peer")
    p.add_argument("--loop", type=_stream_counts, default=None,
                   help="also time the Engine's decode step in steady state at these stream counts (e.g. 1,32,128; "
                        "2048 cached tokens each), with the loop's overlap and without, beside the D workloads' floors")
    bench_speculative.add_args(p)
    p.add_argument("--json", type=output_file, default=None, help="write the results to this JSON file")
    p.add_argument("--markdown", type=output_file, default=None, help="write the table to this markdown file")
    p.add_argument("--host-profile", action="store_true",
                   help="also print where the host's time in a graphs step goes (cProfile, top functions; with "
                        "--speculative / --echo: each window's engine-loop functions, sampled, as host_top in the "
                        "JSON)")
    p.add_argument("--profile", action="store_true",
                   help="also print each workload's device time by phase and its top kernels (torch.profiler "
                        "over the compiled step)")
    return p


def _stream_counts(text: str) -> list[int]:
    """--loop's comma-separated positive stream counts."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated stream counts (e.g. 1,32,128), got {text!r}")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be positive, got {text!r}")
    return counts


@dataclass(frozen=True)
class _Plan:
    """What the flags ask for, checked: the variants, the config (at --layers), the workloads to run and
    those left out (too long for the preset), the baseline timings, the speculative workloads."""
    variants: list[str]
    cfg: object
    workloads: list[str]
    too_long: dict[str, int]
    baseline: dict[str, float] | None
    spec: bench_speculative.SpecPlan | None = None


def _plan(p: argparse.ArgumentParser, args) -> _Plan:
    """The flags checked together (usage errors, exit code 2) before any model is built."""
    variants = args.variants or [v for v in VARIANTS if args.tp == 1 or v != "peer"]
    if args.tp > 1 and "peer" in variants:
        p.error("the peer runs on one GPU: leave it out of --variants under --tp")
    if args.tp > 1 and args.generate:
        p.error("--generate times one GPU against the peer; under --tp use metrale_graph.tools.generate --tp")
    if args.tp > 1 and args.loop:
        p.error("--loop times one GPU's engine; leave it out under --tp")
    if args.baseline and "graphs" not in variants:
        p.error("--baseline compares graphs timings: keep graphs in --variants")
    files = [(flag, path) for flag, path in (("--baseline", args.baseline), ("--json", args.json),
                                             ("--markdown", args.markdown)) if path]
    for i, (flag, path) in enumerate(files):  # one file for two of them: a write destroys the other
        for other, other_path in files[i + 1:]:
            if os.path.realpath(path) == os.path.realpath(other_path):
                p.error(f"{flag} and {other} name the same file {path!r}; give each its own")
    cfg = PRESETS[args.preset]
    if args.layers and args.layers > cfg.num_hidden_layers:
        p.error(f"--layers {args.layers}: the preset {args.preset} has {cfg.num_hidden_layers} layers; "
                "--layers takes at most that many")
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    spec = bench_speculative.plan_of(p, args)
    # --speculative / --echo alone run no step workload (name --workloads to add them)
    workloads, too_long = fitting_workloads(cfg, args.workloads or ([] if spec else list(WORKLOADS)))
    if args.workloads and too_long:
        p.error(f"--workloads: {', '.join(f'{w} ({n} positions)' for w, n in too_long.items())} past the preset "
                f"{args.preset}'s max_position_embeddings {cfg.max_position_embeddings}")
    baseline = None
    if args.baseline:
        try:
            baseline = read_baseline(args.baseline, args.preset, cfg.num_hidden_layers)
        except ValueError as e:
            p.error(f"--baseline: {e}")
    return _Plan(variants, cfg, workloads, too_long, baseline, spec)


def main(argv=None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    plan = _plan(p, args)
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this benchmark needs a CUDA GPU; torch sees none\n")
    run = start_run(args, p)  # no --device / --dtype: bf16 on cuda (cuda:LOCAL_RANK under --tp)
    with run.silence_other_ranks():
        _bench(p, args, plan, run)


def _bench(p, args, plan: _Plan, run) -> None:
    """Build the model (and the peer), run the workloads, print the table, write --json / --markdown."""
    from tqdm.auto import tqdm

    cfg, variants = plan.cfg, plan.variants
    if plan.too_long and not args.workloads:
        print(f"left out {', '.join(plan.too_long)}: longer than the preset {args.preset}'s max_position_embeddings "
              f"{cfg.max_position_embeddings}")
    try:
        model = HybridModel.from_preset(bench_speculative.model_config(cfg, plan.spec), dtype=torch.bfloat16,
                                        device=run.device, seed=args.seed, tp=run.tp)
    except ValueError as e:
        p.error(f"--preset {args.preset}: {e}")
    hf = None
    if "peer" in variants and (plan.workloads or args.generate):
        from metrale_graph.tools.peer import peer_model

        hf = peer_model(model)
    moe_parallel = run.moe_parallel if cfg.moe_layers else None
    run_info, device = provenance(), torch.cuda.get_device_name()
    so_far = []

    def on_row(row, lines):
        """As each workload finishes: its profile and row printed, and the record so far written to --json
        (a run cut short keeps its rows)."""
        so_far.append(row)
        if not run.reports:
            return
        if lines:
            tqdm.write("\n".join(lines))
        tqdm.write(json.dumps(row))
        if args.json:
            record = bench_record(args, cfg.num_hidden_layers, moe_parallel, device, run_info, so_far)
            write_whole(args.json, render(record, variants, "json"))

    results = run_workloads(model, plan.workloads, variants, args.repeat, args.seed, args.tp, hf, args.profile,
                            plan.baseline, run, on_row, args.host_profile) if plan.workloads else []
    generation = None
    if args.generate:
        torch.cuda.empty_cache()
        generation = bench_generate(model, hf, seed=args.seed)
    loop_rows = []
    for n in args.loop or []:
        floor = workload_floor(cfg, Workload((1,) * n, (2048,) * n)).floor_ms
        torch.cuda.empty_cache()
        for row in bench_decode_loop(model, n, seed=args.seed):
            row.update(floor_ms=round(floor, 3), vs_floor=round(row["step_ms"] / floor, 2))
            loop_rows.append(row)
            if run.reports:
                tqdm.write(json.dumps(row))
    record = bench_record(args, cfg.num_hidden_layers, moe_parallel, device, run_info, results, generation)
    if loop_rows:
        record["decode_loop"] = loop_rows
        print("\nthe Engine's decode step (steady state, 2048 cached per stream, graphs):")
        print(format_table(["streams", "overlap", "step ms", "device ms", "GPU busy", "floor ms", "x floor"],
                           [[r["streams"], r["overlap"], r["step_ms"], r["device_ms"], f"{100 * r['gpu_busy']:.0f}%",
                             r["floor_ms"], r["vs_floor"]] for r in loop_rows]))
    if plan.spec:
        print("\n" + bench_speculative.bench_part(model, plan.spec, args.seed, record, args.json))
    if results or not plan.spec:
        print("\n" + render(record, variants))
    if not run.reports:  # the other ranks ran the same steps; rank 0 reports
        return
    if args.markdown:  # (the speculative tables as the tool prints them)
        spec = f"\n\n```\n{bench_speculative.render(record['speculative'])}\n```\n" if plan.spec else ""
        write_whole(args.markdown, (render(record, variants, "markdown") if results else title(record)) + spec)
    if args.json:
        write_whole(args.json, render(record, variants, "json"))
    print_json(record)


def cli() -> None:
    """The console script and `python -m`: main(), then the end of a --tp run (tools.distributed)."""
    with ends_quietly():
        main()
    end_tensor_parallel()


if __name__ == "__main__":
    cli()
