"""Prefix caching's benchmark: three workloads that resend prefixes, run through the Engine with the
prefix cache and without it, side by side (same model, same prompts, greedy): the hit rate (prompt
tokens restored / reusable prompt tokens), time to first token and throughput.

    python -m metrale_graph.tools.bench_prefix [--model tiny|FOLDER|PRESET] [--workloads system,chat,split]
                                               [--scale 1.0] [--num-slots 64] [--json FILE]

Workloads (token counts at --scale 1; --scale multiplies them, and the default checkpoint interval and
token budget with them, and --requests sets how many, for a quick run on a CPU):
  system  a 2048-token shared system prompt + 64 distinct 128-token questions, 32 new tokens each;
          reusable: the system prompt of every request but the first
  chat    32 conversations x 4 turns, each turn adding a 64-token user message to the conversation so
          far (its prompts and answers; 32 new tokens each); reusable: everything but the new message
  split   64 requests sharing their first 1500 tokens, 700 of their own after; reusable: the shared
          part of every request but the first (also 1600 / 600: split-1600)

The checkpoint interval (default 128 x --scale, at least 64 and a multiple of 64: the GDN chunk and the
block size) and token budget (default 2048 x --scale, at least --num-slots) keep a scaled-down run's
shape: a shared part longer than the interval, and a first prompt that fills a step alone, as at scale 1
(with the whole budget a few short prompts would all start in one step, none finding another's prefix).
Both are printed; a shared part still shorter than the interval (below --scale 0.04) is named, since its
workload can have no hits.

One engine per mode runs every workload (warmed once: on a GPU the bucket grid's capture is the slow
part; with --eager one 1-token request, the first step's one-time setup), its prefix cache reset before
each (no prefix from another workload); a workload's requests are submitted together (chat: turn by
turn, every conversation's turn t together). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from metrale_graph.tools.distributed import start_run
from metrale_graph.tools.files import write_whole
from metrale_graph.tools.flags import add_model_args, names_of, output_file, positive_int
from metrale_graph.tools.loading import build_engine, check_engine_sizes, load_model, model_config
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import bars_shown, ends_quietly, print_json, print_table

WORKLOADS = ("system", "chat", "split", "split-1600")
SHARED = {"system": 2048, "split": 1500, "split-1600": 1600}  # each workload's shared prefix at --scale 1
CHUNK = 64  # the GDN chunk (and the Engine's block size here): checkpoint intervals are multiples of it


def scaled_sizes(scale: float, num_slots: int) -> tuple[int, int]:
    """The default (checkpoint interval, token budget) at `scale`: the Engine's defaults (128, 2048) scaled,
    the interval a multiple of CHUNK and at least one, the budget at least num_slots."""
    from metrale_graph.engine import DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_TOKEN_BUDGET

    interval = max(CHUNK, int(DEFAULT_CHECKPOINT_INTERVAL * scale) // CHUNK * CHUNK)
    return interval, max(num_slots, int(DEFAULT_TOKEN_BUDGET * scale))


def _tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (max(n, 1),), generator=gen).tolist()


def system_workload(gen, vocab, scale, requests=64):
    """(waves of prompts, reusable tokens): one wave of requests sharing a system prompt."""
    system = _tokens(gen, int(2048 * scale), vocab)
    questions = [_tokens(gen, int(128 * scale), vocab) for _ in range(requests)]
    return [[system + q for q in questions]], (requests - 1) * len(system)


def split_workload(gen, vocab, scale, requests=64, shared=1500, own=700):
    prefix = _tokens(gen, int(shared * scale), vocab)
    prompts = [prefix + _tokens(gen, int(own * scale), vocab) for _ in range(requests)]
    return [prompts], (requests - 1) * len(prefix)


def run_waves(engine, waves, max_new: int, follow=None) -> dict:
    """Run each wave's prompts together (generate); `follow(wave index, results)` may return the next
    wave (chat's turns depend on the answers). Returns the counters of all the runs."""
    results, ttft, start = [], [], time.perf_counter()
    wave, i = waves[0], 0
    while wave:
        out = engine.generate(wave, max_new_tokens=max_new, stop_token_ids=[])
        results.append((wave, out))
        ttft += [r.first_token_s for r in out]
        i += 1
        wave = follow(i, wave, out) if follow else (waves[i] if i < len(waves) else None)
    wall = time.perf_counter() - start
    prompt = sum(len(p) for wave, _ in results for p in wave)
    new = sum(len(r.token_ids) for _, out in results for r in out)
    cached = sum(r.cached_tokens for _, out in results for r in out)
    return {"wall_s": wall, "prompt_tokens": prompt, "new_tokens": new, "cached_tokens": cached,
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": _quantile(ttft, 0.99),
            "tokens_per_s": (prompt + new) / wall, "results": results}


def chat_workload(gen, vocab, scale, conversations=32, turns=4):
    """The first wave (turn 1 of every conversation) and a function giving each next turn's wave."""
    message = int(64 * scale)
    first = [_tokens(gen, message, vocab) for _ in range(conversations)]
    reusable = [0]

    def follow(i, wave, out):
        if i == turns:
            return None
        nxt = []
        for prompt, r in zip(wave, out):
            history = prompt + r.token_ids
            reusable[0] += len(history)
            nxt.append(history + _tokens(gen, message, vocab))
        return nxt
    return first, follow, reusable


def longest_request(args) -> int:
    """The most tokens (prompt and new) one request of args.workloads holds: the prompts of _tokens' lengths, chat's
    last turn its four messages and four answers (args.max_new_tokens // 2 each)."""
    def n(count: int) -> int:
        return max(int(count * args.scale), 1)

    new = args.max_new_tokens
    need = {"system": n(2048) + n(128) + new, "split": n(1500) + n(700) + new, "split-1600": n(1600) + n(600) + new,
            "chat": 4 * (n(64) + (new // 2 or 1))}
    return max(need[w] for w in args.workloads)


def _quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_workload(engine, workload: str, args) -> dict:
    """One workload's waves on `engine` (its prompts drawn from args.seed: the same in both modes)."""
    gen = torch.Generator().manual_seed(args.seed)
    vocab = engine.model.config.vocab_size
    if workload == "chat":
        first, follow, reusable = chat_workload(gen, vocab, args.scale, args.requests // 2)
        record = run_waves(engine, [first], args.max_new_tokens // 2 or 1, follow)
        record["reusable_tokens"] = reusable[0]
    else:
        waves, reusable = (system_workload(gen, vocab, args.scale, args.requests) if workload == "system" else
                           split_workload(gen, vocab, args.scale, args.requests,
                                          *((1600, 600) if workload == "split-1600" else (1500, 700))))
        record = run_waves(engine, waves, args.max_new_tokens)
        record["reusable_tokens"] = reusable
    record["hit_rate"] = record["cached_tokens"] / record["reusable_tokens"] if record["reusable_tokens"] else None
    return record


COUNTERS = ("lookups", "hits", "hit_tokens", "evicted_blocks", "evicted_checkpoints")


def run_mode(p, model, args, prefix: bool) -> dict[str, dict]:
    """Every workload on one engine (warmed once), with the prefix cache or without; the cache forgets
    every kept prefix before each workload (reset_prefix_cache), so none hits another's. Returns
    workload -> record. Sizes the Engine refuses, or a cache the device cannot hold, end the tool through
    p.error (loading.build_engine)."""
    opts = dict(prefix_cache=prefix)
    if prefix:
        opts["checkpoint_interval"] = args.checkpoint_interval
    if prefix and args.prefix_checkpoints is not None:
        opts["prefix_checkpoints"] = args.prefix_checkpoints
    records = {}
    with build_engine(p, args, model, **opts) as engine:
        # --eager too (one 1-token request): the first step's one-time initialization (about a second on a CPU)
        # would otherwise fall into the first workload's TTFT and throughput
        t = time.perf_counter()
        engine.warmup(progress=bars_shown())  # a bar per bucket compiled (and captured on CUDA), on a terminal only
        print(f"{'with' if prefix else 'without'} the prefix cache: warmup{' (eager)' if args.eager else ''} "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        for w in args.workloads:
            engine.reset_prefix_cache()
            before = engine.stats().prefix
            record = run_workload(engine, w, args)
            after = engine.stats().prefix
            if after is not None:  # this workload's counters, and what the cache holds after it
                after.update({k: after[k] - before[k] for k in COUNTERS})
            record["prefix_stats"] = after
            records[w] = record
            hit = "" if not prefix else f", hit rate {100 * record['hit_rate']:.1f}%"
            # a long run's progress (and what a run stopped early has measured): one line per workload
            print(f"{w} {'with' if prefix else 'without'} the prefix cache: TTFT p50 "
                  f"{record['ttft_p50_s'] * 1e3:.1f} ms, {record['tokens_per_s']:,.0f} tok/s{hit}", flush=True)
    return records


def check_sizes(p, args) -> None:
    """--max-context (its default filled in: the longest request), --token-budget (if given) and --num-slots against
    the model and the workloads, before the model loads: usage errors naming the flag."""
    limit = model_config(args).max_position_embeddings
    need = longest_request(args)
    longest = f"the longest request of {','.join(args.workloads)} holds {need} tokens (prompt and --max-new-tokens)"
    if args.max_context is None and need > limit:
        p.error(f"--scale {args.scale} / --max-new-tokens {args.max_new_tokens}: {longest}, past the model's "
                f"max_position_embeddings ({limit})")
    if args.max_context is not None and args.max_context < need <= limit:
        p.error(f"--max-context {args.max_context}: {longest}; give at least {need}")
    args.max_context = args.max_context or need
    check_engine_sizes(p, args)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.bench_prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, parallel=False)  # one whole model: --tp / --moe-parallel are refused by name below
    p.add_argument("--workloads", type=names_of(WORKLOADS), default=list(WORKLOADS),
                   help=f"comma-separated, out of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every token count (default 1)")
    p.add_argument("--num-slots", type=positive_int, default=64, help="the engines' cache slots (default 64)")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help="most tokens (prompt and new) per request, at least the longest request of --workloads, at "
                        "most the model's max_position_embeddings (default: that longest request)")
    p.add_argument("--token-budget", type=positive_int, default=None,
                   help="tokens per step (default 2048 x --scale, at least --num-slots, at most --num-slots x "
                        "--max-context)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32,
                   help="new tokens per request (chat: half as many per turn; default 32)")
    p.add_argument("--checkpoint-interval", type=positive_int, default=None,
                   help="tokens between a prompt's state checkpoints, a multiple of 64 (default 128 x --scale, "
                        "at least 64)")
    p.add_argument("--prefix-checkpoints", type=positive_int, default=None,
                   help="state checkpoints the prefix cache holds (default: the Engine's, 4 x --num-slots)")
    p.add_argument("--requests", type=positive_int, default=64,
                   help="requests of system and split; chat has half as many conversations (default 64)")
    p.add_argument("--eager", action="store_true", help="model.prefill eagerly (no compile, no graphs)")
    p.add_argument("--json", type=output_file, default=None, help="also write the JSON record to this file")
    args = p.parse_args(argv)
    if args.tp != 1 or args.moe_parallel is not None:  # out of its help (add_model_args(parallel=False))
        p.error("--tp / --moe-parallel: bench_prefix runs one whole model in one process; leave them out")
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")
    if args.requests < 2:
        p.error("--requests must be at least 2 (a prefix is reused from the second request on)")
    if args.checkpoint_interval is not None and args.checkpoint_interval % CHUNK:
        p.error(f"--checkpoint-interval must be a multiple of {CHUNK} (the GDN chunk and the block size), got "
                f"{args.checkpoint_interval}")
    interval, budget = scaled_sizes(args.scale, args.num_slots)
    args.checkpoint_interval = args.checkpoint_interval or interval
    check_sizes(p, args)
    args.token_budget = args.token_budget or min(budget, args.num_slots * args.max_context)  # (a step holds no more)
    print(f"checkpoint interval {args.checkpoint_interval} tokens, token budget {args.token_budget} tokens "
          f"(--scale {args.scale})")
    short = {w: int(SHARED[w] * args.scale) for w in args.workloads
             if w in SHARED and int(SHARED[w] * args.scale) < args.checkpoint_interval}
    if short:
        print(f"note: the shared prefix of {', '.join(f'{w} ({n} tokens)' for w, n in short.items())} is shorter than "
              f"the checkpoint interval ({args.checkpoint_interval}): no checkpoint falls inside it, so those "
              "workloads cannot hit (a larger --scale gives them one)")
    model = load_model(args, p, start_run(args, p))
    offs, ons = run_mode(p, model, args, prefix=False), run_mode(p, model, args, prefix=True)
    rows, records = [], {}
    for w in args.workloads:
        off, on = offs[w], ons[w]
        pairs = [(a.token_ids, b.token_ids) for (_, x), (_, y) in zip(off["results"], on["results"])
                 for a, b in zip(x, y)]
        identical = sum(a == b for a, b in pairs)
        same = identical == len(pairs)
        for r in (off, on):
            del r["results"]
        # (in bf16 a random-weight model's near-tie logits flip a greedy token at any change of batch or
        # chunking, so the counts say how far apart; fp32 runs give the same tokens: tests/test_prefix_cache.py)
        records[w] = {"without": off, "with": on, "same_tokens": same, "requests": len(pairs),
                      "identical_requests": identical, "same_first_token": sum(a[:1] == b[:1] for a, b in pairs)}
        rows.append([w, f"{on['reusable_tokens']:,}", f"{on['cached_tokens']:,}", f"{100 * on['hit_rate']:.1f}%",
                     f"{off['ttft_p50_s'] * 1e3:.1f} / {on['ttft_p50_s'] * 1e3:.1f}",
                     f"{off['ttft_p99_s'] * 1e3:.1f} / {on['ttft_p99_s'] * 1e3:.1f}",
                     f"{off['tokens_per_s']:,.0f} / {on['tokens_per_s']:,.0f}",
                     f"{identical} / {len(pairs)}", f"{records[w]['same_first_token']} / {len(pairs)}"])
    print_table(["workload", "reusable tok", "cached tok", "hit rate", "TTFT p50 ms (off / on)",
                 "TTFT p99 ms (off / on)", "tok/s (off / on)", "same tokens", "same first token"], rows)
    record = {"tool": "bench_prefix", "model": args.model, "scale": args.scale, "num_slots": args.num_slots,
              "checkpoint_interval": args.checkpoint_interval, "token_budget": args.token_budget,
              **provenance(), "workloads": records}
    if args.json:
        import json

        write_whole(args.json, json.dumps(record, indent=1))
    print_json(record)


def cli() -> None:
    with ends_quietly():
        main()


if __name__ == "__main__":
    cli()
