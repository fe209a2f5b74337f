"""Export the packed prefill step of a model for one bucket (B streams, T tokens) to ONNX, every
metrale op as standard ONNX operators (runs in plain onnxruntime). Prints the node counts per op
type and the file size; ends with one JSON line.

    python -m metrale_graph.tools.export_onnx [--model PRESET|FOLDER] [-B 4] [-T 256] [--verify] ...

The graph has fixed shapes: one file per bucket and cache geometry (--slots, --blocks,
--block-size, --max-context). Attention reads every position of a stream's block table, so its
cost grows with --max-context. --verify runs a padded continuation batch through onnxruntime and
the torch step and prints their relative errors, for fp32 models only (bf16 / fp16 exports run in
onnxruntime too, their translations computing in fp32: tests/test_onnx_bf16.py compares them with the torch step).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import sys
import time
import warnings

import torch
from tqdm import tqdm

from metrale_graph import Stream
from metrale_graph.tools.flags import add_model_args, device_and_dtype, output_file, positive_int
from metrale_graph.tools.loading import load_model, model_config
from metrale_graph.tools.report import ends_quietly, print_json, print_table


def _verify_streams(B: int, T: int) -> int:
    """Streams of _verify's batch: B - 1 (a zero-length padding stream too when B > 1), at most one per
    token of the bucket (each holds a token), at least 1."""
    return max(1, min(B - 1, T))


def _verify_plan(B: int, T: int, capacity: int, gen: torch.Generator) -> tuple[list[int], list[tuple[int, int]]]:
    """_verify's batches, drawn from `gen` for a cache of `capacity` tokens per slot: the context lengths
    prefilled into slots 0, 2, 4, ..., then the (slot, length) of each stream of the second batch (slots
    0, 2, 4, ... continue, odd slots start; about 3/4 of the bucket's tokens, the rest padding in no
    stream). It depends on the flags alone, so main checks before any work that the cache holds it."""
    n = _verify_streams(B, T)  # main checks that 2 n slots exist
    first = torch.randint(1, max(2, min(T, capacity // 2)), (n,), generator=gen).tolist()
    budget = max(n, 3 * T // 4)
    cuts = sorted(torch.randperm(budget - 1, generator=gen)[: n - 1].add(1).tolist())
    lengths = [b - a for a, b in zip([0] + cuts, cuts + [budget])]
    slots = [2 * (i // 2) if i % 2 == 0 else 2 * (i // 2) + 1 for i in range(n)]
    return first, list(zip(slots, lengths))


def _verify_needs(B: int, T: int, block_size: int, max_context: int, seed: int) -> tuple[int, int]:
    """(tokens per slot, KV blocks) that _verify's batches need on a cache of this geometry (max_context
    rounded up to whole blocks, as HybridCache does)."""
    capacity = -(-max_context // block_size) * block_size
    first, second = _verify_plan(B, T, capacity, torch.Generator().manual_seed(seed))
    held = {2 * i: k for i, k in enumerate(first)}
    for slot, k in second:
        held[slot] = held.get(slot, 0) + k
    return max(held.values()), sum(-(-k // block_size) for k in held.values())


def _verify_geometry_error(B: int, T: int, args) -> str | None:
    """Why the cache of the flags cannot hold _verify's batches (naming the flags that fix it), or None."""
    bs, seed = args.block_size, args.seed
    capacity = -(-args.max_context // bs) * bs
    tokens, blocks = _verify_needs(B, T, bs, args.max_context, seed)
    if tokens <= capacity and blocks <= args.blocks:
        return None
    context, need = args.max_context, blocks
    if tokens > capacity:  # the smallest --max-context (whole blocks) whose batches fit a slot; <= 2 T always does
        context = next(c for c in range(bs, 2 * T + bs + 1, bs) if _verify_needs(B, T, bs, c, seed)[0] <= c)
        need = _verify_needs(B, T, bs, context, seed)[1]
    fix = ([f"--max-context {context}"] if context != args.max_context else []) + (
        [f"--blocks {need}"] if need > args.blocks else [])
    return (f"--verify's batches for a bucket of {B} streams and {T} tokens do not fit the cache: they put {tokens} "
            f"tokens in a slot (it holds {capacity}) and need {blocks} KV blocks (it has {args.blocks}); "
            f"pass {' '.join(fix)}")


def _verify(model, cache, path: str, B: int, T: int, seed: int) -> dict[str, float]:
    """Prefill context into some slots, then run a batch continuing half of them plus new streams,
    padded to the bucket, through onnxruntime and the torch step; relative norm errors by output."""
    from metrale_graph.onnx import ort_session, run_step
    from metrale_graph.protocol import prefill_call

    gen = torch.Generator().manual_seed(seed)
    first, second = _verify_plan(B, T, cache.max_context, gen)
    vocab = model.config.vocab_size
    model.prefill(cache, [Stream(2 * i, torch.randint(0, vocab, (k,), generator=gen)) for i, k in enumerate(first)])
    streams = [Stream(s, torch.randint(0, vocab, (k,), generator=gen)) for s, k in second]
    compared = {}

    def step(packed):  # the torch step on a copy of the cache, onnxruntime on the cache's pools as they are
        batch = packed.padded(B, T, cache)
        ref_cache = copy.deepcopy(cache)
        with torch.no_grad():
            compared["ref"] = model.forward_packed(ref_cache, batch)
        compared["ref_pools"] = ref_cache.pools()
        compared["out"] = run_step(ort_session(path), batch, cache)
        return compared["ref"][:packed.num_streams]

    with prefill_call(model, cache, streams) as call:  # metrale_graph/protocol.py
        call.run(step)
    ref, out = compared["ref"], compared["out"]

    def rel(name, expected):
        expected = expected.double().cpu()
        return ((torch.from_numpy(out[name]).double() - expected).norm() / expected.norm()).item()

    errors = {"logits": rel("logits", ref)}
    for name, pool in zip(cache.pool_names(), compared["ref_pools"]):
        errors[name] = rel(f"{name}_out", pool)
    return errors


def _loads_in_fp8(args) -> bool:
    """Whether --model loads with FP8 weights (as from_pretrained reads its config), which export_prefill refuses:
    told before the load (an FP8 checkpoint of 80B loads for minutes). A config that does not read: the load names it."""
    from metrale_graph import PRESETS
    from metrale_graph.weights import checkpoint_config

    try:
        cfg = PRESETS[args.model] if args.model in PRESETS else checkpoint_config(args.model,
                                                                                   requantize_fp8=args.requantize_fp8)
    except ValueError:
        return False
    return cfg.quantization is not None


def main(argv=None) -> None:
    """The console script and `python -m` too (no --tp, so no cli(): tools.report.ends_quietly here)."""
    with ends_quietly():
        _export(argv)


def _export(argv) -> None:
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.export_onnx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, parallel=False)  # one whole model: --tp / --moe-parallel are refused by name below
    p.add_argument("-B", "--batch-size", type=positive_int, default=4, help="streams in the bucket (default 4)")
    p.add_argument("-T", "--tokens", type=positive_int, default=256, help="tokens in the bucket (default 256)")
    p.add_argument("--slots", type=positive_int, default=8, help="cache slots, plus the scratch slot (default 8)")
    p.add_argument("--blocks", type=positive_int, default=64, help="KV blocks, plus the null block (default 64)")
    p.add_argument("--block-size", type=positive_int, default=64, help="tokens per KV block (default 64)")
    p.add_argument("--max-context", type=positive_int, default=1024, help="tokens per slot at most (default 1024)")
    p.add_argument("-o", "--output", type=output_file, default=None,
                   help="ONNX file (default: prefill_B{B}_T{T}.onnx)")
    p.add_argument("--verify", action="store_true", help="compare onnxruntime with the torch step on a batch")
    args = p.parse_args(argv)
    if args.tp != 1:
        p.error("--tp: the ONNX export writes one whole model from one process (a shard's collectives have no "
                "ONNX form); leave out --tp")
    if args.moe_parallel is not None:
        p.error("--moe-parallel says how --tp ranks split MoE experts; the ONNX export runs one whole model: "
                "leave it out")
    limit = model_config(args).max_position_embeddings  # before the (possibly long) model load
    if args.max_context > limit:
        p.error(f"--max-context {args.max_context} exceeds the model's max_position_embeddings ({limit}): no position "
                "past it exists")
    if _loads_in_fp8(args):
        p.error(f"--model {args.model}: the ONNX export does not write FP8 models (their translations have no W8A8 "
                "projections); export the floating-point checkpoint")
    B, T = args.batch_size, args.tokens
    try:  # the default path passes the same check as -o
        path = args.output or output_file(f"prefill_B{B}_T{T}.onnx")
    except argparse.ArgumentTypeError as e:
        p.error(f"-o (default): {e}")
    verify_slots = 2 * _verify_streams(B, T)  # _verify: half the streams continue, half start
    if args.verify and verify_slots > args.slots:
        p.error(f"--verify needs {verify_slots} slots for a bucket of {B} streams and {T} tokens; "
                f"pass --slots {verify_slots}")
    why = _verify_geometry_error(B, T, args) if args.verify else None
    if why:
        p.error(why)
    if args.verify and device_and_dtype(args)[1] != torch.float32:
        p.error("--verify compares fp32 steps only: pass --dtype float32 (a bf16 / fp16 export runs in onnxruntime "
                "too; tests/test_onnx_bf16.py checks those against the torch step)")
    # SIGTERM (timeout, a job scheduler) as an exit: the staged save then removes its partial files, as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # torchvision-not-installed notices
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # torch.export internals

    import onnx

    from metrale_graph.onnx import export_prefill, node_counts, save_onnx

    steps = ["load model", "torch.export", "translate to ONNX", "save", "check_model"]
    steps += ["verify"] if args.verify else []
    tty = sys.stderr.isatty()  # a bar on a terminal, one line per step in a log
    bar = tqdm(total=len(steps), unit="step", disable=not tty, leave=False,  # cleared: the report follows
               bar_format="{desc:<20} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]")
    timings: dict[str, float] = {}
    clock = [time.perf_counter(), None]

    def step(name: str) -> None:
        now = time.perf_counter()
        if clock[1] is not None:
            timings[clock[1]] = now - clock[0]
            bar.update(1)
        clock[:] = [now, name]
        bar.set_description(name)
        if not tty and name in steps:
            print(f"[{steps.index(name) + 1}/{len(steps)}] {name}", file=sys.stderr, flush=True)

    step("load model")
    model = load_model(args, p)
    try:
        cache = model.new_cache(args.slots, args.blocks, block_size=args.block_size, max_context=args.max_context)
        program = export_prefill(model, cache, B, T, progress=step)
    except ValueError as e:
        p.error(str(e))
    save_onnx(program, path, progress=step)  # the file whole and checked, or none: steps save, check_model
    proto = onnx.load(path, load_external_data=False)
    geometry = repr(cache)
    errors = None
    if args.verify:
        step("verify")
        try:
            errors = _verify(model, cache, path, B, T, args.seed)
        except ValueError as e:
            p.error(f"--verify: {e}")
    step("done")
    bar.close()

    external = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    size = sum(os.path.getsize(os.path.join(os.path.dirname(path), f)) for f in external) + os.path.getsize(path)
    counts = node_counts(proto)
    print(f"\n{path}: {model.extra_repr()}; bucket B={B}, T={T}; {geometry}")
    print_table(["op type", "nodes", "in loop bodies"], [[k, a, b] for k, (a, b) in counts.items()])
    print(f"\nnodes: {sum(a for a, _ in counts.values())} in the main graph, "
          f"{sum(b for _, b in counts.values())} in loop bodies; file size {size / 2**20:.2f} MiB")
    print("steps: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    if errors is not None:
        print()
        print_table(["output", "rel. norm error vs torch"], [[k, f"{v:.2e}"] for k, v in errors.items()])
    print_json({"tool": "export_onnx", "model": args.model, "dtype": str(model.dtype), "batch_size": B, "tokens": T,
                "path": path, "file_bytes": size, "opset": proto.opset_import[0].version,
                "nodes": {k: a + b for k, (a, b) in counts.items()},
                "inputs": [i.name for i in proto.graph.input], "outputs": [o.name for o in proto.graph.output],
                "max_rel_error": None if errors is None else max(errors.values()),
                "seconds": {k: round(v, 2) for k, v in timings.items()}})


if __name__ == "__main__":
    main()
