"""The speculative step's tail as functions of a few static tensors: what capture/speculative.py compiles with
torch.compile(fullgraph=True) and, on CUDA, captures into one graph per bucket, so that after the verify step's
own graph a speculative step replays a handful of graphs instead of launching hundreds of eager kernels.

Shapes: R rows (a bucket's sampling rows: a speculating stream's K + 1 verify positions, or a plain row's one
position repeated K + 1 times), K drafts per stream (the option's num_tokens), V vocabulary, T tokens, B
streams, D hidden. Each function reads its per-call inputs from two or three packed buffers that the host fills
with one copy each (layouts below; `host_rows`, `host_drafting` build them), so the graph's inputs keep their
addresses.

- `accept_greedy(model, h, ints, K)` / `accept_sampled(model, h, ints, floats, K)`: the LM head over the rows'
  hidden states, then the tokens verify.py's eager path gives for the same rows when no logits processor applies:
  each position's token drawn as `sampling.sample` draws (the argmax, or its inverse CDF over the sorted
  probabilities with the position's uniform) and `acceptance.accept_drawn` (rows without drafts, prompt chunks'
  last tokens and decodes without any, simply emit their first position's draw), so a seeded request draws the
  same token whichever path its step took. Returns int64 [R, K + 2]: the accept count, then the row's K + 1
  tokens (Accepted's layout).
- `mtp_drafts(model, cache, h, tok, strm, K)`: the MTP head's catch-up over the kept positions and its K - 1
  single-token draft steps (drafting.py's eager loop), drafts chosen on the device: int64 [B, K].
  `mtp_drafts_after(model, cache, h, result, tok, strm, K)`: the same right after an acceptance, its tokens,
  positions and draft lengths made on the device from the acceptance's result (no read back between them).
- `keep_verified_states(cache, index)`: the accepted runs' conv / GDN states into their slots (not compiled:
  captured as it is, and verify.py's eager path calls it too); `keep_accepted_states` its index from an
  acceptance's counts on the device, run (captured) right after accept_greedy / accept_sampled.

Layouts (int64 unless stated):
    ints   [R, 2K + 4]: h rows of the K + 1 positions | drafts (K) | num_drafts | top_k | greedy (0 / 1)
    floats [R, K + 4] fp32: uniforms (K + 1: acceptance.Uniforms.values, position j's in column j) | temperature |
           top_p | log(min_p)
    tok    [3, T]: the catch-up's tokens | positions | h rows
    keep   [2, R]: each row's slot | its first verify entry (the scratch slot / checkpoint: nothing to keep)
    strm   [4 + 2 (K - 1), B]: the catch-up streams' cu_seqlens[1:] | slot ids | context_lens (the head's entries
           start there) | the catch-up row of each stream's last token; then per draft step s: positions (= the
           head's context) | slot ids
  mtp_drafts_after's (its catch-up covers every verify position of a stream, so the host knows its layout):
    tok    [3, T]: each token's index into the acceptance's result flattened (row i, column 1 + t) | positions |
           h rows
    strm   [5, B]: cu_seqlens[1:] | slot ids | context_lens | each stream's first catch-up row | the tokens its
           request may still emit before the step (max_new - len(out); `want` follows from it and the count)
A greedy row's sampling values must still describe a distribution (temperature 1, top_k V, top_p 2, log(min_p)
-inf: `host_rows` writes them) so that no row of the sampled variant divides by zero. Padding streams of the
draft steps run one token on the scratch slot at position 0, whose block-table row is all the null block: what
they write lands there, which no stream reads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..batch import PackedBatch
from ..ops.checkpoints import copy_rows
from ..sampling import _sorted_probs, inverse_cdf
from .acceptance import accept_drawn
from .mtp import mtp_hidden_states

GREEDY_ROW = (1.0, 2.0, -math.inf)  # temperature, top_p, log(min_p) of a greedy or padding row (top_k: V)


def _logits(model, h: Tensor, ints: Tensor, K: int) -> Tensor:
    """The LM head's logits [R * (K + 1), V] of the rows' positions (model.logits_of, as the eager path)."""
    return model.logits_of(h.index_select(0, ints[:, :K + 1].reshape(-1)))


def _result(counts: Tensor, tokens: Tensor) -> Tensor:
    return torch.cat([counts.unsqueeze(1), tokens], dim=1)


def accept_greedy(model, h: Tensor, ints: Tensor, K: int) -> Tensor:
    """Every row greedy: the longest run of drafts equal to the argmax, then the argmax after it
    (acceptance.accept_drawn on the argmax). int64 [R, K + 2]."""
    R = ints.shape[0]
    top = _logits(model, h, ints, K).argmax(dim=-1).view(R, K + 1)
    return _result(*accept_drawn(top, ints[:, K + 1:2 * K + 1], ints[:, 2 * K + 1]))


def accept_sampled(model, h: Tensor, ints: Tensor, floats: Tensor, K: int) -> Tensor:
    """Greedy and sampled rows together (the layouts in the module docstring): each position's token drawn as
    sampling.draw_with draws it (the argmax, or the inverse CDF of the sorted probabilities with the position's
    uniform), then acceptance.accept_drawn. int64 [R, K + 2]."""
    R, K1 = ints.shape[0], K + 1
    logits = _logits(model, h, ints, K)
    greedy = ints[:, 2 * K + 3] != 0

    def per_position(x: Tensor) -> Tensor:
        return x.unsqueeze(1).expand(R, K1).reshape(R * K1)

    # every row's sorted distributions (greedy rows carry a harmless one, replaced below)
    sorted_probs, order = _sorted_probs(logits.float(), per_position(floats[:, K1]), per_position(ints[:, 2 * K + 2]),
                                        per_position(floats[:, K1 + 1]), per_position(floats[:, K1 + 2]))
    drawn = inverse_cdf(sorted_probs, order, floats[:, :K1].reshape(R * K1)).view(R, K1)
    drawn = torch.where(greedy.unsqueeze(1), logits.argmax(dim=-1).view(R, K1), drawn)
    return _result(*accept_drawn(drawn, ints[:, K + 1:2 * K + 1], ints[:, 2 * K + 1]))


def mtp_drafts(model, cache, h: Tensor, tok: Tensor, strm: Tensor, K: int) -> Tensor:
    """The MTP head's catch-up and drafts (drafting.py's conventions; the layouts in the module docstring):
    h [T', D] the verify step's hidden states (before the final norm). Mutates the head's KV pools at the
    catch-up's and the draft steps's positions. int64 [B, K]."""
    slots = strm[1]
    prev = _catch_up(model, cache, h, tok[0], tok[1], tok[2], strm[0], slots, strm[2]).index_select(0, strm[3])
    steps = [(strm[4 + 2 * s], strm[5 + 2 * s]) for s in range(K - 1)]
    return _draft_steps(model, cache, prev, steps)


def mtp_drafts_after(model, cache, h: Tensor, result: Tensor, tok: Tensor, strm: Tensor, K: int) -> Tensor:
    """mtp_drafts right after an acceptance, its inputs made on the device from that acceptance's `result` [R, K +
    2] (counts, then tokens; row i is stream i's), so that the drafting needs no read back before it (the
    `after` layouts in the module docstring). Stream i caught up on all its n_i + 1 verify positions (its kept
    ones first: what follows its count is overwritten by the drafts and the next catch-up, never counted), each
    reading the token the acceptance drew there (a kept draft, then the emitted token); draft 1 from the head's
    output at its count, draft s + 2 at position begin + count + 1 + s while the stream wants it (min(K, rem -
    count - 2) drafts: verify.SpeculativeStep.room after the step), else on the scratch slot. int64 [B, K]."""
    B = strm.shape[1]
    slots, begins, counts = strm[1], strm[2], result[:B, 0]
    ids = result.reshape(-1).index_select(0, tok[0]).clamp(min=0)  # (-1 past a count: any token will do there)
    prev = _catch_up(model, cache, h, ids, tok[1], tok[2], strm[0], slots, begins).index_select(0, strm[3] + counts)
    want = torch.clamp(strm[4] - counts - 2, max=K)
    scratch = torch.full_like(slots, cache.scratch_slot)
    steps = []
    for s in range(K - 1):
        live = want > s + 1
        steps.append((torch.where(live, begins + counts + 1 + s, 0), torch.where(live, slots, scratch)))
    return _draft_steps(model, cache, prev, steps)


def _catch_up(model, cache, h: Tensor, ids: Tensor, positions: Tensor, rows: Tensor, ends: Tensor, slots: Tensor,
              begins: Tensor) -> Tensor:
    """The head over each stream's caught-up positions (tokens `ids` at `positions`, beside h's `rows`; streams
    ending at `ends`, their entries from `begins` on): its outputs [T, D]."""
    cu = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    catch = PackedBatch(tokens=ids, positions=positions, cu_seqlens=cu, slot_ids=slots,
                        context_lens=begins.to(torch.int32), block_tables=cache.block_tables.index_select(0, slots))
    return mtp_hidden_states(model, cache, catch, model.normed(h.index_select(0, rows)))


def _draft_steps(model, cache, prev: Tensor, steps: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Draft 1 from the head's outputs `prev` [B, D]; then per (positions, slots) of `steps` one single-token head
    step on the draft before it, beside its own previous output. int64 [B, 1 + len(steps)]."""
    draft = model.head(prev).argmax(dim=-1)
    drafts = [draft]
    one_each = torch.arange(prev.shape[0] + 1, dtype=torch.int32, device=prev.device)
    for positions, step_slots in steps:
        batch = PackedBatch(tokens=draft, positions=positions, cu_seqlens=one_each, slot_ids=step_slots,
                            context_lens=positions.to(torch.int32),
                            block_tables=cache.block_tables.index_select(0, step_slots))
        prev = mtp_hidden_states(model, cache, batch, prev)
        draft = model.head(prev).argmax(dim=-1)
        drafts.append(draft)
    return torch.stack(drafts, dim=1)


def row_values(params, vocab: int) -> tuple[int, int, float, float, float]:
    """(greedy, top_k, temperature, top_p, log(min_p)) of a row's SamplingParams, as sampling._row_values writes
    them (a greedy row: GREEDY_ROW's harmless distribution)."""
    if params.greedy:
        return 1, vocab, *GREEDY_ROW
    return (0, min(params.top_k or vocab, vocab), params.temperature, params.top_p if params.top_p < 1.0 else 2.0,
            math.log(params.min_p) if params.min_p > 0.0 else -math.inf)


def host_rows(positions: list[list[int]], drafts: list[list[int]], params: list, uniforms: Tensor, K: int,
              vocab: int) -> tuple[Tensor, Tensor]:
    """(ints [r, 2K + 4], floats [r, K + 4]) on the host for r rows: each row's K + 1 h rows, its drafts (fewer
    than K: padded), its SamplingParams and its uniforms [r, K + 1] (acceptance.Uniforms.values)."""
    ints, floats = [], []
    for rows, d, p in zip(positions, drafts, params):
        greedy, top_k, temperature, top_p, log_min_p = row_values(p, vocab)
        ints.append(rows + d + [0] * (K - len(d)) + [len(d), top_k, greedy])
        floats.append([temperature, top_p, log_min_p])
    return (torch.tensor(ints, dtype=torch.int64),
            torch.cat([uniforms, torch.tensor(floats, dtype=torch.float32)], dim=1))


def keep_accepted_states(cache, result: Tensor, ints: Tensor, keep: Tensor, K: int) -> None:
    """After an acceptance (`result` [R, K + 2], accept_greedy's / accept_sampled's, over `ints`' rows): each row
    that kept fewer drafts than it verified takes verify entry keep[1] + count into slot keep[0]; keep [2, R]:
    the row's slot and its first verify entry, the scratch slot / checkpoint for rows that keep nothing (plain
    rows, padding). The index is made on the device from the counts, so the copy needs no read back (captured in
    the acceptance's graph). Not compiled (keep_verified_states' reason)."""
    counts, num_drafts = result[:, 0], ints[:, 2 * K + 1]
    redo = (counts < num_drafts) & (keep[1] != cache.scratch_checkpoint)
    index = torch.stack([torch.where(redo, keep[0], cache.scratch_slot),
                         torch.where(redo, keep[1] + counts, cache.scratch_checkpoint)])
    keep_verified_states(cache, index)


def write_last_tokens(last_tokens: Tensor, result: Tensor, slots: Tensor) -> None:
    """last_tokens[slots[i]] := row i's last emitted token (`result` [R, K + 2]: its count c, then tokens; the
    token at c + 1), on the device, so the engine loop's plain steps read it there without a copy from the host.
    Padding rows name the scratch slot (any token: nobody reads it). Not compiled (captured after the acceptance)."""
    last_tokens.index_copy_(0, slots, result.gather(1, result[:, :1] + 1).squeeze(1))


def keep_verified_states(cache, index: Tensor) -> None:
    """index [2, n] int64: slots, then verify entries; each conv / GDN pool's slot rows := the entries' kept states
    (on CUDA one row-copy kernel a pool, the scratch slot's padding rows skipped: ops/checkpoints.copy_rows)."""
    for pool, kept in zip(cache.conv_states + cache.gdn_states,
                          cache.checkpoint_conv_states + cache.checkpoint_gdn_states):
        if pool.is_cuda:
            copy_rows(pool, kept, index, skip=cache.scratch_slot)
        else:
            pool.index_copy_(0, index[0], kept.index_select(0, index[1]))
