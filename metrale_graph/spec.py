"""Weight specs: every tensor a model holds, block by block, and for each how it is shaped, split under
tensor parallelism, drawn at random, stacked for the GEMM that reads it, and what kind of tensor it is
(a projection [out, in], a stacked expert tensor [E, out, in], ...).

Everything that lists or walks the weights derives from here: `weight_shapes`, random initialization,
the checkpoint loader and saver (weights.py), the tensor-parallel plan (sharding.py) and the model's
choice of feed-forward op per layer. Our names are transformers' in-memory module names without the
`model.` prefix (`layers.3.linear_attn.in_proj_qkv.weight`, `layers.0.mlp.experts.gate_up_proj`).

A layer is its two norms, its feed-forward block (`feed_forward`: a sparse MoE block on the layers of
`config.moe_layers`, else a dense MLP) and its mixer block (by `config.layer_types`: Gated DeltaNet or
gated full attention), in that order; the embedding comes first, the final norm and the LM head
(untied models) last. This order is the order of `weight_shapes` and of the random draws.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import torch

from .config import FULL, LINEAR, ModelConfig

# kinds of weight
PROJECTION = "projection"  # a linear layer's weight [out, in] (what FP8 checkpoints store block-quantized)
EXPERTS = "experts"  # every expert's projection stacked [E, out, in]; the checkpoint stores one tensor per expert
EMBEDDING = "embedding"  # the token embedding [V, D]
VECTOR = "vector"  # 1-D: norm weights, A_log, dt_bias
CONV = "conv"  # the GDN depthwise conv kernel [C, 1, W]
KINDS = (PROJECTION, EXPERTS, EMBEDDING, VECTOR, CONV)

# feed-forward blocks (mixer blocks are named by config.layer_types)
MLP, MOE = "mlp", "moe"

# how a Shard hands out its units
EVEN = "even"  # count / n units to each rank (check_shardable: n divides count)
REPLICATE = "replicate"  # as EVEN; with fewer units than ranks, rank r holds unit r * count // n (KV heads)
PADDED = "padded"  # ceil(count / n) units each, the last rank's short and padded with zeros (the vocabulary)


class Shard(NamedTuple):
    """How tensor parallelism splits a weight: dimension `dim` is `segments` laid end to end, each
    (count, size): `count` units of `size` elements (heads of a head dim, rows of one); rank r of n holds
    its share of the units of every segment, concatenated in order (sharding.rule_ranges)."""
    dim: int
    segments: tuple[tuple[int, int], ...]
    mode: str = EVEN


class Init(NamedTuple):
    """A random draw: `normal` (mean a, std b), `uniform` on [a, b), or `log_uniform` (log of uniform [a, b))."""
    how: str
    a: float
    b: float

    def draw(self, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Fill `t` in place from `gen`; returns it."""
        if self.how == "normal":
            return t.normal_(self.a, self.b, generator=gen)
        if self.how == "uniform":
            return t.uniform_(self.a, self.b, generator=gen)
        if self.how == "log_uniform":
            return t.uniform_(self.a, self.b, generator=gen).log_()
        raise ValueError(f"unknown init {self.how!r}; expected 'normal', 'uniform' or 'log_uniform'")


SCALED = Init("normal", 0.0, 0.02)  # embeddings and projections: transformers' initializer_range
ZERO_CENTRED = Init("normal", 0.0, 0.1)  # RMSNorm weights, applied as (1 + w)


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of the model. `shard` None: every rank holds all of it; for EXPERTS, how each expert
    is split within (moe="within"; split across ranks, each rank holds E / n whole experts). `stack`:
    (group, position): stored back to back with the other members of its layer's group, in position
    order, so the op reads them as one GEMM without a copy (ops.kernels.stacked). `parts` (EXPERTS):
    the checkpoint's per-expert tensors, dim 1 split evenly among them (`experts.{e}.{part}.weight`)."""
    name: str
    shape: tuple[int, ...]
    kind: str
    init: Init
    shard: Shard | None = None
    stack: tuple[str, int] | None = None
    parts: tuple[str, ...] = ()
    layer: int | None = None  # the layer it belongs to (None: embedding, final norm, LM head)

    @property
    def local(self) -> str:
        """The name within its layer (`linear_attn.in_proj_qkv.weight`), or the whole name outside layers."""
        return self.name if self.layer is None else self.name[len(f"layers.{self.layer}."):]


def _projection(name, out_features, in_features, shard=None, stack=None) -> WeightSpec:
    return WeightSpec(name, (out_features, in_features), PROJECTION, SCALED, shard, stack)


def _vector(name, size, init=ZERO_CENTRED, shard=None) -> WeightSpec:
    return WeightSpec(name, (size,), VECTOR, init, shard)


def _rows(*segments, mode=EVEN) -> Shard:
    return Shard(0, segments, mode)


def _columns(*segments) -> Shard:
    return Shard(1, segments)


def norms_block(cfg: ModelConfig) -> list[WeightSpec]:
    D = cfg.hidden_size
    return [_vector("input_layernorm.weight", D), _vector("post_attention_layernorm.weight", D)]


def mlp_block(cfg: ModelConfig) -> list[WeightSpec]:
    """A dense SiLU-gated MLP: gate / up rows and down columns split over ranks."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    return [_projection("mlp.gate_proj.weight", I, D, _rows((I, 1)), (MLP, 0)),
            _projection("mlp.up_proj.weight", I, D, _rows((I, 1)), (MLP, 1)),
            _projection("mlp.down_proj.weight", D, I, _columns((I, 1)))]


def moe_block(cfg: ModelConfig) -> list[WeightSpec]:
    """A sparse MoE block: the router (on every rank), the experts stacked (gate rows then up rows of each),
    a shared expert split like a dense MLP and its one-row sigmoid gate. The shared expert's gate / up and
    the router form one stacked group, in ops.moe's order (the one-row gate stays apart: a [2 IS + E + 1]-row
    GEMM output is unaligned)."""
    D, E, IE, IS = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return [_projection("mlp.gate.weight", E, D, stack=(MOE, 2)),
            WeightSpec("mlp.experts.gate_up_proj", (E, 2 * IE, D), EXPERTS, SCALED, Shard(1, ((IE, 1), (IE, 1))),
                       parts=("gate_proj", "up_proj")),
            WeightSpec("mlp.experts.down_proj", (E, D, IE), EXPERTS, SCALED, Shard(2, ((IE, 1),)),
                       parts=("down_proj",)),
            _projection("mlp.shared_expert.gate_proj.weight", IS, D, _rows((IS, 1)), (MOE, 0)),
            _projection("mlp.shared_expert.up_proj.weight", IS, D, _rows((IS, 1)), (MOE, 1)),
            _projection("mlp.shared_expert.down_proj.weight", D, IS, _columns((IS, 1))),
            _projection("mlp.shared_expert_gate.weight", 1, D)]


def gdn_block(cfg: ModelConfig) -> list[WeightSpec]:
    """Gated DeltaNet: key heads split over ranks with their value heads (qkv / conv channels [q | k | v],
    z, b, a, A_log, dt_bias by value head), out_proj by its input columns; the gated norm everywhere."""
    D, H, HV = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    channels, heads = _rows((H, K), (H, K), (HV, V)), _rows((HV, 1))
    return [_projection("linear_attn.in_proj_qkv.weight", cfg.conv_dim, D, channels, ("gdn", 0)),
            _projection("linear_attn.in_proj_z.weight", cfg.value_dim, D, _rows((HV, V)), ("gdn", 1)),
            _projection("linear_attn.in_proj_b.weight", HV, D, heads, ("gdn", 2)),
            _projection("linear_attn.in_proj_a.weight", HV, D, heads, ("gdn", 3)),
            WeightSpec("linear_attn.conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), CONV,
                       Init("uniform", -0.5, 0.5), channels),
            _vector("linear_attn.A_log", HV, Init("log_uniform", 1.0, 16.0), heads),
            _vector("linear_attn.dt_bias", HV, Init("uniform", 0.5, 1.5), heads),
            _vector("linear_attn.norm.weight", V, Init("normal", 1.0, 0.1)),  # the gated norm: a plain weight
            _projection("linear_attn.out_proj.weight", D, cfg.value_dim, _columns((HV, V)))]


def attention_block(cfg: ModelConfig) -> list[WeightSpec]:
    """Gated full attention: query heads split (q_proj rows [q_h | gate_h] per head, o_proj columns); KV
    heads split, or, with fewer KV heads than ranks, each rank holds the one its query heads read."""
    D, HD, HQ, HKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    kv = _rows((HKV, HD), mode=REPLICATE)
    return [_projection("self_attn.q_proj.weight", HQ * HD * 2, D, _rows((HQ, 2 * HD)), ("attention", 0)),
            _projection("self_attn.k_proj.weight", HKV * HD, D, kv, ("attention", 1)),
            _projection("self_attn.v_proj.weight", HKV * HD, D, kv, ("attention", 2)),
            _projection("self_attn.o_proj.weight", D, HQ * HD, _columns((HQ, HD))),
            _vector("self_attn.q_norm.weight", HD),
            _vector("self_attn.k_norm.weight", HD)]


# a layer's blocks: mixers by config.layer_types, feed-forward blocks by feed_forward()
MIXERS: dict[str, Callable[[ModelConfig], list[WeightSpec]]] = {LINEAR: gdn_block, FULL: attention_block}
FEED_FORWARDS: dict[str, Callable[[ModelConfig], list[WeightSpec]]] = {MLP: mlp_block, MOE: moe_block}


def feed_forward(cfg: ModelConfig, layer: int) -> str:
    """The feed-forward block of a layer: MOE on the layers of config.moe_layers, else MLP."""
    return MOE if layer in cfg.moe_layers else MLP


@functools.lru_cache(maxsize=32)
def model_spec(cfg: ModelConfig) -> Mapping[str, WeightSpec]:
    """Every weight of the config, by name, in the module docstring's order (a read-only mapping)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    vocab = _rows((V, 1), mode=PADDED)
    specs = [WeightSpec("embed_tokens.weight", (V, D), EMBEDDING, SCALED, vocab)]
    moe = set(cfg.moe_layers)
    for i, kind in enumerate(cfg.layer_types):
        block = norms_block(cfg) + FEED_FORWARDS[MOE if i in moe else MLP](cfg) + MIXERS[kind](cfg)
        specs += [dataclasses.replace(s, name=f"layers.{i}.{s.name}", layer=i) for s in block]
    specs.append(_vector("norm.weight", D))
    if not cfg.tie_word_embeddings:
        specs.append(_projection("lm_head.weight", V, D, vocab))
    return MappingProxyType({s.name: s for s in specs})


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by name, with its shape."""
    return {name: s.shape for name, s in model_spec(cfg).items()}


def stacked_groups(cfg: ModelConfig) -> list[list[str]]:
    """Each layer's stacked groups: the names of its members, in position order (WeightSpec.stack)."""
    groups: dict[tuple[int | None, str], list[tuple[int, str]]] = {}
    for name, s in model_spec(cfg).items():
        if s.stack is not None:
            groups.setdefault((s.layer, s.stack[0]), []).append((s.stack[1], name))
    return [[name for _, name in sorted(members)] for members in groups.values()]


def weight_bytes(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes that tensors of these shapes take in `dtype`."""
    return sum(torch.Size(shape).numel() for shape in shapes.values()) * dtype.itemsize
