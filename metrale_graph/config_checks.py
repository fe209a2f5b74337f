"""The field checks of a model config: each field's type and range, normalized (an integral float to an int,
a list to a tuple), and the rules across fields (a family's own fields, the MoE layers, the layer types, the
head groupings; the rotary dim and RoPE scaling: rope.check_rope); config.ModelConfig runs them on every
instance (__post_init__) and on `from_hf`'s fields. A failed check is a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from .families import COMMON_DEFAULTS, FAMILIES, MULTIMODAL, OPTIONAL_FIELDS
from .quantization import Fp8Config
from .rope import RopeScaling, check_rope

LINEAR = "linear_attention"
FULL = "full_attention"


# field -> smallest value. The conv keeps kernel - 1 columns of state, so its kernel is >= 2.
# (intermediate_size: >= 1 when a layer is dense, checked in _checked.)
_INT_FIELDS = {name: 1 for name in (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "max_position_embeddings", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "decoder_sparse_step")} | {"linear_conv_kernel_dim": 2, "num_experts": 0,
                                                                  "mtp_num_hidden_layers": 0}


# field -> (a value below its minimum that transformers builds a model of, what that model is: not supported here)
_DEGENERATE = {
    "shared_expert_intermediate_size": (0, "a MoE block without a shared expert (transformers builds one of width 0, "
                                           "which adds nothing) is not supported"),
    "moe_intermediate_size": (0, "experts of width 0 (transformers builds them; they add nothing) are not supported"),
    "intermediate_size": (0, "a dense MLP of width 0 (transformers builds one; it adds nothing) is not supported; the "
                             "layers without a dense MLP are the MoE layers (num_experts, decoder_sparse_step, "
                             "mlp_only_layers)"),
    "linear_conv_kernel_dim": (1, "a Gated DeltaNet conv of kernel 1 (the current token alone: no conv state) is not "
                                  "supported"),
}


# config.json fields that size the weights: a missing one takes transformers' default for the family (config.from_hf)
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "shared_expert_intermediate_size")


def unset_sizes(raw: dict, family, cfg=None) -> str:
    """What an error about a config.json (its parsed dict `raw`: a multimodal one's text_config is read) adds where
    the file sets none of some fields that size the weights (SIZE_FIELDS): their names and the defaults of `family`
    (families.Family) that were taken in their place, as transformers takes them; '' where it sets them all. `cfg`
    (a ModelConfig): only the fields it still holds the default of."""
    text = raw.get("text_config") if raw.get("model_type") in MULTIMODAL else raw
    if not isinstance(text, dict):
        return ""
    unset = [(n, family.default(n)) for n in SIZE_FIELDS if n not in text and (n in family.defaults or n in
             COMMON_DEFAULTS) and (cfg is None or getattr(cfg, n) == family.default(n))]
    if not unset:
        return ""
    return (f"; config.json does not set {', '.join(n for n, _ in unset)}, so transformers' default"
            f"{'s' if len(unset) > 1 else ''} for model_type {family.model_type!r} ("
            f"{', '.join(f'{n} {v}' for n, v in unset)}) {'were' if len(unset) > 1 else 'was'} taken")


def _invalid(where: str, msg: str) -> ValueError:
    return ValueError(f"invalid model config{where}: {msg}")


def supported_architectures() -> list[str]:
    """transformers' classes of the families run here (config.json's `architectures`): each family's causal LM
    and its multimodal wrappers' models."""
    return [name for f in FAMILIES.values() for name in (f.causal_lm_class, *(m.model_class for m in f.multimodal))]


def check_model_kind(raw: dict, where: str = "") -> None:
    """ValueError naming config.json's `architectures` when it names no class of a family here (a sequence
    classifier, another model of a supported model_type's name), or its `model_type` when that is missing: the
    model is told apart by them before any field is read. An absent or empty `architectures` is not checked
    (transformers reads model_type alone)."""
    names = raw.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise _invalid(where, f"field 'architectures' must be a list of class names, got {names!r}")
    known = supported_architectures()
    if names and not any(n in known for n in names):
        raise _invalid(where, f"architectures {names} (model_type {raw.get('model_type')!r}) names no model "
                              f"metrale-graph runs: it runs causal language models of {', '.join(known)}")
    if raw.get("model_type") is None:
        raise _invalid(where, "no 'model_type' field (transformers' name of the model's family, e.g. 'qwen3_5' "
                              f"or 'qwen3_next'{f'; architectures {names}' if names else ''})")


def _int(name: str, value, minimum: int, where: str = "") -> int:
    """An int (an integral float such as 4.0 too; not a bool) >= minimum."""
    number = int(value) if isinstance(value, float) and value.is_integer() else value
    if not isinstance(number, int) or isinstance(number, bool) or number < minimum:
        raise _invalid(where, f"field {name!r} must be an integer >= {minimum}, got {value!r}")
    return number


def _sized(name: str, value, minimum: int, where: str = "") -> int:
    """_int, the error saying what the model is where the value is one transformers builds a model of (_DEGENERATE)."""
    try:
        return _int(name, value, minimum, where)
    except ValueError as e:
        degenerate = _DEGENERATE.get(name)
        if degenerate is not None and not isinstance(value, bool) and value == degenerate[0]:
            raise ValueError(f"{e}: {degenerate[1]}") from None
        raise


def _float(name: str, value, ok, expected: str, where: str = "") -> float:
    """A finite int or float (not a bool) for which ok(value) holds, as a float."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not (math.isfinite(number) and ok(number)):
        raise _invalid(where, f"field {name!r} must be {expected}, got {value!r}")
    return number


def _moe_layers(num_layers: int, num_experts: int, sparse_step: int, mlp_only: tuple[int, ...]) -> list[int]:
    """transformers' Qwen3-Next rule (Qwen3.5-MoE's config keeps step 1 and no mlp_only_layers: every layer)."""
    if num_experts <= 0:
        return []
    return [i for i in range(num_layers) if i not in mlp_only and (i + 1) % sparse_step == 0]


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
        v[name] = _sized(name, v[name], minimum, where)
    v["partial_rotary_factor"] = _float("partial_rotary_factor", v["partial_rotary_factor"], lambda x: 0 < x <= 1,
                                        "a number in (0, 1]", where)
    for name in ("rope_theta", "rms_norm_eps"):
        v[name] = _float(name, v[name], lambda x: x > 0, "a positive number", where)
    for name in ("tie_word_embeddings", "norm_topk_prob"):
        need(isinstance(v[name], bool), f"field {name!r} must be true or false, got {v[name]!r}")
    model_type = v["model_type"]
    need(isinstance(model_type, str) and model_type in FAMILIES,
         f"field 'model_type' must be one of {', '.join(map(repr, FAMILIES))}, got {model_type!r}")
    family = FAMILIES[model_type]
    layers = v["mlp_only_layers"]
    need(isinstance(layers, (list, tuple)), f"field 'mlp_only_layers' must be a list of layer indices, got {layers!r}")
    # an index past the last layer names no layer (transformers accepts it too, and to_hf keeps it)
    v["mlp_only_layers"] = layers = tuple(_int("mlp_only_layers", i, 0, where) for i in layers)
    need(len(set(layers)) == len(layers), f"field 'mlp_only_layers' holds a layer twice: {list(layers)}")
    if v["num_experts"] > 0:
        need(v["num_experts_per_tok"] <= v["num_experts"],
             f"field 'num_experts_per_tok' ({v['num_experts_per_tok']}) exceeds num_experts ({v['num_experts']})")
    def owned(name):  # a field the family does not have keeps its default
        absent = OPTIONAL_FIELDS[name]
        need(name in family.fields or v[name] == absent,
             f"model_type {model_type!r} has no field {name!r}: it must be {absent!r}, got {v[name]!r}")

    for name in OPTIONAL_FIELDS:
        if name != "intermediate_size":
            owned(name)
    for name, (least, why) in family.minimums.items():
        need(v[name] >= least, f"field {name!r} must be an integer >= {least} for model_type {model_type!r} "
                               f"({why}), got {v[name]!r}")
    moe = _moe_layers(v["num_hidden_layers"], v["num_experts"], v["decoder_sparse_step"], layers)
    # a dense MLP needs an intermediate size; a model without one may say 0
    v["intermediate_size"] = _sized("intermediate_size", v["intermediate_size"],
                                  1 if len(moe) < v["num_hidden_layers"] else 0, where)
    owned("intermediate_size")
    need(v["quantization"] is None or isinstance(v["quantization"], Fp8Config),
         f"field 'quantization' must be a quantization.Fp8Config or None, got {v['quantization']!r}")
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
    _rope_in_float_range(v["rope_scaling"], need)
    check_rope(v, need)
    _rope_arithmetic(v, need)
    return v


def _rope_in_float_range(s, need) -> None:
    """An integer field of RopeScaling `s` beyond a float's range (JSON's integers have no bound) named, before
    rope.check_rope compares it as a float (an OverflowError)."""
    if not isinstance(s, RopeScaling):
        return
    for f in dataclasses.fields(s):
        x = getattr(s, f.name)
        if isinstance(x, int) and not isinstance(x, bool) and abs(x) > sys.float_info.max:
            signed = f.name in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
            what = "integer" if f.name == "original_max_position_embeddings" else "number"
            need(False, f"rope_parameters' {f.name} must be a {'' if signed else 'positive '}{what} for rope_type "
                        f"{s.rope_type!r}, got {x!r}")


def _rope_arithmetic(v: dict, need) -> None:
    """What rope.check_rope lets through that rope.rope_frequencies (run when the model is built, after its weights are
    read) cannot compute: llama3's two freq factors present but null, yarn's ramp over log(rope_theta) (0 for theta 1)
    and log(original / (beta * 2 pi)) (undefined for a negative beta; 0 or null takes transformers' default)."""
    s = v["rope_scaling"]
    if s is None:
        return
    if s.rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor"):
            need(getattr(s, name) is not None,
                 f"rope_parameters' {name} must be a positive number for rope_type 'llama3', got None")
    if s.rope_type == "yarn":
        need(v["rope_theta"] != 1, "rope_type 'yarn' needs a rope_theta other than 1 (its ramp divides by "
                                   f"log(rope_theta)), got {v['rope_theta']!r}")
        for name in ("beta_fast", "beta_slow"):
            x = getattr(s, name)
            need(x is None or x >= 0, f"rope_parameters' {name} must not be negative for rope_type 'yarn' (its ramp "
                                      f"takes the log of original_max_position_embeddings / ({name} * 2 pi)), got {x!r}")
