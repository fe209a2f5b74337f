"""Acceptance of draft tokens: which of a stream's k drafts the target model keeps, and the one token it adds,
on batched tensors, greedy and sampled rows side by side; no per-row host loop but the draw of each sampled
row's uniforms from its request's generator.

Shapes: B streams (rows), K drafts at most (row b has num_drafts[b] <= K; the rest is padding), V vocabulary.

The engine's drafts (n-gram lookups, the MTP head's greedy drafts) are one-hot proposals, and for them
acceptance is a match against the target's own draw at each position:

    uniforms = draw_uniforms(generators, num_drafts, K)       # .values [B, K+1]: one per verify position
    drawn = draw_positions(logits, params, uniforms.values)   # [B, K+1]: what a plain step would draw there
    result = accept_drawn(drawn, draft_tokens, num_drafts)     # counts [B], tokens [B, K+1]
    uniforms.settle(result.counts)                             # each generator just past the uniforms used

Row b's position j scores the token after draft j (position 0: after the last token before the drafts). Its
token there is drawn as a plain decode step draws (sampling.draw_with: the argmax for a greedy row, else the
inverse CDF of the sorted, masked probabilities with the position's uniform u_j, the j-th uniform the request's
generator gives from here); drafts are kept while they equal those draws, and the first draw that differs (or
the one after the last draft) is the added token. For a one-hot draft d this is standard speculative rejection
sampling (Leviathan et al. 2023; Chen et al. 2023) with q = one-hot(d): d is kept with probability p(d) =
min(1, p(d) / q(d)), and on rejection the added token follows p conditioned on not being d, the normalized
residual max(p - q, 0). The randomness is coupled to plain sampling's: a row that keeps c drafts has used c + 1
uniforms, and `Uniforms.settle` puts its generator back just past them, so a seeded request draws the same
uniform for the same output position whatever was drafted, and emits the tokens plain decoding with its seed
would (up to the rounding of logits computed in a differently shaped step): its tokens never depend on what
else shares its steps, nor on whether a step verified drafts.

`rejection_sample` is the general form for drafts drawn from a distribution q (draft_probs; None: one-hot),
with its own uniforms' layout (K acceptance tests, then the final draw); no engine path draws sampled drafts yet.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ..sampling import SamplingParams, draw_with, probabilities, row_cumsum

EMPTY = -1  # tokens' entries past what a row emits


class Accepted(NamedTuple):
    """accept_drawn's and rejection_sample's result, on the inputs' device: `counts` int64 [B], the drafts each row keeps (0 ..
    num_drafts[b]); `tokens` int64 [B, K+1], each row's kept drafts, then the token it adds, then EMPTY. Row b
    emits counts[b] + 1 tokens."""
    counts: Tensor
    tokens: Tensor


def target_probabilities(target_logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The distributions [B, K+1, V] fp32 that rejection_sample compares the drafts against: for a sampled row
    sampling.probabilities of each position (the sampler's temperature, min_p, top-k, top-p), for a greedy row
    the one-hot of each position's argmax (the sampler's greedy token)."""
    B, K1, V = target_logits.shape
    if len(params) != B:
        raise ValueError(f"{len(params)} sampling parameters for {B} rows of target logits")
    out = torch.zeros(B, K1, V, dtype=torch.float32, device=target_logits.device)
    greedy = [b for b, p in enumerate(params) if p.greedy]
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=target_logits.device)
        top = target_logits.index_select(0, index).argmax(dim=-1, keepdim=True)  # [G, K+1, 1]
        out.index_copy_(0, index, torch.zeros_like(out[:len(greedy)]).scatter_(2, top, 1.0))
    if sampled:
        index = torch.tensor(sampled, device=target_logits.device)
        rows = target_logits.index_select(0, index).reshape(len(sampled) * K1, V)
        probs = probabilities(rows, [params[b] for b in sampled for _ in range(K1)])
        out.index_copy_(0, index, probs.reshape(len(sampled), K1, V))
    return out


class Uniforms:
    """Each sampled row's uniforms for a verify step (draw_uniforms): `values` fp32 [B, K+1], row b's
    num_drafts[b] + 1 uniforms in columns 0 .. num_drafts[b] (position j's in column j), drawn from its request's
    generator in that order; zeros elsewhere and in greedy rows (generator None)."""

    def __init__(self, generators: Sequence[torch.Generator | None], num_drafts: Sequence[int], max_drafts: int):
        if len(generators) != len(num_drafts):
            raise ValueError(f"{len(generators)} generators for {len(num_drafts)} rows of drafts")
        self.values = torch.zeros(len(generators), max_drafts + 1, dtype=torch.float32)
        self._rewind = []  # (row, generator, its state before the draw, drafts): rows that may use fewer
        for b, (g, n) in enumerate(zip(generators, num_drafts)):
            if not 0 <= n <= max_drafts:
                raise ValueError(f"row {b} has {n} drafts, outside 0 .. {max_drafts}")
            if g is None:
                continue
            if n:
                self._rewind.append((b, g, g.get_state(), n))
            self.values[b, :n + 1] = torch.rand(n + 1, generator=g)

    def settle(self, counts: Sequence[int]) -> None:
        """After acceptance, `counts` (host ints [B]) the drafts each row kept: a row that kept c < num_drafts
        used c + 1 uniforms, so its generator goes back to its state before the draw and draws those c + 1 again:
        the next uniform it gives is the one after the last token the row emitted."""
        for b, g, state, n in self._rewind:
            c = int(counts[b])
            if c < n:
                g.set_state(state)
                torch.rand(c + 1, generator=g)


def draw_uniforms(generators: Sequence[torch.Generator | None], num_drafts: Sequence[int], max_drafts: int
                  ) -> Uniforms:
    """The verify positions' uniforms of B rows (Uniforms): generators[b] the row's request's (None: greedy),
    num_drafts[b] its drafts (at most max_drafts)."""
    return Uniforms(generators, num_drafts, max_drafts)


def draw_positions(logits: Tensor, params: Sequence[SamplingParams], uniforms: Tensor) -> Tensor:
    """The target's token at every verify position, int64 [B, K+1], from `logits` [B * (K+1), V] (row b's
    positions together, after the logits processors) with each row's SamplingParams and uniforms [B, K+1]
    (Uniforms.values; sampling.draw_with: a plain step's draw)."""
    B, K1 = uniforms.shape
    if logits.shape[0] != B * K1 or len(params) != B:
        raise ValueError(f"draw_positions: {logits.shape[0]} rows of logits and {len(params)} sampling parameters "
                         f"for {B} rows of {K1} positions")
    rows = [b * K1 + t for b, p in enumerate(params) if not p.greedy for t in range(K1)]
    values = uniforms.reshape(-1).tolist()
    return draw_with(logits, [p for p in params for _ in range(K1)], rows, [values[i] for i in rows]).view(B, K1)


def accept_drawn(drawn: Tensor, draft_tokens: Tensor, num_drafts: Tensor) -> Accepted:
    """Accepted drafts and the added token (module docstring): drawn int64 [B, K+1] the target's token at each
    verify position (a plain step's draw there), draft_tokens [B, K] (entries past num_drafts[b] ignored),
    num_drafts [B]. Row b keeps the leading run of drafts equal to its draws, then adds the draw after it. Reads
    nothing back to the host."""
    B, K1 = drawn.shape
    K = K1 - 1
    if tuple(draft_tokens.shape) != (B, K) or tuple(num_drafts.shape) != (B,):
        raise ValueError(f"accept_drawn: draft_tokens {tuple(draft_tokens.shape)} and num_drafts "
                         f"{tuple(num_drafts.shape)} do not fit drawn {tuple(drawn.shape)} (expected [{B}, {K}] "
                         f"and [{B}])")
    dev = drawn.device
    valid = torch.arange(K, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)
    counts = ((draft_tokens == drawn[:, :K]) & valid).long().cumprod(dim=1).sum(dim=1)
    final = drawn.gather(1, counts.unsqueeze(1))
    cols = torch.arange(K1, device=dev).unsqueeze(0)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), EMPTY)], dim=1)
    tokens = torch.where(cols < counts.unsqueeze(1), padded, EMPTY)
    return Accepted(counts, torch.where(cols == counts.unsqueeze(1), final, tokens))


def rejection_sample(target_probs: Tensor, draft_tokens: Tensor, num_drafts: Tensor, greedy: Tensor,
                     uniforms: Tensor, draft_probs: Tensor | None = None) -> Accepted:
    """Accept drafts and add one token per row (module docstring).

    Args:
        target_probs: [B, K+1, V] fp32 (target_probabilities): p at each draft's position and after the last.
        draft_tokens: [B, K] int64; entries past num_drafts[b] are ignored.
        num_drafts: [B] int64, each in [0, K].
        greedy: [B] bool: rows accepted by argmax (their uniforms and draft probabilities unused).
        uniforms: [B, K+1] in [0, 1): column j < K tests draft j, column K draws the final token.
        draft_probs: [B, K, V] the distributions the drafts were drawn from, or None (one-hot drafts).
    Returns Accepted (counts [B], tokens [B, K+1]). Reads nothing back to the host.
    """
    B, K1, V = target_probs.shape
    K, dev = K1 - 1, target_probs.device
    if tuple(draft_tokens.shape) != (B, K) or tuple(uniforms.shape) != (B, K1) or tuple(num_drafts.shape) != (B,):
        raise ValueError(f"rejection_sample: draft_tokens {tuple(draft_tokens.shape)}, num_drafts "
                         f"{tuple(num_drafts.shape)} and uniforms {tuple(uniforms.shape)} do not fit target_probs "
                         f"{tuple(target_probs.shape)} (expected [{B}, {K}], [{B}] and [{B}, {K1}])")
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K, V):
        raise ValueError(f"rejection_sample: draft_probs {tuple(draft_probs.shape)}, expected {(B, K, V)}")
    drafts = draft_tokens.clamp(0, V - 1).unsqueeze(2)  # padding entries: any id (masked below)
    valid = torch.arange(K, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)  # [B, K]
    p_d = target_probs[:, :K].gather(2, drafts).squeeze(2)  # [B, K]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.float().gather(2, drafts).squeeze(2)
    kept = torch.where(greedy.unsqueeze(1), drafts.squeeze(2) == target_probs[:, :K].argmax(dim=-1),
                       uniforms[:, :K] * q_d < p_d) & valid
    counts = kept.long().cumprod(dim=1).sum(dim=1)  # the leading run of kept drafts
    # the final token's distribution: p at position counts, less q there when draft `counts` was rejected
    at = counts.view(B, 1, 1).expand(B, 1, V)
    p_final = target_probs.gather(1, at).squeeze(1)  # [B, V]
    rejected = counts < num_drafts
    q_at = at.clamp(max=max(K - 1, 0))
    if K == 0:
        q_final = torch.zeros_like(p_final)
    elif draft_probs is None:
        q_final = torch.zeros_like(p_final).scatter_(1, draft_tokens.clamp(0, V - 1).gather(1, q_at[:, :, 0]), 1.0)
    else:
        q_final = draft_probs.float().gather(1, q_at).squeeze(1)
    residual = (p_final - q_final).clamp(min=0)
    # p == q (up to rounding) leaves no residual, and then rejection has probability 0: p is the safe fallback
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_final)
    final_dist = torch.where(rejected.unsqueeze(1), residual, p_final)
    sampled = _inverse_cdf(final_dist, uniforms[:, K])
    final = torch.where(greedy, p_final.argmax(dim=1), sampled)
    # tokens: the kept drafts, the final token at column counts, EMPTY past it
    cols = torch.arange(K1, device=dev).unsqueeze(0)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), EMPTY)], dim=1)
    tokens = torch.where(cols < counts.unsqueeze(1), padded, EMPTY)
    tokens = torch.where(cols == counts.unsqueeze(1), final.unsqueeze(1), tokens)
    return Accepted(counts, tokens)


def _inverse_cdf(dist: Tensor, u: Tensor) -> Tensor:
    """One token per row of `dist` [B, V] (non-negative, not normalized): the first id whose cumulative mass
    exceeds u * total, never one of zero mass (rounding at the top end takes the last id with mass)."""
    cdf = row_cumsum(dist)  # (not Tensor.cumsum: sampling.row_cumsum says why)
    pick = torch.searchsorted(cdf, (u.float() * cdf[:, -1]).unsqueeze(1).contiguous(), right=True).squeeze(1)
    V = dist.shape[1]
    last = V - 1 - (dist > 0).flip(1).long().argmax(dim=1)
    return torch.minimum(pick, last)


def unprocessed(r) -> bool:
    """Whether no logits processor changes request r's logits at any verify position (no grammar, penalty,
    logit_bias, logprobs nor min_tokens still holding its stop tokens back): its rows may take the captured
    acceptance (verify.SpeculativeStep._accept_captured)."""
    p = r.params
    return (r.grammar is None and not p.penalized and not p.logit_bias and p.logprobs is None
            and (not r.stop_ids or p.min_tokens <= min(len(r.out), r.generated)))
