"""The op registry: every `metrale::` op's facts in one record (OpSpec), registered by the op's own
module. Tests (opcheck, references, CUDA paths), the benchmarks (inputs, FLOPs and bytes), the
profiler (kernel names) and the ONNX export (translation, mutated arguments) read it from here.

Adding an op: write `ops/<name>.py` (the op through `metrale_op`, its fake, CPU reference, CUDA
path, `example` and `cost`, and `register(OpSpec(...))` at the bottom), then import it in
ops/__init__.py. That import is the registry line.

`Shapes` is one op call's sizes: a batch of streams and the model dims the ops touch (letters as
in ops/common.py). `Shapes.from_config` makes one from a model config; tests write small ones.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

REGISTRY: dict[str, "OpSpec"] = {}
_PROTOTYPES: dict[int, tuple[str, inspect.Signature, tuple[str, ...]]] = {}


def metrale_op(name: str, mutates_args: tuple[str, ...] = ()):
    """`torch.library.custom_op("metrale::<name>", mutates_args, device_types="cpu")`: the decorated
    function is the op's schema and its CPU implementation. Also keeps the function's signature,
    which the ONNX export builds the op's functional twin from."""
    def wrap(fn):
        op = torch.library.custom_op(f"metrale::{name}", mutates_args=mutates_args, device_types="cpu")(fn)
        _PROTOTYPES[id(op)] = (name, inspect.signature(fn), tuple(mutates_args))
        return op
    return wrap


@dataclass(frozen=True)
class Shapes:
    """Sizes of one op call: streams of `lengths` new tokens after `context` cached ones, in a cache of
    `num_slots` slots (+ the scratch slot) and `num_blocks` KV blocks of BS tokens (+ the null block)."""
    lengths: tuple[int, ...]
    context: tuple[int, ...]
    H: int = 2
    HV: int = 4
    K: int = 16
    V: int = 24
    D: int = 32
    I: int = 40
    HQ: int = 4
    HKV: int = 2
    HD: int = 16
    R: int = 8  # rotary dim
    W: int = 4
    BS: int = 16
    num_slots: int = 6
    num_blocks: int = 24
    eps: float = 1e-6
    E: int = 6  # experts (MoE layers)
    TOPK: int = 2  # experts per token
    IE: int = 24  # expert intermediate size
    IS: int = 16  # shared expert intermediate size

    @property
    def T(self) -> int:
        return sum(self.lengths)

    @property
    def B(self) -> int:
        return len(self.lengths)

    @property
    def C(self) -> int:  # conv channels: [q | k | v]
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def id(self) -> str:
        return (f"L{'-'.join(map(str, self.lengths))}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}"
                f"-HQ{self.HQ}-HKV{self.HKV}-HD{self.HD}-R{self.R}-W{self.W}-BS{self.BS}-E{self.E}k{self.TOPK}")

    @classmethod
    def from_config(cls, cfg, lengths, context=None, block_size: int = 64) -> "Shapes":
        """A model config's dims for streams of `lengths` (fresh unless `context` is given), each in
        its own slot with just enough blocks."""
        context = tuple(context or (0,) * len(lengths))
        moe = dict(E=cfg.num_experts, TOPK=cfg.num_experts_per_tok, IE=cfg.moe_intermediate_size,
                   IS=cfg.shared_expert_intermediate_size) if getattr(cfg, "num_experts", 0) else {}
        per_stream = max(-(-(c + n) // block_size) for c, n in zip(context, lengths))
        return cls(lengths=tuple(lengths), context=context, H=cfg.linear_num_key_heads,
                   HV=cfg.linear_num_value_heads, K=cfg.linear_key_head_dim, V=cfg.linear_value_head_dim,
                   D=cfg.hidden_size, I=cfg.intermediate_size, HQ=cfg.num_attention_heads,
                   HKV=cfg.num_key_value_heads, HD=cfg.head_dim, R=cfg.rotary_dim, W=cfg.linear_conv_kernel_dim,
                   BS=block_size, num_slots=len(lengths), num_blocks=len(lengths) * per_stream,
                   eps=cfg.rms_norm_eps, **moe)


# random inputs for `example` functions: seeded on the CPU, realistic scales ----------------------
def rand(g: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def weight(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    """A projection weight [out, in] (or [E, out, in]) scaled by in**-0.5."""
    return rand(g, *shape, dtype=dtype, scale=shape[-1] ** -0.5)


def norm_weight(g: torch.Generator, n: int, dtype=torch.float32) -> torch.Tensor:
    """A zero-centred RMSNorm weight."""
    return rand(g, n, dtype=dtype, scale=0.2)


def stream_meta(s: Shapes, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """cu_seqlens [B+1] int32, slot_ids [B] int64 (distinct; zero-length streams on the scratch slot),
    context_lens [B] int32, block_tables [B, MB] int32 (distinct blocks)."""
    B = s.B
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(s.lengths).cumsum(0)
    real = torch.randperm(s.num_slots, generator=g)[:B]
    slots = torch.where(torch.tensor(s.lengths) > 0, real, torch.full_like(real, s.num_slots))
    mb = s.num_blocks // B
    blocks = torch.randperm(s.num_blocks, generator=g)[: mb * B].view(B, mb).to(torch.int32)
    ctx = torch.tensor(s.context, dtype=torch.int32)
    if any(c + n > mb * s.BS for c, n in zip(s.context, s.lengths)):
        raise ValueError(f"{s.id}: {s.num_blocks} blocks of {s.BS} cannot hold every stream")
    return cu, slots, ctx, blocks


@dataclass(frozen=True)
class OpSpec:
    """One op's facts. `name`, `signature` and `mutates` come from its `metrale_op` declaration."""
    op: Any  # the custom op (torch.library.CustomOpDef)
    reference: Callable  # plain-torch CPU reference, the op's arguments (the spec the CUDA path is tested against)
    example: Callable[[Shapes, torch.dtype, torch.Generator], tuple]  # random positional arguments for a case
    cost: Callable[[Shapes], tuple[float, float]]  # (matrix FLOPs, fewest bytes moved) of one call, bf16
    cuda: Callable | None = None  # the CUDA implementation (same arguments), or None
    kernels: tuple[str, ...] = ()  # substrings of its own CUDA kernels' names (the profile attributes time by them)
    onnx: str | None = None  # "module:function" of its ONNX translation, or None
    name: str = field(init=False)
    signature: inspect.Signature = field(init=False)
    mutates: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        if id(self.op) not in _PROTOTYPES:
            raise ValueError(f"{self.op!r} was not declared with ops.registry.metrale_op")
        name, signature, mutates = _PROTOTYPES[id(self.op)]
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "signature", signature)
        object.__setattr__(self, "mutates", mutates)

    @property
    def mutated_positions(self) -> list[int]:
        """Positions, among the op's arguments, of the ones it mutates."""
        return [i for i, n in enumerate(self.signature.parameters) if n in self.mutates]


def register(spec: OpSpec) -> OpSpec:
    if spec.name in REGISTRY and REGISTRY[spec.name].op is not spec.op:
        raise ValueError(f"metrale::{spec.name} is registered twice")
    REGISTRY[spec.name] = spec
    return spec


def example_args(name: str, shapes: Shapes, dtype: torch.dtype, seed: int = 0, device=None) -> tuple:
    """Positional arguments of metrale::<name> for `shapes` (drawn on the CPU, then moved to `device`)."""
    args = REGISTRY[name].example(shapes, dtype, torch.Generator().manual_seed(seed))
    if device is None:
        return args
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def attention_pairs(s: Shapes) -> float:
    """(query, key) pairs of causal attention over cached + new tokens."""
    return sum(n * c + n * (n + 1) / 2 for n, c in zip(s.lengths, s.context))

