"""Next-token sampling on the device, batched over rows, each row with its request's own parameters.

    result = sample(logits, rows, penalties)   # SampleResult: the tokens (and logprobs) still on the device
    tokens, logprobs = result.to_host()        # the one read of the device (the engine loop's)

A row is a request's (SampleRow, or a scheduler Request): its SamplingParams, its generator, its cache slot,
how many tokens it sampled before, its prompt and its stop tokens. Each request draws with its own generator,
so its draws do not depend on what else shares the batch (its logits may, in their last bits: the matmuls follow
the batch's shape; docs/generation.md, "Sampling"). The generators live on the CPU and each gives one
uniform number per sampled row per step; everything else runs on the logits' device for all rows at once,
with no host sync until to_host(). Greedy rows (temperature 0) take the argmax and draw nothing.

In order (vLLM's v1 sampler): the logits processors of logits_processors.py (token bitmask, logit_bias,
min_tokens, then the repetition, frequency and presence penalties), whose result greedy rows take the
argmax of; then for sampled rows temperature, min_p (tokens less likely than min_p times the most likely
one are dropped), top-k, then top-p (the smallest set of most likely tokens whose probability reaches top_p,
at least one), each over what the previous left, and the inverse-CDF draw.

Logprobs (SamplingParams.logprobs, logprobs.py) are of the raw logits, before any of this (vLLM's default):
a request's logprobs do not depend on how it samples.
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch

from .logits_processors import PenaltyState, process_logits, to_device
from .logprobs import MAX_LOGPROBS, DeviceLogprobs, TokenLogprobs, token_logprobs

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; every default is off. temperature 0: greedy; top_k 0: no top-k; top_p 1.0: no
    top-p; min_p 0: none; penalties 0 (presence, frequency) and 1 (repetition): none; logit_bias: (token id,
    bias) pairs sorted by id; min_tokens: stop tokens suppressed until that many tokens are out; logprobs /
    prompt_logprobs: None, or N: each sampled / prompt token's log-probability and the N most likely."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def plain(self) -> bool:
        """Greedy with nothing else: no logit processor applies (logit_bias, min_tokens, penalties) and no logprobs
        are asked for; its token is the argmax of the logits. (Cached: a decode step reads it for every row.)"""
        return (self.greedy and not self.logit_bias and self.min_tokens == 0 and not self.penalized
                and self.logprobs is None)

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the request's token statistics (logits_processors.PenaltyState)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def check_params(temperature, top_k, top_p, *, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                 repetition_penalty=1.0, logit_bias=None, min_tokens=0, logprobs=None, prompt_logprobs=None,
                 vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams from user values (Python or numpy numbers; logit_bias a mapping of token id to bias, ids
    below `vocab_size` when given, as logprobs / prompt_logprobs are at most it); ValueError naming a bad one."""
    if not _is_real(temperature) or not 0.0 <= _comparable(temperature) <= sys.float_info.max:
        raise ValueError(f"temperature must be a finite number >= 0, got {_describe(temperature)}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: off), got {_describe(top_k)}")
    if not _is_real(top_p) or not 0.0 < _comparable(top_p) <= 1.0:
        raise ValueError(f"top_p must be a number in (0, 1], got {_describe(top_p)}")
    if not _is_real(min_p) or not 0.0 <= _comparable(min_p) <= 1.0:
        raise ValueError(f"min_p must be a number in [0, 1] (0: off), got {_describe(min_p)}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _is_real(value) or not -MAX_PENALTY <= _comparable(value) <= MAX_PENALTY:
            raise ValueError(f"{name} must be a number in [-2, 2] (0: off), got {_describe(value)}")
    if not _is_real(repetition_penalty) or not 0.0 < _comparable(repetition_penalty) <= sys.float_info.max:
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {_describe(repetition_penalty)}")
    if not _is_int(min_tokens) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {_describe(min_tokens)}")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (the top tokens returned "
                             f"beside each token's own), got {_describe(value)}")
        if value is not None and vocab_size is not None and value > vocab_size:  # (was an assertion mid-step)
            raise ValueError(f"{name}={value} asks for more top tokens than the model's vocabulary holds "
                             f"({vocab_size} tokens)")
    return SamplingParams(float(temperature), int(top_k), float(top_p), float(min_p), float(presence_penalty),
                          float(frequency_penalty), float(repetition_penalty), _check_logit_bias(logit_bias, vocab_size),
                          int(min_tokens), None if logprobs is None else int(logprobs),
                          None if prompt_logprobs is None else int(prompt_logprobs))


def _check_logit_bias(logit_bias, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {type(logit_bias).__name__}")
    out = []
    for token, bias in logit_bias.items():
        if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"logit_bias: {token!r} is not a token id of this model (expected ids in {where})")
        if not _is_real(bias) or not -MAX_LOGIT_BIAS <= _comparable(bias) <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got "
                             f"{_describe(bias)}")
        out.append((int(token), float(bias)))
    return tuple(sorted(out))


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


class SampleRow(NamedTuple):
    """One row of `sample` (a scheduler Request has the same fields): the request's parameters and generator
    (None: greedy), its cache slot (its row of the penalty state), the tokens it sampled before this step
    (min_tokens; 0: its penalty statistics start now), its prompt (read then, for repetition_penalty) and its
    stop tokens (suppressed while fewer than min_tokens are out)."""
    params: SamplingParams
    generator: torch.Generator | None = None
    slot: int = 0
    generated: int = 0
    prompt: Sequence[int] = ()
    stop_ids: frozenset = frozenset()


class SampleResult(NamedTuple):
    """What `sample` gives, on the logits' device: one token per row, and for the rows whose request asked for
    logprobs (`logprob_rows`, in row order) the sampled tokens' raw logprobs and their top N (logprobs.py)."""
    tokens: torch.Tensor  # int64 [n]
    logprob_rows: list[int]
    logprobs: DeviceLogprobs | None
    top_n: list[int]  # N of each logprob row

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens, and each row's TokenLogprobs (None for a row that did not ask). Reads the device."""
        tokens = self.tokens.tolist()
        entries: list[TokenLogprobs | None] = [None] * len(tokens)
        if self.logprobs is not None:
            for k, entry in zip(self.logprob_rows, self.logprobs.to_host(self.top_n)):
                entries[k] = entry
        return tokens, entries


def sample(logits: torch.Tensor, rows: Sequence, state: PenaltyState | None = None,
           token_bitmask: torch.Tensor | None = None) -> SampleResult:
    """One token per row of `logits` [n, vocab] (SampleResult; nothing read back to the host). Row i samples
    with rows[i]'s parameters (SampleRow's fields); a sampled row draws one uniform number from its generator.
    `state`: the per-slot penalty statistics (needed when a row has a penalty), updated with the new tokens.
    `token_bitmask`: int32 [n, ceil(vocab / 32)] of the tokens each row may take (structured outputs), or None.
    `logits` is not changed."""
    # every row greedy, nothing else (a decode step's usual; a comprehension: faster than all() over a map)
    if token_bitmask is None and not [r for r in rows if not r.params.plain]:
        return SampleResult(logits.argmax(dim=-1), [], None, [])
    params = [r.params for r in rows]
    x = process_logits(logits, rows, state, token_bitmask)
    tokens = _draw(x, params, [r.generator for r in rows])
    dev = logits.device
    penalized = [k for k, p in enumerate(params) if p.penalized]
    if penalized:
        state.record(to_device([rows[k].slot for k in penalized], torch.int64, dev),
                     tokens.index_select(0, to_device(penalized, torch.int64, dev)))
    want = [k for k, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return SampleResult(tokens, [], None, [])
    top_n = [params[k].logprobs for k in want]
    if len(want) < len(rows):
        index = to_device(want, torch.int64, dev)
        raw, chosen = logits.index_select(0, index), tokens.index_select(0, index)
    else:
        raw, chosen = logits, tokens
    return SampleResult(tokens, want, token_logprobs(raw, chosen, max(top_n)), top_n)


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled row draws from, fp32 [n, vocab]: softmax of `logits` [n, vocab] (already
    processed: process_logits) under each row's temperature, min_p, top-k and top-p, renormalized. Every row must
    sample (temperature > 0)."""
    assert not any(p.greedy for p in params), "greedy rows draw nothing"
    uniforms = [0.0] * len(params)
    probs, order = _sorted_probs(logits.float(), *_row_values(logits, params, range(len(params)), uniforms)[1:5])
    return torch.zeros_like(probs).scatter_(1, order, probs / probs.sum(dim=-1, keepdim=True))


def _row_values(logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[int], uniforms: list[float]):
    """Device tensors [len(rows)] of rows' uniforms, temperatures, top_k, top_p, log(min_p), and the row indices:
    one copy to the device per dtype."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = [params[i].temperature for i in rows]
    top_p = [params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in rows]  # 1.0: no mask
    log_min_p = [math.log(params[i].min_p) if params[i].min_p > 0.0 else -math.inf for i in rows]
    top_k = [min(params[i].top_k or vocab, vocab) for i in rows]  # any int: beyond int64 too
    floats = to_device([uniforms, temps, top_p, log_min_p], torch.float32, dev)
    ints = to_device([top_k, list(rows)], torch.int64, dev)
    return floats[0], floats[1], ints[0], floats[2], floats[3], ints[1]


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """One token per row of `logits` [n, vocab] (int64 [n]): greedy rows the argmax, the others an inverse-CDF draw
    under temperature, min_p, top-k and top-p with one uniform from their generator."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    return draw_with(logits, params, rows, [float(torch.rand(1, generator=generators[i])) for i in rows])


def draw_with(logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[int],
              uniforms: list[float]) -> torch.Tensor:
    """_draw's tokens int64 [n] with given uniforms: uniforms[j] is row rows[j]'s (the sampled rows, in order);
    the other rows take the argmax. A speculative step draws its verify positions here (acceptance.py), so a
    position's token is the one a plain step would draw with the same uniform."""
    greedy = logits.argmax(dim=-1)  # in the logits' dtype: widening to fp32 is exact, so the same argmax
    if not rows:
        return greedy
    uniforms, temps, top_k, top_p, log_min_p, index = _row_values(logits, params, rows, uniforms)
    probs, order = _sorted_probs(logits.index_select(0, index).float(), temps, top_k, top_p, log_min_p)
    out = greedy.clone()
    out[index] = inverse_cdf(probs, order, uniforms)
    return out


def inverse_cdf(probs: torch.Tensor, order: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row int64 [n] from _sorted_probs' (probs, order) [n, vocab] and uniforms [n]: the first sorted
    entry whose cumulative mass exceeds u * total, never past the last kept entry (rounding: u * total can reach
    its cdf)."""
    cdf = row_cumsum(probs)
    pos = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True)
    kept = (probs > 0).sum(dim=-1, keepdim=True)
    pos = torch.minimum(pos, kept - 1).clamp(min=0)  # (clamp: a row of no mass, a captured bucket's padding)
    return order.gather(1, pos).squeeze(1)


@torch.library.custom_op("metrale_sampling::row_cumsum", mutates_args=(), schema="(Tensor x) -> Tensor")
def _row_cumsum_op(x):
    return torch.cumsum(x, dim=-1)


@_row_cumsum_op.register_fake
def _(x):
    return torch.empty_like(x)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """torch.cumsum(x, dim=-1); under torch.compile an op Inductor does not see into. Inductor turns a cumsum
    over a vocabulary-long row into a split scan, whose Triton codegen fails on a dynamic row count (torch 2.11 on
    the H200: `TypeError: list indices must be integers or slices, not NoneType` in get_block_shape, compiling
    the speculative step's sampled acceptance over Qwen3.5's 248,320 tokens). Through the op the compiled and
    the eager paths run the same kernel, so they draw the same tokens."""
    return _row_cumsum_op(x) if torch.compiler.is_compiling() else torch.cumsum(x, dim=-1)


def _sorted_probs(logits, temps, top_k, top_p, log_min_p):
    """Probabilities over each row's tokens sorted by decreasing logit, masked by min_p, top-k and top-p (not
    renormalized), and the sort order."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    # Shifted so each row's largest logit is 0 before dividing: a tiny temperature then sends the others
    # to -inf, never the largest to inf (inf - inf: NaN probabilities). Temperatures below fp32's
    # smallest normal (which would round to 0: 0 / 0) are clamped to it; at that scale only the row's
    # maximum (and exact ties) keep any probability anyway.
    tiny = torch.finfo(torch.float32).tiny
    sorted_logits = (sorted_logits - sorted_logits[:, :1]) / temps.float().clamp(min=tiny).unsqueeze(1)
    # min_p: p / p_max = exp(logit - max logit) < min_p drops a token (never the first: its shifted logit is 0)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < log_min_p.unsqueeze(1), float("-inf"))
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = row_cumsum(probs) - probs  # probability of the more likely tokens
    # the first token always stays, also for a top_p that rounds to 0 in fp32 (before 0 >= top_p 0)
    probs = probs.masked_fill((before >= top_p.unsqueeze(1)) & (rank > 0), 0.0)
    return probs, order
