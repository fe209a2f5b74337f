"""tools.bench's speculative-decoding workloads (issue 39; docs/benchmarking.md): `--speculative STREAMS` and
`--echo STREAMS`. One run measures, on the preset's random weights, with the Engine in steady state:

1. The verify step: at each stream count, the plain Engine's decode step (speculative=None, overlap on), then one
   Engine(speculative={"method": "ngram", "num_tokens": max k}) whose prompt lookup is replaced by a proposer that
   never misses (FORCED: each decode proposes exactly k drafts, its last token repeated), in phases of one
   generate call: k = 0 (no drafts: lookup finds nothing, so the loop keeps its overlapped step) then each k of
   --speculative-k. A verify step feeds k + 1 tokens per stream through the model whatever the drafts are, so its
   cost does not depend on acceptance; acceptance is reported as it comes (random weights: mostly rejected).
2. The MTP engine (--speculative-mtp-k K, default 2; the preset given a random one-layer MTP head): its head drafts
   K every step (room permitting), so its steps are verify + draft at a fixed K; the head's drafting call
   (speculative/drafting.py's MtpDrafter.draft) is timed inside them (device synchronized around it).
3. Echo (`--echo`), last, on the preset's weights made a bigram model (`bigram_weights`: every layer's output
   projections into the residual zeroed, in place, so the next token is a function of the current one; every weight
   is still read, so a step costs what a random-weight step costs; random weights do not repeat a continuation, and
   prompt lookup then found 6 drafts in 250 steps on the H100): a greedy continuation C of random prompts P is
   generated first (plain engine), then the prompt P + C + P (the text, then its prompt again: the bigram model
   continues with C) is generated again, plain and with real n-gram drafts (prompt lookup, k = max k): tokens/s of
   the whole generate call (prefill included), acceptance, whether the two outputs agree and whether the model
   echoed C. The echo's two engines are built after the others (the weights change under them).
4. A projection (PUBLISHED, labelled as such): tokens/s at vLLM's published acceptance for the 35B-A3B-FP8 with MTP
   at k = 2 (per-position 0.80 / 0.43: 2.23 tokens a step) from the steps measured at k = 2 (projections(): the MTP
   engine's, and the forced verify step plus the MTP draft; the verify step alone without the MTP engine).

Each window: `settle` steps after every request decodes (or after the phase changes), then `steps` timed steps;
wall ms per step (host work included), device ms and the GPU-busy fraction between two marker kernels (as bench
--loop; CUDA only), tokens a stream gets per step, ms per emitted token, drafts proposed and accepted. The
generate call ends (its requests aborted) once its last window closes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import asdict, dataclass

import torch

from metrale_graph.tools.engine_windows import FORCED, DraftTimer, forced_drafts, run_windows
from metrale_graph.tools.flags import non_negative_int, positive_ints
from metrale_graph.tools.speculative_tables import render

PUBLISHED = {"source": "vLLM, Qwen3.5-35B-A3B-FP8 with MTP (num_speculative_tokens 2): acceptance length 2.23",
             "num_tokens": 2, "per_position": [0.80, 0.43]}
SLACK = 8  # steps per phase the engine may run past what the measuring thread has seen
# a decoder layer's projections into the residual stream (HybridModel's parameter names), main model and MTP head
RESIDUAL_OUTPUTS = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                    "mlp.experts.down_proj", "mlp.shared_expert.down_proj.weight")


@torch.no_grad()
def bigram_weights(model) -> None:
    """`model` made a bigram model in place: every parameter named by RESIDUAL_OUTPUTS zeroed (FP8 codes too: their
    scales then multiply zeros), so each position's final hidden state is its token's embedding and the next token a
    function of the current one. The echo workload's weights (module docstring)."""
    for name, p in model.named_parameters():
        if name.endswith(RESIDUAL_OUTPUTS):
            p.zero_()


def acceptance_length(per_position) -> float:
    """Tokens a verify step emits per stream on average: the bonus token, plus each position's acceptance rate
    (vLLM's per-position rates are unconditional: position j counts only when 1 .. j - 1 were kept)."""
    rates = [float(r) for r in per_position]
    if any(not 0 <= r <= 1 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"per-position acceptance rates must lie in [0, 1] and not grow, got {rates}")
    return 1 + sum(rates)


def project(streams: int, step_ms: float, plain_ms: float, published: dict = PUBLISHED) -> dict:
    """Tokens/s of `streams` streams whose speculative step takes step_ms, at the published acceptance length,
    against the plain step's plain_ms (one token a stream)."""
    length = acceptance_length(published["per_position"])
    tok_s, plain = streams * length / step_ms * 1e3, streams / plain_ms * 1e3
    return {"streams": streams, "k": published["num_tokens"], "acceptance_length": round(length, 3),
            "step_ms": step_ms, "plain_ms": plain_ms, "projected_tok_s": round(tok_s, 1),
            "plain_tok_s": round(plain, 1), "speedup": round(tok_s / plain, 3)}


def echo_prompts(prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The echo workload's prompts: each prompt's text, its greedy continuation, the prompt again."""
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts for {len(continuations)} continuations")
    return [list(p) + list(c) + list(p) for p, c in zip(prompts, continuations)]


@dataclass(frozen=True)
class SpecPlan:
    """What --speculative / --echo ask for."""
    streams: tuple[int, ...] = ()  # the verify workload's stream counts
    ks: tuple[int, ...] = (1, 2, 3)  # forced drafts per stream and step
    mtp_k: int = 2  # the MTP engine's num_tokens (0: no MTP engine)
    echo: tuple[int, ...] = ()  # the echo workload's stream counts
    context: int = 2048  # prompt tokens of the verify workload
    steps: int = 32  # timed steps per window
    settle: int = 4  # steps before each window
    echo_prompt: int = 128  # tokens of the echo's random prompt P
    echo_new: int = 256  # tokens of its continuation C, and of each echo generation
    host_top: int = 0  # with --host-profile: each window's largest host functions of the engine loop (sampled)
    trace: str | None = None  # --trace: a folder for each verify run's profiler trace (chrome format, gzipped)

    @property
    def needs_mtp(self) -> bool:
        return bool(self.streams) and self.mtp_k > 0


def add_args(p) -> None:
    p.add_argument("--speculative", type=positive_ints, default=None,
                   help="speculative decoding's verify step at these stream counts (e.g. 1,8,32,128; 2048-token "
                        "prompts): the plain engine's decode step, the n-gram engine with drafts forced to each "
                        "--speculative-k, the MTP engine at --speculative-mtp-k, and the projection at published "
                        "acceptance")
    p.add_argument("--speculative-k", type=positive_ints, default=None,
                   help="the n-gram engine's forced drafts per stream and step (default 1,2,3; its most is the echo's k)")
    p.add_argument("--speculative-mtp-k", type=non_negative_int, default=None,
                   help="drafts per step of the MTP engine (a random one-layer head; default 2, the published "
                        "acceptance's k; 0 leaves it out)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --speculative: write each verify run's torch.profiler trace (its windows' CUDA kernels "
                        "and runtime calls such as cudaGraphLaunch, chrome format) to DIR/<engine>-<streams>.json.gz, "
                        "to see when a graph's launch lets the GPU start")
    p.add_argument("--echo", type=positive_ints, default=None,
                   help="the n-gram echo workload at these stream counts (e.g. 1,16): tokens/s plain and with "
                        "n-gram drafts")


def plan_of(p, args) -> SpecPlan | None:
    """The flags' SpecPlan (None without --speculative and --echo); usage errors through p.error."""
    if not args.speculative and not args.echo:
        for flag, value in (("--speculative-k", args.speculative_k), ("--speculative-mtp-k", args.speculative_mtp_k),
                            ("--trace", args.trace)):
            if value is not None:
                p.error(f"{flag} sets up --speculative / --echo; give one of them too")
        return None
    if args.trace is not None and not args.speculative:
        p.error("--trace records --speculative's verify runs; give --speculative too")
    if args.speculative_mtp_k is not None and not args.speculative:
        p.error("--speculative-mtp-k sets up the MTP engine of --speculative; give --speculative too")
    if args.tp > 1:
        p.error("--speculative and --echo time one GPU's engine; leave them out under --tp")
    for flag, values in (("--speculative", args.speculative), ("--speculative-k", args.speculative_k),
                         ("--echo", args.echo)):
        if values and len(set(values)) != len(values):
            p.error(f"{flag}: {values} names a value twice")
    defaults = SpecPlan()
    return SpecPlan(tuple(args.speculative or ()), tuple(sorted(args.speculative_k or defaults.ks)),
                    defaults.mtp_k if args.speculative_mtp_k is None else args.speculative_mtp_k, tuple(args.echo or ()),
                    host_top=12 if getattr(args, "host_profile", False) else 0, trace=args.trace)


def model_config(cfg, plan: SpecPlan | None):
    """The config to build: with the MTP engine in the plan, the preset given a one-layer MTP head (random weights;
    the main weights are drawn the same with or without it)."""
    if plan is not None and plan.needs_mtp and not cfg.mtp_num_hidden_layers:
        return cfg.replace(mtp_num_hidden_layers=1)
    return cfg


BUDGET = 2048  # the engines' token budget (at least their slots)


def _budget(counts) -> int:
    return max(BUDGET, *counts)


def _trace(plan: SpecPlan, engine: str, n: int) -> str | None:
    """Where a verify run's trace goes (--trace), or None."""
    if plan.trace is None:
        return None
    os.makedirs(plan.trace, exist_ok=True)
    return os.path.join(plan.trace, f"{engine}-{n}.json.gz")


def window_tokens(plan: SpecPlan, n: int, phases: int, k: int) -> int:
    """max_new_tokens of a windowed generate call of n requests (`phases` windows, at most k drafts a step): every
    request decodes through the last window even if every draft is accepted (k + 1 tokens a step) from its first
    step on, while the other prompts prefill (a budget a step)."""
    prefill = -(-n * plan.context // _budget([n])) + 2
    return (prefill + phases * (plan.settle + plan.steps + SLACK)) * (k + 1)


def engine_grid(counts, ks, budget: int) -> tuple[list[int], list[int]]:
    """Bucket grid of the engines: the stream counts, and the tokens of their steps: n (plain decode), n x (k + 1)
    (verify: at one stream a bucket of k + 1 <= 64 tokens, decode-shaped, so the step is not padded to two streams:
    verify.pads_one_stream), the budget and the budget plus n x max k (a prompt chunk beside verifying decodes)."""
    k_max = max(ks, default=0)
    tokens = {n * (k + 1) for n in counts for k in (0, *ks)} | {budget} | {budget + n * k_max for n in counts}
    return sorted(set(counts)), sorted(tokens)


@contextlib.contextmanager
def _engine(model, plan: SpecPlan, counts, speculative, compile: bool):
    """An Engine for the stream counts `counts` (a slot each for the widest), stop tokens off, shut down after the
    block. The engine before it must be gone (the caller dels its name): its memory is freed first."""
    from metrale_graph import Engine

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    ks = (0,) if speculative is None else (*plan.ks, plan.mtp_k)
    budget = _budget(counts)
    longest = max([plan.context + window_tokens(plan, n, 1 + len(plan.ks), max(ks)) for n in plan.streams]
                  + [2 * plan.echo_prompt + 2 * plan.echo_new] * bool(plan.echo))
    batch_sizes, token_counts = engine_grid(counts, ks, budget)
    if speculative is not None:  # every stream count measured speculates (options.py's max_streams would stop it)
        speculative = {**speculative, "max_streams": max(counts)}
    engine = Engine(model, num_slots=max(counts), max_context=longest + 1, token_budget=budget,
                    batch_sizes=batch_sizes, token_counts=token_counts, stop_token_ids=[], compile=compile,
                    speculative=speculative)
    try:
        yield engine
    finally:
        engine.shutdown()


def _warm(engine, n: int, ks) -> None:
    """Capture now the buckets a window of n streams replays: the plain decode's and each k's verify (hidden
    states, then the tail's graphs), so that no window times a capture."""
    runner = engine.runner
    if runner is None:
        return
    from metrale_graph.capture.buckets import choose
    from metrale_graph.speculative.verify import pads_one_stream

    def warm():
        runner.warm_bucket(choose(runner.grid, n, n))
        if engine.speculative is not None:
            with engine.cache.exclusive():
                for k in ks:  # (the streams the verify step runs: verify.pads_one_stream)
                    pad = n == 1 and engine.model.device.type == "cuda" and pads_one_stream(runner, n * (k + 1))
                    entry = runner.hidden_bucket(2 if pad else n, n * (k + 1))
                    if entry is not None:  # and its tail (acceptance, MTP drafts: capture/speculative.py)
                        engine._loop.spec.graphs.warm(entry.bucket)

    engine._loop.run_job(warm, warmup=True)


def _generate(engine, prompts, new: int) -> tuple[float, list[list[int]], dict]:
    """An untimed call (it captures the buckets), then the timed one: its seconds, outputs and the engine's
    speculative counters and steps over it."""
    engine.generate(prompts, max_new_tokens=new)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    gc.collect()  # (the untimed call's garbage, and the engine's before it)
    before = engine.stats()
    t0 = time.perf_counter()
    out = [r.token_ids for r in engine.generate(prompts, max_new_tokens=new)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds, after = time.perf_counter() - t0, engine.stats()
    spec = {k: after.speculative[k] - before.speculative[k] for k in ("proposed", "accepted")} \
        if after.speculative else {}
    return seconds, out, {"steps": after.steps - before.steps, **spec}


def run_speculative(model, plan: SpecPlan, seed: int = 0, compile: bool = True, log=print) -> dict:
    """Run the plan (module docstring) on `model`: the record's "speculative" part, {"setup", "verify", "echo",
    "projection"}. `log(row)` as each row is measured."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(0, V, (length,), generator=g).tolist() for _ in range(n)]

    verify_prompts = {n: prompts(n, plan.context) for n in plan.streams}
    echo_source = prompts(max(plan.echo), plan.echo_prompt) if plan.echo else []
    K = max(plan.ks)
    verify, echo, plain_echo = [], [], {}

    def done(rows: list[dict], engine: str) -> None:
        for r in rows:
            verify.append({"engine": engine, **r})
            log(verify[-1])

    if plan.streams:
        with _engine(model, plan, plan.streams, None, compile) as engine:
            for n in plan.streams:
                _warm(engine, n, [])
                done(run_windows(engine, verify_prompts[n], [0], window_tokens(plan, n, 1, 0), plan.steps,
                                 plan.settle, host_top=plan.host_top, trace=_trace(plan, "plain", n)), "plain")
        del engine  # (its cache and graphs go before the next engine's are made)
        with _engine(model, plan, plan.streams, {"method": "ngram", "num_tokens": K}, compile) as engine:
            with forced_drafts() as forced:
                for n in plan.streams:
                    _warm(engine, n, plan.ks)
                    done(run_windows(engine, verify_prompts[n], [0, *plan.ks],
                                     window_tokens(plan, n, 1 + len(plan.ks), K), plan.steps, plan.settle,
                                     forced=forced, host_top=plan.host_top, trace=_trace(plan, "ngram", n)),
                         "ngram, forced drafts")
        del engine
    if plan.needs_mtp:
        with _engine(model, plan, plan.streams, {"method": "mtp", "num_tokens": plan.mtp_k}, compile) as engine:
            with DraftTimer(engine) as timer:
                for n in plan.streams:
                    _warm(engine, n, [plan.mtp_k])
                    done(run_windows(engine, verify_prompts[n], [plan.mtp_k], window_tokens(plan, n, 1, plan.mtp_k),
                                     plan.steps, plan.settle, timer=timer, host_top=plan.host_top,
                                     trace=_trace(plan, "mtp", n)), "mtp")
    if plan.echo:  # last: the weights become a bigram model's (module docstring)
        bigram_weights(model)
        with _engine(model, plan, plan.echo, None, compile) as engine:
            continuations = [r.token_ids for r in engine.generate(echo_source, max_new_tokens=plan.echo_new)]
            echo_set = echo_prompts(echo_source, continuations)
            plain_echo = {n: _generate(engine, echo_set[:n], plan.echo_new) for n in plan.echo}
        del engine
        with _engine(model, plan, plan.echo, {"method": "ngram", "num_tokens": K}, compile) as engine:
            for n in plan.echo:  # real prompt lookup
                echo.append(_echo_row(n, plain_echo[n], _generate(engine, echo_set[:n], plan.echo_new),
                                      continuations[:n], len(echo_set[0])))
                log(echo[-1])
        del engine
    plain = {r["streams"]: r["step_ms"] for r in verify if r["engine"] == "plain"}
    for r in verify:
        r["vs_plain"] = round(r["step_ms"] / plain[r["streams"]], 3)
    return {"setup": {**asdict(plan), "forced": FORCED, "published": PUBLISHED}, "verify": verify, "echo": echo,
            "projection": projections(verify, plan)}


def bench_part(model, plan: SpecPlan, seed: int, record: dict, json_path: str | None) -> str:
    """run_speculative for tools.bench: each row printed as a JSON line and, with json_path, the record so far
    written there (a run cut short keeps its rows); the part goes into record["speculative"]. Returns its tables."""
    import json

    from tqdm.auto import tqdm

    from metrale_graph.tools.files import write_whole

    rows = []

    def row_done(row: dict) -> None:
        rows.append(row)
        tqdm.write(json.dumps(row))
        if json_path:
            write_whole(json_path, json.dumps({**record, "speculative_rows_so_far": rows}, indent=1))

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    record["speculative"] = run_speculative(model, plan, seed, log=row_done)
    return render(record["speculative"])


def _echo_row(n: int, plain, spec, continuations, prompt_tokens: int) -> dict:
    (plain_s, plain_out, plain_stats), (spec_s, spec_out, spec_stats) = plain, spec
    new = sum(len(o) for o in spec_out)
    echoed = sum(a == b for o, c in zip(plain_out, continuations) for a, b in zip(o, c))
    return {"streams": n, "prompt_tokens": prompt_tokens, "new_tokens": new // n,
            "plain_s": round(plain_s, 3), "plain_tok_s": round(sum(map(len, plain_out)) / plain_s, 1),
            "ngram_s": round(spec_s, 3), "ngram_tok_s": round(new / spec_s, 1), "speedup": round(plain_s / spec_s, 3),
            "plain_steps": plain_stats["steps"], "ngram_steps": spec_stats["steps"],
            "proposed": spec_stats["proposed"], "accepted": spec_stats["accepted"],
            "acceptance": round(spec_stats["accepted"] / spec_stats["proposed"], 3) if spec_stats["proposed"] else None,
            "same_output": sum(a == b for a, b in zip(plain_out, spec_out)) / n,
            "echoed": round(echoed / sum(map(len, plain_out)), 3)}


def projections(verify: list[dict], plan: SpecPlan, published: dict = PUBLISHED) -> list[dict]:
    """Projections per stream count (PUBLISHED's acceptance) from the steps measured at its k: the MTP engine's step
    (verify and draft as they ran together), and the forced verify step plus the MTP engine's draft ms per step
    (the two measured costs added); the forced verify step alone (draft excluded) where the MTP engine did not run
    at that k; none where nothing ran at that k."""
    k, out = published["num_tokens"], []
    for n in plan.streams:
        rows = {(r["engine"], r["k"]): r for r in verify if r["streams"] == n}
        plain, mtp, forced = rows[("plain", 0)]["step_ms"], rows.get(("mtp", k)), rows.get(("ngram, forced drafts", k))
        steps = []
        if mtp is not None:
            steps.append(("MTP engine step", mtp["step_ms"]))
        if forced is not None and mtp is not None:
            steps.append(("forced verify + MTP draft", round(forced["step_ms"] + mtp["draft_ms_per_step"], 3)))
        elif forced is not None:
            steps.append(("forced verify step (no draft)", forced["step_ms"]))
        out += [{**project(n, ms, plain, published), "from": source} for source, ms in steps]
    return out
