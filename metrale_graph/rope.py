"""Rotary position embeddings: a config's RoPE scaling (`RopeScaling`, read from config.json's `rope_parameters`
or legacy `rope_scaling` section), the checks on it, and the inverse frequencies and cos / sin scale the model
rotates with (`rope_frequencies`), computed as transformers' ROPE_INIT_FUNCTIONS compute them, in fp32.

dim = int(head_dim * partial_rotary_factor) sets the frequencies 1 / theta^(2i / dim), i < ceil(dim / 2), and
each rotates a pair of channels (rotate-half over the first 2 * ceil(dim / 2) of a head: an odd dim rotates one
channel more than it names, as in transformers; dim 0 rotates none). The rope types:

- default: those frequencies.
- linear: divided by `factor`.
- dynamic: NTK scaling of theta, which transformers starts only at positions past max_position_embeddings; a
  cache never holds them (max_context <= max_position_embeddings), so the default frequencies.
- yarn: the low frequencies divided by `factor`, the high ones kept, a linear ramp between (over the dims that
  `beta_fast` / `beta_slow` rotations at original_max_position_embeddings name), and cos / sin scaled by
  `attention_factor` (by default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio).
- llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor divided by `factor`, shorter
  than original_max_position_embeddings / high_freq_factor kept, smoothed between.
- proportional: head_dim / 2 frequencies 1 / theta^(2i / head_dim), those past dim / 2 zero (the whole head in
  rotate-half pairs, the zero ones unrotated), divided by `factor`.

longrope is refused: transformers switches its frequencies when a forward call reaches past
original_max_position_embeddings, for that call's every token, which no prefill chunked over steps or decode
continuing a cache can match.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

SCALED = ("linear", "dynamic", "yarn", "llama3", "proportional")  # beside "default"
# per type: the fields transformers requires (original_max_position_embeddings it fills in itself), and reads
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "proportional": ()}
_READ = {"linear": ("factor",), "dynamic": ("factor",),
         "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                  "mscale", "mscale_all_dim", "truncate"),
         "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
         "proportional": ("factor",)}


@dataclass(frozen=True)
class RopeScaling:
    """The scaling of a rope_parameters section whose rope_type is not 'default': its fields as config.json names
    them (None: absent, transformers' default applies)."""
    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def to_hf(self) -> dict:
        """The section's fields (rope_type and those set), as config.json holds them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def parse_rope_scaling(rope: dict, field: str, fail: Callable[[str], Exception], top_original,
                       max_positions: int) -> RopeScaling | None:
    """The RopeScaling of config.json's RoPE section `rope` (found under `field`), None for rope_type 'default'.
    yarn's and llama3's original_max_position_embeddings: config.json's top-level field `top_original` where it is
    not None (it wins, as transformers' standardize_rope_params has it), else the section's, else max_positions.
    `fail(msg)` makes the error to raise."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in SCALED:
        raise fail(f"unsupported rope_type {rope_type!r} in {field!r}: metrale-graph runs 'default' and "
                   f"{', '.join(map(repr, SCALED))} RoPE" + (
                       " (longrope's frequencies switch with the length of transformers' forward call, which a "
                       "cache continued over steps cannot follow)" if rope_type == "longrope" else ""))
    missing = [k for k in _REQUIRED[rope_type] if k not in rope]
    if missing:
        raise fail(f"{field!r} of rope_type {rope_type!r} has no {', '.join(map(repr, missing))}")
    fields = {k: rope.get(k) for k in _READ[rope_type]}
    if "original_max_position_embeddings" in fields:
        fields["original_max_position_embeddings"] = (
            top_original if top_original is not None else rope.get("original_max_position_embeddings", max_positions))
    return RopeScaling(rope_type, **fields)


def check_rope(v: dict, need: Callable[[bool, str], None]) -> None:
    """The rules on a config's RoPE fields (`v`: ModelConfig's fields, rope_scaling a RopeScaling or None); need(cond,
    msg) raises with msg where cond fails. Which rotary dims each type takes is transformers': where its
    computation would fail, the field that makes it fail is named here."""
    s, hd = v["rope_scaling"], v["head_dim"]
    need(s is None or isinstance(s, RopeScaling), f"field 'rope_scaling' must be a rope.RopeScaling or None, got {s!r}")
    dim = int(hd * v["partial_rotary_factor"])
    kind = "default" if s is None else s.rope_type
    need(kind in ("default", *SCALED), f"unsupported rope_type {kind!r}; expected one of 'default', {SCALED}")
    if kind != "proportional":
        need(2 * -(-dim // 2) <= hd, f"partial_rotary_factor {v['partial_rotary_factor']} gives rotary dim {dim} of "
                                     f"head_dim {hd}: it rotates {dim + 1} channels (in pairs), more than a head has")
    if s is None:
        return

    def number(name, positive=True, integer=False, optional=True):
        x = getattr(s, name)
        ok = ((x is None and optional) or (isinstance(x, (int, float)) and not isinstance(x, bool)
                                           and math.isfinite(x) and (x > 0 or not positive)
                                           and (not integer or float(x).is_integer())))
        need(ok, f"rope_parameters' {name} must be a {'positive ' if positive else ''}"
                 f"{'integer' if integer else 'number'} for rope_type {kind!r}, got {x!r}")

    number("factor", optional=kind in ("yarn", "proportional"))
    if kind in ("yarn", "llama3"):
        number("original_max_position_embeddings", integer=True)
    if kind == "yarn":
        for name in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
            number(name, positive=False)
        need(s.truncate is None or isinstance(s.truncate, bool),
             f"rope_parameters' truncate must be true or false, got {s.truncate!r}")
        need(dim % 2 == 0, f"rope_type 'yarn' needs an even rotary dim (its ramp spans dim // 2 frequencies of "
                           f"ceil(dim / 2)); partial_rotary_factor {v['partial_rotary_factor']} gives {dim} of head_dim {hd}")
    if kind == "llama3":
        number("low_freq_factor")
        number("high_freq_factor")
    if kind == "dynamic":
        need(dim != 2, "rope_type 'dynamic' with rotary dim 2: its NTK exponent dim / (dim - 2) divides by zero")


def rope_frequencies(cfg, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [ceil(dim / 2)] fp32, or [head_dim // 2] for proportional; the scale of cos and sin) of the RoPE
    of `cfg` (a config.ModelConfig), computed as transformers computes them (module docstring)."""
    s, base, hd = cfg.rope_scaling, cfg.rope_theta, cfg.head_dim
    dim = int(hd * cfg.partial_rotary_factor)
    kind = "default" if s is None else s.rope_type
    if kind == "proportional":
        angles = int(cfg.partial_rotary_factor * hd // 2)
        inv = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / hd))
        inv = torch.cat([inv, torch.zeros(hd // 2 - angles, device=device)])
        return inv / (1.0 if s.factor is None else s.factor), 1.0
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if kind in ("default", "dynamic"):
        return inv, 1.0
    if kind == "linear":
        return inv / s.factor, 1.0
    original = s.original_max_position_embeddings or cfg.max_position_embeddings
    if kind == "llama3":
        low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(s, dim, base, original, cfg.max_position_embeddings, device)


def _yarn(s: RopeScaling, dim: int, base: float, original: int, max_positions: int, device) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters, step for step."""
    factor = s.factor if s.factor is not None else max_positions / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim) if s.mscale and s.mscale_all_dim
                     else mscale(factor))

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)
