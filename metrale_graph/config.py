"""Model configuration: the Hugging Face Qwen3.5 text config, validated, with derived sizes.

Field names follow `transformers.Qwen3_5TextConfig`. `from_hf` reads a `config.json` dict of
model_type `qwen3_5_text`, or `qwen3_5` (the multimodal config, text part under
`text_config`). Model families we do not run raise `ValueError` naming what is unsupported.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def replace(self, **changes) -> "ModelConfig":
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = default_layer_types(_int("num_hidden_layers", changes["num_hidden_layers"], 1))
        return dataclasses.replace(self, **changes)

    # Hugging Face config.json
    @classmethod
    def from_hf(cls, cfg: dict, source: str | None = None) -> "ModelConfig":
        """Build from a parsed `config.json` (qwen3_5_text, or qwen3_5 with `text_config`); a
        missing field takes transformers' default. Errors name `source`, the file, when given."""
        where = f" {source}" if source else ""
        if not isinstance(cfg, dict):
            raise _invalid(where, f"expected a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        tie = cfg.get("tie_word_embeddings")
        if isinstance(model_type, str) and model_type in _UNSUPPORTED:
            raise _invalid(where, f"model_type {model_type!r}: {_UNSUPPORTED[model_type]}")
        if model_type == "qwen3_5":
            if not isinstance(cfg.get("text_config"), dict):
                raise _invalid(where, "model_type 'qwen3_5' config has no 'text_config' section")
            cfg = dict(cfg["text_config"])
            cfg.setdefault("model_type", "qwen3_5_text")
            # The multimodal wrapper carries tie_word_embeddings at the top level.
            if tie is not None and "tie_word_embeddings" not in cfg:
                cfg["tie_word_embeddings"] = tie
            model_type = cfg["model_type"]
        if model_type != "qwen3_5_text":
            raise _invalid(where, f"unsupported model_type {model_type!r}: metrale-graph runs 'qwen3_5_text' and "
                                  "'qwen3_5'")
        if cfg.get("hidden_act", "silu") != "silu":
            raise _invalid(where, f"unsupported hidden_act {cfg['hidden_act']!r}: only 'silu' is supported")
        bias = cfg.get("attention_bias")
        if bias is not None and bias is not False:
            raise _invalid(where, f"unsupported attention_bias {bias!r}: only false is supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise _invalid(where, f"field 'rope_parameters' must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise _invalid(where, f"unsupported rope_type {rope_type!r}: only 'default' RoPE is supported")
        n_layers = _int("num_hidden_layers", cfg.get("num_hidden_layers", 32), 1, where)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = _int("full_attention_interval", cfg.get("full_attention_interval", 4), 1, where)
            layer_types = default_layer_types(n_layers, interval)
        layer_types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in _strings("layer_types", layer_types, where))
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            head_dim = (_int("hidden_size", cfg.get("hidden_size", 4096), 1, where)
                        // _int("num_attention_heads", cfg.get("num_attention_heads", 16), 1, where))
        return cls(**_checked(dict(
            vocab_size=cfg.get("vocab_size", 248320),
            hidden_size=cfg.get("hidden_size", 4096),
            intermediate_size=cfg.get("intermediate_size", 12288),
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=cfg.get("num_attention_heads", 16),
            num_key_value_heads=cfg.get("num_key_value_heads", 4),
            head_dim=head_dim,
            partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
            linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
            linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
            linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        ), where))

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


# field -> smallest value. The conv keeps kernel - 1 columns of state, so its kernel is >= 2.
_INT_FIELDS = {name: 1 for name in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "max_position_embeddings")} | {"linear_conv_kernel_dim": 2}


def _invalid(where: str, msg: str) -> ValueError:
    return ValueError(f"invalid model config{where}: {msg}")


def _int(name: str, value, minimum: int, where: str = "") -> int:
    """An int (an integral float such as 4.0 too; not a bool) >= minimum."""
    number = int(value) if isinstance(value, float) and value.is_integer() else value
    if not isinstance(number, int) or isinstance(number, bool) or number < minimum:
        raise _invalid(where, f"field {name!r} must be an integer >= {minimum}, got {value!r}")
    return number


def _float(name: str, value, ok, expected: str, where: str = "") -> float:
    """A finite int or float (not a bool) for which ok(value) holds, as a float."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not (math.isfinite(number) and ok(number)):
        raise _invalid(where, f"field {name!r} must be {expected}, got {value!r}")
    return number


def _strings(name: str, value, where: str = "") -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _invalid(where, f"field {name!r} must be a list of strings, got {value!r}")
    return tuple(value)


def _checked(v: dict, where: str = "") -> dict:
    """ModelConfig field values, type- and range-checked and normalized (see __post_init__)."""
    def need(cond: bool, msg: str):
        if not cond:
            raise _invalid(where, msg)

    v = dict(v)
    for name, minimum in _INT_FIELDS.items():
        v[name] = _int(name, v[name], minimum, where)
    v["partial_rotary_factor"] = _float("partial_rotary_factor", v["partial_rotary_factor"], lambda x: 0 < x <= 1,
                                        "a number in (0, 1]", where)
    for name in ("rope_theta", "rms_norm_eps"):
        v[name] = _float(name, v[name], lambda x: x > 0, "a positive number", where)
    need(isinstance(v["tie_word_embeddings"], bool),
         f"field 'tie_word_embeddings' must be true or false, got {v['tie_word_embeddings']!r}")
    v["layer_types"] = types = _strings("layer_types", v["layer_types"], where)
    need(len(types) == v["num_hidden_layers"],
         f"layer_types has {len(types)} entries for {v['num_hidden_layers']} layers")
    bad = sorted({t for t in types if t not in (LINEAR, FULL)})
    need(not bad, f"layer_types holds {bad}; expected {LINEAR!r} or {FULL!r}")
    need(v["num_attention_heads"] % v["num_key_value_heads"] == 0,
         f"num_attention_heads ({v['num_attention_heads']}) is not a multiple of "
         f"num_key_value_heads ({v['num_key_value_heads']})")
    need(v["linear_num_value_heads"] % v["linear_num_key_heads"] == 0,
         f"linear_num_value_heads ({v['linear_num_value_heads']}) is not a multiple of "
         f"linear_num_key_heads ({v['linear_num_key_heads']})")
    rotary = int(v["head_dim"] * v["partial_rotary_factor"])
    need(rotary >= 2 and rotary % 2 == 0,
         f"partial_rotary_factor {v['partial_rotary_factor']} gives rotary dim {rotary} of head_dim "
         f"{v['head_dim']}; it must be even and >= 2")
    return v


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
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: malformed JSON or not UTF-8
        raise ValueError(f"cannot read model config {path}: {e}") from None
    return ModelConfig.from_hf(data, source=path)
