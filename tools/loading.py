"""The model of a tool's --model / --dtype / --device / --seed flags, and its config read alone."""

from __future__ import annotations

import sys

import torch

from metrale_graph.tools.distributed import Run, start_run


def model_config(args):
    """The ModelConfig of --model (a preset's, or the checkpoint folder's config.json, which flags.model_name
    has already checked), read without loading any weights: for checks of other flags before the model loads."""
    from metrale_graph import load_config

    return load_config(args.model)


def load_model(args, parser, run: Run | None = None):
    """The model of the flags on `run`'s device and dtype (this rank's shard under --tp); run=None starts a
    one-process run (start_run) for a tool that has no other use for it. A checkpoint that does not load
    ends the tool through parser.error (exit code 2) with the reason. Loading a checkpoint shows a progress
    bar on a terminal only (in a log its text would be left in front of the tool's first line)."""
    from metrale_graph import PRESETS, HybridModel

    run = run or start_run(args, parser)
    try:
        if args.model in PRESETS:
            return HybridModel.from_preset(args.model, dtype=run.dtype, device=run.device, seed=args.seed, tp=run.tp)
        return HybridModel.from_pretrained(args.model, dtype=run.dtype, device=run.device, tp=run.tp,
                                           progress=run.reports and sys.stderr.isatty())
    except ValueError as e:
        parser.error(f"--model {args.model}: {e}")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a host clock read next times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
