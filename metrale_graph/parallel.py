"""Tensor parallelism, Megatron-style, over `torch.distributed` (NCCL on GPUs, gloo on the CPU).

Every rank holds a shard of every weight and of every state pool, and runs the same step on the
same batch; the ranks meet in two all-reduces per layer (after each mixer's output projection and
after each feed-forward half) and around the vocabulary-parallel embedding and LM head. Through
torch.distributed's functional collectives the compiled step stays one graph, and NCCL runs
inside the captured CUDA graphs.

How each weight is split (`shard_ranges`; `local_config` gives the per-rank head counts that the
cache and the ops see):
- GDN: key heads split over ranks with their value heads (in_proj_qkv / conv1d channels [q | k | v],
  in_proj_z, in_proj_b / a, A_log, dt_bias by value head); out_proj by its input columns.
- attention: query heads split (q_proj rows [q_h | gate_h] per head, o_proj columns); KV heads split,
  or, when there are fewer KV heads than ranks, each rank holds the one KV head its query heads read.
- dense MLP: gate / up rows, down columns. MoE: the router everywhere; the experts either split across
  ranks (`moe="expert"`, expert parallel: each rank holds E / tp whole experts and computes them for
  every token routed to them) or each split within (`moe="within"`, the default, DEFAULT_MOE: every
  rank holds every expert's gate / up rows and down columns of its IE / tp slice, like a dense MLP);
  the shared expert split like a dense MLP either way. Both end in the feed-forward's one all-reduce.
- embedding and LM head: vocabulary rows, ceil(V / tp) per rank (the last rank's padded with zeros).
- norms (and the gated norm's per-head weight) everywhere.
Only rank 0 adds the residual stream in a mixer or feed-forward op; the all-reduce sums it in once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .config import ModelConfig

Ranges = tuple[int, list[tuple[int, int]]]  # (dim, [start, stop) ranges concatenated in order)
MOE_MODES = ("expert", "within")  # how MoE experts are split over ranks (module docstring)
# the default: on two H200s, 35B-A3B shape, split within measured 1-3% faster than across the ranks
# (W1 22.3 / 22.9 ms, W2 57.1 / 58.0, W5 234.3 / 237.8 at 21c0f63, BENCHMARKS.md)
DEFAULT_MOE = "within"


def _check_moe_mode(moe) -> None:
    if moe not in MOE_MODES:
        raise ValueError(f"moe must be one of {MOE_MODES} (how experts are split over ranks), got {moe!r}")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank `rank` of `size` in `group` (None: the
    default process group); `moe`: how MoE experts are split (MOE_MODES, module docstring)."""
    rank: int
    size: int
    group: Any = None
    moe: str = DEFAULT_MOE

    def __post_init__(self):
        _check_moe_mode(self.moe)

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


def check_shardable(cfg: ModelConfig, size: int, moe: str = DEFAULT_MOE) -> None:
    """ValueError naming the config field that `size` ranks cannot split (experts split as `moe` says)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {size!r}")
    _check_moe_mode(moe)
    if size == 1:
        return
    need = [("num_attention_heads", cfg.num_attention_heads)]
    if cfg.linear_layers:
        need.append(("linear_num_key_heads", cfg.linear_num_key_heads))
    if len(cfg.moe_layers) < cfg.num_hidden_layers:
        need.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe_layers:
        need += [("num_experts", cfg.num_experts) if moe == "expert" else
                 ("moe_intermediate_size", cfg.moe_intermediate_size),
                 ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)]
    other = {"num_experts": ("within", cfg.moe_intermediate_size),  # the other way to split the experts
             "moe_intermediate_size": ("expert", cfg.num_experts)}
    for field, value in need:
        if value % size:
            hint = ""
            if field in other and other[field][1] % size == 0:
                hint = f" (the experts split with moe={other[field][0]!r} would divide)"
            raise ValueError(f"{field} ({value}) is not a multiple of the tensor-parallel size {size}{hint}")
    kv = cfg.num_key_value_heads
    if cfg.full_layers and kv % size and size % kv:
        raise ValueError(f"num_key_value_heads ({kv}) and the tensor-parallel size {size} do not divide one another "
                         "(KV heads are split, or replicated when fewer than the ranks)")


def vocab_rows(cfg: ModelConfig, size: int) -> int:
    """Vocabulary rows each of `size` ranks holds (the last rank's shard padded up to it)."""
    return math.ceil(cfg.vocab_size / size)


def local_config(cfg: ModelConfig, size: int, moe: str = DEFAULT_MOE) -> ModelConfig:
    """The head counts and sizes one rank's shard has: what its cache and ops are built for. The
    router still sees every expert (num_experts is the global count); split within, each expert's
    intermediate size is the rank's slice."""
    check_shardable(cfg, size, moe)
    if size == 1:
        return cfg
    return cfg.replace(
        moe_intermediate_size=cfg.moe_intermediate_size // size if cfg.moe_layers and moe == "within"
        else cfg.moe_intermediate_size,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // size),
        linear_num_key_heads=cfg.linear_num_key_heads // size,
        linear_num_value_heads=cfg.linear_num_value_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        shared_expert_intermediate_size=(cfg.shared_expert_intermediate_size // size
                                         if cfg.moe_layers else cfg.shared_expert_intermediate_size),
        vocab_size=vocab_rows(cfg, size))


def first_expert(cfg: ModelConfig, tp: TensorParallel | None) -> int:
    """The global index of this rank's first expert: rank * E / tp split across ranks, else 0 (every
    rank holds every expert, or a slice of each)."""
    if tp is None or tp.size == 1 or tp.moe != "expert":
        return 0
    return tp.rank * (cfg.num_experts // tp.size)


def vocab_shard(cfg: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows this rank holds (the last rank's may be short)."""
    per = vocab_rows(cfg, tp.size)
    return min(tp.rank * per, cfg.vocab_size), min((tp.rank + 1) * per, cfg.vocab_size)


def shard_ranges(name: str, cfg: ModelConfig, tp: TensorParallel) -> Ranges | None:
    """How our weight `name` is split: (dim, ranges of rank tp.rank, concatenated in order), or None
    when every rank holds all of it."""
    if tp.size == 1:
        return None
    r, n = tp.rank, tp.size

    def part(total: int, unit: int = 1, offset: int = 0) -> tuple[int, int]:
        size = total // n * unit
        return offset + r * size, offset + (r + 1) * size

    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 0, [vocab_shard(cfg, tp)]
    if ".linear_attn." in name:
        H, HV, K, V = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                       cfg.linear_value_head_dim)
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if leaf in ("in_proj_qkv", "conv1d"):
            return 0, [part(H, K), part(H, K, H * K), part(HV, V, 2 * H * K)]
        if leaf == "in_proj_z":
            return 0, [part(HV, V)]
        if leaf in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
            return 0, [part(HV)]
        if leaf == "out_proj":
            return 1, [part(HV, V)]
        return None  # the gated norm's weight
    if ".self_attn." in name:
        HQ, HKV, HD = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if ".q_proj." in name:
            return 0, [part(HQ, 2 * HD)]
        if ".k_proj." in name or ".v_proj." in name:
            if HKV >= n:
                return 0, [part(HKV, HD)]
            kv = r * (HQ // n) // (HQ // HKV)  # the KV head this rank's query heads read
            return 0, [(kv * HD, (kv + 1) * HD)]
        if ".o_proj." in name:
            return 1, [part(HQ, HD)]
        return None  # q_norm, k_norm
    if ".mlp.shared_expert." in name:
        IS = cfg.shared_expert_intermediate_size
        return (1, [part(IS)]) if ".down_proj." in name else (0, [part(IS)])
    if ".mlp.experts." in name:  # stacked (`experts.gate_up_proj` [E, 2 * IE, D], `experts.down_proj`
        # [E, D, IE]) or one expert's checkpoint tensor (`experts.{e}.gate_proj.weight` [IE, D], ...)
        stacked = not name.endswith(".weight")
        if tp.moe == "expert":  # whole experts: a range of the stacked ones; one expert whole, or not at all
            return (0, [part(cfg.num_experts)]) if stacked else None
        IE = cfg.moe_intermediate_size  # within: each expert's gate and up rows, down columns of the slice
        if stacked:
            return (2, [part(IE)]) if name.endswith(".down_proj") else (1, [part(IE), part(IE, offset=IE)])
        return (1, [part(IE)]) if ".down_proj." in name else (0, [part(IE)])
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        return 0, [part(cfg.intermediate_size)]
    if ".mlp.down_proj." in name:
        return 1, [part(cfg.intermediate_size)]
    return None  # norms, the router, the shared expert's gate


def take(t, ranges: Ranges | None) -> torch.Tensor:
    """The shard of `t` (a tensor, or a safetensors slice: only the ranges are read)."""
    if ranges is None:
        return t if isinstance(t, torch.Tensor) else t[:]
    dim, spans = ranges
    index = [slice(None)] * (dim + 1)
    pieces = []
    for a, b in spans:
        index[dim] = slice(a, b)
        pieces.append(t[tuple(index)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def shard_shape(shape: tuple[int, ...], ranges: Ranges | None) -> tuple[int, ...]:
    if ranges is None:
        return tuple(shape)
    dim, spans = ranges
    return tuple(sum(b - a for a, b in spans) if d == dim else s for d, s in enumerate(shape))


def sharded_shapes(cfg: ModelConfig, tp: TensorParallel) -> dict[str, tuple[int, ...]]:
    """The shape of every weight's shard on this rank (the vocabulary shards padded to ceil(V / tp))."""
    from .weights import weight_shapes

    out = {name: shard_shape(shape, shard_ranges(name, cfg, tp)) for name, shape in weight_shapes(cfg).items()}
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in out:
            out[name] = (vocab_rows(cfg, tp.size),) + out[name][1:]
    return out


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Every weight's shard for this rank (from full tensors; loading from a checkpoint reads only the
    shard instead: weights.load_checkpoint(..., tp=)). The vocabulary shard is padded to ceil(V / tp)
    rows with zeros."""
    out = {name: take(t, shard_ranges(name, cfg, tp)).clone() for name, t in weights.items()}
    return pad_vocab(out, cfg, tp)


def pad_vocab(weights: dict[str, torch.Tensor], cfg: ModelConfig, tp: TensorParallel) -> dict[str, torch.Tensor]:
    per = vocab_rows(cfg, tp.size)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        t = weights.get(name)
        if t is not None and t.shape[0] < per:
            weights[name] = torch.cat([t, t.new_zeros(per - t.shape[0], *t.shape[1:])])
    return weights
