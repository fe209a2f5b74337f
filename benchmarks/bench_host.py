"""The host work of one decode step, without its kernels: tools.bench's D1 / D32 / D128 path
(`GraphRunner.prefill` of one-token streams on slots holding `--cached` tokens each, the cache restored
before every call) with the compiled step replaced by a no-op, so what is timed is everything the host
does around the step: the checks, validation, KV-block growth (after 2048 cached tokens every stream
takes a new block, as in tools.bench), packing, the static buffers' fill, the commit, the logits.
`--engine` times the Engine loop's decode steps instead (scheduling, that prefill, greedy sampling,
stop checks, delivery; a new block every 64 steps per stream, as in serving), from inside its loop
thread. Runs on the CPU, on the tiny preset (the host's bookkeeping does not depend on the model's
size), one torch thread, the garbage collector paused while timing; median and minimum per step of
`--repeat` steps. On a GPU the same work also launches the step's copies and kernels, so it costs
more there; this measures what grows with the stream count.

    python benchmarks/bench_host.py [--streams 1,32,128,256] [--cached 2048] [--repeat 50] [--engine]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch

from metrale_graph import PRESETS, HybridModel, Stream
from metrale_graph.tools.flags import positive_int, positive_ints
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table

BUDGET = 2048  # the engine's token budget: its prompts are prefilled in steps of this many tokens


@contextlib.contextmanager
def _no_collection():
    """The garbage collector paused: a collection's cost is the whole process's (here mostly the cache
    snapshots'), not the step's."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _no_op_step(vocab: int, streams: int):
    """A stand-in for the compiled step (cache, batch) -> logits: rows of one buffer, written by nothing."""
    out = torch.zeros(streams, vocab)

    def step(cache, batch):
        return out[:batch.num_streams]

    return step


def _no_op_runner(runner) -> None:
    """Replace a GraphRunner's compiled steps (before it compiles anything) by a no-op."""
    widest = max(e.batch.num_streams for e in runner.entries.values())
    runner.step = runner.step_one_stream = _no_op_step(runner.model.config.vocab_size, widest)


def runner_step_ms(model, streams: int, cached: int, repeat: int, warmup: int = 3) -> list[float]:
    """ms of each of `repeat` calls of GraphRunner.prefill (no-op step, graphs off) of `streams` one-token
    streams on slots holding `cached` tokens each, the cache restored before every call (tools.bench's
    decode workloads)."""
    from metrale_graph.capture import GraphRunner
    from metrale_graph.protocol import prefill_call

    cache = model.new_cache(num_slots=streams, num_blocks=streams * -(-(cached + 1) // 64), max_context=cached + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    context = [Stream(i, torch.randint(0, vocab, (cached,), generator=gen)) for i in range(streams)]
    step = _no_op_step(vocab, streams)
    with prefill_call(model, cache, context) as call:  # the context's bookkeeping, through the same protocol
        call.run(lambda batch: step(cache, batch))
    snapshot = cache.snapshot()
    runner = GraphRunner(model, cache, [streams], [streams], use_graphs=False)
    _no_op_runner(runner)
    decode = [Stream(i, torch.randint(0, vocab, (1,), generator=gen)) for i in range(streams)]
    times = []
    for i in range(warmup + repeat):
        cache.restore(snapshot)
        with _no_collection():
            t0 = time.perf_counter()
            runner.prefill(decode)
            t1 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0) * 1e3)
    return times


def engine_step_ms(model, streams: int, cached: int, repeat: int, warmup: int = 3) -> list[float]:
    """ms of each of `repeat` Engine loop steps in which all `streams` requests decode (prompts of `cached`
    tokens, a no-op step: greedy, every new token 0), timed in the loop thread."""
    from metrale_graph import Engine

    budget = max(streams, BUDGET)
    # the first requests decode while the last prompts are prefilled: enough new tokens for every request to
    # decode warmup + repeat times once all of them do
    new_tokens = -(-streams * cached // budget) + warmup + repeat + 1
    engine = Engine(model, num_slots=streams, max_context=cached + new_tokens + 1, token_budget=budget,
                    batch_sizes=[streams], token_counts=[streams, budget], stop_token_ids=[])
    _no_op_runner(engine.runner)
    loop = engine._loop
    sched, times, inner = loop.scheduler, [], loop._step

    def timed_step():
        decoding = not sched.waiting and all(r.prefilled for r in sched.running)
        t0 = time.perf_counter()
        inner()
        if decoding and len(sched.running) == streams:  # (a step ending requests is not one of them)
            times.append((time.perf_counter() - t0) * 1e3)

    loop._step = timed_step
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (cached,), generator=gen).tolist() for _ in range(streams)]
    with engine, _no_collection():
        engine.generate(prompts, max_new_tokens=new_tokens)
    return times[warmup:warmup + repeat]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_host.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=positive_ints, default=[1, 32, 128, 256], help="decode streams per step")
    p.add_argument("--cached", type=positive_int, default=2048, help="tokens cached per stream before the step")
    p.add_argument("--repeat", type=positive_int, default=50, help="timed steps (median, minimum)")
    p.add_argument("--engine", action="store_true", help="time the Engine loop's decode steps instead")
    args = p.parse_args(argv)
    cfg = PRESETS["tiny"]
    extra = (-(-max(args.streams) * args.cached // BUDGET) + args.repeat + 5) if args.engine else 1
    if args.cached + extra > cfg.max_position_embeddings:
        p.error(f"--cached {args.cached}{' with --engine and --repeat ' + str(args.repeat) if args.engine else ''}: "
                f"streams of {args.cached + extra} tokens, past the tiny preset's max_position_embeddings "
                f"{cfg.max_position_embeddings}")
    model = HybridModel.from_preset(cfg, seed=0)
    measure = engine_step_ms if args.engine else runner_step_ms
    rows, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # the host work is one thread's; more only add scheduling noise
    try:
        with torch.no_grad():
            for n in args.streams:
                times = measure(model, n, args.cached, args.repeat)
                median = statistics.median(times)
                rows.append({"streams": n, "median_ms": round(median, 4), "min_ms": round(min(times), 4),
                             "per_stream_us": round(median / n * 1e3, 2)})
    finally:
        torch.set_num_threads(threads)
    print_table(["streams", "host ms / step (median)", "min ms", "us / stream"],
                [[str(r["streams"]), f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}", f"{r['per_stream_us']:.1f}"]
                 for r in rows])
    print_json({"tool": "bench_host", "path": "engine" if args.engine else "runner", "cached": args.cached,
                "repeat": args.repeat, **provenance(), "results": rows})


if __name__ == "__main__":
    main()
