"""Shared pieces of the command-line tools: flag types, model loading flags, tables, JSON lines.

The flag types raise argparse.ArgumentTypeError naming the value and what was expected, so a bad
flag ends the tool with argparse's usage message and exit code 2 before any work starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The H200's two ceilings, measured there (DESIGN.md): bf16 dense matrix rate, and device-to-device
# copy bandwidth counting bytes read plus bytes written.
MATMUL_RATE = 790e12
COPY_RATE = 4.3e12


def floor_ms(flops: float, nbytes: float) -> tuple[float, str]:
    """(ms, "compute" or "memory"): the larger of FLOPs at MATMUL_RATE and bytes at COPY_RATE."""
    compute, memory = flops / MATMUL_RATE * 1e3, nbytes / COPY_RATE * 1e3
    return max(compute, memory), "compute" if compute >= memory else "memory"


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
    """A file path to write: not a folder, in a folder that exists."""
    folder = os.path.dirname(os.path.abspath(text))
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if os.path.isdir(text) or text.endswith((os.sep, os.altsep or os.sep)):  # "out/" names a folder
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: folder {folder} does not exist")
    why = unwritable(folder)
    if why:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write into folder {folder} ({why})")
    return text


def write_whole(path: str, data: str | bytes) -> None:
    """Write `data` (text, or bytes) to `path` so that the file holds all of it or stays as it was: a Ctrl-C, a
    full disk or an error mid-write leaves the previous file (bench rewrites its --json after every workload;
    warmup's ranks and runs share a folder), never a torn one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def unwritable(folder: str) -> str | None:
    """Why no file can be written into the existing `folder` (the OS's reason), or None. Checked by writing
    one: os.access says yes to root on read-only file systems."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return str(e.strerror or e)
    return None


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


def model_config(args):
    """The ModelConfig of --model (a preset's, or the checkpoint folder's config.json, which model_name has
    already checked), read without loading any weights: for checks of other flags before the model loads."""
    from metrale_graph import load_config

    return load_config(args.model)


def add_model_args(p: argparse.ArgumentParser, seed_help: str = "seed of random preset weights and of inputs",
                   parallel: bool = True) -> None:
    """--model, --dtype, --device, --seed, --tp and --moe-parallel. parallel=False: a tool that runs one
    whole model leaves --tp / --moe-parallel out of its help (they still parse, for the tool to refuse them
    by name)."""
    from metrale_graph import PRESETS

    p.add_argument("--model", type=model_name, default="tiny",
                   help=f"preset name ({', '.join(PRESETS)}: random weights) or a Hugging Face checkpoint "
                        "folder (default: tiny, embedded)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", type=device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--seed", type=seed, default=0, help=seed_help)
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: launch with torchrun --nproc-per-node N ... --tp N "
                        "(NCCL on GPUs, one per rank; gloo on the CPU); ranks other than 0 print nothing"
                   if parallel else argparse.SUPPRESS)
    add_moe_parallel_arg(p, shown=parallel)


def add_moe_parallel_arg(p: argparse.ArgumentParser, shown: bool = True) -> None:
    from metrale_graph.sharding import DEFAULT_MOE, MOE_MODES

    p.add_argument("--moe-parallel", choices=MOE_MODES, default=None,
                   help=f"with --tp on an MoE model: each expert split within (within, the default "
                        f"{DEFAULT_MOE!r}: measured faster on two H200s) or the experts split across the ranks "
                        "(expert); only with --tp" if shown else argparse.SUPPRESS)


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The --device and --dtype flags with their defaults filled in."""
    dev = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return dev, DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def tensor_parallel(args, parser: argparse.ArgumentParser):
    """None for --tp 1; else this process's TensorParallel, from the environment torchrun sets (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / PORT): NCCL with one GPU per rank (args.device becomes
    cuda:LOCAL_RANK), gloo on the CPU. Ranks other than 0 have their standard output silenced."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp == 1 and world > 1:  # each process would run the whole model alone, and each would report
        parser.error(f"this run has {world} processes (torchrun): pass --tp {world}, or run one process "
                     "(without --tp each would run the whole model alone)")
    if args.tp == 1:
        if getattr(args, "moe_parallel", None) is not None:  # it would be ignored
            parser.error("--moe-parallel says how --tp ranks split MoE experts; it needs --tp N (N > 1)")
        return None
    import sys

    import torch.distributed as dist

    from metrale_graph.parallel import TensorParallel
    from metrale_graph.sharding import DEFAULT_MOE

    if world != args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} processes (torchrun --nproc-per-node {args.tp} ...); "
                     f"this run has {world}")
    dev, _ = device_and_dtype(args)
    if dev.type == "cuda":
        args.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(args.device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    args.moe_parallel = getattr(args, "moe_parallel", None) or DEFAULT_MOE  # what the records report
    tp = TensorParallel.current(moe=args.moe_parallel)
    if tp.rank != 0:
        sys.stdout = open(os.devnull, "w")
    return tp


def end_tensor_parallel() -> None:
    """The end of a tool's process under --tp (a tool's cli() calls it after main() returns): every rank
    waits for the others (a barrier), flushes its output and leaves with os._exit(0), skipping the
    interpreter's finalization. A gloo rank that finalized normally aborted now and then (SIGABRT,
    "terminate called without an active exception") after all its work was done, failing the run; an
    NCCL group cannot be destroyed while CUDA graphs that captured its collectives are alive (it waits
    forever). Returns without an initialized torch.distributed (a one-process run finalizes as usual)."""
    import sys

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_model(args, parser: argparse.ArgumentParser):
    """The model of the add_model_args flags (this rank's shard with --tp); a checkpoint that does not
    load ends the tool through parser.error (exit code 2) with the reason."""
    from metrale_graph import PRESETS, HybridModel

    tp = tensor_parallel(args, parser)
    dev, dtype = device_and_dtype(args)
    try:
        if args.model in PRESETS:
            return HybridModel.from_preset(args.model, dtype=dtype, device=dev, seed=args.seed, tp=tp)
        return HybridModel.from_pretrained(args.model, dtype=dtype, device=dev, tp=tp,
                                           progress=tp is None or tp.rank == 0)
    except ValueError as e:
        parser.error(f"--model {args.model}: {e}")


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def provenance() -> dict:
    """What produced a benchmark record: the command line, the commit of this checkout ("-dirty" with
    uncommitted changes; None outside a git checkout) and the torch / triton versions."""
    import subprocess
    import sys

    import triton

    here = os.path.dirname(os.path.abspath(__file__))

    def git(*cmd):
        try:
            return subprocess.run(["git", "-C", here, *cmd], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or None
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    return {"command": " ".join([program] + sys.argv[1:]), "commit": commit, "torch": torch.__version__,
            "triton": triton.__version__}


def print_json(record: dict) -> None:
    print(json.dumps(record, sort_keys=True))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
