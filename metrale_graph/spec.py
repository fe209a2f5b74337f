"""Weight specs: every tensor a model holds, block by block, and for each how it is shaped, split under
tensor parallelism, drawn at random, stacked for the GEMM that reads it, and what kind of tensor it is
(a projection [out, in], a stacked expert tensor [E, out, in], ...).

Everything that lists or walks the weights derives from here: `weight_shapes`, random initialization,
the checkpoint layout (`checkpoint_layout`, below) the loader (loader.py) and the saver read, the
tensor-parallel plan (sharding.py) and the model's choice of feed-forward op per layer. Our names are
transformers' in-memory module names without the `model.` prefix (`layers.3.linear_attn.in_proj_qkv.weight`,
`layers.0.mlp.experts.gate_up_proj`).

A layer is its two norms, its feed-forward block (`feed_forward`: a sparse MoE block on the layers of
`config.moe_layers`, else a dense MLP) and its mixer block (by `config.layer_types`: Gated DeltaNet or
gated full attention), in that order; the embedding comes first, the final norm and the LM head
(untied models) after the layers, and the multi-token-prediction head (`mtp_block`, when
config.mtp_num_hidden_layers > 0) last. This order is the order of `weight_shapes` and of the random draws
(a config with an MTP head draws the same main weights as the one without).

The MTP head (Qwen3.5 / Qwen3-Next checkpoints' `mtp.*`, named as they name it): `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden` (zero-centred RMSNorm weights [D]), `mtp.fc` [D, 2 D] (a projection of the two
normed halves, embedding first; held whole on every tensor-parallel rank), its decoder layers
`mtp.layers.{i}.*` (each a full-attention layer of the model's kind: norms, feed-forward as
config.mtp_moe_layers says, gated attention; split over ranks like the main layers), and `mtp.norm`. Its
layers carry layer indices after the main model's (num_hidden_layers + i) and `layer_prefix`
`mtp.layers.{i}.`. It shares the embeddings and the LM head (speculative/mtp.py runs it).

FP8 (config.quantization, quantization.py): a weight that may be FP8 (`quantizable`: projections and
experts but the router, the shared-expert gate and lm_head) and that the quantization_config converts
is `fp8` (float8_e4m3fn in memory), and its block scales follow it as a SCALE spec (`of`: the weight;
fp32 [ceil(N / 128), ceil(K / 128)], for experts [E, parts * ceil(rows / 128), ceil(K / 128)], each part's
grid in turn). A family's fused checkpoint tensor is converted or not as one module (its name). Under a
compressed-tensors checkpoint's config the converted weights are those its files hold as FP8 with 128 x 128-block
scales (with requantize_fp8: any scales; compressed_tensors.py), every expert of a layer and part alike, a fused
tensor only on whole 128-row blocks; its other FP8 weights are dequantized at load.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

import torch

from .config import FULL, LINEAR, ModelConfig
from .families import Fusion
from .quantization import FP8_BLOCK, scale_name

# kinds of weight
PROJECTION = "projection"  # a linear layer's weight [out, in] (what FP8 checkpoints store block-quantized)
EXPERTS = "experts"  # every expert's projection stacked [E, out, in]; the checkpoint stores one tensor per expert
EMBEDDING = "embedding"  # the token embedding [V, D]
VECTOR = "vector"  # 1-D: norm weights, A_log, dt_bias
CONV = "conv"  # the GDN depthwise conv kernel [C, 1, W]
SCALE = "scale"  # an FP8 weight's block scales (weight_scale_inv, fp32): `of` is the weight
KINDS = (PROJECTION, EXPERTS, EMBEDDING, VECTOR, CONV, SCALE)

# feed-forward blocks (mixer blocks are named by config.layer_types)
MLP, MOE = "mlp", "moe"

# how a Shard hands out its units
EVEN = "even"  # count / n units to each rank (check_shardable: n divides count)
REPLICATE = "replicate"  # as EVEN; with fewer units than ranks, rank r holds unit r * count // n (KV heads)
PADDED = "padded"  # ceil(count / n) units each, the last rank's short and padded with zeros (the vocabulary)


class Shard(NamedTuple):
    """How tensor parallelism splits a weight: dimension `dim` is `segments` laid end to end, each
    (count, size): `count` units of `size` elements (heads of a head dim, rows of one); rank r of n holds
    its share of the units of every segment, concatenated in order (sharding.rule_ranges). `fields`: the
    config fields whose units it splits (for errors)."""
    dim: int
    segments: tuple[tuple[int, int], ...]
    mode: str = EVEN
    fields: tuple[str, ...] = ()


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
    the checkpoint's per-expert tensors, dim 1 split evenly among them (`experts.{e}.{part}.weight`).
    `quantizable`: may be stored FP8; `fp8`: is (module docstring); `of`: a SCALE spec's weight."""
    name: str
    shape: tuple[int, ...]
    kind: str
    init: Init | None
    shard: Shard | None = None
    stack: tuple[str, int] | None = None
    parts: tuple[str, ...] = ()
    layer: int | None = None  # the layer it belongs to (None: embedding, final norm, LM head, MTP fc / norms)
    quantizable: bool = False
    fp8: bool = False
    of: "WeightSpec | None" = None
    layer_prefix: str = ""  # its layer's part of the name: `layers.3.`, `mtp.layers.0.` ("" outside layers)

    @property
    def module(self) -> str:
        """transformers' module of the weight, our naming (`layers.0.mlp.gate_proj`, `layers.0.mlp.experts`)."""
        return self.name.rsplit(".", 1)[0]

    @property
    def local(self) -> str:
        """The name within its layer (`linear_attn.in_proj_qkv.weight`), or the whole name outside layers."""
        return self.name[len(self.layer_prefix):]


def _projection(name, out_features, in_features, shard=None, stack=None, quantizable=True) -> WeightSpec:
    return WeightSpec(name, (out_features, in_features), PROJECTION, SCALED, shard, stack, quantizable=quantizable)


def _vector(name, size, init=ZERO_CENTRED, shard=None) -> WeightSpec:
    return WeightSpec(name, (size,), VECTOR, init, shard)


def _rows(*segments, mode=EVEN, fields=()) -> Shard:
    return Shard(0, segments, mode, fields)


def _columns(*segments, fields=()) -> Shard:
    return Shard(1, segments, fields=fields)


def norms_block(cfg: ModelConfig) -> list[WeightSpec]:
    D = cfg.hidden_size
    return [_vector("input_layernorm.weight", D), _vector("post_attention_layernorm.weight", D)]


def mlp_block(cfg: ModelConfig) -> list[WeightSpec]:
    """A dense SiLU-gated MLP: gate / up rows and down columns split over ranks."""
    D, I = cfg.hidden_size, cfg.intermediate_size
    f = ("intermediate_size",)
    return [_projection("mlp.gate_proj.weight", I, D, _rows((I, 1), fields=f), (MLP, 0)),
            _projection("mlp.up_proj.weight", I, D, _rows((I, 1), fields=f), (MLP, 1)),
            _projection("mlp.down_proj.weight", D, I, _columns((I, 1), fields=f))]


def moe_block(cfg: ModelConfig) -> list[WeightSpec]:
    """A sparse MoE block: the router (on every rank), the experts stacked (gate rows then up rows of each),
    a shared expert split like a dense MLP and its one-row sigmoid gate. The shared expert's gate / up and
    the router form one stacked group, in ops.moe's order (the one-row gate stays apart: a [2 IS + E + 1]-row
    GEMM output is unaligned). The router and the one-row gate stay in floating point under FP8 (transformers'
    router is no nn.Linear it converts; the gate is read inside the MoE combine kernel)."""
    D, E, IE, IS = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    fe, fs = ("moe_intermediate_size",), ("shared_expert_intermediate_size",)
    return [_projection("mlp.gate.weight", E, D, stack=(MOE, 2), quantizable=False),
            WeightSpec("mlp.experts.gate_up_proj", (E, 2 * IE, D), EXPERTS, SCALED,
                       Shard(1, ((IE, 1), (IE, 1)), fields=fe), parts=("gate_proj", "up_proj"), quantizable=True),
            WeightSpec("mlp.experts.down_proj", (E, D, IE), EXPERTS, SCALED, Shard(2, ((IE, 1),), fields=fe),
                       parts=("down_proj",), quantizable=True),
            _projection("mlp.shared_expert.gate_proj.weight", IS, D, _rows((IS, 1), fields=fs), (MOE, 0)),
            _projection("mlp.shared_expert.up_proj.weight", IS, D, _rows((IS, 1), fields=fs), (MOE, 1)),
            _projection("mlp.shared_expert.down_proj.weight", D, IS, _columns((IS, 1), fields=fs)),
            _projection("mlp.shared_expert_gate.weight", 1, D, quantizable=False)]


def gdn_block(cfg: ModelConfig) -> list[WeightSpec]:
    """Gated DeltaNet: key heads split over ranks with their value heads (qkv / conv channels [q | k | v],
    z, b, a, A_log, dt_bias by value head), out_proj by its input columns; the gated norm everywhere."""
    D, H, HV = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    fk, fv = ("linear_num_key_heads", "linear_num_value_heads"), ("linear_num_value_heads",)
    channels, heads = _rows((H, K), (H, K), (HV, V), fields=fk), _rows((HV, 1), fields=fv)
    return [_projection("linear_attn.in_proj_qkv.weight", cfg.conv_dim, D, channels, ("gdn", 0)),
            _projection("linear_attn.in_proj_z.weight", cfg.value_dim, D, _rows((HV, V), fields=fv), ("gdn", 1)),
            _projection("linear_attn.in_proj_b.weight", HV, D, heads, ("gdn", 2)),
            _projection("linear_attn.in_proj_a.weight", HV, D, heads, ("gdn", 3)),
            WeightSpec("linear_attn.conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), CONV,
                       Init("uniform", -0.5, 0.5), channels),
            _vector("linear_attn.A_log", HV, Init("log_uniform", 1.0, 16.0), heads),
            _vector("linear_attn.dt_bias", HV, Init("uniform", 0.5, 1.5), heads),
            _vector("linear_attn.norm.weight", V, Init("normal", 1.0, 0.1)),  # the gated norm: a plain weight
            _projection("linear_attn.out_proj.weight", D, cfg.value_dim, _columns((HV, V), fields=fv))]


def attention_block(cfg: ModelConfig) -> list[WeightSpec]:
    """Gated full attention: query heads split (q_proj rows [q_h | gate_h] per head, o_proj columns); KV
    heads split, or, with fewer KV heads than ranks, each rank holds the one its query heads read."""
    D, HD, HQ, HKV = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    fq = ("num_attention_heads",)
    kv = _rows((HKV, HD), mode=REPLICATE, fields=("num_key_value_heads",))
    return [_projection("self_attn.q_proj.weight", HQ * HD * 2, D, _rows((HQ, 2 * HD), fields=fq), ("attention", 0)),
            _projection("self_attn.k_proj.weight", HKV * HD, D, kv, ("attention", 1)),
            _projection("self_attn.v_proj.weight", HKV * HD, D, kv, ("attention", 2)),
            _projection("self_attn.o_proj.weight", D, HQ * HD, _columns((HQ, HD), fields=fq)),
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
    vocab = _rows((V, 1), mode=PADDED, fields=("vocab_size",))
    specs = [WeightSpec("embed_tokens.weight", (V, D), EMBEDDING, SCALED, vocab)]
    moe = set(cfg.moe_layers)
    for i, kind in enumerate(cfg.layer_types):
        block = norms_block(cfg) + FEED_FORWARDS[MOE if i in moe else MLP](cfg) + MIXERS[kind](cfg)
        specs += _in_layer(block, f"layers.{i}.", i)
    specs.append(_vector("norm.weight", D))
    if not cfg.tie_word_embeddings:
        specs.append(_projection("lm_head.weight", V, D, vocab, quantizable=False))
    if cfg.mtp_num_hidden_layers:
        specs += mtp_block(cfg)
    if cfg.quantization is not None:
        specs = _quantized(specs, cfg)
    return MappingProxyType({s.name: s for s in specs})


def mtp_feed_forward(cfg: ModelConfig, mtp_layer: int) -> str:
    """The feed-forward block of MTP layer `mtp_layer` (0 ..): MOE on config.mtp_moe_layers, else MLP."""
    return MOE if mtp_layer in cfg.mtp_moe_layers else MLP


def mtp_block(cfg: ModelConfig) -> list[WeightSpec]:
    """The multi-token-prediction head (module docstring): the fc's norms and fc, its decoder layers, its norm."""
    D, L = cfg.hidden_size, cfg.num_hidden_layers
    specs = [_vector("mtp.pre_fc_norm_embedding.weight", D), _vector("mtp.pre_fc_norm_hidden.weight", D),
             _projection("mtp.fc.weight", D, 2 * D)]
    for i in range(cfg.mtp_num_hidden_layers):
        block = norms_block(cfg) + FEED_FORWARDS[mtp_feed_forward(cfg, i)](cfg) + attention_block(cfg)
        specs += _in_layer(block, f"mtp.layers.{i}.", L + i)
    return specs + [_vector("mtp.norm.weight", D)]


def _in_layer(block: list[WeightSpec], prefix: str, layer: int) -> list[WeightSpec]:
    return [dataclasses.replace(s, name=prefix + s.name, layer=layer, layer_prefix=prefix) for s in block]


def _quantized(specs: list[WeightSpec], cfg: ModelConfig) -> list[WeightSpec]:
    """The specs with each weight the quantization_config converts marked fp8 and followed by its scales."""
    out = []
    for s in specs:
        fusion = cfg.family.fusion_of(s.local) if s.layer is not None else None
        module = f"{s.layer_prefix}{fusion.name.rsplit('.', 1)[0]}" if fusion is not None else s.module
        leaves = tuple(f"{e}.{part}" for e in range(s.shape[0]) for part in s.parts) if s.kind == EXPERTS else ()
        if not (s.quantizable and cfg.quantization.converts(module, leaves)) or (
                fusion is not None and cfg.quantization.compressed is not None and not _whole_blocks(fusion, cfg)):
            out.append(s)  # (a compressed-tensors file's FP8 fused tensor that 128-row blocks cannot split: dequantized)
            continue
        s = dataclasses.replace(s, fp8=True)
        out += [s, WeightSpec(scale_name(s.name), scale_shape(s), SCALE, None, layer=s.layer, parts=s.parts, of=s,
                              layer_prefix=s.layer_prefix)]
    return out


def blocks(n: int) -> int:
    """128-blocks covering n (ceil)."""
    return -(-n // FP8_BLOCK)


def scale_shape(spec: WeightSpec) -> tuple[int, ...]:
    """The block-scale grid of a weight: [NB, KB], or for experts [E, parts * blocks(rows of a part), KB]."""
    *lead, rows, cols = spec.shape
    parts = max(1, len(spec.parts))
    return (*lead, parts * blocks(rows // parts), blocks(cols))


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by name, with its shape."""
    return {name: s.shape for name, s in model_spec(cfg).items()}


def weight_bytes(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, cfg: ModelConfig | None = None) -> int:
    """Bytes that tensors of these shapes take in `dtype`; with `cfg`, its FP8 weights (spec.fp8) one byte an
    element and their scales four (weight_dtype)."""
    spec = model_spec(cfg) if cfg is not None else {}
    return sum(torch.Size(shape).numel() * weight_dtype(spec[n], dtype).itemsize if n in spec
               else torch.Size(shape).numel() * dtype.itemsize for n, shape in shapes.items())


FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32


def weight_dtype(spec: WeightSpec, dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight is held in by a model of `dtype`: float8_e4m3fn if fp8, fp32 for scales."""
    return FP8_DTYPE if spec.fp8 else SCALE_DTYPE if spec.kind == SCALE else dtype


# ---- the checkpoint layout: the tensors transformers' save_pretrained writes, and what each holds of ours ----

class Stored(NamedTuple):
    """One tensor of the checkpoint layout (name without the `model.` prefix) and what it holds: our
    weight `spec` whole, one expert's part of it (`expert`, `part`: an index into spec.parts), or, with
    `fusion`, every member of the family's fusion in that layer (`spec`: its first member)."""
    name: str
    shape: tuple[int, ...]
    spec: WeightSpec
    expert: int | None = None
    part: int = 0
    fusion: Fusion | None = None


def expert_name(spec: WeightSpec, expert: int, part: str) -> str:
    """`layers.0.mlp.experts.gate_up_proj`, 3, `up_proj` -> `layers.0.mlp.experts.3.up_proj.weight` (its
    block scales, `..._scale_inv`: `layers.0.mlp.experts.3.up_proj.weight_scale_inv`)."""
    leaf = scale_name("weight") if spec.kind == SCALE else "weight"
    return f"{spec.name.rsplit('.', 1)[0]}.{expert}.{part}.{leaf}"


def _whole_blocks(fusion: Fusion, cfg: ModelConfig) -> bool:
    """Whether each member's rows per group of a fused tensor are whole 128-row blocks (its scales then split)."""
    return not any(n % FP8_BLOCK for member in fusion.segments(cfg) for n in member)


def _scale_fusion(fusion: Fusion, cfg: ModelConfig, layer: int) -> Fusion:
    """The fusion of the block scales of an FP8 fused tensor: the same groups and members' scales, each
    segment in 128-row blocks. ValueError when a segment is not whole blocks (a block would straddle two
    members: the fused tensor cannot be split)."""
    if not _whole_blocks(fusion, cfg):
        raise ValueError(f"the quantization_config converts layers.{layer}.{fusion.name} to FP8, but its members' "
                         f"rows per group {fusion.segments(cfg)} are not multiples of 128: its 128-row scale blocks "
                         "would straddle members, so it cannot be split at load (keep it in floating point: "
                         "modules_to_not_convert)")
    return Fusion(scale_name(fusion.name), tuple(scale_name(m) for m in fusion.members), fusion.groups,
                  lambda c: tuple(tuple(n // FP8_BLOCK for n in member) for member in fusion.segments(c)))


def checkpoint_layout(cfg: ModelConfig, experts_apart: bool = True) -> list[Stored]:
    """The checkpoint's tensors in our weights' order: the family's fusions fused (at their first member),
    and, with experts_apart (the checkpoint on disk, not transformers' in-memory state), experts one tensor
    per expert and part; FP8 block scales likewise (each after its weight); the MTP head's as ours."""
    out, fused = [], set()
    for name, spec in model_spec(cfg).items():
        weight = spec.of if spec.kind == SCALE else spec
        fusion = cfg.family.fusion_of(weight.local) if spec.layer is not None else None
        if fusion is not None:
            if spec.kind == SCALE:
                fusion = _scale_fusion(fusion, cfg, spec.layer)
            if (spec.layer, fusion.name) not in fused:
                fused.add((spec.layer, fusion.name))
                out.append(Stored(f"{spec.layer_prefix}{fusion.name}", (fusion.rows(cfg), *spec.shape[1:]), spec,
                                  fusion=fusion))
        elif weight.kind == EXPERTS and experts_apart:
            E, rows, *rest = spec.shape
            shape = (rows // len(spec.parts), *rest)
            out += [Stored(expert_name(spec, e, part), shape, spec, e, k)
                    for e in range(E) for k, part in enumerate(spec.parts)]
        else:
            out.append(Stored(name, spec.shape, spec))
    return out


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the config's checkpoint as transformers' save_pretrained writes it (names
    without the `model.` prefix): experts one tensor each, the family's fusions fused."""
    return {s.name: s.shape for s in checkpoint_layout(cfg)}
