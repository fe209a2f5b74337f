"""Text generation with the Engine (continuous batching over the captured prefill step): streams
the new tokens as they come, then prints the time to first token and tokens/s; ends with one
JSON line.

    python -m metrale_graph.tools.generate [--model tiny|FOLDER] [--prompt TEXT_OR_IDS]... [--max-new-tokens 32]
                                           [--temperature 0] [--top-k 0] [--top-p 1.0] [--seed 0] [--num-slots 8]
                                           [--speculative mtp:3 | ngram | '{"method": ..., ...}']

--prompt is text when the model folder has a tokenizer, else comma-separated token ids (the
default `tiny` preset has none); repeat it for several prompts, generated as one batch. One
prompt streams token by token; several print each request as it finishes. With --speculative (vLLM's
--speculative-config JSON or METHOD[:K]) the figures add the drafts' acceptance: proposed, accepted, and
tokens per stream and verify step. Ctrl-C ends the run with
one line on standard error and the text produced so far (exit code 130).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from metrale_graph.tools.distributed import end_tensor_parallel, start_run
from metrale_graph.tools.flags import (INT_TEXT, add_engine_args, add_model_args, add_speculative_arg, non_negative_float,
                                       non_negative_int, positive_int, probability)
from metrale_graph.tools.loading import build_engine, check_engine_sizes, check_speculative_model, load_model
from metrale_graph.tools.report import (bars_shown, ends_quietly, print_json, speculative_figures,
                                        speculative_line)


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seed_help="seed of random preset weights and of sampling (request i draws from seed + i)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt: text with a tokenizer, else comma-separated token ids (repeatable; "
                        "default: 'The capital of France is' or 1,2,3,4,5)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32,
                   help="new tokens per prompt at most (default 32); a request ends sooner at a stop token or at "
                        "--max-context")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="0: off (default)")
    p.add_argument("--top-p", type=probability, default=1.0, help="1.0: off (default)")
    add_engine_args(p, num_slots=8)
    add_speculative_arg(p, "--speculative")
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


class _Produced:
    """What a run has produced so far, for the report of a Ctrl-C: the stage it is in, each request's new
    tokens, the finished ones, and what of a single request's stream is printed (its line is open until
    the stream ends)."""

    def __init__(self):
        self.stage = "loading the model"
        self.engine = None
        self.outputs: dict[int, list[int]] = {}
        self.reasons: dict[int, str] = {}
        self.start = None
        self.streaming = False
        self.shown_ids = 0  # tokens of the streamed request printed (as ids: no tokenizer)
        self.shown_text = ""  # its text printed (with a tokenizer)

    def show(self, ids: list[int], final: bool = False) -> None:
        """Print what the streamed request's tokens `ids` add to what is printed already (ids when there is
        no tokenizer); a partial UTF-8 character waits for the next token, unless `final` (the stream has ended:
        what is left, as the result's text has it)."""
        text = self.engine.decode(ids)
        if text is None:
            if len(ids) == self.shown_ids:
                return
            piece = ("," if self.shown_ids else "") + ",".join(map(str, ids[self.shown_ids:]))
            self.shown_ids = len(ids)
        elif (text.endswith("\ufffd") and not final) or not text.startswith(self.shown_text):
            return
        else:
            piece, self.shown_text = text[len(self.shown_text):], text
        # the print last: a Ctrl-C lands after it (signals are handled between bytecodes), never between it
        # and the update, which would print the piece again
        print(piece, end="", flush=True)


def main(argv=None) -> None:
    from metrale_graph.tokenizer import has_tokenizer_files

    p, args = _parse_args(argv)
    check_engine_sizes(p, args)
    check_speculative_model(p, args, "--speculative")
    if not has_tokenizer_files(args.model):  # a preset, or a folder without one: --prompt must be ids, checked now
        _prompts(p, args, None)
    run = start_run(args, p)
    produced = _Produced()
    with run.silence_other_ranks():
        try:
            _generate(p, args, run, produced)
        except KeyboardInterrupt:
            _interrupted(produced)


def _generate(p, args, run, produced: _Produced) -> None:
    t0 = time.perf_counter()
    model = load_model(args, p, run)
    engine = build_engine(p, args, model, speculative=args.speculative)
    produced.engine = engine
    prompts = _prompts(p, args, engine.tokenizer)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed)
    try:  # every request is checked now (stream checks its arguments when called), before the warmup compiles
        engine.stream(prompts, **kwargs).close()
    except ValueError as e:
        p.error(str(e))
    print(f"model: {args.model}  {model.extra_repr()}  (built in {time.perf_counter() - t0:.2f} s)\n{engine}",
          flush=True)
    if not args.no_warmup:
        produced.stage = "warming up"
        t = time.perf_counter()
        engine.warmup(progress=bars_shown(run))  # a bar per bucket compiled (and captured on CUDA)
        what = "eager" if engine.runner is None else f"{len(engine.runner.grid)} buckets"
        print(f"warmup ({what}): {time.perf_counter() - t:.1f} s", flush=True)

    produced.stage = "generating"
    single = produced.streaming = len(prompts) == 1
    outputs, reasons = produced.outputs, produced.reasons
    outputs.update({i: [] for i in range(len(prompts))})
    before = engine.stats().speculative  # (the warmup's and the checks' steps left out)
    stream = engine.stream(prompts, **kwargs)
    start = produced.start = time.perf_counter()
    first = None
    try:
        for index, token, reason in stream:
            first = first if first is not None else time.perf_counter() - start
            outputs[index].append(token)
            if reason is not None:
                reasons[index] = reason
            if single:
                produced.show(outputs[index])
            elif reason is not None:
                print(f"[{index}] ({reason}) {_render(engine, outputs[index])}", flush=True)
    finally:
        stream.close()
    elapsed = time.perf_counter() - start
    if single:
        produced.show(outputs[0], final=True)  # a partial character the last token left
        print(flush=True)
        produced.streaming = False
    new = sum(len(o) for o in outputs.values())
    print(f"\n{len(prompts)} prompt(s), {new} new tokens in {elapsed:.3f} s: time to first token "
          f"{first * 1e3:.1f} ms, {new / elapsed:,.1f} tokens/s ({model.dtype}, {model.device})")
    speculative = speculative_figures(engine.stats().speculative, before)
    if speculative is not None:
        print(speculative_line(speculative))
    print_json({"tool": "generate", "tp": args.tp, "model": args.model, "device": str(model.device),
                "dtype": str(model.dtype),
                "prompts": len(prompts), "new_tokens": new, "token_ids": [outputs[i] for i in sorted(outputs)],
                "texts": [engine.decode(outputs[i]) for i in sorted(outputs)],
                "finish_reasons": [reasons[i] for i in sorted(outputs)],
                "ttft_ms": round(first * 1e3, 3), "elapsed_s": round(elapsed, 4),
                "tokens_per_s": round(new / elapsed, 1), "speculative": speculative})


def _interrupted(produced: _Produced) -> None:
    """After a Ctrl-C: the text of each request not printed yet (a streamed line is ended), then one line on
    standard error saying where the run was; exit code 130 (128 + SIGINT), no traceback."""
    if produced.streaming:
        produced.show(produced.outputs[0], final=True)  # a token sampled but not printed yet
        print(flush=True)
    elif produced.engine is not None:
        for index in sorted(produced.outputs):
            if index not in produced.reasons and produced.outputs[index]:
                print(f"[{index}] (interrupted) {_render(produced.engine, produced.outputs[index])}")
    new = sum(len(o) for o in produced.outputs.values())
    done = (f": {new} new token{'s' if new != 1 else ''} in {time.perf_counter() - produced.start:.1f} s"
            if produced.start is not None else "; no tokens generated")
    sys.stdout.flush()
    print(f"interrupted (Ctrl-C) while {produced.stage}{done}", file=sys.stderr, flush=True)
    raise SystemExit(130)


def _render(engine, ids: list[int]) -> str:
    text = engine.decode(ids)
    return text if text is not None else ",".join(map(str, ids))


def cli() -> None:
    """The console script and `python -m`: main(), then the end of a --tp run (tools.distributed). After a
    Ctrl-C, another one while the process exits is ignored (it would interrupt the interpreter's
    finalization, which prints a traceback)."""
    try:
        with ends_quietly():
            main()
    except SystemExit as e:
        if e.code == 130:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise
    end_tensor_parallel()


if __name__ == "__main__":
    cli()
