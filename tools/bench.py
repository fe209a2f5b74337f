"""End-to-end prefill benchmark: workloads W1-W6 of DESIGN.md on one model shape (default the
Qwen3.5-9B shape, random bf16 weights, full depth), side by side in one process with the same
weights: the peer (transformers Qwen3.5 with flash-linear-attention kernels, eager), ours eager,
ours compiled, ours compiled + CUDA graphs. Median of CUDA-event timings after warmup, next to
each workload's floor max(FLOPs / 790 TFLOP/s, weight bytes / 4.3 TB/s). Prints a table, writes
JSON and markdown if asked, and ends with one JSON line.

    python -m tools.bench [--workloads W1,W2,...] [--repeat 10] [--markdown FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from metrale_graph import PRESETS, HybridModel, Stream
from metrale_graph.ops import REGISTRY, kernels
from metrale_graph.tools.common import floor_ms, names_of, output_file, positive_int, print_json, print_table, seed
from metrale_graph.weights import weight_shapes

VARIANTS = ("peer", "eager", "compiled", "graphs")

# id -> (new tokens per stream, cached tokens per stream)
WORKLOADS = {
    "W1": ([512], 0),
    "W2": ([512] * 8, 0),
    "W3": ([1500, 37, 900, 256, 700, 128, 420, 155], 0),
    "W4": ([128] * 32, 0),
    "W5": ([16384], 0),
    "W6": ([512] * 4, 2048),
}


def workload_floor(cfg, lengths: list[int], cached: int) -> tuple[float, float, float]:
    """(floor ms, FLOPs, bytes): matmul FLOPs of every projection over every new token, the LM head
    over each stream's last token, causal attention over cached + new tokens; bytes = weights read
    once (the embedding only for the rows used)."""
    shapes = weight_shapes(cfg)
    proj = sum(torch.Size(s).numel() for n, s in shapes.items()
               if len(s) >= 2 and not n.startswith(("embed_tokens", "lm_head")) and "conv1d" not in n)
    T, B = sum(lengths), len(lengths)
    head = cfg.vocab_size * cfg.hidden_size
    pairs = sum(L * cached + L * (L + 1) / 2 for L in lengths)
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * pairs * len(cfg.full_layers)
    flops = 2 * T * proj + 2 * B * head + attn
    nbytes = 2 * (proj + head + T * cfg.hidden_size)
    return floor_ms(flops, nbytes)[0], flops, nbytes


# kernel name -> phase, first match wins: each op's own kernels (its spec), then the GEMMs (cuBLAS /
# CUTLASS kernels have many names), then the row kernels several ops share
PHASES = ([(f"{name} (own kernels)", spec.kernels) for name, spec in REGISTRY.items() if spec.kernels]
          + [("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "splitk", "splitK", "sm90_", "sm80_")),
             ("shared row kernels (norms, SiLU-mul)", kernels.SHARED_KERNELS)])


def kernel_breakdown(fn, setup, runs: int = 3) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Device time per prefill by phase and by kernel (ms), from torch.profiler over `runs` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    setup()
    fn()  # anything lazy happens outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            setup()
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA:
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3 / runs
    if not kernels:
        raise RuntimeError("torch.profiler recorded no CUDA kernels")
    phases: dict[str, float] = {}
    for name, ms in kernels.items():
        phase = next((p for p, keys in PHASES if any(k in name for k in keys)), "other (copies, gathers, Inductor)")
        phases[phase] = phases.get(phase, 0.0) + ms
    by = lambda d: sorted(d.items(), key=lambda kv: -kv[1])  # noqa: E731
    return by(phases), by(kernels)


def time_cuda(fn, setup, repeat: int, warmup: int = 2) -> float:
    """Median ms of fn() with CUDA events; setup() (untimed) runs before each call."""
    times = []
    for i in range(warmup + repeat):
        setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


class Ours:
    """Our model in the three modes over one cache; slots 0..B-1, restored before each timed call."""

    def __init__(self, model, workloads, grid):
        self.model = model
        per_slot = max(max(lengths) + cached for lengths, cached in workloads)
        blocks = max(sum(-(-(n + cached) // 64) for n in lengths) for lengths, cached in workloads)
        self.cache = model.new_cache(num_slots=max(len(lengths) for lengths, _ in workloads), num_blocks=blocks,
                                     max_context=per_slot)
        from metrale_graph.capture import GraphRunner

        batch_sizes, token_counts = grid
        self.graphs = GraphRunner(model, self.cache, batch_sizes, token_counts, use_graphs=True)
        self.compiled = GraphRunner(model, self.cache, batch_sizes, token_counts, use_graphs=False)
        self.snapshot = None

    def prepare_context(self, prompts):
        """Prefill cached context (untimed) and remember the cache state to restore before runs."""
        for s in range(self.cache.num_slots):
            self.cache.reset(s)
        if prompts:
            self.model.prefill(self.cache, [Stream(i, p) for i, p in enumerate(prompts)])
        self.snapshot = self.cache.snapshot()

    def restore(self):
        self.cache.restore(self.snapshot)

    def run(self, mode, streams):
        if mode == "eager":
            return self.model.prefill(self.cache, streams)
        return (self.graphs if mode == "graphs" else self.compiled).prefill(streams)


def peer_model(model):
    """transformers' Qwen3_5ForCausalLM with the same bf16 weights (it picks flash-linear-attention's
    kernels when fla is installed)."""
    import transformers

    cfg = model.config
    hf_cfg = transformers.Qwen3_5TextConfig(**cfg.to_hf())
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForCausalLM(hf_cfg)
    state = {(n if n == "lm_head.weight" else "model." + n): p.contiguous()
             for n, p in model.named_parameters()}
    hf.load_state_dict(state, strict=False, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg, device=model.device)
    return hf.to(model.device).eval()


def peer_prefill(hf, batch: torch.Tensor, mask=None, past=None):
    out = hf(input_ids=batch, attention_mask=mask, past_key_values=past, use_cache=True, logits_to_keep=1)
    return out.past_key_values


def main(argv=None) -> None:
    from tqdm.auto import tqdm

    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b", choices=list(PRESETS))
    p.add_argument("--layers", type=positive_int, default=None, help="fewer layers than the preset (quick runs)")
    p.add_argument("--workloads", type=names_of(WORKLOADS), default=",".join(WORKLOADS))
    p.add_argument("--variants", type=names_of(VARIANTS), default=",".join(VARIANTS))
    p.add_argument("--repeat", type=positive_int, default=10, help="timed runs per variant (median)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the results to this JSON file")
    p.add_argument("--markdown", type=output_file, default=None, help="write the table to this markdown file")
    p.add_argument("--profile", action="store_true",
                   help="also print each workload's device time by phase (torch.profiler over the compiled step)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this benchmark needs a CUDA GPU; torch sees none\n")
    cfg = PRESETS[args.preset]
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    workloads, variants = args.workloads, args.variants
    model = HybridModel.from_preset(cfg, dtype=torch.bfloat16, device="cuda", seed=args.seed)
    hf = peer_model(model) if "peer" in variants else None
    # a grid holding one bucket per workload's (streams, new tokens)
    grid = (sorted({len(WORKLOADS[w][0]) for w in workloads}), sorted({sum(WORKLOADS[w][0]) for w in workloads}))
    ours = Ours(model, [WORKLOADS[w] for w in workloads], grid)
    gen = torch.Generator().manual_seed(args.seed)
    results = []
    for w in tqdm(workloads, desc="workloads", unit="workload"):
        lengths, cached = WORKLOADS[w]
        new = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
        ctx = [torch.randint(0, cfg.vocab_size, (cached,), generator=gen) for _ in lengths] if cached else []
        streams = [Stream(i, t) for i, t in enumerate(new)]
        row = {"workload": w, "streams": len(lengths), "tokens": sum(lengths), "cached": cached}
        row["floor_ms"], row["flops"], row["bytes"] = workload_floor(cfg, lengths, cached)
        for v in variants:
            if v == "peer":
                row["peer_ms"], row["peer_mode"] = bench_peer(hf, new, ctx, args.repeat)
                continue
            ours.prepare_context(ctx)
            if v == "graphs":
                ours.graphs.warm_bucket(min(b for b in ours.graphs.grid if b.holds(len(streams), sum(lengths))))
            row[f"{v}_ms"] = time_cuda(lambda: ours.run(v, streams), ours.restore, args.repeat)
        if args.profile:
            ours.prepare_context(ctx)
            phases, kernels = kernel_breakdown(lambda: ours.run("compiled", streams), ours.restore)
            total = sum(ms for _, ms in phases)
            row["profile_ms"] = {p: round(ms, 3) for p, ms in phases}
            lines = [f"{w}: device time {total:.1f} ms per prefill (floor {row['floor_ms']:.1f} ms)"]
            lines += [f"  {ms:8.2f} ms {100 * ms / total:5.1f}%  {p}" for p, ms in phases]
            lines += ["  top kernels:"] + [f"  {ms:8.2f} ms  {k[:100]}" for k, ms in kernels[:12]]
            tqdm.write("\n".join(lines))
        results.append(row)
        tqdm.write(json.dumps(row))  # as each workload finishes: a cut-short run still leaves its rows
        torch.cuda.empty_cache()

    headers = ["workload", "floor ms"] + [f"{v} ms" for v in variants]
    if "peer" in variants:
        headers += [f"peer / {v}" for v in variants if v != "peer"]
    headers += ["graphs / floor", "graphs tok/s"] if "graphs" in variants else []
    rows = []
    for r in results:
        lengths = WORKLOADS[r["workload"]][0]
        shape = (f"{r['streams']}x{lengths[0]}" if len(set(lengths)) == 1 else f"{r['streams']} ragged, {r['tokens']} tok")
        line = [f"{r['workload']} {shape}" + (f" +{r['cached']} cached" if r["cached"] else ""),
                f"{r['floor_ms']:.1f}"] + [f"{r[f'{v}_ms']:.1f}" for v in variants]
        if "peer" in variants:
            line += [f"{r['peer_ms'] / r[f'{v}_ms']:.2f}x" for v in variants if v != "peer"]
        if "graphs" in variants:
            line += [f"{r['graphs_ms'] / r['floor_ms']:.2f}x", f"{r['tokens'] / r['graphs_ms'] * 1e3:,.0f}"]
        rows.append(line)
    title = f"{args.preset}{f' ({cfg.num_hidden_layers} layers)' if args.layers else ''}, bf16, {torch.cuda.get_device_name()}"
    print("\n" + title)
    print_table(headers, rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{title}\n\n| " + " | ".join(headers) + " |\n|" + "---|" * len(headers) + "\n")
            for r in rows:
                f.write("| " + " | ".join(r) + " |\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_json({"tool": "bench", "preset": args.preset, "layers": cfg.num_hidden_layers,
                "device": torch.cuda.get_device_name(),
                "results": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in results]})


@torch.no_grad()
def bench_peer(hf, new, ctx, repeat):
    """The peer's best mode: equal lengths as one batch; ragged lengths as a left-padded batch or
    one stream at a time, whichever is faster; cached context through its own cache."""
    dev = next(hf.parameters()).device
    lengths = [t.numel() for t in new]
    if ctx:
        past0 = peer_prefill(hf, torch.stack(ctx).to(dev))
        batch = torch.stack(new).to(dev)
        holder = {}
        ms = time_cuda(lambda: peer_prefill(hf, batch, past=holder["past"]),
                       lambda: holder.update(past=copy.deepcopy(past0)), repeat)
        return ms, "batch with cache"
    if len(set(lengths)) == 1:
        batch = torch.stack(new).to(dev)
        return time_cuda(lambda: peer_prefill(hf, batch), lambda: None, repeat), "batch"
    L = max(lengths)
    padded = torch.zeros(len(new), L, dtype=torch.long)
    mask = torch.zeros(len(new), L, dtype=torch.long)
    for i, t in enumerate(new):
        padded[i, L - t.numel():] = t
        mask[i, L - t.numel():] = 1
    padded, mask = padded.to(dev), mask.to(dev)
    batched = time_cuda(lambda: peer_prefill(hf, padded, mask), lambda: None, repeat)
    singles = [t.to(dev)[None] for t in new]
    one_by_one = time_cuda(lambda: [peer_prefill(hf, s) for s in singles], lambda: None, repeat)
    return (batched, "padded batch") if batched <= one_by_one else (one_by_one, "one at a time")


if __name__ == "__main__":
    main()
