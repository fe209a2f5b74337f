"""Verify ahead against the synchronous MTP step (issue 38's asynchronous verify): one engine and its captured graphs,
per stream count four settings in turn: plain decoding (every request speculate=False), the synchronous MTP step
(the drafting after the acceptance's read back), the drafting behind the acceptance (METRALE_MTP_AFTER) and verify
ahead (METRALE_VERIFY_AHEAD: step N + 1 launched before N's counts are read back). Per setting one untimed generate
call, then a timed one: wall ms per step, tokens per stream and step, ms per token of one stream, and the steps
launched ahead. Random weights with a random one-layer MTP head (drafts nearly always rejected: about one token a
step), so what differs between the settings is the host's part of the step, not the acceptance. The three
speculative settings run the same shapes, so their tokens must be equal (greedy): a mismatch is an error. Plain
decoding runs other shapes (a verify step has k + 1 rows a stream), so in bf16 its tokens may part from theirs at a
near tie of random weights (the GPU tests check equality in fp32): each row prints the share of tokens equal to
plain decoding's before the first difference.

    python benchmarks/check_verify_ahead.py --preset qwen3.5-9b --streams 1,8 --k 2 --new 96 --json FILE
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from metrale_graph import Engine, HybridModel, envs
from metrale_graph.config import PRESETS
from metrale_graph.tools.provenance import provenance


def _common(a: list, b: list) -> int:
    """How many leading tokens two streams share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/check_verify_ahead.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-9b", choices=sorted(PRESETS))
    p.add_argument("--streams", default="1,8", help="stream counts, comma-separated")
    p.add_argument("--k", type=int, default=2, help="MTP drafts per step")
    p.add_argument("--new", type=int, default=96, help="tokens per request of a timed call")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--layers", type=int, default=None, help="keep only this many layers (a quick look)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights dtype (default: bfloat16 on CUDA, float32 on the CPU); fp32 tells a near tie from a defect")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    cfg = PRESETS[args.preset].replace(mtp_num_hidden_layers=1)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers, layer_types=cfg.layer_types[:args.layers])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = HybridModel.from_preset(cfg, dtype=getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device == "cuda" else torch.float32), device=device)
    g = torch.Generator().manual_seed(0)
    K, top = args.k, max(streams)
    counts = sorted(set(streams))
    tokens = sorted({n * (k + 1) for n in counts for k in (0, K)} | {2 * (K + 1), 2048})
    rows = []
    with envs.override(**{"METRALE_MTP_AFTER": "1"}), \
            Engine(model, num_slots=top, max_context=args.context + 2 * args.new + 8, token_budget=2048,
                   batch_sizes=sorted(set(counts) | {2}), token_counts=tokens, stop_token_ids=[],
                   speculative={"method": "mtp", "num_tokens": K, "max_streams": top}) as engine:
        spec = engine._loop.spec
        from metrale_graph.speculative.ahead import VerifyAhead

        ahead = VerifyAhead(spec)
        for n in streams:
            prompts = [torch.randint(0, cfg.vocab_size, (args.context,), generator=g).tolist() for _ in range(n)]
            plain = reference = None
            for setting in ("plain", "sync", "after", "ahead"):
                spec.ahead = ahead if setting == "ahead" else None
                with envs.override(**{"METRALE_MTP_AFTER": "1" if setting in ("after", "ahead") else "0"}):
                    kw = dict(max_new_tokens=args.new, speculate=setting != "plain")
                    engine.generate(prompts, **kw)  # untimed: captures what the timed call replays
                    if device == "cuda":
                        torch.cuda.synchronize()
                    before, chained = engine.stats(), ahead.chained
                    t0 = time.perf_counter()
                    out = [r.token_ids for r in engine.generate(prompts, **kw)]
                    if device == "cuda":
                        torch.cuda.synchronize()
                    seconds, after = time.perf_counter() - t0, engine.stats()
                if setting == "plain":
                    plain = out
                else:
                    reference = out if reference is None else reference
                    if out != reference:
                        raise RuntimeError(f"{setting} at {n} streams gave other tokens than the synchronous MTP step")
                steps = after.steps - before.steps
                row = {"setting": setting, "streams": n, "k": K, "steps": steps,
                       "ms_per_step": round(1e3 * seconds / steps, 3),
                       "tokens_per_step": round(n * args.new / steps / n, 3),
                       "ms_per_token": round(1e3 * seconds / args.new, 3), "chained": ahead.chained - chained,
                       "same_as_plain": round(sum(_common(a, b) for a, b in zip(out, plain)) / (n * args.new), 3)}
                rows.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/check_verify_ahead.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "json"),
                **provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
