"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next checkpoints as a drafter: its step over packed
tokens (`mtp_hidden_states`, a pure function of packed tensors, weights and pools, as the model's step is) and
an eager drafting loop for one stream (`draft_mtp`, engine-free; the engine's, batched: drafting.py, compiled and
captured through tail.mtp_drafts).

The conventions are vLLM's (qwen3_5_mtp.py, qwen3_next_mtp.py, and its EAGLE proposer with method "mtp"):

- The head's input at position p is token p + 1's embedding beside the main model's hidden state of position
  p after the final norm (HybridModel.normed: what the LM head reads, which is vLLM's model output):
      x = fc(cat(rms(e(t_{p+1}); pre_fc_norm_embedding), rms(h_p; pre_fc_norm_hidden)))     (embedding first)
      x = decoder layer (input norm, gated attention at RoPE position p, + x; post norm, MLP / MoE, + x)
      h'_p = rms(x; mtp.norm);   logits = lm_head(h'_p)                       (the shared LM head)
  h'_p's logits score token p + 2. The norms are zero-centred (x * (1 + w)), as the model's.
- The layer's K / V of position p go to the head's own pools (cache.mtp_k_caches[0]) where the main model keeps
  its own of p: the slot's blocks, no blocks of its own.
- Drafting k tokens after a step whose emitted token x_n is not yet in the cache (the slot's context is n):
  the head first catches up on the positions it has not seen, cache.mtp_context_lens[slot] = s .. n - 1
  (tokens t_{s+1} .. x_n beside the main model's h_s .. h_{n-1}); its last output gives draft 1 (of token
  n + 1). Draft j + 1 runs the head at position n + j - 1 on draft j beside its own previous output h' (vLLM
  feeds the head's hidden state back, not the main model's, which it does not have yet).
- The drafts' K / V (positions n .. n + k - 2) are not counted: mtp_context_lens advances to n only. The next
  catch-up rewrites the accepted positions from the main model's hidden states; attention never reads a
  position past what a stream has written.

Drafting runs the head's first layer (a head of several layers, which vLLM cycles through, is refused:
speculative/options.py).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ..batch import PackedBatch
from ..numbers import as_int
from ..ops.common import rms_norm
from ..ops.fp8.projection import linear
from ..sampling import SamplingParams, probabilities


class Draft(NamedTuple):
    """draft_mtp's result: `tokens` (k ids), `logits` [k, V] (the head's raw logits each was chosen from) and
    `probs` [k, V] fp32, the distributions they were drawn from (sampled drafts), or None (greedy drafts: one-hot
    proposals for acceptance.accept_drawn)."""
    tokens: list[int]
    logits: Tensor
    probs: Tensor | None


def mtp_hidden_states(model, cache, batch: PackedBatch, hidden: Tensor, layer: int = 0) -> Tensor:
    """The MTP head's step (module docstring): batch.tokens [T] are the tokens that follow each position
    (batch.positions, RoPE), `hidden` [T, D] the hidden states the head reads beside them (the main model's
    after its final norm, or the head's own previous output); batch.context_lens are the positions each stream's
    head entries start at. Returns the head's outputs h' [T, D] after mtp.norm (model.head of them: the draft
    logits). Mutates cache.mtp_k_caches[layer] / mtp_v_caches[layer] at the batch's positions. Under tensor
    parallelism every rank runs it on the same batch (fc is held whole; the layer all-reduces as the main ones)."""
    head, eps = model.mtp, model.local.rms_norm_eps
    e = model._embed(batch.tokens)
    x = torch.cat([rms_norm(e, head.pre_fc_norm_embedding.weight, eps),
                   rms_norm(hidden, head.pre_fc_norm_hidden.weight, eps)], dim=-1)
    x = linear(x, *model._w(head.fc))
    block = head.layers[layer]
    x = model._reduce(model._attention_mixer(block, x, batch, cache.mtp_k_caches[layer], cache.mtp_v_caches[layer]))
    x = model._reduce(model._feed_forward(block, x, batch))
    return rms_norm(x, head.norm.weight, eps)


def one_stream_batch(cache, slot: int, tokens: Tensor, start: int) -> PackedBatch:
    """A PackedBatch of one stream: `tokens` [T] int64 at positions start .. start + T - 1 of `slot`, whose
    entries start at `start` (its blocks must cover them)."""
    T, dev = tokens.shape[0], cache.device
    return PackedBatch(tokens=tokens.to(dev), positions=torch.arange(start, start + T, device=dev),
                       cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=dev),
                       slot_ids=torch.tensor([slot], dtype=torch.int64, device=dev),
                       context_lens=torch.tensor([start], dtype=torch.int32, device=dev),
                       block_tables=cache.block_tables[slot:slot + 1])


@torch.no_grad()
def draft_mtp(model, cache, slot: int, tokens: Sequence[int] | Tensor, hidden: Tensor, k: int,
              params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Draft:
    """Draft k tokens for the stream of `slot` with the model's MTP head (module docstring), eagerly.

    The slot holds n tokens of context and its head has caught up on s = cache.mtp_context_lens[slot] of them:
    `tokens` are the n - s tokens that follow positions s .. n - 1 (the last is the token the main model just
    emitted, not yet in the cache) and `hidden` [n - s, D] the main model's hidden states of those positions
    after its final norm (HybridModel.normed of hidden_states' rows). `params` None or greedy: each draft is the
    argmax (Draft.probs None); else drawn from sampling.probabilities under `params` with one uniform from
    `generator` per draft (Draft.probs those distributions).

    Gives the slot the blocks its drafts' positions need (up to n + k - 2), which the verify step then fills;
    advances mtp_context_lens[slot] to n. Bad input is a ValueError before anything changes; a failure after
    that resets the slot (HybridCache.transaction).
    """
    if model.mtp is None:
        raise ValueError("draft_mtp needs a model with an MTP head (model.mtp is None: no mtp.* weights)")
    model.check_cache(cache)
    cache.check_slot(slot)
    steps = as_int(k)
    if steps is None or steps < 1:
        raise ValueError(f"k (the drafts to make) must be an integer >= 1, got {k!r}")
    greedy = params is None or params.greedy
    if not greedy and not isinstance(generator, torch.Generator):
        raise ValueError("sampled drafts need the request's torch.Generator (generator=...)")
    with cache.exclusive():
        n, start = cache.context_lens[slot], cache.mtp_context_lens[slot]
        ids = _checked_tokens(tokens, n - start, model.config.vocab_size, slot, start, n)
        want = (n - start, model.config.hidden_size)
        if not (isinstance(hidden, Tensor) and tuple(hidden.shape) == want and hidden.dtype == model.dtype
                and hidden.device == model.device):
            got = (f"{tuple(hidden.shape)} {hidden.dtype} on {hidden.device}" if isinstance(hidden, Tensor)
                   else type(hidden).__name__)
            raise ValueError(f"hidden must be the main model's normed hidden states {list(want)} {model.dtype} on "
                             f"{model.device} (positions {start} .. {n - 1}), got {got}")
        if n + steps - 1 > cache.max_context:
            raise ValueError(f"{steps} drafts after {n} tokens reach position {n + steps - 2}, past the slot's "
                             f"max_context {cache.max_context}")
        needs = cache.block_needs([(slot, steps - 1)])
        if sum(b for _, b in needs) > cache.free_blocks:
            raise ValueError(f"the cache has {cache.free_blocks} free KV blocks; {steps} drafts after {n} tokens "
                             f"need {sum(b for _, b in needs)} more")
        with cache.transaction([slot]):
            cache.allocate(needs)
            h = mtp_hidden_states(model, cache, one_stream_batch(cache, slot, ids, start), hidden)[-1:]
            cache.mtp_context_lens[slot] = n
            drafts, all_logits, all_probs = [], [], []
            for j in range(steps):
                logits = model.head(h)[0]
                token, probs = _choose(logits, params, generator, greedy)
                drafts.append(token)
                all_logits.append(logits)
                all_probs.append(probs)
                if j + 1 < steps:
                    step = torch.tensor([token], dtype=torch.int64)
                    h = mtp_hidden_states(model, cache, one_stream_batch(cache, slot, step, n + j), h)
    return Draft(drafts, torch.stack(all_logits), None if greedy else torch.stack(all_probs))


def _checked_tokens(tokens, count: int, vocab: int, slot: int, start: int, n: int) -> Tensor:
    """`tokens` as an int64 tensor of `count` ids in [0, vocab), else ValueError naming the problem."""
    if count < 1:
        raise ValueError(f"slot {slot}'s MTP head has caught up on all its {n} tokens: drafting needs the token the "
                         "main model emitted after them (prefill it first, then draft)")
    values = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
    if len(values) != count or not all(as_int(t) is not None for t in values):
        raise ValueError(f"tokens must be the {count} token ids that follow positions {start} .. {n - 1} of slot "
                         f"{slot} (the MTP head has seen {start} of its {n}), got {len(values)}: {values[:8]}")
    values = [as_int(t) for t in values]
    bad = [t for t in values if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return torch.tensor(values, dtype=torch.int64)


def _choose(logits: Tensor, params: SamplingParams | None, generator, greedy: bool) -> tuple[int, Tensor | None]:
    """A draft from the head's logits [V]: the argmax, or a draw from the request's distribution (its probs)."""
    if greedy:
        return int(logits.argmax()), None
    probs = probabilities(logits.unsqueeze(0), [params])[0]
    cdf = probs.cumsum(0)
    pick = int(torch.searchsorted(cdf, torch.rand(1, generator=generator).to(cdf.device) * cdf[-1], right=True))
    last = int((probs > 0).nonzero()[-1])
    return min(pick, last), probs
