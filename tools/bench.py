"""End-to-end benchmark: the workloads of DESIGN.md on one model shape (default the Qwen3.5-9B
shape, random bf16 weights, full depth), side by side in one process with the same weights: the
peer (transformers with flash-linear-attention kernels, eager), ours eager, ours compiled, ours
compiled + CUDA graphs. W1-W7 are prefill / mixed steps; D1 and D32 are decode steps (one new
token per stream after 2048 cached, time per step including host work). Median of CUDA-event
timings after warmup, next to each workload's floor max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s),
where bytes are the weights a step reads (for MoE presets only the experts its tokens can touch)
plus the cached K/V it reads and the GDN states it reads and writes. `--generate` adds an
end-to-end generation run (32 prompts of 512 tokens, 256 new tokens each) against transformers'
generate. Prints a table, writes JSON and markdown if asked, and ends with one JSON line.

With `--tp N` (launched by torchrun, one GPU per rank, NCCL) our three variants run tensor-parallel
and the floor is that of N GPUs; the peer runs on one GPU and is left out. `--baseline FILE`, the
JSON of a one-GPU run of the same preset, adds each workload's speed-up over one GPU.

    python -m metrale_graph.tools.bench [--preset qwen3.5-9b] [--workloads W1,W2,...] [--repeat 10] [--json FILE]
    torchrun --nproc-per-node 2 -m metrale_graph.tools.bench --tp 2 --variants graphs --baseline one_gpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

from metrale_graph import PRESETS, HybridModel, Stream
from metrale_graph.ops import REGISTRY, kernels
from metrale_graph.tools.distributed import end_tensor_parallel, start_run
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import add_moe_parallel_arg, names_of, output_file, positive_int, seed
from metrale_graph.tools.floors import floor_ms
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import markdown_table, print_json, print_table
from metrale_graph.weights import weight_shapes

VARIANTS = ("peer", "eager", "compiled", "graphs")

@dataclass(frozen=True)
class Workload:
    new: tuple[int, ...]  # new tokens per stream
    cached: tuple[int, ...]  # tokens already cached per stream

    @property
    def label(self) -> str:
        groups = sorted(Counter(zip(self.new, self.cached)).items(), key=lambda kv: -kv[1])
        if len(groups) > 2:
            return f"{len(self.new)} ragged, {sum(self.new)} tok"
        return " + ".join(f"{n}x{new}" + (f" +{c} cached" if c else "") for (new, c), n in groups)


WORKLOADS = {
    "W1": Workload((512,), (0,)),
    "W2": Workload((512,) * 8, (0,) * 8),
    "W3": Workload((1500, 37, 900, 256, 700, 128, 420, 155), (0,) * 8),
    "W4": Workload((128,) * 32, (0,) * 32),
    "W5": Workload((16384,), (0,)),
    "W6": Workload((512,) * 4, (2048,) * 4),
    "W7": Workload((1,) * 31 + (512,), (2048,) * 31 + (0,)),  # a mixed step: 31 decodes + 1 prompt
    "D1": Workload((1,), (2048,)),
    "D32": Workload((1,) * 32, (2048,) * 32),
}


def fitting_workloads(cfg, names: list[str]) -> tuple[list[str], dict[str, int]]:
    """The workloads of `names` whose streams fit cfg.max_position_embeddings (cached + new tokens), and
    the others with the positions they need."""
    need = {w: max(n + c for n, c in zip(WORKLOADS[w].new, WORKLOADS[w].cached)) for w in names}
    too_long = {w: n for w, n in need.items() if n > cfg.max_position_embeddings}
    return [w for w in names if w not in too_long], too_long


def expected_experts(cfg, tokens: int) -> float:
    """Experts of one MoE layer that `tokens` tokens touch, in expectation under uniform routing."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def workload_floor(cfg, w: Workload, gpus: int = 1) -> tuple[float, float, float]:
    """(floor ms on `gpus` GPUs, FLOPs, bytes). FLOPs: every projection over every new token (MoE: the router, the
    top-k experts and the shared expert), the LM head over each stream's last token, causal attention
    over cached + new tokens. Bytes: every weight read once (the embedding table and the LM head
    included, as DESIGN.md's decode floors count them; MoE: only the experts the tokens can touch, in
    expectation), cached K/V read, GDN states read and written. On several GPUs each does its share of
    the FLOPs and bytes (collectives not counted)."""
    shapes = weight_shapes(cfg)
    T, B = sum(w.new), len(w.new)
    experts = expected_experts(cfg, T) if getattr(cfg, "num_experts", 0) else 0
    flops_per_token, weight_bytes = 0.0, 0.0
    for name, shape in shapes.items():
        if len(shape) < 2 or name.startswith(("embed_tokens", "lm_head")) or "conv1d" in name:
            continue
        n = torch.Size(shape).numel()
        if ".mlp.experts." in name:  # [E, ...]: top-k of E per token, the touched ones read
            flops_per_token += 2 * n * cfg.num_experts_per_tok / cfg.num_experts
            weight_bytes += 2 * n * experts / cfg.num_experts
        else:
            flops_per_token += 2 * n
            weight_bytes += 2 * n
    head = cfg.vocab_size * cfg.hidden_size
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in zip(w.new, w.cached))
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * pairs * len(cfg.full_layers)
    kv = 2 * 2 * cfg.num_key_value_heads * cfg.head_dim * sum(w.cached) * len(cfg.full_layers)
    states = 2 * 4 * B * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim \
        * len(cfg.linear_layers)
    flops = T * flops_per_token + 2 * B * head + attn
    nbytes = weight_bytes + 2 * head * (1 if cfg.tie_word_embeddings else 2) + kv + states
    return floor_ms(flops / gpus, nbytes / gpus)[0], flops, nbytes


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
    kernels: dict[str, float] = {}
    for _ in range(runs):  # one profile per call: setup's kernels (the cache restore) stay outside
        setup()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
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
    """Our model in the three modes over one cache; stream i in slot i, the cache restored before each
    timed call."""

    def __init__(self, model, workloads: list[Workload], grid):
        from metrale_graph.capture import GraphRunner

        self.model = model
        per_slot = max(n + c for w in workloads for n, c in zip(w.new, w.cached))
        blocks = max(sum(-(-(n + c) // 64) for n, c in zip(w.new, w.cached)) for w in workloads)
        self.cache = model.new_cache(num_slots=max(len(w.new) for w in workloads), num_blocks=blocks,
                                     max_context=per_slot)
        batch_sizes, token_counts = grid
        self.graphs = GraphRunner(model, self.cache, batch_sizes, token_counts, use_graphs=True)
        self.compiled = GraphRunner(model, self.cache, batch_sizes, token_counts, use_graphs=False)
        self.snapshot = None

    def prepare_context(self, contexts: list[torch.Tensor | None]):
        """Prefill each stream's cached context (untimed) and remember the cache state to restore."""
        for s in range(self.cache.num_slots):
            self.cache.reset(s)
        prompts = [Stream(i, c) for i, c in enumerate(contexts) if c is not None]
        if prompts:
            self.model.prefill(self.cache, prompts)
        self.snapshot = self.cache.snapshot()

    def restore(self):
        self.cache.restore(self.snapshot)

    def run(self, mode, streams):
        if mode == "eager":
            return self.model.prefill(self.cache, streams)
        return (self.graphs if mode == "graphs" else self.compiled).prefill(streams)


# model_type -> (transformers config class, causal LM class)
PEER_CLASSES = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
                "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
                "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM")}


def peer_model(model):
    """transformers' causal LM of the model's family with the same bf16 weights (it picks
    flash-linear-attention's kernels when fla is installed)."""
    import transformers

    from metrale_graph.weights import hf_state_dict

    cfg = model.config
    config_cls, model_cls = (getattr(transformers, n) for n in PEER_CLASSES[getattr(cfg, "model_type", "qwen3_5_text")])
    hf_cfg = config_cls(**cfg.to_hf())
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    state = hf_state_dict(dict(model.named_parameters()), cfg)
    hf.load_state_dict(state, strict=False, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg, device=model.device)
    return hf.to(model.device).eval()


def peer_prefill(hf, batch: torch.Tensor, mask=None, past=None):
    out = hf(input_ids=batch, attention_mask=mask, past_key_values=past, use_cache=True, logits_to_keep=1)
    return out.past_key_values


@torch.no_grad()
def bench_peer(hf, w: Workload, new, ctx, repeat):
    """The peer's best way through a workload: the streams with cached context as one batch through its
    own cache (their lengths agree in every workload); the others as one batch when their lengths
    agree, else as a left-padded batch or one stream at a time, whichever is faster. A mixed step (W7)
    is the two calls back to back."""
    dev = next(hf.parameters()).device
    cached = [i for i, c in enumerate(w.cached) if c]
    fresh = [i for i, c in enumerate(w.cached) if not c]
    calls, setups, modes = [], [], []
    if cached:
        past0 = peer_prefill(hf, torch.stack([ctx[i] for i in cached]).to(dev))
        batch = torch.stack([new[i] for i in cached]).to(dev)
        holder = {}
        calls.append(lambda: peer_prefill(hf, batch, past=holder["past"]))
        setups.append(lambda: holder.update(past=copy.deepcopy(past0)))
        modes.append("batch with cache")
    if fresh:
        toks = [new[i] for i in fresh]
        if len({t.numel() for t in toks}) == 1:
            batch2 = torch.stack(toks).to(dev)
            calls.append(lambda: peer_prefill(hf, batch2))
            modes.append("batch")
        else:
            L = max(t.numel() for t in toks)
            padded = torch.zeros(len(toks), L, dtype=torch.long)
            mask = torch.zeros(len(toks), L, dtype=torch.long)
            for i, t in enumerate(toks):
                padded[i, L - t.numel():] = t
                mask[i, L - t.numel():] = 1
            padded, mask = padded.to(dev), mask.to(dev)
            singles = [t.to(dev)[None] for t in toks]
            options = {"padded batch": lambda: peer_prefill(hf, padded, mask),
                       "one at a time": lambda: [peer_prefill(hf, s) for s in singles]}
            best = min(options, key=lambda k: time_cuda(options[k], lambda: None, max(1, repeat // 2)))
            calls.append(options[best])
            modes.append(best)
    ms = time_cuda(lambda: [c() for c in calls], lambda: [s() for s in setups], repeat)
    return ms, " + ".join(modes)


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b", choices=list(PRESETS))
    p.add_argument("--layers", type=positive_int, default=None,
                   help="fewer layers than the preset (quick runs; at most the preset's)")
    p.add_argument("--workloads", type=names_of(WORKLOADS), default=None,
                   help=f"out of {', '.join(WORKLOADS)} (default: all that fit the preset's "
                        "max_position_embeddings)")
    p.add_argument("--variants", type=names_of(VARIANTS), default=None,
                   help=f"out of {', '.join(VARIANTS)} (default: all; without the peer under --tp)")
    p.add_argument("--repeat", type=positive_int, default=10, help="timed runs per variant (median)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: torchrun --nproc-per-node N -m metrale_graph.tools.bench --tp N "
                        "(one GPU each)")
    add_moe_parallel_arg(p)
    p.add_argument("--baseline", default=None,
                   help="JSON of a one-GPU run (--json) of the same preset: adds the speed-up over one GPU")
    p.add_argument("--generate", action="store_true",
                   help="also time end-to-end generation (32 prompts x 512 tokens, 256 new each) against the peer")
    p.add_argument("--json", type=output_file, default=None, help="write the results to this JSON file")
    p.add_argument("--markdown", type=output_file, default=None, help="write the table to this markdown file")
    p.add_argument("--profile", action="store_true",
                   help="also print each workload's device time by phase (torch.profiler over the compiled step)")
    args = p.parse_args(argv)
    variants = args.variants or [v for v in VARIANTS if args.tp == 1 or v != "peer"]
    if args.tp > 1 and "peer" in variants:
        p.error("the peer runs on one GPU: leave it out of --variants under --tp")
    if args.tp > 1 and args.generate:
        p.error("--generate times one GPU against the peer; under --tp use metrale_graph.tools.generate --tp")
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
    workloads, too_long = fitting_workloads(cfg, args.workloads or list(WORKLOADS))
    if args.workloads and too_long:
        p.error(f"--workloads: {', '.join(f'{w} ({n} positions)' for w, n in too_long.items())} past the preset "
                f"{args.preset}'s max_position_embeddings {cfg.max_position_embeddings}")
    baseline = None
    if args.baseline:
        try:
            baseline = read_baseline(args.baseline, args.preset, cfg.num_hidden_layers)
        except ValueError as e:
            p.error(f"--baseline: {e}")
    if not torch.cuda.is_available():
        p.exit(1, f"{p.prog}: error: this benchmark needs a CUDA GPU; torch sees none\n")
    run = start_run(args, p)  # no --device / --dtype: bf16 on cuda (cuda:LOCAL_RANK under --tp)
    with run.silence_other_ranks():
        _bench(p, args, cfg, variants, workloads, too_long, baseline, run, run.tp, run.device)


def _bench(p, args, cfg, variants, workloads, too_long, baseline, run, tp, device) -> None:
    from tqdm.auto import tqdm

    if too_long and not args.workloads:
        print(f"left out {', '.join(too_long)}: longer than the preset {args.preset}'s max_position_embeddings "
              f"{cfg.max_position_embeddings}")
    try:
        model = HybridModel.from_preset(cfg, dtype=torch.bfloat16, device=device, seed=args.seed, tp=tp)
    except ValueError as e:
        p.error(f"--preset {args.preset}: {e}")
    hf = peer_model(model) if "peer" in variants else None
    # a grid holding one bucket per workload's (streams, new tokens)
    grid = (sorted({len(WORKLOADS[w].new) for w in workloads}), sorted({sum(WORKLOADS[w].new) for w in workloads}))
    ours = Ours(model, [WORKLOADS[w] for w in workloads], grid)
    gen = torch.Generator().manual_seed(args.seed)
    quiet = tp is not None and tp.rank != 0
    results = []
    run_info = provenance()

    def save(generation=None) -> dict:
        """The record so far, written to --json (after every workload: a run cut short keeps its rows)."""
        record = {"tool": "bench", "preset": args.preset, "layers": cfg.num_hidden_layers, "tp": args.tp,
                  "moe_parallel": run.moe_parallel if cfg.moe_layers else None,
                  "device": torch.cuda.get_device_name(), **run_info, "repeat": args.repeat, "generation": generation,
                  "results": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                              for r in results]}
        if args.json and not quiet:
            write_whole(args.json, json.dumps(record, indent=1))
        return record

    for name in tqdm(workloads, desc="workloads", unit="workload", disable=quiet):
        w = WORKLOADS[name]
        new = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in w.new]
        ctx = [torch.randint(0, cfg.vocab_size, (c,), generator=gen) if c else None for c in w.cached]
        streams = [Stream(i, t) for i, t in enumerate(new)]
        row = {"workload": name, "label": w.label, "streams": len(w.new), "tokens": sum(w.new),
               "cached": sum(w.cached)}
        row["floor_ms"], row["flops"], row["bytes"] = workload_floor(cfg, w, args.tp)
        for v in variants:
            if v == "peer":
                row["peer_ms"], row["peer_mode"] = bench_peer(hf, w, new, ctx, args.repeat)
                continue
            ours.prepare_context(ctx)
            if v == "graphs":
                ours.graphs.warm_bucket(min(b for b in ours.graphs.grid if b.holds(len(streams), sum(w.new))))
            row[f"{v}_ms"] = time_cuda(lambda: ours.run(v, streams), ours.restore, args.repeat)
        if args.profile:
            ours.prepare_context(ctx)
            phases, kernels = kernel_breakdown(lambda: ours.run("compiled", streams), ours.restore)
            total = sum(ms for _, ms in phases)
            row["profile_ms"] = {p: round(ms, 3) for p, ms in phases}
            lines = [f"{name}: device time {total:.1f} ms per step (floor {row['floor_ms']:.1f} ms)"]
            lines += [f"  {ms:8.2f} ms {100 * ms / total:5.1f}%  {p}" for p, ms in phases]
            lines += ["  top kernels:"] + [f"  {ms:8.2f} ms  {k[:100]}" for k, ms in kernels[:12]]
            if not quiet:
                tqdm.write("\n".join(lines))
        if baseline and name in baseline:
            row["one_gpu_graphs_ms"] = baseline[name]
        results.append(row)
        if not quiet:
            tqdm.write(json.dumps(row))
            save()  # as each workload finishes: a cut-short run still leaves its rows
        torch.cuda.empty_cache()

    headers = ["workload", "floor ms"] + [f"{v} ms" for v in variants]
    if "peer" in variants:
        headers += [f"peer / {v}" for v in variants if v != "peer"]
    headers += ["graphs / floor", "graphs tok/s"] if "graphs" in variants else []
    headers += ["1 GPU graphs ms", "speed-up"] if baseline else []
    rows = []
    for r in results:
        line = [f"{r['workload']} {r['label']}", f"{r['floor_ms']:.1f}"] + [f"{r[f'{v}_ms']:.1f}" for v in variants]
        if "peer" in variants:
            line += [f"{r['peer_ms'] / r[f'{v}_ms']:.2f}x" for v in variants if v != "peer"]
        if "graphs" in variants:
            line += [f"{r['graphs_ms'] / r['floor_ms']:.2f}x", f"{r['tokens'] / r['graphs_ms'] * 1e3:,.0f}"]
        if baseline:
            one = r.get("one_gpu_graphs_ms")
            line += [f"{one:.1f}", f"{one / r['graphs_ms']:.2f}x"] if one else ["-", "-"]
        rows.append(line)
    generation = None
    if args.generate:
        del ours
        torch.cuda.empty_cache()
        generation = bench_generate(model, hf, seed=args.seed)
    title = (f"{args.preset}{f' ({cfg.num_hidden_layers} layers)' if args.layers else ''}, bf16, "
             f"{f'{args.tp} x ' if args.tp > 1 else ''}{torch.cuda.get_device_name()}")
    print("\n" + title)
    print_table(headers, rows)
    if generation:
        print(f"\ngeneration, {generation['prompts']} prompts x {generation['prompt_len']} tokens, "
              f"{generation['new_tokens']} new each: ours {generation['ours_tok_s']:,.0f} tokens/s"
              + (f", peer {generation['peer_tok_s']:,.0f} tokens/s" if "peer_tok_s" in generation else ""))
    if quiet:  # the other ranks ran the same steps; rank 0 reports
        return
    if args.markdown:
        write_whole(args.markdown, f"{title}\n\n{markdown_table(headers, rows)}")
    print_json(save(generation))


def cli() -> None:
    """The console script and `python -m`: main(), then the end of a --tp run (tools.distributed)."""
    main()
    end_tensor_parallel()


if __name__ == "__main__":
    cli()
