"""Tensor parallelism, Megatron-style, over `torch.distributed` (NCCL on GPUs, gloo on the CPU): the
communicator. The plan (which part of each weight a rank holds, the per-rank sizes) is sharding.py.

Every rank holds a shard of every weight and of every state pool, and runs the same step on the
same batch; the ranks meet in two all-reduces per layer (after each mixer's output projection and
after each feed-forward half) and around the vocabulary-parallel embedding and LM head. Through
torch.distributed's functional collectives the compiled step stays one graph, and NCCL runs
inside the captured CUDA graphs. Only rank 0 adds the residual stream in a mixer or feed-forward
op; the all-reduce sums it in once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .sharding import DEFAULT_MOE, check_moe_mode


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank `rank` of `size` in `group` (None: the
    default process group); `moe`: how MoE experts are split (sharding.MOE_MODES)."""
    rank: int
    size: int
    group: Any = None
    moe: str = DEFAULT_MOE

    def __post_init__(self):
        check_moe_mode(self.moe)

    @classmethod
    def current(cls, group=None, moe: str = DEFAULT_MOE) -> "TensorParallel":
        """From an initialized torch.distributed (init_process_group; torchrun sets it up)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tensor parallelism needs torch.distributed initialized "
                             "(torch.distributed.init_process_group; torchrun sets the environment)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group, moe)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks (a functional collective: traced into the compiled step)."""
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self._group()))

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim`, in rank order. Gathered along dim 0 and moved
        into place here (funcol's own gather along other dims calls a helper dynamo will not trace)."""
        import torch.distributed._functional_collectives as funcol

        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # named so from torch 2.13
        out = funcol.wait_tensor(gather(x.contiguous(), 0, self._group()))  # [size * x.shape[0], ...]
        parts = out.view(self.size, *x.shape)
        return torch.cat(parts.unbind(0), dim) if dim else out

    def _group(self):
        import torch.distributed as dist

        return self.group if self.group is not None else dist.group.WORLD
