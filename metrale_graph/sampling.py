"""Next-token sampling on the device: greedy, temperature, top-k, top-p, batched over rows.

Each request draws with its own generator, so its tokens do not depend on what else shares the
batch. The generators live on the CPU and each gives one uniform number per sampled row per
step; everything else (temperature, the top-k and top-p masks, the inverse-CDF draw) runs on
the logits' device for all rows at once. Greedy rows (temperature 0) take the argmax and draw
nothing.

Order of the processing, as transformers' `generate` applies it: temperature, then top-k, then
top-p (the smallest set of most likely tokens whose probability reaches top_p, at least one).
"""

from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass

import torch

from .numbers import to_device


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0: greedy; top_k 0: no top-k; top_p 1.0: no top-p."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_params(temperature, top_k, top_p) -> SamplingParams:
    """SamplingParams from user values (Python or numpy numbers); ValueError naming a bad one."""
    if not _is_real(temperature) or not 0.0 <= _comparable(temperature) <= sys.float_info.max:
        raise ValueError(f"temperature must be a finite number >= 0, got {_describe(temperature)}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: off), got {_describe(top_k)}")
    if not _is_real(top_p) or not 0.0 < _comparable(top_p) <= 1.0:
        raise ValueError(f"top_p must be a number in (0, 1], got {_describe(top_p)}")
    return SamplingParams(float(temperature), int(top_k), float(top_p))


SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes: [low, high)


def check_seed(seed) -> int | None:
    """`seed` as an int if it is None or an integer (Python or numpy) torch's generators take; ValueError
    naming it otherwise."""
    if seed is None:
        return None
    if not _is_int(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer or None (an integer in [-2**63, 2**64)), got {_describe(seed)}")
    return int(seed)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _comparable(x):
    """A Python int as it is (float() of one past float's range raises OverflowError), any other real number
    (np.float32 included, which would warn when compared with a float beyond its range) as a float."""
    return x if isinstance(x, int) else float(x)


def _describe(x) -> str:
    """A bad value for a message: its repr, and its type where the repr does not say it is not a number."""
    return repr(x) if isinstance(x, numbers.Number) else f"{type(x).__name__} {x!r}"


def wrapped_seed(seed: int) -> int:
    """`seed` in SEED_RANGE: one past 2**64 - 1 (seed + request index, for a seed near the top) wrapped around
    modulo 2**64, which seeds torch's generators alike."""
    return seed - 2**64 if seed >= SEED_RANGE[1] else seed


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed` (wrapped_seed), or from the OS's entropy when seed is None."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(wrapped_seed(seed))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `logits` [n, vocab] (int64 [n], on the logits' device). Row i uses
    params[i]; a sampled row draws one uniform number from generators[i] (greedy rows: None)."""
    greedy = logits.argmax(dim=-1)  # in the logits' dtype: widening to fp32 is exact, so the same argmax
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy
    dev, vocab = logits.device, logits.shape[-1]
    uniforms = torch.cat([torch.rand(1, generator=generators[i]) for i in rows])
    temps = torch.tensor([params[i].temperature for i in rows])
    top_p = torch.tensor([params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in rows])  # 1.0: no mask
    top_k = [min(params[i].top_k or vocab, vocab) for i in rows]  # any int: beyond int64 too
    floats = to_device(torch.stack([uniforms, temps, top_p]), dev)  # one copy per dtype to the device
    ints = to_device(torch.tensor([top_k, rows], dtype=torch.int64), dev)
    uniforms, temps, top_p, top_k, index = floats[0], floats[1], floats[2], ints[0], ints[1]
    probs, order = _sorted_probs(logits[index].float(), temps, top_k, top_p)
    cdf = probs.cumsum(dim=-1)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True)
    kept = (probs > 0).sum(dim=-1, keepdim=True)
    pos = torch.minimum(pos, kept - 1)  # rounding: u * total can reach the last kept entry's cdf
    out = greedy.clone()
    out[index] = order.gather(1, pos).squeeze(1)
    return out


def _sorted_probs(logits, temps, top_k, top_p):
    """Probabilities over each row's tokens sorted by decreasing logit, masked by top-k and top-p
    (not renormalized), and the sort order."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    # Shifted so each row's largest logit is 0 before dividing: a tiny temperature then sends the others
    # to -inf, never the largest to inf (inf - inf: NaN probabilities). Temperatures below fp32's
    # smallest normal (which would round to 0: 0 / 0) are clamped to it; at that scale only the row's
    # maximum (and exact ties) keep any probability anyway.
    tiny = torch.finfo(torch.float32).tiny
    sorted_logits = (sorted_logits - sorted_logits[:, :1]) / temps.float().clamp(min=tiny).unsqueeze(1)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    # the first token always stays, also for a top_p that rounds to 0 in fp32 (before 0 >= top_p 0)
    probs = probs.masked_fill((before >= top_p.unsqueeze(1)) & (rank > 0), 0.0)
    return probs, order
