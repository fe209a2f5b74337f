"""A serving benchmark, like vLLM's: N streamed /v1/completions requests against a running server,
random token prompts (token ids: no tokenizer needed), sent at a request rate (Poisson arrivals)
and/or under a fixed concurrency; reports request throughput, output tokens/s, time to first token
(TTFT), inter-token latency (ITL), time per output token (TPOT) and end-to-end latency as a table
and one JSON line.

    python -m metrale_graph.tools.bench_serve --base-url http://127.0.0.1:8000 --num-prompts 256 \\
        --input-len 512 --output-len 256 --max-concurrency 128 [--request-rate 20] [--json FILE]

--input-len / --output-len take N or LO:HI (uniform integers in [LO, HI], drawn per request with
--seed). Requests ask for ignore_eos (vLLM's extension; --no-ignore-eos to stop at eos) so that each
runs to its output length, and return_token_ids so that every streamed token is counted even where
the model has no tokenizer. TTFT is from sending a request to its first token; ITL is the gap
between two events that carry tokens; TPOT is a request's (latency - TTFT) / (tokens - 1). One
request of 1 token is sent first (not timed) to check the server and the model name. A run in which no
request completed (every one failed: the table and JSON line say how) ends with exit code 1.

`--cookbook` runs SGLang's Qwen3.6 cookbook workload instead (8192 prompt tokens, 1024 new, at concurrency
1, 16 and 64, 2 x concurrency requests each, at least 4) and prints each level's TPOT beside SGLang's
published one-H200 figures for Qwen3.6-35B-A3B (MTP speculation on), so ours stand beside theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

from metrale_graph.tools.flags import non_negative_float, output_file, positive_int
from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import bars_shown, ends_quietly, print_json, print_table


def length_range(text: str) -> tuple[int, int]:
    """N or LO:HI, positive integers with LO <= HI."""
    parts = text.split(":")
    try:
        lo, hi = (positive_int(parts[0]), positive_int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except argparse.ArgumentTypeError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected a positive integer N or a range LO:HI (1 <= LO <= HI), got {text!r}")
    return lo, hi


def rate(text: str) -> float:
    """Requests per second: a number > 0, or inf (all at once)."""
    if text.strip().lower() in ("inf", "infinity"):
        return float("inf")
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a request rate > 0 (or inf), got {text!r}")
    return value


# SGLang's Qwen3.6 cookbook, one H200, 8192 in / 1024 out, MTP on: TPOT ms of Qwen3.6-35B-A3B by concurrency
COOKBOOK = {"input_len": 8192, "output_len": 1024, "concurrency": (1, 16, 64),
            "sglang_tpot_ms": {"bf16": {1: 2.23, 16: 8.13}, "fp8": {1: 1.98, 16: 6.20}}}


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.bench_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=positive_int, default=100, help="requests to send (default 100)")
    p.add_argument("--input-len", type=length_range, default=(512, 512), help="prompt tokens: N or LO:HI (default 512)")
    p.add_argument("--output-len", type=length_range, default=(256, 256),
                   help="new tokens per request (max_tokens): N or LO:HI (default 256)")
    p.add_argument("--request-rate", type=rate, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy (default)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="run every request to its output length (default: on)")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="prompt token ids are drawn from [0, N) (default: the server's vocab_size in /v1/models, "
                        "which is also its most)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrival times (default 0)")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds one request may take (default 600)")
    p.add_argument("--cookbook", action="store_true",
                   help="SGLang's cookbook workload (8192 in / 1024 out at concurrency 1, 16, 64) beside its published "
                        "TPOT; replaces --input-len / --output-len / --max-concurrency / --num-prompts / --request-rate")
    p.add_argument("--json", type=output_file, default=None, help="also write the JSON record to this file")
    return p, p.parse_args(argv)


@dataclass
class Record:
    """One request as the client saw it (seconds from its send)."""
    input_len: int
    output_len: int  # asked for
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linearly interpolated as numpy's default; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _model_card(client, args) -> dict:
    """The /v1/models entry of --model (default: the first); SystemExit naming what is wrong."""
    try:
        r = await client.get(f"{args.base_url}/v1/models", headers=_headers(args))
    except Exception as e:
        raise SystemExit(f"cannot reach {args.base_url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise SystemExit(f"GET {args.base_url}/v1/models: HTTP {r.status_code}: {r.text[:300]}")
    cards = r.json().get("data") or []
    if not cards:
        raise SystemExit(f"{args.base_url}/v1/models lists no model")
    card = next((c for c in cards if c.get("id") == args.model), None) if args.model else cards[0]
    if card is None:
        raise SystemExit(f"--model {args.model!r}: the server serves {', '.join(c.get('id', '?') for c in cards)}")
    return card


async def _request(client, args, model: str, prompt: list[int], output_len: int) -> Record:
    rec = Record(len(prompt), output_len)
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": args.temperature,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos,
               "return_token_ids": True}
    start = last = time.perf_counter()
    usage = None
    try:
        async with client.stream("POST", f"{args.base_url}/v1/completions", json=payload, headers=_headers(args),
                                 timeout=args.timeout) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))
                    break
                usage = chunk.get("usage") or usage
                n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if n:
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last, rec.tokens = now, rec.tokens + n
    except Exception as e:  # the connection failed or timed out: this request failed, the others go on
        rec.error = f"{type(e).__name__}: {e}"
    rec.latency = time.perf_counter() - start
    if usage and rec.error is None:
        rec.tokens = usage.get("completion_tokens", rec.tokens)
    return rec


def _workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.num_prompts):
        n = rng.randint(*args.input_len)
        work.append(([rng.randrange(vocab) for _ in range(n)], rng.randint(*args.output_len)))
    return work


async def _run(args) -> dict:
    import httpx
    from tqdm.auto import tqdm

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        card = await _model_card(client, args)
        model = card["id"]
        vocab = args.vocab_size or card.get("vocab_size")
        if not vocab:
            raise SystemExit("the server does not say its vocab_size in /v1/models: pass --vocab-size")
        if card.get("vocab_size") and vocab > card["vocab_size"]:  # every prompt would hold ids the model lacks
            raise SystemExit(f"--vocab-size {vocab}: {model!r} has {card['vocab_size']} tokens (/v1/models); token ids "
                             f"past {card['vocab_size'] - 1} are refused, so give at most {card['vocab_size']}")
        limit = card.get("max_model_len")
        if limit and args.input_len[1] + args.output_len[1] > limit:
            flags = ("--cookbook's {} prompt + {} new" if args.cookbook else "--input-len {} + --output-len {}").format(
                args.input_len[1], args.output_len[1])
            raise SystemExit(f"{flags} tokens exceed the server's max_model_len ({limit})")
        probe = await _request(client, args, model, [0], 1)
        if probe.error is not None:
            raise SystemExit(f"the first request failed: {probe.error}")

        work = _workload(args, vocab)
        rng = random.Random(args.seed + 1)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(work), disable=not bars_shown(), leave=False, unit="req")

        async def one(prompt, output_len):
            if gate is None:
                rec = await _request(client, args, model, prompt, output_len)
            else:
                async with gate:
                    rec = await _request(client, args, model, prompt, output_len)
            bar.update(1)
            return rec

        start = time.perf_counter()
        tasks = []
        for prompt, output_len in work:
            tasks.append(asyncio.ensure_future(one(prompt, output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return _summary(args, model, records, duration)


def _summary(args, model: str, records: list[Record], duration: float) -> dict:
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.tokens for r in ok)
    ms = 1e3

    def stats(name, values):
        return {f"{name}_mean_ms": round(sum(values) / len(values) * ms, 3) if values else None,
                f"{name}_p50_ms": _round(percentile(values, 50), ms), f"{name}_p99_ms": _round(percentile(values, 99), ms)}

    tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    record = {"tool": "bench_serve", "base_url": args.base_url, "model": model, "num_prompts": args.num_prompts,
              "input_len": list(args.input_len), "output_len": list(args.output_len),
              "request_rate": None if args.request_rate == float("inf") else args.request_rate,
              "max_concurrency": args.max_concurrency, "completed": len(ok), "failed": len(records) - len(ok),
              "duration_s": round(duration, 3), "input_tokens": sum(r.input_len for r in ok),
              "output_tokens": out_tokens, "request_throughput": round(len(ok) / duration, 3),
              "output_tokens_per_s": round(out_tokens / duration, 1),
              "total_tokens_per_s": round((out_tokens + sum(r.input_len for r in ok)) / duration, 1),
              **stats("ttft", [r.ttft for r in ok if r.ttft is not None]),
              **stats("itl", [x for r in ok for x in r.itl]), **stats("tpot", tpot),
              **stats("e2e", [r.latency for r in ok])}
    errors = [r.error for r in records if r.error is not None]
    if errors:
        record["first_error"] = errors[0]
    return record


def _round(value, scale):
    return None if value is None else round(value * scale, 3)


def _print(record: dict) -> None:
    def show(v):
        return "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)

    rows = [["requests completed / failed", f"{record['completed']} / {record['failed']}"],
            ["duration (s)", show(record["duration_s"])],
            ["request throughput (req/s)", f"{record['request_throughput']:.2f}"],
            ["output tokens/s", show(record["output_tokens_per_s"])],
            ["total tokens/s", show(record["total_tokens_per_s"])]]
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "latency")):
        rows.append([f"{label} mean / p50 / p99 (ms)", " / ".join(show(record[f"{name}_{k}_ms"])
                                                                  for k in ("mean", "p50", "p99"))])
    print_table(["metric", "value"], rows)
    if "first_error" in record:
        print(f"first error: {record['first_error']}", file=sys.stderr)


def main(argv=None) -> None:
    from metrale_graph.tools.files import write_whole

    p, args = _parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    if args.base_url.endswith("/v1"):
        args.base_url = args.base_url[:-3]
    if args.cookbook:
        record = {**_cookbook(args), **provenance(argv)}
    else:
        record = {**asyncio.run(_run(args)), **provenance(argv)}
        _print(record)
    print_json(record)
    if args.json:
        write_whole(args.json, json.dumps(record, indent=1, sort_keys=True) + "\n")
    empty = [r for r in record.get("levels", [record]) if not r["completed"]]
    if empty:  # nothing was measured: a script running the benchmark must see it failed
        raise SystemExit(f"{p.prog}: error: none of the {empty[0]['num_prompts']} requests completed"
                         f"{' at concurrency ' + str(empty[0]['max_concurrency']) if args.cookbook else ''} "
                         f"(first error: {empty[0]['first_error']})")


def _cookbook(args) -> dict:
    """The cookbook workload's levels, each a _run of its own; a table of TPOT beside SGLang's."""
    length = COOKBOOK["input_len"], COOKBOOK["output_len"]
    args.input_len, args.output_len, args.request_rate = (length[0],) * 2, (length[1],) * 2, float("inf")
    levels = []
    for c in COOKBOOK["concurrency"]:
        args.max_concurrency, args.num_prompts = c, max(4, 2 * c)
        levels.append(asyncio.run(_run(args)))
    theirs = COOKBOOK["sglang_tpot_ms"]
    print_table(["concurrency", "requests", "output tok/s", "TPOT p50 ms", "TTFT p50 ms", "SGLang TPOT ms (bf16 / fp8)"],
                [[r["max_concurrency"], f"{r['completed']} / {r['num_prompts']}", r["output_tokens_per_s"], r["tpot_p50_ms"],
                  r["ttft_p50_ms"], " / ".join(str(theirs[k].get(r["max_concurrency"], "-")) for k in ("bf16", "fp8"))]
                 for r in levels])
    return {"tool": "bench_serve", "workload": "cookbook", "base_url": args.base_url, "model": levels[0]["model"],
            "levels": levels, "sglang_tpot_ms": {k: {str(c): v for c, v in d.items()} for k, d in theirs.items()},
            "sglang_source": "SGLang's Qwen3.6 cookbook, one H200, Qwen3.6-35B-A3B, MTP on"}


def cli() -> None:
    with ends_quietly():
        main()


if __name__ == "__main__":
    cli()
