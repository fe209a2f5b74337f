"""A tool process's run: one process, or one rank of a `--tp N` group launched by torchrun.

`start_run(args, parser)` checks --tp and --moe-parallel against the launch and returns a `Run`: the
device and dtype this process uses, its TensorParallel (None for one process), the MoE split its
records report, and whether it reports (rank 0). Nothing in `args` is changed. A tool prints inside
`with run.silence_other_ranks():`, so that the ranks other than 0, which run the same steps, print
nothing. `end_tensor_parallel()` is how a tool's process ends under --tp (its `cli()` calls it).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch

from metrale_graph.tools.flags import device_and_dtype, requantize_ignored


@dataclass(frozen=True)
class Run:
    """One tool process. `device` is cuda:LOCAL_RANK on each GPU rank; `moe_parallel` is the MoE split of a
    --tp run (the default filled in), None for one process."""
    device: torch.device
    dtype: torch.dtype
    tp: object | None = None  # metrale_graph.parallel.TensorParallel
    moe_parallel: str | None = None

    @property
    def rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    @property
    def world_size(self) -> int:
        return 1 if self.tp is None else self.tp.size

    @property
    def reports(self) -> bool:
        """Whether this process prints and writes the results (rank 0; the others ran the same steps)."""
        return self.rank == 0

    def silence_other_ranks(self):
        """A context manager: standard output as it is on the reporting rank, discarded on the others
        (their errors still reach standard error)."""
        if self.reports:
            return contextlib.nullcontext()
        return contextlib.redirect_stdout(open(os.devnull, "w"))


def start_run(args, parser) -> Run:
    """The Run of the parsed flags (--tp, --moe-parallel, and --device / --dtype where the tool has them).
    --requantize-fp8 for a model it would not change is a usage error. --tp 1: this process alone (usage errors
    for --moe-parallel, which would be ignored, and for a torchrun
    launch of several processes, each of which would run the whole model). --tp N: from the environment
    torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / PORT) this rank's TensorParallel, NCCL with
    one GPU per rank (torch.cuda.set_device(cuda:LOCAL_RANK)) or gloo on the CPU."""
    tp_size = getattr(args, "tp", 1)
    moe_parallel = getattr(args, "moe_parallel", None)
    ignored = requantize_ignored(args)
    if ignored:
        parser.error(f"--requantize-fp8 applies to compressed-tensors FP8 checkpoints (their non-block scales); "
                     f"{ignored}: leave it out")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp_size == 1 and world > 1:
        parser.error(f"this run has {world} processes (torchrun): pass --tp {world}, or run one process "
                     "(without --tp each would run the whole model alone)")
    try:
        dev, dtype = device_and_dtype(args)
    except ValueError as e:  # --dtype auto over a config.json whose dtype the model does not run in
        parser.error(f"--dtype {args.dtype}: {e}")
    if tp_size == 1:
        if moe_parallel is not None:
            parser.error("--moe-parallel says how --tp ranks split MoE experts; it needs --tp N (N > 1)")
        return Run(dev, dtype)
    import torch.distributed as dist

    from metrale_graph.parallel import TensorParallel
    from metrale_graph.sharding import DEFAULT_MOE

    if world != tp_size:
        parser.error(f"--tp {tp_size} needs {tp_size} processes (torchrun --nproc-per-node {tp_size} ...); "
                     f"this run has {world}")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    moe_parallel = moe_parallel or DEFAULT_MOE
    return Run(dev, dtype, TensorParallel.current(moe=moe_parallel), moe_parallel)


def end_tensor_parallel() -> None:
    """The end of a tool's process under --tp (a tool's cli() calls it after main() returns): every rank
    waits for the others (a barrier), flushes its output and leaves with os._exit(0), skipping the
    interpreter's finalization, in which a gloo rank can abort after its work is done and an NCCL group
    that live CUDA graphs captured cannot be destroyed. Returns without an initialized
    torch.distributed (a one-process run finalizes as usual)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
