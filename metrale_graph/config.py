"""Model configuration: the Hugging Face Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text config, validated,
with derived sizes.

Field names follow transformers' `Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig` and `Qwen3NextConfig`.
`from_hf` reads a `config.json` dict of a family's model_type (`qwen3_5_text`, `qwen3_5_moe_text`,
`qwen3_next`), or of a multimodal wrapper (`qwen3_5` / `qwen3_5_moe`: text part under `text_config`;
the model runs its text part and `model_type` records the text family). Other model families raise
`ValueError`. A fine-grained FP8 `quantization_config` (Qwen's FP8 releases; at the top level or in
`text_config`) is read into `quantization` (quantization.py), and so is a compressed-tensors FP8 one
(llm-compressor's; compressed_tensors.py: the FP8 the model holds of it); any other quantization is refused.

What sets a family apart (its own fields, transformers' defaults and classes, its checkpoint
transforms) is its record in families.py; this module reads and writes configs through it. The
feed-forward half of a layer is a sparse MoE block on the layers of `moe_layers` (`num_experts` > 0,
not in `mlp_only_layers`, (i + 1) % `decoder_sparse_step` == 0: every layer for Qwen3.5-MoE, which
has no dense MLP and so `intermediate_size` 0), a dense MLP on the others (every layer for Qwen3.5,
`num_experts` 0). A family's config has only its own fields: the others keep their defaults (so
`to_hf` and `from_hf` round-trip every config exactly).

`mtp_num_hidden_layers`: the multi-token-prediction layers the model holds (the `mtp.*` weights of
spec.py; 0: none), read from and written to the family's field (`mtp_num_hidden_layers` for Qwen3.5,
`num_nextn_predict_layers` for Qwen3-Next). A config.json may declare MTP layers its checkpoint does not
hold (transformers' save_pretrained drops `mtp.*`) or hold them undeclared (Qwen3-Next):
weights.checkpoint_config settles the count from the checkpoint's tensors. An MTP with its own embeddings
(`mtp_use_dedicated_embeddings`) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

# the field checks; LINEAR and FULL, the layer types, live there and are imported from here too
from .config_checks import (FULL, LINEAR, _checked, _int, _invalid, _moe_layers, _strings, check_model_kind,
                            unset_sizes)
from .families import FAMILIES, MULTIMODAL, OPTIONAL_FIELDS, QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, Family
from .compressed_tensors import is_compressed_tensors, parse_compressed_tensors
from .quantization import QWEN_KEPT, TEXT_PREFIX, Fp8Config, parse_quantization
from .rope import RopeScaling, parse_rope_scaling
_LEGACY_LAYER_TYPES = {"mamba": LINEAR, "conv": LINEAR, "attention": FULL}
# config.json fields every family has, read as they are (a missing one takes transformers' default)
_COMMON_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # a rope_type other than 'default' (rope.py); None: default RoPE
    # gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    # the family (weight layout, saving); see the module docstring
    model_type: str = QWEN3_5.model_type
    # sparse MoE (Qwen3.5-MoE, Qwen3-Next); num_experts 0 = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True  # renormalize the top-k routing weights (Qwen3.5-MoE: always)
    decoder_sparse_step: int = 1  # Qwen3-Next: MoE in layers with (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these (dense MLP)
    # FP8 checkpoints: which projections are stored float8_e4m3fn with block scales (None: none)
    quantization: Fp8Config | None = None
    # the multi-token-prediction head's decoder layers (module docstring; 0: no MTP head)
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        """Check every field's type and range (ValueError naming the field); integral floats
        become ints (JSON has one number type), numbers become floats, layer_types a tuple."""
        for name, value in _checked({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}).items():
            object.__setattr__(self, name, value)

    # derived sizes
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        """transformers' `dim` of the RoPE frequencies (rope.py: an odd one rotates one channel more)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def family(self) -> Family:
        """The record of this config's model family (families.py)."""
        return FAMILIES[self.model_type]

    @property
    def moe_layers(self) -> list[int]:
        """Layers whose feed-forward half is a sparse MoE block (the others have a dense MLP)."""
        return _moe_layers(self.num_hidden_layers, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    @property
    def mtp_moe_layers(self) -> list[int]:
        """The MTP layers (0 ..) whose feed-forward half is a sparse MoE block: the main model's rule applied to
        the MTP layer's own index, as vLLM builds them (every one for Qwen3.5-MoE and Qwen3-Next's releases)."""
        return _moe_layers(self.mtp_num_hidden_layers, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    def replace(self, **changes) -> "ModelConfig":
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = default_layer_types(_int("num_hidden_layers", changes["num_hidden_layers"], 1))
        return dataclasses.replace(self, **changes)

    # Hugging Face config.json
    @classmethod
    def from_hf(cls, cfg: dict, source: str | None = None) -> "ModelConfig":
        """Build from a parsed `config.json` (qwen3_5_text, qwen3_5_moe_text or qwen3_next, or the
        multimodal qwen3_5 / qwen3_5_moe with `text_config`); a missing field takes transformers'
        default for the family, a field the family does not have is ignored (as transformers
        ignores it). Errors name `source`, the file, when given."""
        where = f" {source}" if source else ""
        if not isinstance(cfg, dict):
            raise _invalid(where, f"expected a JSON object, got {type(cfg).__name__}")
        check_model_kind(cfg, where)
        model_type = cfg.get("model_type")
        tie = cfg.get("tie_word_embeddings")
        quant, prefix = cfg.get("quantization_config"), TEXT_PREFIX
        if isinstance(model_type, str) and model_type in MULTIMODAL:
            if not isinstance(cfg.get("text_config"), dict):
                raise _invalid(where, f"model_type {model_type!r} config has no 'text_config' section")
            family, wrapper = MULTIMODAL[model_type]
            text_type, prefix = family.model_type, wrapper.text_prefix
            cfg = dict(cfg["text_config"])
            if cfg.get("model_type") in (None, model_type):  # early checkpoints named it as their wrapper
                cfg["model_type"] = text_type
            # The multimodal model ties (or not) by its top-level tie_word_embeddings: a text_config's own
            # value is ignored (transformers writes the text config's default, false, under a tied wrapper),
            # but where the top level has none (a config.json written by hand) it is the text_config's, as vLLM
            # reads it (transformers then runs a random lm_head of a checkpoint that stores none).
            cfg["tie_word_embeddings"] = tie if tie is not None else cfg.get("tie_word_embeddings", False)
            if cfg["model_type"] != text_type:
                raise _invalid(where, f"model_type {model_type!r} config holds a text_config of model_type "
                                      f"{cfg['model_type']!r}; expected {text_type!r}")
            model_type = cfg["model_type"]
            inner = cfg.get("quantization_config")
            if quant is not None and inner is not None and inner != quant:
                raise _invalid(where, "the top level and text_config hold different quantization_config sections")
            quant = quant if quant is not None else inner
        if is_compressed_tensors(quant):  # llm-compressor's FP8: what the model holds of it in memory
            quantization = parse_compressed_tensors(quant, where, prefix).memory_config()
        else:
            quantization = None if quant is None else parse_quantization(quant, where, prefix)
        if not (isinstance(model_type, str) and model_type in FAMILIES):
            raise _invalid(where, f"unsupported model_type {model_type!r}: metrale-graph runs "
                                  f"{', '.join(map(repr, [*FAMILIES, *MULTIMODAL]))}")
        # transformers' ACT2FN maps 'swish' to SiLU too (MLPs, experts and the GDN conv alike)
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise _invalid(where, f"unsupported hidden_act {cfg['hidden_act']!r}: only 'silu' (or its alias "
                                  "'swish') is supported")
        bias = cfg.get("attention_bias")
        if bias is not None and bias is not False:
            raise _invalid(where, f"unsupported attention_bias {bias!r}: only false is supported")
        # transformers reads a legacy rope_scaling in place of rope_parameters when both are there
        rope_field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        rope = cfg.get(rope_field) or {}
        if not isinstance(rope, dict):
            raise _invalid(where, f"field {rope_field!r} must be an object, got {rope!r}")
        per_layer = sorted(set(rope) & {LINEAR, FULL})
        if per_layer:
            raise _invalid(where, f"field {rope_field!r} holds per-layer-type entries {per_layer}: only one set of "
                                  "RoPE parameters for every layer is supported")
        family = FAMILIES[model_type]
        n_layers = _int("num_hidden_layers", cfg.get("num_hidden_layers", family.default("num_hidden_layers")), 1,
                        where)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = _int("full_attention_interval",
                            cfg.get("full_attention_interval", family.default("full_attention_interval")), 1, where)
            layer_types = default_layer_types(n_layers, interval)
        layer_types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in _strings("layer_types", layer_types, where))
        # a missing field takes transformers' default (head_dim's is 256, not hidden_size // num_attention_heads)
        fields = {name: cfg.get(name, family.default(name)) for name in _COMMON_FIELDS}
        fields.update(
            num_hidden_layers=n_layers, layer_types=layer_types, model_type=model_type,
            **{name: rope.get(name, cfg.get(name, family.default(name)))
               for name in ("partial_rotary_factor", "rope_theta")},
            rope_scaling=parse_rope_scaling(rope, rope_field, lambda msg: _invalid(where, msg),
                                            cfg.get("original_max_position_embeddings"),
                                            fields["max_position_embeddings"]))
        # the family's own fields from the file (transformers' default when missing), the others absent
        for name, absent in OPTIONAL_FIELDS.items():
            fields[name] = cfg.get(name, family.default(name)) if name in family.fields else absent
        if fields["mlp_only_layers"] is None:  # transformers reads null as []
            fields["mlp_only_layers"] = []
        fields["quantization"] = quantization
        mtp = cfg.get(family.mtp_field)
        fields["mtp_num_hidden_layers"] = 0 if mtp is None else _int(family.mtp_field, mtp, 0, where)
        if cfg.get("mtp_use_dedicated_embeddings") and mtp:
            raise _invalid(where, "mtp_use_dedicated_embeddings is true: an MTP head with embeddings of its own is "
                                  "not supported (Qwen's MTP heads share the model's)")
        try:
            return cls(**_checked(fields, where))
        except ValueError as e:  # a field missing from the file, its default taken, may be what does not fit
            raise ValueError(f"{e}{unset_sizes(cfg, family)}") from None

    def to_hf(self) -> dict:
        """The `config.json` dict (model_type: this config's family) that `transformers` reads."""
        hf = {
            "architectures": self.family.architectures,
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", **(self.rope_scaling.to_hf() if self.rope_scaling else {}),
                                "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor},
            "partial_rotary_factor": self.partial_rotary_factor,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name in self.family.fields:
            value = getattr(self, name)
            hf[name] = list(value) if isinstance(value, tuple) else value
        if self.quantization is not None:
            hf["quantization_config"] = self.quantization.to_hf()
        if self.mtp_num_hidden_layers:
            hf[self.family.mtp_field] = self.mtp_num_hidden_layers
        return hf


def default_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """Every `full_attention_interval`-th layer is full attention, the rest Gated DeltaNet."""
    return tuple(FULL if (i + 1) % full_attention_interval == 0 else LINEAR for i in range(num_layers))


PRESETS: dict[str, ModelConfig] = {
    # The embedded default: runs in well under a second on a CPU. Grouped value heads (r=2)
    # and dk != dv so the default path exercises both.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=default_layer_types(4), num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, partial_rotary_factor=0.25, rope_theta=10000.0,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, max_position_embeddings=4096,
    ),
    # The Qwen3.5-9B shape (benchmarks use random weights of this shape).
    "qwen3.5-9b": ModelConfig(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        layer_types=default_layer_types(32), num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, max_position_embeddings=262144,
    ),
    # The Qwen3.5-27B (and Qwen3.6-27B) shape: 64 layers = 48 GDN + 16 attention, 54 GB in bf16.
    "qwen3.5-27b": ModelConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        layer_types=default_layer_types(64), num_attention_heads=24, num_key_value_heads=4,
        head_dim=256, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, max_position_embeddings=262144,
    ),
    # The Qwen3.5-35B-A3B shape: 256 experts, top-8, a MoE block in every layer (the other fields
    # are transformers' Qwen3_5MoeTextConfig defaults).
    "qwen3.5-35b-a3b": ModelConfig(
        vocab_size=248320, hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
        layer_types=default_layer_types(40), num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, partial_rotary_factor=0.25, rope_theta=10000.0,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, max_position_embeddings=32768, model_type=QWEN3_5_MOE.model_type,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    ),
    # The Qwen3-Next-80B-A3B shape: 512 experts, top-10, a MoE block in every layer (the other fields
    # are transformers' Qwen3NextConfig defaults).
    "qwen3-next-80b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        layer_types=default_layer_types(48), num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, partial_rotary_factor=0.25, rope_theta=10000.0,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, max_position_embeddings=32768, model_type=QWEN3_NEXT.model_type,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
    ),
}
# FP8 shapes of the three (random weights quantized as Qwen's FP8 releases are: quantized.fp8_config with
# Qwen's kept modules; drawn and quantized on the device)
for _name in ("qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"):
    PRESETS[f"{_name}-fp8"] = PRESETS[_name].replace(quantization=Fp8Config(QWEN_KEPT))


def no_config(folder: str) -> ValueError:
    """The error of a folder without config.json, naming what it holds instead where that is known (a PEFT adapter,
    a tokenizer's files, a download cut short) and what to do."""
    names = set(os.listdir(folder))
    if "adapter_config.json" in names:
        what = ("; it holds a PEFT adapter (adapter_config.json), not a model: merge it into its base model (peft's "
                "merge_and_unload) and save_pretrained the result")
    elif names and names <= {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                             "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json"}:
        what = "; it holds a tokenizer's files only"
    else:
        what = ""
    return ValueError(f"checkpoint folder {folder!r} has no config.json (the model's Hugging Face config, which "
                      f"transformers' save_pretrained writes beside the weights){what}")


def load_config(path_or_preset: str) -> ModelConfig:
    """A preset name, a checkpoint folder holding `config.json`, or a `config.json` path."""
    if path_or_preset in PRESETS:
        return PRESETS[path_or_preset]
    path = path_or_preset
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise no_config(path_or_preset)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path_or_preset!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder "
            "with a config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # malformed JSON, not UTF-8, nested too deep
        raise ValueError(f"cannot read model config {path}: {e}") from None
    return ModelConfig.from_hf(data, source=path)
