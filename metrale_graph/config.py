"""Model configuration: the Hugging Face Qwen3.5 text config, validated, with derived sizes.

Field names follow `transformers.Qwen3_5TextConfig`. `from_hf` reads a `config.json` dict of
model_type `qwen3_5_text`, or `qwen3_5` (the multimodal config, text part under
`text_config`). Model families we do not run raise `ValueError` naming what is unsupported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

LINEAR = "linear_attention"
FULL = "full_attention"
_LEGACY_LAYER_TYPES = {"mamba": LINEAR, "conv": LINEAR, "attention": FULL}
_UNSUPPORTED = {
    "qwen3_next": "Qwen3-Next (MoE MLP and fused in_proj_qkvz / in_proj_ba) is not supported yet",
    "qwen3_5_moe": "Qwen3.5-MoE (sparse MoE MLP) is not supported yet",
    "qwen3_5_moe_text": "Qwen3.5-MoE (sparse MoE MLP) is not supported yet",
}


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
    # gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"invalid model config: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel_dim"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        need(not bad, f"layer_types holds {bad}; expected {LINEAR!r} or {FULL!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
             f"num_key_value_heads ({self.num_key_value_heads})")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
             f"linear_num_key_heads ({self.linear_num_key_heads})")
        need(0.0 < self.partial_rotary_factor <= 1.0 and self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
             f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim}; "
             "it must be even and positive")

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
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def replace(self, **changes) -> "ModelConfig":
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = default_layer_types(changes["num_hidden_layers"])
        return dataclasses.replace(self, **changes)

    # Hugging Face config.json
    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed `config.json` (qwen3_5_text, or qwen3_5 with `text_config`)."""
        model_type = cfg.get("model_type")
        tie = cfg.get("tie_word_embeddings")
        if model_type in _UNSUPPORTED:
            raise ValueError(f"model_type {model_type!r}: {_UNSUPPORTED[model_type]}")
        if model_type == "qwen3_5":
            if not isinstance(cfg.get("text_config"), dict):
                raise ValueError("model_type 'qwen3_5' config has no 'text_config' section")
            cfg = dict(cfg["text_config"])
            cfg.setdefault("model_type", "qwen3_5_text")
            # The multimodal wrapper carries tie_word_embeddings at the top level.
            if tie is not None and "tie_word_embeddings" not in cfg:
                cfg["tie_word_embeddings"] = tie
            model_type = cfg["model_type"]
        if model_type != "qwen3_5_text":
            raise ValueError(
                f"unsupported model_type {model_type!r}: metrale-graph runs 'qwen3_5_text' and 'qwen3_5'")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: only 'silu' is supported")
        if cfg.get("attention_bias", False):
            raise ValueError("unsupported config: attention_bias=True")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}: only 'default' RoPE is supported")
        n_layers = int(cfg.get("num_hidden_layers", 32))
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            layer_types = default_layer_types(n_layers, int(cfg.get("full_attention_interval", 4)))
        layer_types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in layer_types)
        hidden = int(cfg.get("hidden_size", 4096))
        n_heads = int(cfg.get("num_attention_heads", 16))
        return cls(
            vocab_size=int(cfg.get("vocab_size", 248320)),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 12288)),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", 4)),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        )

    def to_hf(self) -> dict:
        """The `config.json` dict (model_type qwen3_5_text) that `transformers` reads."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
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
}


def load_config(path_or_preset: str) -> ModelConfig:
    """A preset name, a checkpoint folder holding `config.json`, or a `config.json` path."""
    if path_or_preset in PRESETS:
        return PRESETS[path_or_preset]
    path = path_or_preset
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"{path_or_preset!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder "
            "with a config.json")
    with open(path) as f:
        return ModelConfig.from_hf(json.load(f))
