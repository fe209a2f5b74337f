"""Text generation with the Engine (continuous batching over the captured prefill step): streams
the new tokens as they come, then prints the time to first token and tokens/s; ends with one
JSON line.

    python -m metrale_graph.tools.generate [--model tiny|FOLDER] [--prompt TEXT_OR_IDS]... [--max-new-tokens 32]
                                           [--temperature 0] [--top-k 0] [--top-p 1.0] [--seed 0] [--num-slots 8]

--prompt is text when the model folder has a tokenizer, else comma-separated token ids (the
default `tiny` preset has none); repeat it for several prompts, generated as one batch. One
prompt streams token by token; several print each request as it finishes.
"""

from __future__ import annotations

import argparse
import time

import torch

from metrale_graph.tools.distributed import end_tensor_parallel, start_run
from metrale_graph.tools.flags import (INT_TEXT, add_model_args, non_negative_float, non_negative_int, positive_int,
                                       probability)
from metrale_graph.tools.loading import load_model, model_config
from metrale_graph.tools.report import print_json


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seed_help="seed of random preset weights and of sampling (request i draws from seed + i)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt: text with a tokenizer, else comma-separated token ids (repeatable; "
                        "default: 'The capital of France is' or 1,2,3,4,5)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="0: off (default)")
    p.add_argument("--top-p", type=probability, default=1.0, help="1.0: off (default)")
    p.add_argument("--num-slots", type=positive_int, default=8, help="cache slots (concurrent requests)")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help="most tokens (prompt + new) per request, at most the model's max_position_embeddings "
                        "(default: min(model's, 4096))")
    p.add_argument("--token-budget", type=positive_int, default=None,
                   help="most tokens per step, from --num-slots to --num-slots x max context "
                        "(default: max(2048, slots))")
    p.add_argument("--eager", action="store_true", help="run model.prefill eagerly (no compile, no graphs)")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile / capture buckets on first use instead of before timing")
    return p, p.parse_args(argv)


def _prompts(p, args, tokenizer):
    texts = args.prompt or (["The capital of France is"] if tokenizer is not None else ["1,2,3,4,5"])
    if tokenizer is not None:
        return texts
    prompts = []
    for text in texts:
        items = text.split(",") if text.strip() else []  # "": an empty prompt, which the engine names
        if not all(INT_TEXT.fullmatch(x) for x in items if x.strip()):
            p.error(f"--prompt {text!r}: this model has no tokenizer; give comma-separated token ids")
        if not all(x.strip() for x in items):
            p.error(f"--prompt {text!r}: an empty token id between commas; give comma-separated token ids")
        prompts.append([int(x) for x in items])
    return prompts


def _check_sizes(p, args) -> None:
    """--max-context and --token-budget against what the model and a step can hold, before the model loads
    (the cache, the bucket grid and their buffers are sized by them)."""
    from metrale_graph.engine import DEFAULT_MAX_CONTEXT

    limit = model_config(args).max_position_embeddings
    if args.max_context is not None and args.max_context > limit:
        p.error(f"--max-context {args.max_context} exceeds the model's max_position_embeddings ({limit})")
    if args.max_context == 1:
        p.error("--max-context 1 leaves no room for a new token after a prompt: give at least 2")
    max_context = args.max_context or min(limit, DEFAULT_MAX_CONTEXT)
    if args.token_budget is not None and args.token_budget < args.num_slots:
        p.error(f"--token-budget {args.token_budget} must be at least num_slots (--num-slots {args.num_slots}): "
                "every running request feeds one token per step")
    if args.token_budget is not None and args.token_budget > args.num_slots * max_context:
        p.error(f"--token-budget {args.token_budget}: a step never holds more than --num-slots x max context "
                f"({args.num_slots} x {max_context} = {args.num_slots * max_context}) tokens")


def _out_of_memory(e: BaseException) -> bool:
    """An allocation the device (or a size torch can express) could not hold."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text or "Overflow when unpacking" in text


def main(argv=None) -> None:
    from metrale_graph.tokenizer import has_tokenizer_files

    p, args = _parse_args(argv)
    _check_sizes(p, args)
    if not has_tokenizer_files(args.model):  # a preset, or a folder without one: --prompt must be ids, checked now
        _prompts(p, args, None)
    run = start_run(args, p)
    with run.silence_other_ranks():
        _generate(p, args, run)


def _generate(p, args, run) -> None:
    from metrale_graph import Engine

    t0 = time.perf_counter()
    model = load_model(args, p, run)
    try:
        engine = Engine(model, num_slots=args.num_slots, max_context=args.max_context,
                        token_budget=args.token_budget, compile=not args.eager)
    except ValueError as e:
        p.error(str(e))
    except (RuntimeError, TypeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not _out_of_memory(e):
            raise
        p.error(f"--num-slots {args.num_slots} / --max-context / --token-budget: the cache does not fit in the "
                f"memory of {model.device} ({str(e).splitlines()[0]})")
    prompts = _prompts(p, args, engine.tokenizer)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed)
    try:  # every request is checked now (stream checks its arguments when called), before the warmup compiles
        engine.stream(prompts, **kwargs).close()
    except ValueError as e:
        p.error(str(e))
    print(f"model: {args.model}  {model.extra_repr()}  (built in {time.perf_counter() - t0:.2f} s)\n{engine}")
    if not args.no_warmup:
        t = time.perf_counter()
        engine.warmup()
        what = "eager" if engine.runner is None else f"{len(engine.runner.grid)} buckets"
        print(f"warmup ({what}): {time.perf_counter() - t:.1f} s")

    single, shown = len(prompts) == 1, [""]
    stream = engine.stream(prompts, **kwargs)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    reasons: dict[int, str] = {}
    start = time.perf_counter()
    first = None
    for index, token, reason in stream:
        first = first if first is not None else time.perf_counter() - start
        outputs[index].append(token)
        if reason is not None:
            reasons[index] = reason
        if single:
            _show_piece(engine, outputs[index], shown)
        elif reason is not None:
            print(f"[{index}] ({reason}) {_render(engine, outputs[index])}", flush=True)
    elapsed = time.perf_counter() - start
    if single:
        print(flush=True)
    new = sum(len(o) for o in outputs.values())
    print(f"\n{len(prompts)} prompt(s), {new} new tokens in {elapsed:.3f} s: time to first token "
          f"{first * 1e3:.1f} ms, {new / elapsed:,.1f} tokens/s ({model.dtype}, {model.device})")
    print_json({"tool": "generate", "tp": args.tp, "model": args.model, "device": str(model.device),
                "dtype": str(model.dtype),
                "prompts": len(prompts), "new_tokens": new, "token_ids": [outputs[i] for i in sorted(outputs)],
                "texts": [engine.decode(outputs[i]) for i in sorted(outputs)],
                "finish_reasons": [reasons[i] for i in sorted(outputs)],
                "ttft_ms": round(first * 1e3, 3), "elapsed_s": round(elapsed, 4),
                "tokens_per_s": round(new / elapsed, 1)})


def _render(engine, ids: list[int]) -> str:
    text = engine.decode(ids)
    return text if text is not None else ",".join(map(str, ids))


def _show_piece(engine, ids: list[int], shown: list[str]) -> None:
    """Print what the new token adds to the text (ids when there is no tokenizer); a partial UTF-8
    character waits for the next token."""
    text = engine.decode(ids)
    if text is None:
        print(("," if len(ids) > 1 else "") + str(ids[-1]), end="", flush=True)
        return
    if text.endswith("\ufffd") or not text.startswith(shown[0]):
        return
    print(text[len(shown[0]):], end="", flush=True)
    shown[0] = text


def cli() -> None:
    """The console script and `python -m`: main(), then the end of a --tp run (tools.distributed)."""
    main()
    end_tensor_parallel()


if __name__ == "__main__":
    cli()
