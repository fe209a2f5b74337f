"""Flag types and the shared model flags of the command-line tools.

The flag types raise argparse.ArgumentTypeError naming the value and what was expected, so a bad
flag ends the tool with argparse's usage message and exit code 2 before any work starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch

from metrale_graph.tools.files import unwritable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

INT_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")  # an integer in plain ASCII digits: int() also takes "1_0"


def _int(text: str, minimum: int, expected: str, maximum: int | None = None) -> int:
    value = int(text) if INT_TEXT.fullmatch(text) else None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int(text, 0, "a non-negative integer")


def _float(text: str, ok, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not ok(value):  # NaN fails every check
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    return _float(text, lambda v: 0 <= v < float("inf"), "a number >= 0")


def probability(text: str) -> float:
    """A number in (0, 1]."""
    return _float(text, lambda v: 0 < v <= 1, "a number in (0, 1]")


def positive_ints(text: str) -> list[int]:
    """Comma-separated positive integers, at least one; an empty item ("5,,3", "5,") is an error."""
    try:
        values = [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def names_of(choices):
    """A flag type: comma-separated names, each one of `choices`, at least one, none twice; an empty item
    ("W1,,W2", "W1,") is an error, as in positive_ints."""
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",")]
        if not all(x in choices for x in names):
            raise argparse.ArgumentTypeError(f"expected comma-separated names out of {', '.join(choices)}, "
                                             f"got {text!r}")
        twice = sorted({x for x in names if names.count(x) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{', '.join(twice)} given more than once in {text!r}")
        return names
    return parse


def speculative(text: str) -> dict:
    """Speculative decoding's option (speculative/options.py) from a flag: vLLM's --speculative-config JSON
    ('{"method": "mtp", "num_speculative_tokens": 3}', options.from_vllm's keys), or METHOD[:K] ("mtp:3",
    "ngram"). Checked but for the model's MTP head (loading.check_speculative_model, before the model loads)."""
    from metrale_graph.speculative import from_vllm

    text = text.strip()
    try:
        if text.startswith("{"):
            try:
                config = json.loads(text)
            except ValueError as e:
                raise ValueError(f"not valid JSON ({e}); expected an object such as "
                                 "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}' (single quotes around it in "
                                 "a shell)") from None
        else:
            method, sep, k = text.partition(":")
            config = {"method": method}
            if sep:
                if not INT_TEXT.fullmatch(k):
                    raise ValueError(f"expected METHOD or METHOD:K (K the drafts per step, an integer), got {text!r}")
                config["num_tokens"] = int(k)
        option = from_vllm(config)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return option


def seed(text: str) -> int:
    """An integer torch.Generator.manual_seed takes."""
    return _int(text, -2**63, "an integer in [-2**63, 2**64 - 1]", 2**64 - 1)


def device(text: str) -> torch.device:
    """cpu, cuda or cuda:N, a device this machine has."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA GPU that torch can use")
        if (dev.index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s), "
                                             f"cuda:0..cuda:{count - 1}")
    return dev


def output_file(text: str) -> str:
    """A file path to write: not a folder, in a folder that exists and takes new files."""
    folder = os.path.dirname(os.path.abspath(text))
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if os.path.isdir(text) or text.endswith((os.sep, os.altsep or os.sep)):  # "out/" names a folder
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: {folder} is a file, not a folder" if os.path.exists(folder)
                                         else f"{text!r}: folder {folder} does not exist")
    why = unwritable(folder)
    if why:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write into folder {folder} ({why})")
    return text


def model_name(text: str) -> str:
    """A preset, or a checkpoint folder whose config.json is valid."""
    from metrale_graph import PRESETS, load_config

    if text in PRESETS:
        return text
    presets = ", ".join(PRESETS)
    if os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file; expected a preset ({presets}) or a checkpoint folder")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a preset ({presets}) nor a checkpoint folder")
    try:
        load_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_model_args(p: argparse.ArgumentParser, seed_help: str = "seed of random preset weights and of inputs",
                   parallel: bool = True) -> None:
    """--model, --dtype, --device, --seed, --requantize-fp8, --tp and --moe-parallel. parallel=False: a tool
    that runs one whole model leaves --tp / --moe-parallel out of its help (they still parse, for the tool to
    refuse them by name)."""
    from metrale_graph import PRESETS

    p.add_argument("--model", type=model_name, default="tiny",
                   help=f"preset name ({', '.join(PRESETS)}: random weights) or a Hugging Face checkpoint "
                        "folder (default: tiny, embedded)")
    p.add_argument("--dtype", choices=[*DTYPES, "auto"], default=None,
                   help="weights and activations (default: bfloat16 on CUDA, float32 on CPU; auto: a checkpoint's "
                        "own, config.json's dtype, as transformers' dtype='auto')")
    p.add_argument("--device", type=device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--seed", type=seed, default=0, help=f"{seed_help} (default 0)")
    p.add_argument("--requantize-fp8", action="store_true",
                   help="a compressed-tensors FP8 checkpoint's weights with per-tensor, per-channel (or other "
                        "non-128 x 128-block) scales: held as 128 x 128-block FP8 instead of dequantized to --dtype "
                        "(per-tensor exactly, others requantized: a second rounding; half the memory of bf16); "
                        "refused for any other model")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: launch with torchrun --nproc-per-node N ... --tp N "
                        "(NCCL on GPUs, one per rank; gloo on the CPU); ranks other than 0 print nothing (default 1: "
                        "one process)"
                   if parallel else argparse.SUPPRESS)
    add_moe_parallel_arg(p, shown=parallel)


def add_engine_args(p: argparse.ArgumentParser, num_slots: int) -> None:
    """The Engine's sizes and modes: --num-slots (default `num_slots`), --max-context, --token-budget,
    --eager and --no-warmup (loading.check_engine_sizes checks them against the model; loading.build_engine
    builds the Engine)."""
    p.add_argument("--num-slots", type=positive_int, default=num_slots,
                   help=f"cache slots (concurrent requests; default {num_slots})")
    p.add_argument("--max-context", type=positive_int, default=None,
                   help="most tokens (prompt + new) per request, at most the model's max_position_embeddings "
                        "(default: min(model's, 4096))")
    p.add_argument("--token-budget", type=positive_int, default=None,
                   help="most tokens per step, from --num-slots to --num-slots x max context "
                        "(default: max(2048, slots))")
    p.add_argument("--eager", action="store_true", help="run model.prefill eagerly (no compile, no graphs)")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile / capture buckets on first use instead of before timing")


def add_speculative_arg(p: argparse.ArgumentParser, flag: str) -> None:
    """`flag` (--speculative-config in serve, vLLM's name; --speculative in generate) as args.speculative: the
    Engine's speculative= option (flags.speculative), None when not given."""
    p.add_argument(flag, dest="speculative", type=speculative, default=None, metavar="CONFIG",
                   help="speculative decoding (docs/speculative.md): vLLM's JSON, e.g. '{\"method\": \"mtp\", "
                        "\"num_speculative_tokens\": 3}' (methods mtp, its older name qwen3_next_mtp, ngram; keys "
                        "num_speculative_tokens, prompt_lookup_min / prompt_lookup_max for ngram, "
                        "disable_by_batch_size or max_streams: steps with more decode streams decode one token per "
                        "stream), or METHOD[:K] such as mtp:3 (default: off)")


def add_moe_parallel_arg(p: argparse.ArgumentParser, shown: bool = True) -> None:
    from metrale_graph.sharding import DEFAULT_MOE, MOE_MODES

    p.add_argument("--moe-parallel", choices=MOE_MODES, default=None,
                   help=f"with --tp on an MoE model: within, each expert split across the ranks (measured faster "
                        f"on two H200s), or expert, whole experts shared out among the ranks (default "
                        f"{DEFAULT_MOE!r}); only with --tp" if shown else argparse.SUPPRESS)


def requantize_ignored(args) -> str | None:
    """Why --requantize-fp8 would do nothing for --model (a preset, or a checkpoint without a compressed-tensors
    quantization_config), or None: the tools refuse a flag they would ignore."""
    if not getattr(args, "requantize_fp8", False):
        return None
    from metrale_graph import PRESETS
    from metrale_graph.compressed_tensors import checkpoint_format

    if args.model in PRESETS:
        return f"--model {args.model} is a preset (random weights in --dtype)"
    try:
        if checkpoint_format(args.model) is not None:
            return None
    except ValueError:  # a malformed quantization_config: the load names it
        return None
    return f"--model {args.model} has no compressed-tensors quantization_config"


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The --device and --dtype flags with their defaults filled in (a tool without one of them gets its
    default; --dtype auto: a checkpoint folder's own, weights.checkpoint_dtype, a preset's the default)."""
    dev = getattr(args, "device", None) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, model = getattr(args, "dtype", None), getattr(args, "model", None)
    if dtype == "auto" and model is not None and os.path.isdir(model):  # a preset has no dtype of its own
        from metrale_graph.weights import checkpoint_dtype

        return dev, checkpoint_dtype(model, "auto")
    return dev, DTYPES[dtype] if dtype in DTYPES else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
