"""The tensor-parallel plan: which part of each weight a rank holds, the shapes of the shards, the
vocabulary padding and the per-rank config. It reads only the config and the weight spec (spec.py,
where each weight's `Shard` rule lives) and holds no tensors; parallel.TensorParallel is the communicator.
rank_shards gathers what one rank holds, once per config and rank: its config, its weights' shapes, their stacked
buffers (Stack), its first expert; load_plan, for one load, what it reads of each checkpoint tensor and where that
goes (Read). The model reads the first, the loader (loader.py) both.

A `tp` argument here is anything with `rank`, `size` and `moe` (a parallel.TensorParallel); `None` or
size 1 means one process holding everything. Ranges are (dim, [start, stop) spans concatenated in
order). MoE experts are split either across ranks (moe="expert": each rank holds E / n whole experts)
or each within (moe="within", DEFAULT_MOE: every rank holds its slice of every expert, the expert's
own Shard rule), the router on every rank either way.

An FP8 weight's block scales (spec.SCALE) are split with it, in 128-row / 128-column blocks: each rank's
spans of the weight must start on a block and end on one or at the end of the dimension (of the part,
for a stacked expert tensor), or check_shardable names the config field that does not divide so.
"""

from __future__ import annotations

import functools
import math
from types import MappingProxyType
from typing import Mapping, NamedTuple

from .config import ModelConfig
from .families import Fusion
from .quantization import FP8_BLOCK, scale_name
from .spec import (EXPERTS, PADDED, REPLICATE, SCALE, Shard, WeightSpec, blocks, checkpoint_layout, expert_name,
                   model_spec)

Ranges = tuple[int, list[tuple[int, int]]]
MOE_MODES = ("expert", "within")  # how MoE experts are split over ranks (module docstring)
DEFAULT_MOE = "within"  # measured faster on two H200s (docs/parallel.md)


def check_moe_mode(moe) -> None:
    if moe not in MOE_MODES:
        raise ValueError(f"moe must be one of {MOE_MODES} (how experts are split over ranks), got {moe!r}")


def check_shardable(cfg: ModelConfig, size: int, moe: str = DEFAULT_MOE) -> None:
    """ValueError naming the config field that `size` ranks cannot split (experts split as `moe` says)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {size!r}")
    check_moe_mode(moe)
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
    if cfg.quantization is not None:
        _check_fp8_blocks(cfg, size, moe)


class _Rank(NamedTuple):
    rank: int
    size: int
    moe: str


def _check_fp8_blocks(cfg: ModelConfig, size: int, moe: str) -> None:
    """Every rank's share of every FP8 weight on whole 128-blocks (scale_ranges), else ValueError naming the
    weight and the config fields its split divides."""
    seen = set()
    for spec in model_spec(cfg).values():
        key = (spec.local, spec.kind)
        if not spec.fp8 or key in seen:
            continue
        seen.add(key)  # every layer's weight of this name splits alike
        for rank in range(size):
            scale_ranges(spec, weight_ranges(spec, _Rank(rank, size, moe)), size)


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


def first_expert(cfg: ModelConfig, tp) -> int:
    """The global index of this rank's first expert: rank * E / n split across ranks, else 0 (every
    rank holds every expert, or a slice of each)."""
    if not _parallel(tp) or tp.moe != "expert":
        return 0
    return tp.rank * (cfg.num_experts // tp.size)


def rule_ranges(rule: Shard, rank: int, size: int) -> Ranges:
    """The spans of `rule`'s dimension that rank `rank` of `size` holds (spec.Shard)."""
    spans, offset = [], 0
    for count, unit in rule.segments:
        if rule.mode == PADDED:
            per = math.ceil(count / size)
            first, last = min(rank * per, count), min((rank + 1) * per, count)
        elif rule.mode == REPLICATE and count < size:
            first = rank * count // size
            last = first + 1
        else:
            per = count // size
            first, last = rank * per, (rank + 1) * per
        spans.append((offset + first * unit, offset + last * unit))
        offset += count * unit
    return rule.dim, spans


def weight_ranges(spec: WeightSpec, tp) -> Ranges | None:
    """The part of a weight (or of an FP8 weight's scales: its blocks, scale_ranges) this rank holds, or
    None when it holds all of it."""
    if not _parallel(tp):
        return None
    if spec.kind == SCALE:
        return scale_ranges(spec.of, weight_ranges(spec.of, tp), tp.size)
    if spec.kind == EXPERTS and tp.moe == "expert":
        return rule_ranges(Shard(0, ((spec.shape[0], 1),)), tp.rank, tp.size)
    return rule_ranges(spec.shard, tp.rank, tp.size) if spec.shard else None


def scale_ranges(spec: WeightSpec, ranges: Ranges | None, size: int) -> Ranges | None:
    """A weight's ranges (spec: the FP8 weight) in its block-scale grid: the expert dim as it is, rows and
    columns in 128-blocks (per part for stacked experts). ValueError when a span does not start on a block,
    or ends inside one before the end of its dimension (part)."""
    if ranges is None:
        return None
    dim, spans = ranges
    *lead, rows, cols = spec.shape
    if dim < len(lead):
        return ranges
    parts = max(1, len(spec.parts)) if dim == len(lead) else 1
    length = (rows if dim == len(lead) else cols) // parts
    out = []
    for a, b in spans:
        p = min(a // length, parts - 1) if length else 0
        lo, hi = a - p * length, b - p * length
        if lo % FP8_BLOCK or hi > length or (hi % FP8_BLOCK and hi != length):
            fields = spec.shard.fields if spec.shard else ()
            what = "rows" if dim == len(lead) else "columns"
            raise ValueError(
                f"FP8 weight {spec.name!r} {tuple(spec.shape)} cannot be split over {size} tensor-parallel ranks on "
                f"its 128 x 128 scale blocks: a rank holds {what} {lo}..{hi} of {length}"
                + (f" ({' / '.join(fields)} over {size} ranks must give multiples of 128 {what})" if fields else ""))
        out.append((p * blocks(length) + lo // FP8_BLOCK, p * blocks(length) + blocks(hi)))
    return dim, out


def expert_part_ranges(spec: WeightSpec, part: int, tp) -> Ranges | None:
    """The part of one expert's checkpoint tensor `spec.parts[part]` (an EXPERTS weight's dim-1 block, of
    one expert; or of its block scales) this rank reads: all of it split across ranks (its own experts; it
    reads none of another's), its slice split within."""
    if not _parallel(tp) or tp.moe == "expert":
        return None
    dim, spans = weight_ranges(spec, tp)
    if dim != 1:  # the expert dim is gone: one dim less
        return dim - 1, spans
    rows = spec.shape[1] // len(spec.parts)
    low = part * rows
    return 0, [(a - low, b - low) for a, b in spans if low <= a and b <= low + rows]


def fusion_ranges(fusion, cfg: ModelConfig, tp) -> Ranges | None:
    """The rows of a fused checkpoint tensor (families.Fusion) this rank reads: one run, its groups'."""
    if not _parallel(tp):
        return None
    groups = fusion.groups(cfg)
    return rule_ranges(Shard(0, ((groups, fusion.rows(cfg) // groups),)), tp.rank, tp.size)


def shard_ranges(name: str, cfg: ModelConfig, tp) -> Ranges | None:
    """How our weight `name` is split: (dim, ranges of rank tp.rank, concatenated in order), or None
    when every rank holds all of it."""
    return weight_ranges(model_spec(cfg)[name], tp)


def shard_shape(spec: WeightSpec, tp) -> tuple[int, ...]:
    """The shape of a weight's shard on this rank; a PADDED rule's shard has its padded length."""
    ranges = weight_ranges(spec, tp)
    if ranges is None:
        return spec.shape
    dim, spans = ranges
    length = sum(b - a for a, b in spans)
    if spec.shard is not None and spec.shard.mode == PADDED and dim == spec.shard.dim:
        length = sum(math.ceil(count / tp.size) * unit for count, unit in spec.shard.segments)
    return tuple(length if d == dim else s for d, s in enumerate(spec.shape))


def sharded_shapes(cfg: ModelConfig, tp) -> dict[str, tuple[int, ...]]:
    """The shape of every weight's shard on this rank (the vocabulary shards padded to ceil(V / n))."""
    return {name: shard_shape(spec, tp) for name, spec in model_spec(cfg).items()}


class Read(NamedTuple):
    """What a rank reads of one checkpoint tensor and where it puts it: a tensor of the checkpoint layout
    (spec.checkpoint_layout), or a stacked expert tensor that a checkpoint may hold instead of its per-expert
    ones. Placed whole as our weight `spec.name`; with `fusion`, split into the fusion's members (at the rank's
    sizes, Shards.local); with `expert`, copied into rows `rows` of that expert of the stacked buffer."""
    shape: tuple[int, ...]  # the checkpoint tensor's
    spec: WeightSpec  # the weight (or FP8 scales) it holds; a fusion's first member
    units: tuple[str, ...]  # the checkpoint layout's tensors it provides (a stacked expert tensor: every expert's)
    ranges: Ranges | None  # the part of it this rank reads (take); None: all of it; NOTHING: none
    fusion: Fusion | None = None
    expert: int | None = None  # this rank's index of the expert
    rows: slice | None = None  # the expert's rows of the part this rank holds


NOTHING: Ranges = (0, [(0, 0)])  # the ranges of a tensor a rank reads none of (another rank's expert)


class Stack(NamedTuple):
    """Weights held back to back, rows after rows, in one buffer so that one GEMM reads them without a copy
    (ops.kernels.stacked): a run of a layer's stacked group (spec.WeightSpec.stack), or an FP8 run's scales."""
    names: tuple[str, ...]
    shape: tuple[int, ...]  # the buffer's: the members' rows summed
    rows: tuple[int, ...]  # each member's first row in it


class Shards(NamedTuple):
    """What one rank holds (rank_shards): the sizes of its shard, each of its weights' shape, the buffers its
    stacked weights share, its first expert."""
    local: ModelConfig  # local_config: the rank's heads and sizes (what its ops and cache are built for)
    shapes: Mapping[str, tuple[int, ...]]  # our weights' shard shapes (sharded_shapes; all of each on one rank)
    stacks: tuple[Stack, ...]  # the buffers of the stacked groups (_stacks), at this rank's shapes
    stack_of: Mapping[str, tuple[int, int]]  # a stacked weight's name -> (its Stack's index, its first row)
    first_expert: int


def rank_shards(cfg: ModelConfig, tp) -> Shards:
    """The Shards of rank tp.rank of tp.size (None or size 1: one process holding everything). Computed once per
    config and rank (the loader, the model and shard_weights read the same one): read-only."""
    return _rank_shards(cfg, (tp.rank, tp.size, tp.moe) if _parallel(tp) else None)


@functools.lru_cache(maxsize=16)
def _rank_shards(cfg: ModelConfig, rank: tuple[int, int, str] | None) -> Shards:
    tp = _Rank(*rank) if rank is not None else None
    shapes = sharded_shapes(cfg, tp)
    local = local_config(cfg, tp.size, tp.moe) if tp else cfg
    stacks = _stacks(cfg, shapes)
    stack_of = {n: (i, row) for i, stack in enumerate(stacks) for n, row in zip(stack.names, stack.rows)}
    return Shards(local, MappingProxyType(shapes), stacks, MappingProxyType(stack_of), first_expert(cfg, tp))


class Plan(NamedTuple):
    """What one rank reads of a config's checkpoint (load_plan): what it holds, and a Read for every checkpoint
    tensor by its name without the `model.` prefix."""
    shards: Shards
    reads: dict[str, Read]
    layout: dict[str, tuple[int, ...]]  # the checkpoint layout's tensors: what a checkpoint must provide
    stacked_of: dict[str, str]  # a per-expert tensor's name -> the stacked name that also provides it


def load_plan(cfg: ModelConfig, tp) -> Plan:
    """The Plan of rank tp.rank of tp.size (None or size 1: one process holding everything), for one load: a Read
    per tensor of the spec's checkpoint layout (a model of 512 experts has some 150,000), so it is not kept."""
    layout = checkpoint_layout(cfg)  # what the checkpoint holds (the spec's), then what this rank takes of it
    shards = rank_shards(cfg, tp)
    tp = tp if _parallel(tp) else None
    reads: dict[str, Read] = {}
    stacked_of: dict[str, str] = {}
    for s in layout:
        spec = s.spec
        if s.fusion is not None:
            reads[s.name] = Read(s.shape, spec, (s.name,), fusion_ranges(s.fusion, cfg, tp), s.fusion)
        elif s.expert is not None:
            if (s.expert, s.part) == (0, 0):  # a checkpoint may store the experts stacked, as we do
                units = tuple(expert_name(spec, e, p) for e in range(spec.shape[0]) for p in spec.parts)
                reads[spec.name] = Read(spec.shape, spec, units, weight_ranges(spec, tp))
            local_expert, held = s.expert - shards.first_expert, shards.shapes[spec.name]
            if 0 <= local_expert < held[0]:
                rows = held[1] // len(spec.parts)  # this rank's rows of the part (split within: a slice)
                reads[s.name] = Read(s.shape, spec, (s.name,), expert_part_ranges(spec, s.part, tp),
                                     expert=local_expert, rows=slice(s.part * rows, (s.part + 1) * rows))
            else:  # another rank's expert: none of it is read
                reads[s.name] = Read(s.shape, spec, (s.name,), NOTHING)
            stacked_of[s.name] = spec.name
        else:
            reads[s.name] = Read(s.shape, spec, (s.name,), weight_ranges(spec, tp))
    return Plan(shards, reads, {s.name: s.shape for s in layout}, stacked_of)


def _stacks(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> tuple[Stack, ...]:
    """Each layer's stacked groups (its weights of one WeightSpec.stack group, in position order) in runs of at
    least two members that share one buffer: consecutive members all FP8 or all not; an FP8 run goes on past a
    member only when its rows are whole 128-blocks (its scale grid's rows then line up with the weight's: one GEMM
    reads both), and its scales are a Stack too."""
    specs, groups, out = model_spec(cfg), {}, []
    for name, s in specs.items():
        if s.stack is not None:
            groups.setdefault((s.layer, s.stack[0]), []).append((s.stack[1], name))
    for members in groups.values():
        names = [name for _, name in sorted(members)]
        runs: list[list[str]] = []
        for n in names:
            last = runs[-1] if runs else None
            if (last is not None and specs[last[-1]].fp8 == specs[n].fp8
                    and (not specs[n].fp8 or shapes[last[-1]][0] % FP8_BLOCK == 0)):
                last.append(n)
            else:
                runs.append([n])
        for run in (r for r in runs if len(r) > 1):
            out += [_stack(run, shapes)] + ([_stack([scale_name(n) for n in run], shapes)] if specs[run[0]].fp8 else [])
    return tuple(out)


def _stack(names: list[str], shapes: Mapping[str, tuple[int, ...]]) -> Stack:
    rows = [0]
    for n in names:
        rows.append(rows[-1] + shapes[n][0])
    return Stack(tuple(names), (rows[-1], *shapes[names[0]][1:]), tuple(rows[:-1]))


def _parallel(tp) -> bool:
    return tp is not None and tp.size > 1
