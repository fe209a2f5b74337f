"""Graph-capture warmup: load a model, build a cache, compile (and on CUDA capture) every bucket
of the grid, print what each bucket cost, and persist the compile artifacts in a cache folder so
that the next warmup, in a new process, is faster. Runs on the CPU too (compiled step, no graphs).

    python -m metrale_graph.tools.warmup [--model PRESET|FOLDER] [--batch-sizes 1,2,4] [--token-counts 256,512]
                                         [--cache-dir .metrale_cache]

The cache folder holds Inductor's and Triton's caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
point into it), torch.compile's portable artifacts (compile_artifacts.bin, loaded with
torch.compiler.load_cache_artifacts before compiling) and the cold run's record, so a warm run
prints cold vs warm. The record names what the cold run warmed (model, dtype, device, grid, cache
geometry, tensor parallelism); a warm run of anything else says so instead of comparing. Under
--tp each rank keeps its own artifacts and record (compile_artifacts.rankR.bin, cold_warmup.rankR.json:
the ranks write at the same time); the files are written whole or not at all (a temporary file, renamed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

from metrale_graph.capture import DEFAULT_BATCH_SIZES, DEFAULT_TOKEN_COUNTS

ARTIFACTS, RECORD = "compile_artifacts.bin", "cold_warmup.json"
BLOCK_SIZE = 64  # the cache's KV block, in tokens (--blocks counts them)


def own_files(rank: int | None) -> tuple[str, str]:
    """The artifact and record file names of one process: ARTIFACTS / RECORD, or under tensor parallelism
    (rank not None) the rank's own, so that the ranks, which warm up at the same time, never write one file."""
    if rank is None:
        return ARTIFACTS, RECORD
    return tuple(f"{base}.rank{rank}{ext}" for base, ext in map(os.path.splitext, (ARTIFACTS, RECORD)))


def check_cache_dir(cache_dir: str, record_name: str = RECORD) -> str | None:
    """What is wrong with the (existing) cache folder, or None: it must take new files, Inductor's and
    Triton's caches must be folders, and a cold run's record must be what this tool writes."""
    from metrale_graph.tools.files import unwritable

    why = unwritable(cache_dir)
    if why:
        return f"cannot write into the folder ({why})"
    for sub in ("inductor", "triton"):
        if os.path.exists(os.path.join(cache_dir, sub)) and not os.path.isdir(os.path.join(cache_dir, sub)):
            return f"{os.path.join(cache_dir, sub)} is not a folder (this tool keeps the {sub} cache there)"
    path = os.path.join(cache_dir, record_name)
    if os.path.exists(path):
        try:
            with open(path) as f:
                record = json.load(f)
            ok = isinstance(record, dict) and all(
                isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)
                for k in ("warmup_s", "total_s"))
        except (OSError, ValueError):
            ok = False
        if not ok:
            return f"{path} is not a cold warmup record of this tool (corrupt?); delete it"
    return None


def _load_artifacts(path: str) -> bool:
    """torch.compiler.load_cache_artifacts of the file; False when torch cannot read it (torch then only
    logs a warning with a traceback, which is silenced here: the caller says what is wrong)."""
    import logging

    import torch

    log = logging.getLogger("torch.compiler._cache")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with open(path, "rb") as f:
            return torch.compiler.load_cache_artifacts(f.read()) is not None
    except Exception:
        return False
    finally:
        log.setLevel(level)


def _describe(run) -> str:
    if not isinstance(run, dict):
        return "not recorded"
    return ", ".join(f"{k} {','.join(v) if isinstance(v, list) else v}" for k, v in run.items() if v is not None)


def main(argv=None) -> None:
    from metrale_graph.capture.buckets import make_grid
    from metrale_graph.tools.flags import add_model_args, positive_int, positive_ints

    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch-sizes", type=positive_ints, default=list(DEFAULT_BATCH_SIZES),
                   help="comma-separated streams per bucket of the grid (default "
                        f"{','.join(map(str, DEFAULT_BATCH_SIZES))})")
    p.add_argument("--token-counts", type=positive_ints, default=list(DEFAULT_TOKEN_COUNTS),
                   help="comma-separated tokens per bucket of the grid; buckets of more streams than tokens are "
                        f"skipped (default {','.join(map(str, DEFAULT_TOKEN_COUNTS))})")
    p.add_argument("--slots", type=positive_int, default=64, help="cache slots (default 64)")
    p.add_argument("--blocks", type=positive_int, default=None,
                   help=f"KV blocks of {BLOCK_SIZE} tokens, at most --slots x those of the model's "
                        "max_position_embeddings (default: enough for every slot to hold the largest token count, or "
                        "max_position_embeddings when that is shorter)")
    p.add_argument("--cache-dir", default=".metrale_cache",
                   help="where compile artifacts persist (default .metrale_cache, in the current folder)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when standard error is not a terminal)")
    args = p.parse_args(argv)
    try:
        make_grid(args.batch_sizes, args.token_counts)
    except ValueError as e:
        p.error(f"--batch-sizes / --token-counts: {e}")
    _check_blocks(p, args)

    cache_dir = os.path.abspath(args.cache_dir)
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        p.error(f"--cache-dir {args.cache_dir!r} is a file; expected a folder")
    created = not os.path.exists(cache_dir)
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        p.error(f"--cache-dir {args.cache_dir!r}: cannot create the folder ({e.strerror})")
    try:
        _checked_run(p, args, cache_dir)
    except SystemExit as e:  # a usage error after the folder was made: a folder this run made goes again if empty
        if e.code == 2 and created:
            with contextlib.suppress(OSError):
                os.rmdir(cache_dir)
        raise


def _check_blocks(p, args) -> None:
    """--blocks, before the model loads: a slot holds at most max_position_embeddings tokens (the cache's block
    tables end there), so --slots x that many blocks is what the cache can ever use; more is a usage error. The
    default (args.blocks filled in) is what every slot needs for the largest token count, or for the model's
    whole context when that is shorter."""
    from metrale_graph.tools.loading import model_config

    limit = model_config(args).max_position_embeddings
    most = args.slots * -(-limit // BLOCK_SIZE)
    if args.blocks is None:
        args.blocks = args.slots * -(-min(max(args.token_counts), limit) // BLOCK_SIZE)
    elif args.blocks > most:
        p.error(f"--blocks {args.blocks} exceeds what --slots {args.slots} can use: a slot holds at most the model's "
                f"max_position_embeddings ({limit} tokens, {-(-limit // BLOCK_SIZE)} blocks of {BLOCK_SIZE}): give at "
                f"most {most}")


def _checked_run(p, args, cache_dir: str) -> None:
    artifacts_name, record_name = own_files(int(os.environ.get("RANK", "0")) if args.tp > 1 else None)
    problem = check_cache_dir(cache_dir, record_name)
    if problem:
        p.error(f"--cache-dir {args.cache_dir!r}: {problem}")
    # before anything compiles: Inductor's and Triton's on-disk caches go into the named folder
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")

    t_start = time.perf_counter()
    artifacts = os.path.join(cache_dir, artifacts_name)
    warm = os.path.isfile(artifacts)
    if warm and not _load_artifacts(artifacts):
        p.error(f"--cache-dir {args.cache_dir!r}: {artifacts} is corrupt or from another torch version "
                f"(torch.compiler.load_cache_artifacts cannot read it); delete it to start cold")
    from metrale_graph.tools.distributed import start_run

    run = start_run(args, p)
    with run.silence_other_ranks():
        _warmup(p, args, run, cache_dir, artifacts, record_name, warm, t_start)


def _warmup(p, args, run, cache_dir: str, artifacts: str, record_name: str, warm: bool, t_start: float) -> None:
    import torch
    from tqdm.auto import tqdm

    from metrale_graph.capture import GraphRunner
    from metrale_graph.tools.files import write_whole
    from metrale_graph.tools.loading import load_model, out_of_memory
    from metrale_graph.tools.report import bars_shown, print_json, print_table

    model = load_model(args, p, run)
    blocks = args.blocks  # (_check_blocks: its default filled in)
    try:
        cache = model.new_cache(num_slots=args.slots, num_blocks=blocks, block_size=BLOCK_SIZE)
        runner = GraphRunner(model, cache, args.batch_sizes, args.token_counts)
    except (ValueError, RuntimeError) as e:  # a cache or bucket buffers the device cannot hold (NotEnoughMemory, OOM)
        if isinstance(e, RuntimeError) and not out_of_memory(e):
            raise
        p.error(f"--slots {args.slots} / --blocks {blocks} / --token-counts: {str(e).splitlines()[0]}")
    # what a cold run's time is a time of: a warm run compares itself only with a cold run of the same
    warmed = {"model": args.model, "dtype": str(model.dtype), "device": model.device.type, "tp": args.tp,
              "moe_parallel": run.moe_parallel, "buckets": [str(b) for b in runner.grid],
              "slots": args.slots, "blocks": blocks}
    print(f"model: {args.model}  {model.extra_repr()}\n{cache}\n"
          f"{len(runner.grid)} buckets, {'CUDA graphs' if runner.use_graphs else 'compiled step, no graphs'}, "
          f"{'warm' if warm else 'cold'} start from {cache_dir}")
    t0 = time.perf_counter()

    bar = not args.no_progress and bars_shown(run)
    graphs = runner.use_graphs  # without CUDA graphs nothing is captured: no capture time or graph memory to show

    def measured(value, digits):  # (the JSON's: None where no graph was captured)
        return round(value, digits) if graphs else None

    def on_bucket(r):
        captured = f", capture {r.capture_s:.3f} s, graph {r.graph_bytes / 2**20:.1f} MiB" if graphs else ""
        line = f"{r.bucket}: compile {r.compile_s:.2f} s{captured}, {time.perf_counter() - t0:.1f} s so far"
        (tqdm.write(line) if bar else print(line, flush=True))

    reports = runner.warmup(progress=bar, on_bucket=on_bucket)
    warmup_s = time.perf_counter() - t0
    saved = torch.compiler.save_cache_artifacts()
    if saved is not None:
        write_whole(artifacts, saved[0])

    rows = [[str(r.bucket), f"{r.compile_s:.2f}"] + ([f"{r.capture_s:.3f}", f"{r.graph_bytes / 2**20:.1f}"] if graphs
                                                     else []) for r in reports]
    print_table(["bucket", "compile s"] + (["capture s", "graph MiB"] if graphs else []), rows)
    compile_s, capture_s = sum(r.compile_s for r in reports), sum(r.capture_s for r in reports)
    graph_mib = sum(r.graph_bytes for r in reports) / 2**20
    total_s = time.perf_counter() - t_start
    captured = f", capture {capture_s:.2f} s, graph memory {graph_mib:.1f} MiB" if graphs else ""
    print(f"total: compile {compile_s:.1f} s{captured}, warmup {warmup_s:.1f} s, whole run {total_s:.1f} s")
    record_path = os.path.join(cache_dir, record_name)
    record = {"model": args.model, "buckets": len(reports), "warmup_s": round(warmup_s, 2),
              "total_s": round(total_s, 2), "run": warmed}
    cold = None
    if not warm:
        write_whole(record_path, json.dumps(record))
    elif os.path.isfile(record_path):
        with open(record_path) as f:
            cold = json.load(f)
        if cold.get("run") != warmed:
            print(f"{record_path} records a cold warmup of another run ({_describe(cold.get('run'))}); this run: "
                  f"{_describe(warmed)}; not compared")
            cold = None
        else:
            print(f"cold warmup {cold['warmup_s']:.1f} s (whole run {cold['total_s']:.1f} s) -> "
                  f"warm warmup {warmup_s:.1f} s (whole run {total_s:.1f} s)")
    print_json({"tool": "warmup", "tp": args.tp, "model": args.model, "device": str(model.device),
                "dtype": str(model.dtype), "warm": warm, "graphs": graphs,
                "cache_dir": cache_dir, "buckets": [
                    {"bucket": str(r.bucket), "compile_s": round(r.compile_s, 3), "capture_s": measured(r.capture_s, 4),
                     "graph_mib": measured(r.graph_bytes / 2**20, 1)} for r in reports],
                "compile_s": round(compile_s, 2), "capture_s": measured(capture_s, 3),
                "graph_mib": measured(graph_mib, 1),
                "warmup_s": round(warmup_s, 2), "total_s": round(total_s, 2),
                "cold_warmup_s": cold["warmup_s"] if cold else (None if warm else round(warmup_s, 2))})


def cli() -> None:
    """The console script and `python -m`: main(), then the end of a --tp run (tools.distributed)."""
    from metrale_graph.tools.distributed import end_tensor_parallel
    from metrale_graph.tools.report import ends_quietly

    with ends_quietly():
        main()
    end_tensor_parallel()


if __name__ == "__main__":
    cli()
