"""The speculative-decoding option a user gives (the Engine takes it as `speculative=`), checked against the
model before anything is built: None (off), a method's name, {"method": ..., "num_tokens": k, ...} (a key whose
value is None takes its default, as from_vllm's null) or a Speculative (checked again); and the same option from
vLLM's `--speculative-config` JSON (`from_vllm`, for the command-line tools).

Methods: "mtp" drafts with the checkpoint's multi-token-prediction head (speculative/mtp.py; the model must hold
one of one layer), "ngram" by prompt lookup (speculative/proposers.py; no weights). Keys:
- `num_tokens`: the drafts per step, k >= 1 (default: 1 for "mtp", the token its one layer is trained to predict;
  3 for "ngram").
- `max_streams`: a step with more decode streams than this decodes one token per stream (no drafts verified: the
  loop's own overlapped step), so speculation is off where the verify step's cost makes it a loss (default
  DEFAULT_MAX_STREAMS, from the measured verify costs: docs/speculative.md "When a step speculates").
- `prompt_lookup_min` / `prompt_lookup_max` ("ngram" only; vLLM's names): the suffix lengths prompt lookup
  searches, 1 <= min <= max (default proposers.NGRAM_MIN / NGRAM_MAX, 2 and 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..numbers import as_int
from .proposers import NGRAM_MAX, NGRAM_MIN

METHODS = ("mtp", "ngram")
DEFAULT_NUM_TOKENS = {"mtp": 1, "ngram": 3}
# From the 9B's verify costs (BENCHMARKS.md; H100, e69f6d5): a k = 3 verify step costs 1.20x a plain step at one
# stream, 1.28x at 8, 1.86x at 32 and 2.62x at 128 (MTP k = 2: 1.52x / 1.55x / 2.10x / 2.52x), so at 32 streams
# MTP's published acceptance length (2.23 at k = 2) gains ~6% and at 128 speculation loses; on the H200 16 streams
# cost 1.53x (430bfa9). The verify checkpoints' GDN state writes grow with streams x k (9B: ~50 MiB per entry,
# 2.4 GB at 16 x 3); MoE steps read more experts as tokens grow (35B-A3B: 1.59x at one stream), so theirs may want
# less. vLLM's recipes report MTP a loss at concurrency 64. docs/speculative.md "When a step speculates".
DEFAULT_MAX_STREAMS = 16
_KEYS = ("method", "num_tokens", "max_streams", "prompt_lookup_min", "prompt_lookup_max")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")

# vLLM's --speculative-config keys that map onto ours (vllm/config/speculative.py), and its method names
VLLM_KEYS = {"method": "method", "num_speculative_tokens": "num_tokens", "disable_by_batch_size": "max_streams",
             "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"}
VLLM_METHODS = {"mtp": "mtp", "qwen3_next_mtp": "mtp", "ngram": "ngram"}


@dataclass(frozen=True)
class Speculative:
    """A checked speculative-decoding option: the method, the drafts per step, the most decode streams of a step
    that speculates, and prompt lookup's suffix lengths."""
    method: str
    num_tokens: int
    max_streams: int = DEFAULT_MAX_STREAMS
    prompt_lookup_min: int = NGRAM_MIN
    prompt_lookup_max: int = NGRAM_MAX


def check_speculative(speculative, model) -> Speculative | None:
    """`speculative` (None, "mtp", "ngram", or a mapping with "method" and the optional keys of the module
    docstring) checked for `model`: a Speculative, or None when off. ValueError naming the problem: an unknown
    method or key, a value out of range, and for "mtp" a model without an MTP head (naming what it lacks) or with
    one of several layers."""
    spec = parse_speculative(speculative)
    if spec is not None and spec.method == "mtp":
        check_mtp_head(model.config, getattr(model, "mtp", None) is not None)
    return spec


def parse_speculative(speculative) -> Speculative | None:
    """check_speculative without the model: every check but the MTP head's."""
    if speculative is None:
        return None
    if isinstance(speculative, Speculative):
        options: Mapping = {k: v for k, v in vars(speculative).items()
                            if speculative.method == "ngram" or k not in _NGRAM_KEYS}
    elif isinstance(speculative, str):
        options = {"method": speculative}
    elif isinstance(speculative, Mapping):
        options = {k: v for k, v in speculative.items() if v is not None or k == "method"}
        unknown = sorted(map(repr, set(options) - set(_KEYS)))
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {', '.join(unknown)}; expected 'method' and optionally "
                             f"{', '.join(map(repr, _KEYS[1:]))}")
        if "method" not in options:
            raise ValueError(f"speculative needs a 'method' ({' or '.join(map(repr, METHODS))}), got {dict(options)!r}")
    else:
        raise ValueError(f"speculative must be None, a method name ({', '.join(map(repr, METHODS))}), a mapping "
                         f"{{'method': ..., 'num_tokens': k}} or a Speculative, got {type(speculative).__name__} "
                         f"{speculative!r}")
    method = options["method"]
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {', '.join(map(repr, METHODS))}")
    if method != "ngram" and any(key in options for key in _NGRAM_KEYS):
        raise ValueError(f"speculative {', '.join(repr(k) for k in _NGRAM_KEYS if k in options)}: prompt lookup's "
                         f"suffix lengths, for method 'ngram' only (the method is {method!r})")
    k = _at_least(options, "num_tokens", DEFAULT_NUM_TOKENS[method], 1, "the drafts per step")
    max_streams = _at_least(options, "max_streams", DEFAULT_MAX_STREAMS, 1,
                            "the most decode streams of a step that speculates")
    low = _at_least(options, "prompt_lookup_min", NGRAM_MIN, 1, "the shortest suffix prompt lookup matches")
    high = _at_least(options, "prompt_lookup_max", NGRAM_MAX, 1, "the longest suffix prompt lookup matches")
    if "prompt_lookup_min" not in options:  # one given: the other's default moves to it rather than refuse it
        low = min(low, high)
    if "prompt_lookup_max" not in options:
        high = max(high, low)
    if low > high:
        raise ValueError(f"speculative prompt_lookup_min ({low}) must be at most prompt_lookup_max ({high})")
    return Speculative(method, k, max_streams, low, high)


def _at_least(options: Mapping, key: str, default: int, low: int, what: str) -> int:
    raw = options.get(key, default)
    value = as_int(raw)
    if value is None or value < low:
        raise ValueError(f"speculative {key} ({what}) must be an integer >= {low}, got {raw!r}")
    return value


def check_mtp_head(cfg, has_head: bool) -> None:
    """ValueError unless a model of config `cfg` (holding its MTP head when `has_head`) can draft with it."""
    if not has_head or not cfg.mtp_num_hidden_layers:
        raise ValueError(
            "speculative method 'mtp' needs the model's multi-token-prediction head, and this model has none: no "
            f"mtp.* weights (mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm). "
            f"A checkpoint holds them when its config.json declares {cfg.family.mtp_field} >= 1 and its safetensors "
            "carry the mtp.* tensors (transformers' save_pretrained drops them); from_pretrained(..., mtp=False) "
            "leaves them unread. Use 'ngram' for a model without one")
    if cfg.mtp_num_hidden_layers != 1:
        raise ValueError(f"speculative method 'mtp' drafts with one MTP layer; this model's head has "
                         f"{cfg.mtp_num_hidden_layers} ({cfg.family.mtp_field})")


def from_vllm(config) -> dict:
    """vLLM's --speculative-config (a parsed JSON object: {"method": "mtp", "num_speculative_tokens": 3, ...}) as
    our option (a mapping for check_speculative). vLLM's keys VLLM_KEYS maps ("disable_by_batch_size": our
    max_streams) and our own (num_tokens, max_streams) are taken; ValueError naming any other key (vLLM's
    draft-model keys among them: no draft model here), a key given under both names, or a method that is not
    one of VLLM_METHODS, and a value out of range (parse_speculative's checks, the key named as given). A null value
    is vLLM's "not given": our default."""
    if not isinstance(config, Mapping):
        raise ValueError(f"expected a JSON object such as {{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}, "
                         f"got {type(config).__name__} {config!r}")
    ours = {"num_tokens": "num_tokens", "max_streams": "max_streams"}
    names = VLLM_KEYS | ours
    unknown = [key for key in config if key not in names]
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; the keys taken are "
                         f"{', '.join(map(repr, VLLM_KEYS))} (vLLM's) and {', '.join(map(repr, ours))}")
    option: dict = {}
    for key, value in config.items():
        if value is None:  # vLLM's "not given"
            continue
        target = names[key]
        if target in option:
            twice = [k for k in config if names[k] == target]
            raise ValueError(f"{' and '.join(map(repr, twice))} name the same setting: give one")
        option[target] = value
    if "method" not in option:
        raise ValueError(f"a 'method' is needed ({', '.join(map(repr, VLLM_METHODS))}), got {dict(config)!r}")
    method = option["method"]
    if not isinstance(method, str) or method not in VLLM_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(map(repr, VLLM_METHODS))} "
                         "(qwen3_next_mtp: vLLM's older name of mtp)")
    option["method"] = VLLM_METHODS[method]
    try:
        parse_speculative(option)
    except ValueError as e:  # named as the user wrote it
        text = str(e)
        for key in config:
            text = text.replace(f"speculative {names[key]} ", f"{key} ")
        raise ValueError(text) from None
    return option
