"""Acceptance of draft tokens: which of a stream's k drafts the target model keeps, and the one token it adds,
on batched tensors, greedy and sampled rows side by side (vLLM's rejection sampler); no per-row host loop but
the draw of each sampled row's uniforms from its request's generator.

Shapes: B streams (rows), K drafts at most (row b has num_drafts[b] <= K; the rest is padding), V vocabulary.

    probs = target_probabilities(target_logits, params)       # [B, K+1, V]: the distribution the sampler draws
    uniforms = draw_uniforms(generators, num_drafts, K)       # [B, K+1]: K acceptance tests, then the final draw
    result = rejection_sample(probs, draft_tokens, num_drafts, greedy, uniforms, draft_probs)
    result.counts [B], result.tokens [B, K+1]                  # accepted drafts, then one bonus / resampled token

`target_logits` [B, K+1, V] are the target model's logits at the stream's last verified token and at each
draft, after the sampler's logits processors (sampling.process_logits: bias, penalties, masks); row b's
position j scores the token after draft j (position 0: after the last token before the drafts).

Greedy rows (temperature 0) keep the longest run of drafts equal to the target's argmax and add the argmax
after it: the tokens greedy decoding emits. Sampled rows run standard speculative rejection sampling (Leviathan
et al. 2023; Chen et al. 2023): draft j, drawn from the draft distribution q_j, is kept when u_j * q_j(d_j) <
p_j(d_j) (probability min(1, p / q)); at the first rejection the added token is drawn from the normalized
residual max(p_j - q_j, 0), and when all num_drafts are kept from p at the next position (the bonus token). So
each emitted token is distributed exactly as the target's p, whatever q is: p is sampling.probabilities' (the
request's temperature, min_p, top-k and top-p, renormalized), so the output follows the sampler's own
distribution. `draft_probs` None: the drafts are one-hot proposals (n-gram lookups, greedy MTP drafts), q_j(d_j)
= 1 and the residual is p_j without d_j. The final draw is the sampler's inverse CDF over token ids with the
row's last uniform, which no acceptance test used (reusing the rejected test's uniform would bias it).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ..sampling import SamplingParams, probabilities, row_cumsum

EMPTY = -1  # tokens' entries past what a row emits


class Accepted(NamedTuple):
    """rejection_sample's result, on the inputs' device: `counts` int64 [B], the drafts each row keeps (0 ..
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


def draw_uniforms(generators: Sequence[torch.Generator | None], num_drafts: Sequence[int], max_drafts: int,
                  device=None) -> Tensor:
    """Each sampled row's uniforms [B, K+1] fp32 from its request's generator: num_drafts[b] for the acceptance
    tests (columns 0 .. num_drafts[b] - 1), then one for the final draw (column K), drawn in that order, so a
    seeded request's tokens depend on its seed and its drafts alone. Greedy rows (generator None) draw nothing
    (zeros)."""
    B, K = len(generators), max_drafts
    out = torch.zeros(B, K + 1, dtype=torch.float32)
    for b, (g, n) in enumerate(zip(generators, num_drafts)):
        if g is not None:
            u = torch.rand(n + 1, generator=g)
            out[b, :n], out[b, K] = u[:n], u[n]
    return out.to(device) if device is not None else out


def rejection_sample(target_probs: Tensor, draft_tokens: Tensor, num_drafts: Tensor, greedy: Tensor,
                     uniforms: Tensor, draft_probs: Tensor | None = None) -> Accepted:
    """Accept drafts and add one token per row (module docstring).

    Args:
        target_probs: [B, K+1, V] fp32 (target_probabilities): p at each draft's position and after the last.
        draft_tokens: [B, K] int64; entries past num_drafts[b] are ignored.
        num_drafts: [B] int64, each in [0, K].
        greedy: [B] bool: rows accepted by argmax (their uniforms and draft probabilities unused).
        uniforms: [B, K+1] in [0, 1) (draw_uniforms): column j < K tests draft j, column K draws the final token.
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
