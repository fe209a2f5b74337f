"""Model families: one record per Hugging Face text `model_type` the package runs, holding every fact
that differs between families. config.py reads and writes configs through it, spec.py lays out
checkpoints through it (loader.py reads its multimodal prefixes), and the tests and benchmarks build
transformers' model of a family from it.

A family's record says:
- its `model_type` and the multimodal wrappers that nest it under `text_config`;
- its own config fields (beyond those every family has), each with the value that a family without
  the field keeps (so a config holds only its family's fields, and `to_hf` / `from_hf` round-trip);
- transformers' defaults for it, where they differ from COMMON_DEFAULTS (a field missing from a
  config.json takes them, as in transformers);
- transformers' class names: its config class and causal-LM class (`architectures` in config.json);
- its checkpoint transforms: tensors the checkpoint fuses that the model keeps apart (`Fusion`: split
  at load, fused at save), and where a multimodal wrapper's checkpoint keeps the text model's tensors;
- the config.json field that counts its multi-token-prediction (MTP) layers (`mtp.*` tensors, spec.py).
Which blocks a layer holds follows from the config (spec.py), not from the family.

Adding a family: its record here (and in FAMILIES), its new config fields in `ModelConfig`, and, for a
layer kind the others lack, its block in spec.py and the ops the model calls for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

# transformers' defaults that every family shares (config.json keys; the RoPE pair may also sit in
# rope_parameters, which config.py reads first)
COMMON_DEFAULTS: Mapping[str, Any] = {
    "num_attention_heads": 16, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 32768, "full_attention_interval": 4,
}


@dataclass(frozen=True)
class Multimodal:
    """A multimodal wrapper whose `text_config` holds the family's config. Its checkpoint keeps the text
    model's tensors under `text_prefix`; those under `skipped_prefixes` (the vision tower) are not read."""
    model_type: str
    config_class: str  # transformers' class names
    model_class: str
    text_prefix: str = "model.language_model."
    skipped_prefixes: tuple[str, ...] = ("model.visual.", "visual.")


@dataclass(frozen=True)
class Fusion:
    """A checkpoint tensor [rows, D] that holds several of one layer's weights interleaved by group: for
    each of `groups(cfg)` groups in turn, that group's rows of every segment of every member, in order.
    A member (one of our weights, [rows, D]) is its segments laid end to end, each segment `groups` runs
    of equal size; `segments(cfg)` gives, per member, each segment's rows per group. The checkpoint's
    tensor is split at load and fused at save; under tensor parallelism a rank reads the run of rows of
    its groups (sharding.fusion_ranges)."""
    name: str  # within a layer, e.g. "linear_attn.in_proj_qkvz.weight"
    members: tuple[str, ...]  # our weights within the layer, in the order they are fused
    groups: Callable[[Any], int]  # ModelConfig -> the number of groups
    segments: Callable[[Any], tuple[tuple[int, ...], ...]]  # ModelConfig -> per member, rows per group

    def rows(self, cfg) -> int:
        return self.groups(cfg) * sum(sum(sizes) for sizes in self.segments(cfg))

    def fuse(self, tensors, cfg) -> torch.Tensor:
        """The members (in `members` order) -> the checkpoint's fused tensor."""
        G, trailing = self.groups(cfg), tensors[0].shape[1:]
        runs = [run.reshape(G, -1, *trailing) for t, sizes in zip(tensors, self.segments(cfg))
                for run in t.split([G * s for s in sizes])]
        return torch.cat(runs, dim=1).reshape(-1, *trailing)

    def split(self, fused: torch.Tensor, cfg) -> tuple[torch.Tensor, ...]:
        """The checkpoint's fused tensor -> the members (the inverse of fuse)."""
        G, per, trailing = self.groups(cfg), self.segments(cfg), fused.shape[1:]
        sizes = [s for member in per for s in member]
        runs = iter(fused.reshape(G, sum(sizes), *trailing).split(sizes, dim=1))
        members = []
        for member in per:
            parts = [next(runs).reshape(-1, *trailing) for _ in member]
            members.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return tuple(members)


@dataclass(frozen=True, eq=False)
class Family:
    """Everything that sets one model family apart (module docstring)."""
    model_type: str
    config_class: str  # transformers' class names
    causal_lm_class: str
    fields: Mapping[str, Any] = field(default_factory=dict)  # own field -> the value other families keep
    defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers' defaults beyond COMMON_DEFAULTS
    multimodal: tuple[Multimodal, ...] = ()
    fusions: tuple[Fusion, ...] = ()
    minimums: Mapping[str, tuple[int, str]] = field(default_factory=dict)  # field -> (its least value here, why)
    # the config.json field holding the number of MTP layers (ModelConfig.mtp_num_hidden_layers)
    mtp_field: str = "mtp_num_hidden_layers"

    @property
    def architectures(self) -> list[str]:
        """config.json's `architectures`: what transformers' save_pretrained writes for the family."""
        return [self.causal_lm_class]

    def default(self, name: str):
        """transformers' default of a config.json field for this family."""
        return self.defaults[name] if name in self.defaults else COMMON_DEFAULTS[name]

    def fusion_of(self, name: str) -> Fusion | None:
        """The fusion whose checkpoint tensor holds our weight `name` (within a layer), or None."""
        return next((f for f in self.fusions if name in f.members), None)


def _key_head_groups(cfg) -> int:
    return cfg.linear_num_key_heads


def _qkvz_segments(cfg):
    """Per key head: q (K rows), k (K), v (r * V); then z (r * V); r value heads per key head."""
    rv = cfg.linear_num_value_heads // cfg.linear_num_key_heads * cfg.linear_value_head_dim
    return (cfg.linear_key_head_dim, cfg.linear_key_head_dim, rv), (rv,)


def _ba_segments(cfg):
    """Per key head: its r value heads' b rows, then their a rows."""
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return (r,), (r,)


_MOE_FIELDS = {"num_experts": 0, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512}
_MOE_DEFAULTS = {"num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}

QWEN3_5 = Family(
    "qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
    fields={"intermediate_size": 0},
    defaults=dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                  num_key_value_heads=4),
    multimodal=(Multimodal("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),),
)

# A sparse MoE block in every layer (top-k weights always renormalized); no dense MLP.
QWEN3_5_MOE = Family(
    "qwen3_5_moe_text", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
    fields=_MOE_FIELDS,
    defaults=dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2,
                  num_experts=256, **_MOE_DEFAULTS),
    multimodal=(Multimodal("qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),),
    minimums={"num_experts": (1, "every layer is a MoE block")},
)

# A sparse MoE block in the layers of moe_layers, a dense MLP in the others; the checkpoint fuses each GDN
# layer's in_proj_qkv with in_proj_z, and in_proj_b with in_proj_a, interleaved per key-head group.
QWEN3_NEXT = Family(
    "qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
    fields={"intermediate_size": 0, **_MOE_FIELDS, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": ()},
    defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                  num_key_value_heads=2, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[]),
    mtp_field="num_nextn_predict_layers",  # vLLM's name for it (Qwen3-Next's config.json may not hold it)
    fusions=(
        Fusion("linear_attn.in_proj_qkvz.weight", ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"),
               _key_head_groups, _qkvz_segments),
        Fusion("linear_attn.in_proj_ba.weight", ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
               _key_head_groups, _ba_segments),
    ),
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT)}
# multimodal model_type -> (the family of its text_config, the wrapper)
MULTIMODAL: dict[str, tuple[Family, Multimodal]] = {m.model_type: (f, m) for f in FAMILIES.values()
                                                    for m in f.multimodal}


def _optional_fields() -> dict[str, Any]:
    """Every field some family owns -> the value the families without it keep (one value per field)."""
    out: dict[str, Any] = {}
    for fam in FAMILIES.values():
        for name, absent in fam.fields.items():
            if out.setdefault(name, absent) != absent:
                raise ValueError(f"families disagree on the value {name!r} keeps where it is absent: "
                                 f"{out[name]!r} and {absent!r} ({fam.model_type})")
    return out


OPTIONAL_FIELDS = _optional_fields()
