"""The main job: a batched varlen prefill, then a continuation of some of its streams, on a
model (default: the embedded `tiny` preset, no download). Prints each stream's top next token
and the prefill throughput; ends with one JSON line.

    python -m metrale_graph.tools.prefill [--model PRESET|FOLDER] [--lengths 37,64,130,5] ...
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from metrale_graph import Stream
from metrale_graph.tools.distributed import end_tensor_parallel, start_run
from metrale_graph.tools.flags import add_model_args, non_negative_int, positive_int, positive_ints
from metrale_graph.tools.loading import load_model, model_config, sync
from metrale_graph.tools.report import ends_quietly, print_json, print_table, progress_bar


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--lengths", type=positive_ints, default="37,64,130,5,200,1",
                   help="comma-separated token counts of the first batch's streams (default %(default)s)")
    p.add_argument("--continue-tokens", type=non_negative_int, default=16,
                   help="new tokens for each of the first half of the streams in a second call (default 16; 0: skip)")
    p.add_argument("--repeat", type=positive_int, default=5,
                   help="timed runs of the first batch for throughput, after one untimed run (default 5)")
    args = p.parse_args(argv)

    lengths = args.lengths
    num_continued = max(1, len(lengths) // 2)  # the second call continues the first half of the streams
    longest = max(n + (args.continue_tokens if i < num_continued else 0) for i, n in enumerate(lengths))
    limit = model_config(args).max_position_embeddings  # checked before the (possibly long) model load
    if longest > limit:
        p.error(f"--lengths / --continue-tokens: a stream of {longest} tokens exceeds the model's "
                f"max_position_embeddings ({limit})")
    run = start_run(args, p)
    with run.silence_other_ranks():
        _prefill(p, args, run, num_continued)


def _prefill(p, args, run, num_continued: int) -> None:
    lengths = args.lengths
    t0 = time.perf_counter()
    model = load_model(args, p, run)
    print(f"model: {args.model}  {model.extra_repr()}  (built in {time.perf_counter() - t0:.2f} s)")
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    token_lists = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    slots = [2 * i + 1 for i in range(len(lengths))]  # any slots; not 0..B-1
    num_slots = 2 * len(lengths) + 2
    blocks = sum(-(-(n + args.continue_tokens) // 64) for n in lengths) + 4

    # throughput of the first batch (fresh cache each run; the first run warms up)
    times = []
    for _ in progress_bar(range(args.repeat + 1), run, desc="timed prefills", unit="run"):
        cache = model.new_cache(num_slots, blocks)
        sync(model.device)
        t = time.perf_counter()
        logits = model.prefill(cache, [Stream(s, tok) for s, tok in zip(slots, token_lists)])
        sync(model.device)
        times.append(time.perf_counter() - t)
    ms = statistics.median(times[1:]) * 1e3
    total = sum(lengths)

    rows = []
    top = logits.float().max(-1)
    for s, n, tok, val in zip(slots, lengths, top.indices.tolist(), top.values.tolist()):
        rows.append(["first", s, 0, n, tok, f"{val:.4f}"])
    cont = []
    if args.continue_tokens > 0:
        cont_slots = slots[:num_continued]
        extra = [torch.randint(0, vocab, (args.continue_tokens,), generator=gen) for _ in cont_slots]
        ctx = [cache.context_lens[s] for s in cont_slots]
        logits2 = model.prefill(cache, [Stream(s, t) for s, t in zip(cont_slots, extra)])
        top2 = logits2.float().max(-1)
        for s, c, tok, val in zip(cont_slots, ctx, top2.indices.tolist(), top2.values.tolist()):
            rows.append(["continue", s, c, args.continue_tokens, tok, f"{val:.4f}"])
            cont.append({"slot": s, "context": c, "top_token": tok})
    print_table(["call", "slot", "context", "new tokens", "top token", "logit"], rows)
    print(f"\nfirst batch: {len(lengths)} streams, {total} tokens, median {ms:.2f} ms over {args.repeat} runs "
          f"-> {total / ms * 1e3:,.0f} tokens/s  ({model.dtype}, {model.device})")
    print_json({"tool": "prefill", "tp": args.tp, "model": args.model, "device": str(model.device),
                "dtype": str(model.dtype),
                "streams": len(lengths), "tokens": total, "median_ms": round(ms, 3),
                "tokens_per_s": round(total / ms * 1e3, 1),
                "top_tokens": top.indices.tolist(), "continued": cont})


def cli() -> None:
    """The console script and `python -m`: main(), then the end of a --tp run (tools.distributed)."""
    with ends_quietly():
        main()
    end_tensor_parallel()


if __name__ == "__main__":
    cli()
