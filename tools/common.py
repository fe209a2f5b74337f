"""Shared pieces of the command-line tools: model loading flags, tables, JSON lines."""

from __future__ import annotations

import argparse
import json
import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="preset name (tiny, qwen3.5-9b: random weights) or a Hugging Face checkpoint folder "
                        "(default: tiny, embedded)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of random preset weights and of inputs")


def load_model(args):
    from metrale_graph import PRESETS, HybridModel

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.model in PRESETS:
        return HybridModel.from_preset(args.model, dtype=dtype, device=device, seed=args.seed)
    if not os.path.isdir(args.model):
        raise SystemExit(f"--model {args.model!r}: not a preset ({', '.join(PRESETS)}) nor a checkpoint folder")
    return HybridModel.from_pretrained(args.model, dtype=dtype, device=device)


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def print_json(record: dict) -> None:
    print(json.dumps(record, sort_keys=True))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
