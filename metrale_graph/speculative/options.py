"""The speculative-decoding option a user gives (the Engine will take it as `speculative=`), checked against the
model before anything is built: None (off), a method's name, or {"method": ..., "num_tokens": k}.

Methods: "mtp" drafts with the checkpoint's multi-token-prediction head (speculative/mtp.py; the model must hold
one of one layer), "ngram" by prompt lookup (speculative/proposers.py; no weights). `num_tokens`: the drafts per
step, k >= 1 (default: 1 for "mtp", the token its one layer is trained to predict; 3 for "ngram").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..numbers import as_int

METHODS = ("mtp", "ngram")
DEFAULT_NUM_TOKENS = {"mtp": 1, "ngram": 3}
_KEYS = ("method", "num_tokens")


@dataclass(frozen=True)
class Speculative:
    """A checked speculative-decoding option: the method and the drafts per step."""
    method: str
    num_tokens: int


def check_speculative(speculative, model) -> Speculative | None:
    """`speculative` (None, "mtp", "ngram", or a mapping with "method" and optionally "num_tokens") checked for
    `model`: a Speculative, or None when off. ValueError naming the problem: an unknown method or key, a
    num_tokens that is not an integer >= 1, and for "mtp" a model without an MTP head (naming what it lacks) or
    with one of several layers."""
    if speculative is None:
        return None
    if isinstance(speculative, str):
        options: Mapping = {"method": speculative}
    elif isinstance(speculative, Mapping):
        options = speculative
        unknown = sorted(map(repr, set(options) - set(_KEYS)))
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {', '.join(unknown)}; expected 'method' and optionally "
                             "'num_tokens'")
        if "method" not in options:
            raise ValueError(f"speculative needs a 'method' ({' or '.join(map(repr, METHODS))}), got {dict(options)!r}")
    else:
        raise ValueError(f"speculative must be None, a method name ({', '.join(map(repr, METHODS))}) or a mapping "
                         f"{{'method': ..., 'num_tokens': k}}, got {type(speculative).__name__} {speculative!r}")
    method = options["method"]
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {', '.join(map(repr, METHODS))}")
    raw = options.get("num_tokens", DEFAULT_NUM_TOKENS[method])
    k = as_int(raw)
    if k is None or k < 1:
        raise ValueError(f"speculative num_tokens (the drafts per step) must be an integer >= 1, got {raw!r}")
    if method == "mtp":
        _check_mtp_head(model)
    return Speculative(method, k)


def _check_mtp_head(model) -> None:
    cfg = model.config
    if getattr(model, "mtp", None) is None:
        raise ValueError(
            "speculative method 'mtp' needs the model's multi-token-prediction head, and this model has none: no "
            f"mtp.* weights (mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.layers.0.*, mtp.norm). "
            f"A checkpoint holds them when its config.json declares {cfg.family.mtp_field} >= 1 and its safetensors "
            "carry the mtp.* tensors (transformers' save_pretrained drops them); from_pretrained(..., mtp=False) "
            "leaves them unread. Use 'ngram' for a model without one")
    if cfg.mtp_num_hidden_layers != 1:
        raise ValueError(f"speculative method 'mtp' drafts with one MTP layer; this model's head has "
                         f"{cfg.mtp_num_hidden_layers} ({cfg.family.mtp_field})")
