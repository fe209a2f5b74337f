"""The op registry: every `metrale::` op's facts in one record (OpSpec), registered by the op's own
module. Tests (opcheck, references, CUDA paths), the benchmarks (inputs, FLOPs and bytes), the
profiler (kernel names) and the ONNX export (translation, mutated arguments) read it from here; the
model calls the ops through `OPS`.

An op's module declares it in four pieces (docs/ops.md, "Adding an op"; ops/l2norm.py is the
smallest):

    @metrale_op(mutates_args=(...), check=_check)   # the schema, its contract, the CPU reference
    def name(x: Tensor, ...) -> Tensor: ...
    @metrale_fake(name)                              # fake(a): fresh outputs (new_empty)
    @metrale_cuda(name)                              # cuda(a): the CUDA implementation
    register(OpSpec(name, example, cost, cuda=..., kernels=..., onnx=...))

The op's name is the function's. Its check, fake and CUDA implementation take the call's arguments
as one record `a` (`declaration(op).Args`, a named tuple of the declared parameters: `a.x`, `*a`,
defaults applied), so the signature is written once; the check runs first in every implementation
(CPU reference, fake, CUDA), and its OpInputError reads "metrale::<name>: ...".

`Shapes` is one op call's sizes: a batch of streams and the model dims the ops touch (letters as
in ops/common.py). `Shapes.from_config` makes one from a model config; tests write small ones.
"""

from __future__ import annotations

import collections
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .common import OpInputError

REGISTRY: dict[str, "OpSpec"] = {}


class OpTable:
    """The registered ops by name, as attributes: `OPS.gdn_proj(...)` calls metrale::gdn_proj (the same
    op as `torch.ops.metrale.gdn_proj`). The model calls its ops through this table, so the ONNX export
    can swap an entry for the time of a trace (`setattr`, then back)."""

    def __repr__(self) -> str:
        return f"OpTable({', '.join(vars(self))})"


OPS = OpTable()


@dataclass(frozen=True)
class Declaration:
    """What `metrale_op` keeps of an op: its name, declared signature, mutated arguments, check,
    argument record, and its CPU implementation (the declared function after the check)."""
    name: str
    signature: inspect.Signature
    mutates: tuple[str, ...]
    Args: type
    check: Callable | None
    reference: Callable

    def checked(self, fn: Callable) -> Callable:
        """fn(a) as a function of the op's arguments (shown with the op's signature)."""
        return _checked(self.name, self.signature, self.Args, self.check, fn)


_DECLARED: dict[Any, Declaration] = {}


def _checked(name: str, signature: inspect.Signature, Args: type, check: Callable | None, fn: Callable) -> Callable:
    """The op's arguments bound to an `Args` record, the check run on it, then fn(a)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        a = Args(*args, **kwargs)
        if check is not None:
            try:
                check(a)
            except OpInputError as e:
                e.args = (f"metrale::{name}: {e}",)
                raise
        return fn(a)

    run.__signature__ = signature
    return run


def _args_record(name: str, signature: inspect.Signature) -> type:
    params = list(signature.parameters.values())
    for p in params:
        if p.kind is not p.POSITIONAL_OR_KEYWORD:
            raise TypeError(f"metrale::{name}: parameter {p.name} is {p.kind.description}; metrale ops take "
                            f"positional-or-keyword parameters only")
    Args = collections.namedtuple(f"{name}_args", [p.name for p in params],
                                  defaults=[p.default for p in params if p.default is not p.empty])
    Args.__doc__ = f"The arguments of metrale::{name}{signature}, by name."
    return Args


def metrale_op(fn: Callable | None = None, /, *, mutates_args: tuple[str, ...] = (),
               check: Callable | None = None):
    """Declare `metrale::<fn.__name__>`: `torch.library.custom_op` with `mutates_args`, its schema
    inferred from fn's annotations, fn (after `check(a)`) its CPU implementation. Returns the custom op
    (torch's CustomOpDef). `check(a)` gets the arguments as a record (`Declaration.Args`) and raises
    OpInputError (common.check) on bad metadata; it must never read device data."""
    def declare(fn):
        name, signature = fn.__name__, inspect.signature(fn)
        Args = _args_record(name, signature)
        reference = functools.update_wrapper(_checked(name, signature, Args, check, lambda a: fn(*a)), fn)
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        op = torch.library.custom_op(f"metrale::{name}", reference, mutates_args=mutates_args, device_types="cpu",
                                     schema=schema)
        _bump_versions_with_defaults(op, mutates_args)
        _DECLARED[op] = Declaration(name, signature, tuple(mutates_args), Args, check, reference)
        return op
    return declare if fn is None else declare(fn)


def _bump_versions_with_defaults(op, mutates_args) -> None:
    """torch 2.11's custom-op ADInplaceOrView kernel bumps the versions of mutated arguments by their
    position among the arguments given (IndexError for an omitted optional one, e.g. gdn_recurrence's
    checkpoint pool); 2.13's fills the schema's defaults first. Register that kernel for every op with an
    optional mutated argument, so both behave alike: defaults filled, versions of the given tensors bumped,
    the call passed on below ADInplaceOrView unchanged."""
    schema = op._opoverload._schema
    mutated = [i for i, arg in enumerate(schema.arguments) if arg.name in mutates_args]
    if not any(schema.arguments[i].has_default_value() for i in mutated):
        return
    from torch._library.utils import fill_defaults
    overload = op._opoverload

    def adinplaceorview(keyset, *args, **kwargs):
        filled, _ = fill_defaults(schema, args, kwargs)
        for i in mutated:
            if isinstance(filled[i], torch.Tensor):
                torch.autograd.graph.increment_version(filled[i])
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return overload.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)

    try:
        op._lib.impl(op._name, adinplaceorview, "ADInplaceOrView", with_keyset=True, allow_override=True)
    except TypeError:  # a torch whose Library.impl has no allow_override: its python-impl record, dropped
        torch.library._impls.discard(f"{op._lib.ns}/{op._name}/ADInplaceOrView")
        op._lib.impl(op._name, adinplaceorview, "ADInplaceOrView", with_keyset=True)


def declaration(op) -> Declaration:
    """The `metrale_op` declaration of `op`; ValueError for an op declared otherwise."""
    if op not in _DECLARED:
        raise ValueError(f"{op!r} was not declared with ops.registry.metrale_op")
    return _DECLARED[op]


def metrale_fake(op, fn: Callable | None = None):
    """Register `fn(a)` as op's fake (after the check): fresh outputs of the real shapes and dtypes, made
    with `new_empty` / `empty_like` only, never views of inputs. Usable as a decorator."""
    def register_(fn):
        fake = declaration(op).checked(fn)
        op.register_fake(fake)
        return fake
    return register_ if fn is None else register_(fn)


def metrale_cuda(op, fn: Callable | None = None):
    """Register `fn(a)` as op's CUDA implementation (after the check). Returns it as a function of the
    op's arguments (what `OpSpec.cuda` holds and the tests call directly). Usable as a decorator."""
    def register_(fn):
        cuda = declaration(op).checked(fn)
        op.register_kernel("cuda")(cuda)
        return cuda
    return register_ if fn is None else register_(fn)


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
    fp8: bool = False  # the projections Qwen's FP8 checkpoints convert are float8_e4m3fn with block scales

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
                f"-HQ{self.HQ}-HKV{self.HKV}-HD{self.HD}-R{self.R}-W{self.W}-BS{self.BS}-E{self.E}k{self.TOPK}"
                + (f"-D{self.D}-I{self.I}-IE{self.IE}-IS{self.IS}-fp8" if self.fp8 else ""))

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
                   eps=cfg.rms_norm_eps, fp8=getattr(cfg, "quantization", None) is not None, **moe)


# random inputs for `example` functions: seeded on the CPU, realistic scales ----------------------
def rand(g: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def weight(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    """A projection weight [out, in] (or [E, out, in]) scaled by in**-0.5."""
    return rand(g, *shape, dtype=dtype, scale=shape[-1] ** -0.5)


def no_scale() -> torch.Tensor:
    """The scales argument of a weight that is not FP8: an empty tensor."""
    return torch.empty(0)


def fp8_weight(s: "Shapes", g: torch.Generator, dtype, *shape, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, its scales argument): a projection weight (`weight`) in dtype with no scales, or, with s.fp8,
    block-quantized (float8_e4m3fn, fp32 scales; `parts` equal parts of its rows each with its own grid)."""
    from .fp8.quant import quantize_weight_blocks

    w = weight(g, *shape, dtype=dtype)
    if not s.fp8:
        return w, no_scale()
    pieces = [quantize_weight_blocks(p) for p in w.chunk(parts, dim=-2)]
    return torch.cat([q for q, _ in pieces], dim=-2), torch.cat([sc for _, sc in pieces], dim=-2)


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
    """One op's facts. `name`, `signature`, `mutates` and `reference` come from its `metrale_op`
    declaration."""
    op: Any  # the custom op (torch.library.CustomOpDef)
    example: Callable[[Shapes, torch.dtype, torch.Generator], tuple]  # random positional arguments for a case
    cost: Callable[[Shapes], tuple[float, float]]  # (matrix FLOPs, fewest bytes moved) of one call, bf16 (FP8
    # weights at one byte with s.fp8)
    cuda: Callable | None = None  # the CUDA implementation (same arguments, `metrale_cuda`'s), or None
    kernels: tuple[str, ...] = ()  # substrings of its own CUDA kernels' names (the profile attributes time by them)
    onnx: str | None = None  # "module:function" of its ONNX translation, or None
    name: str = field(init=False)
    signature: inspect.Signature = field(init=False)
    mutates: tuple[str, ...] = field(init=False)
    # plain-torch CPU reference (the spec the CUDA path is tested against): the declared function,
    # check first, called with the op's arguments without the dispatcher
    reference: Callable = field(init=False)

    def __post_init__(self):
        decl = declaration(self.op)
        object.__setattr__(self, "name", decl.name)
        object.__setattr__(self, "signature", decl.signature)
        object.__setattr__(self, "mutates", decl.mutates)
        object.__setattr__(self, "reference", decl.reference)

    @property
    def mutated_positions(self) -> list[int]:
        """Positions, among the op's arguments, of the ones it mutates."""
        return [i for i, n in enumerate(self.signature.parameters) if n in self.mutates]


def register(spec: OpSpec) -> OpSpec:
    """Add `spec` to REGISTRY and its op to OPS."""
    if spec.name in REGISTRY and REGISTRY[spec.name].op is not spec.op:
        raise ValueError(f"metrale::{spec.name} is registered twice")
    REGISTRY[spec.name] = spec
    setattr(OPS, spec.name, spec.op)
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

