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

`--mtp K` times the Engine loop's speculative "mtp" verify steps instead (K drafts a step, prefix caching on,
requests streaming text through a byte-level BPE, with `--stop` the stop strings "\\n\\n" and "END" too): the
model runs eagerly (the tiny preset with an MTP layer, a bigram model whose head drafts what it decodes, so
every draft is kept) and the step's model calls are timed apart, leaving its host work; beside it the host's
stop checks of the step: MtpDrafter.catch_up_ending (which requests the delivery ends), stops.kept_counts (where
a request stops inside its kept drafts) and the delivery (the loop's _advance per token: the text, the outputs).

    python benchmarks/bench_host.py [--streams 1,32,128,256] [--cached 2048] [--repeat 50] [--engine]
    python benchmarks/bench_host.py --mtp 2 [--stop] --cached 64 [--streams 1,32,128] [--repeat 50]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import time

import torch

from metrale_graph import PRESETS, HybridModel, Stream
from metrale_graph.tools.flags import positive_int, positive_ints
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table

BUDGET = 2048  # the engine's token budget: its prompts are prefilled in steps of this many tokens
STOP = ["\n\n", "END"]  # --stop's stop strings (a blank line, a word), which the bigram model's text never holds
# --mtp's tokenizer's training text (no line breaks: its merges never make a stop string)
CORPUS = ("A verify step checks the drafts a head proposed against the model's own tokens, keeps the ones that "
          "agree and adds one more. Before the step's tokens reach their requests, the host asks which of them will "
          "stop: a stop token, the most tokens a request may have, a stop string in the text they add. The text "
          "comes from an incremental detokenizer, which decodes a short window of recent tokens and sends what the "
          "newest ones add once they end in a whole character. Streams of many requests share each step, so every "
          "microsecond spent per request and per token is paid again for each of them, at every step, by all.")


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


def _text_tokenizer(vocab: int):
    """A byte-level BPE (Qwen's kind) of at most `vocab` tokens trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@torch.no_grad()
def _bigram_mtp_model(vocab: int) -> HybridModel:
    """The tiny preset with an MTP layer and a vocabulary of `vocab`, made a bigram model whose head drafts what it
    decodes (tools.bench_speculative.bigram_weights; the head's fc passing the embedding half, its embedding norm
    the identity, its final norm the model's; as tests/speculative_reference.bigram_model)."""
    from metrale_graph.tools.bench_speculative import bigram_weights

    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=vocab, mtp_num_hidden_layers=1)
    model = HybridModel.from_preset(cfg, seed=0)
    bigram_weights(model)
    D = cfg.hidden_size
    model.mtp.fc.weight.zero_()
    model.mtp.fc.weight[:, :D].copy_(torch.eye(D))
    model.mtp.pre_fc_norm_embedding.weight.zero_()
    model.mtp.norm.weight.copy_(model.norm.weight)
    return model


def mtp_step_ms(streams: int, cached: int, repeat: int, k: int, stop: bool, warmup: int = 5) -> dict:
    """Per Engine loop step in which all `streams` requests decode with k MTP drafts each (`--mtp`, the module
    docstring; prompts of `cached` tokens): ms of the whole step ("step") and of its model calls ("model": the main
    model's hidden states, the logits, the MTP head), and of its stop checks ("catch_up_ending", "kept_counts",
    "deliver"); lists of `repeat` steps each."""
    from metrale_graph import Engine
    from metrale_graph.speculative import drafting, verify

    tok = _text_tokenizer(PRESETS["tiny"].vocab_size)
    model = _bigram_mtp_model(len(tok))
    new_tokens = (warmup + repeat + 8 + -(-streams * cached // BUDGET)) * (k + 1)
    engine = Engine(model, num_slots=streams, max_context=cached + new_tokens + 1, token_budget=max(streams, BUDGET),
                    compile=False, prefix_cache=True, tokenizer=tok, stop_token_ids=[],
                    speculative={"method": "mtp", "num_tokens": k, "max_streams": streams})
    loop = engine._loop
    sched, spec, times, now = loop.scheduler, loop.spec, {}, {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                now[name] = now.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
        return call

    hooks = [(model, name, "model") for name in ("hidden_states", "logits_of", "head")] + [
        (drafting, "mtp_hidden_states", "model"), (verify, "kept_counts", "kept_counts"),
        (spec.mtp, "catch_up_ending", "catch_up_ending"), (spec, "_deliver", "deliver")]
    real = [getattr(obj, name) for obj, name, _ in hooks]
    for (obj, name, key), fn in zip(hooks, real):
        setattr(obj, name, timed(key, fn))
    inner = loop._step

    def timed_step():
        decoding = not sched.waiting and len(sched.running) == streams and all(r.prefilled for r in sched.running)
        now.clear()
        t0 = time.perf_counter()
        inner()
        if decoding and len(sched.running) == streams and "deliver" in now:  # (a verify step ending no request)
            now["step"] = (time.perf_counter() - t0) * 1e3
            for key in ("step", "model", "catch_up_ending", "kept_counts", "deliver"):
                times.setdefault(key, []).append(now.get(key, 0.0))

    loop._step = timed_step
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, len(tok), (cached,), generator=gen).tolist() for _ in range(streams)]
    try:
        with engine, _no_collection():
            handles = [engine.submit(p, max_new_tokens=new_tokens, stop=STOP if stop else None) for p in prompts]
            ended = [h.result().finish_reason for h in handles]
    finally:
        verify.kept_counts, drafting.mtp_hidden_states = real[4], real[3]
    if len(times.get("step", ())) < warmup + repeat or ended != ["length"] * streams:
        raise RuntimeError(f"{len(times.get('step', ()))} verify steps of {streams} streams timed, "
                           f"{warmup + repeat} wanted (requests ended: {ended})")
    return {key: t[warmup:warmup + repeat] for key, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_host.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=positive_ints, default=[1, 32, 128, 256], help="decode streams per step")
    p.add_argument("--cached", type=positive_int, default=2048, help="tokens cached per stream before the step")
    p.add_argument("--repeat", type=positive_int, default=50, help="timed steps (median, minimum)")
    p.add_argument("--engine", action="store_true", help="time the Engine loop's decode steps instead")
    p.add_argument("--mtp", type=positive_int, default=None, metavar="K",
                   help="time the Engine loop's MTP verify steps of K drafts instead (prefix caching on, text)")
    p.add_argument("--stop", action="store_true", help="with --mtp: the requests have stop strings")
    args = p.parse_args(argv)
    if args.stop and not args.mtp:
        p.error("--stop needs --mtp")
    if args.mtp and args.engine:
        p.error("--mtp times the engine's MTP verify steps: leave --engine out")
    if args.mtp:
        return _main_mtp(args)
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


def _main_mtp(args) -> None:
    rows, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for n in args.streams:
                times = mtp_step_ms(n, args.cached, args.repeat, args.mtp, args.stop)
                med = {key: statistics.median(t) for key, t in times.items()}
                host = statistics.median([s - m for s, m in zip(times["step"], times["model"])])
                rows.append({"streams": n, "step_ms": round(med["step"], 4), "host_ms": round(host, 4),
                             **{f"{key}_us": round(med[key] * 1e3, 1) for key in ("catch_up_ending", "kept_counts",
                                                                                   "deliver")}})
    finally:
        torch.set_num_threads(threads)
    print_table(["streams", "step ms", "host ms", "catch_up_ending us", "(% host)", "kept_counts us", "deliver us"],
                [[str(r["streams"]), f"{r['step_ms']:.3f}", f"{r['host_ms']:.3f}", f"{r['catch_up_ending_us']:.1f}",
                  f"{100 * r['catch_up_ending_us'] / 1e3 / r['host_ms']:.1f}", f"{r['kept_counts_us']:.1f}",
                  f"{r['deliver_us']:.1f}"] for r in rows])
    print_json({"tool": "bench_host", "path": "mtp", "k": args.mtp, "stop": STOP if args.stop else [],
                "cached": args.cached, "repeat": args.repeat, **provenance(), "results": rows})


if __name__ == "__main__":
    main()
