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


def check_engine_sizes(p, args) -> None:
    """--max-context and --token-budget (flags.add_engine_args) against what the model and a step can hold,
    before the model loads (the cache, the bucket grid and their buffers are sized by them)."""
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


def check_speculative_model(p, args, flag: str) -> None:
    """An "mtp" option (`args.speculative`, flags.speculative) against --model's config and checkpoint headers,
    before the model loads: a model without an MTP head ends the tool through p.error (exit code 2) naming what
    it lacks. A checkpoint whose headers cannot be read is left to load_model to name."""
    from metrale_graph import PRESETS
    from metrale_graph.speculative.options import check_mtp_head
    from metrale_graph.weights import checkpoint_config

    if not args.speculative or args.speculative["method"] != "mtp":
        return
    try:
        cfg = PRESETS[args.model] if args.model in PRESETS else checkpoint_config(args.model)
    except ValueError:
        return
    try:
        check_mtp_head(cfg, cfg.mtp_num_hidden_layers > 0)
    except ValueError as e:
        p.error(f"{flag}: --model {args.model}: {e}")


def build_engine(p, args, model, **kwargs):
    """The Engine of the flags (flags.add_engine_args; `kwargs` go to Engine too). A size the Engine refuses,
    or a cache that does not fit in the device's memory, ends the tool through p.error (exit code 2)."""
    from metrale_graph import Engine
    from metrale_graph.placement import NotEnoughMemory

    try:
        return Engine(model, num_slots=args.num_slots, max_context=args.max_context, token_budget=args.token_budget,
                      compile=not args.eager, **kwargs)
    except NotEnoughMemory as e:
        p.error(f"--num-slots {args.num_slots} / --max-context / --token-budget: the cache does not fit in the "
                f"memory of {model.device} ({e})")
    except ValueError as e:
        p.error(str(e))
    except (RuntimeError, TypeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not out_of_memory(e):
            raise
        p.error(f"--num-slots {args.num_slots} / --max-context / --token-budget: the cache does not fit in the "
                f"memory of {model.device} ({str(e).splitlines()[0]})")


def out_of_memory(e: BaseException) -> bool:
    """An allocation the device (or a size torch can express) could not hold."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text or "Overflow when unpacking" in text


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
                                           progress=run.reports and sys.stderr.isatty(),
                                           requantize_fp8=getattr(args, "requantize_fp8", False))
    except ValueError as e:
        parser.error(f"--model {args.model}: {e}")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a host clock read next times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
