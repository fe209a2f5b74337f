"""What `metrale-bench` (tools/bench.py) measures and prints: the workloads' runner (`run_workloads`: each
workload in each variant, its floors, the GPU-busy fraction, the profile), the generation and decode-loop runs
(`bench_generate`, `bench_decode_loop`), the JSON record of a run (`bench_record`) and its table, markdown or
JSON (`render`). tools/bench.py's docstring says what each variant and floor is.
"""

from __future__ import annotations

import json
import time

import torch

from metrale_graph import PRESETS, Stream
from metrale_graph.tools.floors import COPY_RATE, FP8_MATMUL_RATE, MATMUL_RATE
from metrale_graph.tools.report import format_table, markdown_table, progress_bar
from metrale_graph.tools.workloads import WORKLOADS, Ours, grid_of, workload_floor

TOP_KERNELS = 25  # kernels per workload in the JSON record (--profile)


@torch.no_grad()
def bench_generate(model, hf, prompts: int = 32, prompt_len: int = 512, new_tokens: int = 256, seed: int = 0):
    """Tokens/s of generating `new_tokens` greedy tokens for each of `prompts` random prompts: our
    Engine (one graph replay per step) against transformers' generate on the same weights."""
    from metrale_graph import Engine

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (prompts, prompt_len), generator=g)
    engine = Engine(model, num_slots=prompts, max_context=prompt_len + new_tokens, token_budget=2048,
                    batch_sizes=[prompts], token_counts=[prompts, 2048], stop_token_ids=[])
    engine.warmup()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate([p.tolist() for p in ids], max_new_tokens=new_tokens)
    torch.cuda.synchronize()
    ours_s = time.perf_counter() - t0
    assert all(len(r.token_ids) == new_tokens for r in out)
    row = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "ours_s": round(ours_s, 3),
           "ours_tok_s": round(prompts * new_tokens / ours_s, 1)}
    if hf is not None:
        dev = next(hf.parameters()).device
        x = ids.to(dev)
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        hf.generate(x[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # warm up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        torch.cuda.synchronize()
        peer_s = time.perf_counter() - t0
        row.update(peer_s=round(peer_s, 3), peer_tok_s=round(prompts * new_tokens / peer_s, 1))
    return row


@torch.no_grad()
def bench_decode_loop(model, streams: int, context: int = 2048, steps: int = 48, seed: int = 0) -> list[dict]:
    """The Engine's decode step in steady state, with the loop's overlap and without (loop.py; one engine,
    the same graphs): `streams` requests with `context`-token prompts decoding (stop tokens off), every step a
    graph replay. Times `steps` steps from the first in which every request decodes: the prompts are prefilled
    a budget of 2048 tokens a step, so the first requests decode long before the last starts, and each request
    asks for enough tokens to decode through the whole window (a window in which some have finished would time
    a smaller batch). Wall ms per step (host work included: what a user waits for per token) and the GPU-busy
    fraction of the window, the union of the device's kernels and copies (torch.profiler, CUDA activity only)
    between two marker kernels the measuring thread puts in the stream at its ends. One row per mode."""
    from metrale_graph import Engine

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist() for _ in range(streams)]
    budget = max(2048, streams)
    new = steps + 4 + -(-streams * context // budget)  # the first request's tokens while the others prefill, the window
    engine = Engine(model, num_slots=streams, max_context=context + new + 1, token_budget=budget,
                    batch_sizes=[streams], token_counts=sorted({streams, budget}), stop_token_ids=[])
    try:
        engine.warmup()
        rows = []
        for overlap in (True, False):
            engine._loop.overlap = overlap  # (between calls: no step runs)
            rows.append({"streams": streams, "context": context, "overlap": overlap,
                         **_decode_window(engine, prompts, new, steps)})
        return rows
    finally:
        engine.shutdown()


def _decode_window(engine, prompts: list[list[int]], new: int, steps: int) -> dict:
    """bench_decode_loop's measurement of one generate call of `new` tokens a prompt (see there)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from metrale_graph.tools.profiling import busy_between_markers

    counts, marks = [0] * len(prompts), {}

    def on_token(index, _token):  # (in this thread, as each step's tokens are delivered)
        counts[index] += 1
        if "start" not in marks:
            if counts[index] == 2 and min(counts) >= 2:  # every request decodes from here
                torch.cuda._sleep(1000)  # the window's first marker, behind the steps launched so far
                marks["start"], marks["steps"] = time.perf_counter(), engine.stats().steps
        elif "end" not in marks and engine.stats().steps - marks["steps"] >= steps:
            marks["end"], marks["done"] = time.perf_counter(), engine.stats().steps - marks["steps"]
            torch.cuda._sleep(1000)  # the last marker

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, max_new_tokens=new, on_token=on_token)
        torch.cuda.synchronize()
    assert "end" in marks, "the window never closed: every request finished first"
    wall_s, done = marks["end"] - marks["start"], marks["done"]
    (busy,) = busy_between_markers(prof.events(), DeviceType.CUDA)
    return {"steps": done, "step_ms": round(1e3 * wall_s / done, 3), "device_ms": round(busy * 1e3 * wall_s / done, 3),
            "gpu_busy": round(busy, 3)}


def run_workloads(model, names: list[str], variants: list[str], repeat: int, seed: int = 0, gpus: int = 1,
                  hf=None, profile: bool = False, baseline: dict[str, float] | None = None,
                  run=None, on_row=None, host_profile: bool = False) -> list[dict]:
    """Measure each workload of `names` in each of `variants` (the peer needs `hf`); returns one record
    per workload (the JSON rows: floors, ms per variant, the GPU-busy fraction with graphs, the profile).
    `on_row(row, lines)` is called as each workload finishes, with the lines of its profile (--profile)."""
    from metrale_graph.tools.peer import bench_peer
    from metrale_graph.tools.profiling import (device_busy_ms, host_profile as profile_host, kernel_breakdown,
                                               phase_of, time_cuda)

    cfg = model.config
    ours = Ours(model, [WORKLOADS[w] for w in names], grid_of(names))
    gen = torch.Generator().manual_seed(seed)
    results = []
    for name in progress_bar(names, run, desc="workloads", unit="workload"):
        w = WORKLOADS[name]
        new = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in w.new]
        ctx = [torch.randint(0, cfg.vocab_size, (c,), generator=gen) if c else None for c in w.cached]
        streams = [Stream(i, t) for i, t in enumerate(new)]
        floor = workload_floor(cfg, w, gpus)
        row = {"workload": name, "label": w.label, "streams": len(w.new), "tokens": sum(w.new),
               "cached": sum(w.cached), "floor_ms": floor.floor_ms, "phase_floor_ms": floor.phase_floor_ms,
               "phase_floors_ms": {k: round(ms, 4) for k, ms in floor.by_kind(gpus).items()},
               "flops": floor.flops, "bytes": floor.bytes}
        ours.snapshot = None  # the last workload's copy of the cache, freed before the peer runs
        for v in variants:
            if v == "peer":
                row["peer_ms"], row["peer_mode"] = bench_peer(hf, w, new, ctx, repeat)
                continue
            ours.prepare_context(ctx)
            if v == "graphs":
                ours.graphs.warm_bucket(min(b for b in ours.graphs.grid if b.holds(len(streams), sum(w.new))))
            row[f"{v}_ms"] = time_cuda(lambda: ours.run(v, streams), ours.restore, repeat)
            if v == "graphs":
                busy = device_busy_ms(lambda: ours.run("graphs", streams), ours.restore)
                row["graphs_device_ms"] = busy
                row["gpu_busy"] = None if busy is None else busy / row["graphs_ms"]
        lines = []
        if host_profile and "graphs" in variants:
            ours.prepare_context(ctx)
            row["host_profile"] = profile_host(lambda: ours.run("graphs", streams), ours.restore)
            lines += [f"{name}: host time of a graphs step by function (cProfile, ms per step, cumulative / own)"]
            lines += [f"  {r['cum_ms']:8.3f} {r['self_ms']:8.3f}  x{r['calls']:<6g} {r['function'][:110]}"
                      for r in row["host_profile"]]
        if profile:
            ours.prepare_context(ctx)
            phases, kernels = kernel_breakdown(lambda: ours.run("compiled", streams), ours.restore)
            total = sum(ms for _, ms in phases)
            row["profile_ms"] = {p: round(ms, 3) for p, ms in phases}
            row["profile_kernels_ms"] = {k[:200]: round(ms, 3) for k, ms in kernels[:20]}
            # the same top kernels with their full names (to 400 characters) and the phase each counts to
            row["profile_top_kernels"] = [{"kernel": k[:400], "ms": round(ms, 3), "phase": phase_of(k)}
                                          for k, ms in kernels[:TOP_KERNELS]]
            lines = [f"{name}: device time {total:.1f} ms per step (floor {floor.floor_ms:.1f} ms, "
                     f"phase floor {floor.phase_floor_ms:.1f} ms)"]
            lines += [f"  {ms:8.2f} ms {100 * ms / total:5.1f}%  {p}" for p, ms in phases]
            lines += ["  top kernels:"] + [f"  {ms:8.2f} ms  {k[:100]}" for k, ms in kernels[:12]]
        if baseline and name in baseline:
            row["one_gpu_graphs_ms"] = baseline[name]
        results.append(row)
        if on_row is not None:
            on_row(row, lines)
        torch.cuda.empty_cache()
    return results


def table(results: list[dict], variants: list[str]) -> tuple[list[str], list[list[str]]]:
    """The headers and rows of the results table (the baseline columns when a row carries one)."""
    baseline = any("one_gpu_graphs_ms" in r for r in results)
    graphs = "graphs" in variants
    headers = ["workload", "floor ms", "phase floor ms"] + [f"{v} ms" for v in variants]
    if "peer" in variants:
        headers += [f"peer / {v}" for v in variants if v != "peer"]
    headers += ["graphs / floor", "graphs / phase floor", "GPU busy", "graphs tok/s"] if graphs else []
    headers += ["1 GPU graphs ms", "speed-up"] if baseline else []
    rows = []
    for r in results:
        line = [f"{r['workload']} {r['label']}", f"{r['floor_ms']:.2f}", f"{r['phase_floor_ms']:.2f}"]
        line += [f"{r[f'{v}_ms']:.2f}" for v in variants]
        if "peer" in variants:
            line += [f"{r['peer_ms'] / r[f'{v}_ms']:.2f}x" for v in variants if v != "peer"]
        if graphs:
            busy = r.get("gpu_busy")
            line += [f"{r['graphs_ms'] / r['floor_ms']:.2f}x", f"{r['graphs_ms'] / r['phase_floor_ms']:.2f}x",
                     "-" if busy is None else f"{100 * busy:.1f}%", f"{r['tokens'] / r['graphs_ms'] * 1e3:,.0f}"]
        if baseline:
            one = r.get("one_gpu_graphs_ms")
            line += [f"{one:.1f}", f"{one / r['graphs_ms']:.2f}x"] if one else ["-", "-"]
        rows.append(line)
    return headers, rows


def title(record: dict) -> str:
    layers = record["layers"]
    full = PRESETS[record["preset"]].num_hidden_layers if record["preset"] in PRESETS else layers
    gpus = f"{record['tp']} x " if record["tp"] > 1 else ""
    fp8 = record["preset"] in PRESETS and PRESETS[record["preset"]].quantization is not None
    dtype = "FP8 weights (128 x 128 blocks), bf16 activations" if fp8 else "bf16"
    return f"{record['preset']}{f' ({layers} layers)' if layers != full else ''}, {dtype}, {gpus}{record['device']}"


def render(record: dict, variants: list[str], fmt: str = "table") -> str:
    """The record of a run (bench_record) as "table" (the text the tool prints: title, table, generation),
    "markdown" (title and table) or "json" (the record, indented)."""
    if fmt == "json":
        return json.dumps(record, indent=1)
    headers, rows = table(record["results"], variants)
    if fmt == "markdown":
        return f"{title(record)}\n\n{markdown_table(headers, rows)}"
    if fmt != "table":
        raise ValueError(f"fmt must be 'table', 'markdown' or 'json', got {fmt!r}")
    text = f"{title(record)}\n{format_table(headers, rows)}"
    g = record.get("generation")
    if g:
        text += (f"\n\ngeneration, {g['prompts']} prompts x {g['prompt_len']} tokens, {g['new_tokens']} new each: "
                 f"ours {g['ours_tok_s']:,.0f} tokens/s"
                 + (f", peer {g['peer_tok_s']:,.0f} tokens/s" if "peer_tok_s" in g else ""))
    return text


def bench_record(args, layers: int, moe_parallel: str | None, device: str, run_info: dict, results: list[dict],
                 generation: dict | None = None) -> dict:
    """The JSON record of a run: what ran (preset, depth, parallelism, device, provenance, the kernel backends
    chosen by environment variable, the floor model's rates) and its rows, floats rounded to 3 places (the
    GPU-busy fraction to 4)."""
    from metrale_graph.ops import gdn_recurrence
    from metrale_graph.ops.fp8 import linear

    def rounded(k, v):
        return round(v, 4 if k == "gpu_busy" else 3) if isinstance(v, float) else v

    return {"tool": "bench", "preset": args.preset, "layers": layers, "tp": args.tp, "moe_parallel": moe_parallel,
            "device": device, **run_info, "repeat": args.repeat,
            "backends": {"gdn_chunked": gdn_recurrence.CHUNKED_BACKEND, "fp8_decode": linear.DECODE_GEMM},
            "floor_rates": {"matmul_flop_s": MATMUL_RATE, "fp8_matmul_flop_s": FP8_MATMUL_RATE,
                            "copy_byte_s": COPY_RATE}, "generation": generation,
            "results": [{k: rounded(k, v) for k, v in r.items()} for r in results]}
