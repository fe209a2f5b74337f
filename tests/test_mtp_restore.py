"""A prefix-cache hit keeps MTP drafting (docs/speculative.md, "The MTP head in the engine"): the head's entries
come with the restored blocks (its pools share the block table), and SlotBlocks notes the token each entry read,
so a restore whose entries are the new prompt's own sets mtp_context_lens and the request speculates with MTP
drafts; one whose are not (the token after a kept position differs, or the head did not follow the blocks'
writer) gets none. Greedy output stays plain decoding's either way."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from helpers import random_tokens, tiny_config, unit_gain
from speculative_reference import bigram_model, with_random_mtp
from metrale_graph import Engine, HybridCache, HybridModel
from metrale_graph.protocol import restore_prefix
from metrale_graph.speculative.drafting import MtpDrafter

CFG = tiny_config(mtp_num_hidden_layers=1)
SHARED = random_tokens(70, 9, CFG.vocab_size)


def plain(model, prompts, new_tokens):
    with Engine(model, 2, compile=False) as e:
        return [r.token_ids for r in e.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])]


def run_one_by_one(model, prompts, new_tokens, **kw):
    """Each prompt alone, in order, on one engine; its tokens, cached tokens, (proposed, accepted) deltas and the
    MTP drafts made for it, step by step."""
    out, drafts = [], []
    real = MtpDrafter.draft

    def draft(self, *args):
        made = real(self, *args)
        drafts.extend(made.values())
        return made

    with mock.patch.object(MtpDrafter, "draft", draft), \
            Engine(model, 2, compile=False, speculative={"method": "mtp", "num_tokens": 2}, **kw) as e:
        for p in prompts:
            before, drafts[:] = e.stats().speculative, []
            r = e.generate([p], max_new_tokens=new_tokens, stop_token_ids=[])[0]
            after = e.stats().speculative
            out.append((r.token_ids, r.cached_tokens, after["proposed"] - before["proposed"],
                        after["accepted"] - before["accepted"], list(drafts)))
    return out


def test_restored_streams_get_mtp_drafts_and_stay_exact():
    model = bigram_model(CFG)
    prompts = [SHARED, SHARED + [3, 4]]  # the second restores the first but its last token
    reference = plain(model, prompts, 12)
    (first, *_), (second, cached, proposed, accepted, _) = run_one_by_one(model, prompts, 12, prefix_cache=True)
    assert [first, second] == reference
    assert cached > 0
    # the bigram head drafts what the model decodes: after the hit every draft is kept
    assert proposed > 0 and accepted == proposed


def test_restored_head_entries_are_the_ones_a_fresh_run_writes():
    # random MTP weights: drafts depend on the head's entries of every restored position, so a restored request
    # proposes and keeps exactly what the same request run from scratch does (its drafts are the same argmaxes)
    model = with_random_mtp(unit_gain(HybridModel.from_preset(CFG, seed=1), seed=2), seed=3)
    prompts = [SHARED, SHARED + [3, 4]]
    hit = run_one_by_one(model, prompts, 12, prefix_cache=True)[1]
    fresh = run_one_by_one(model, prompts[1:], 12, prefix_cache=True)[0]  # nothing cached yet (the same feeding)
    assert hit[1] > 0 and fresh[1] == 0
    assert hit[0] == fresh[0] == plain(model, prompts[1:], 12)[0]
    assert hit[2:] == fresh[2:] and hit[2] > 0  # the same drafts, step by step (hit[4]), so the same counts


def test_a_prefix_whose_next_token_differs_gets_no_mtp_drafts():
    model = bigram_model(CFG)
    other = (SHARED[69] + 1) % CFG.vocab_size
    prompts = [SHARED, SHARED[:69] + [other, 5, 6]]  # the kept entry of position 68 read SHARED[69], not `other`
    _, (second, cached, proposed, _, _) = run_one_by_one(model, prompts, 12, prefix_cache=True)
    assert second == plain(model, prompts[1:], 12)[0]
    assert cached == 69 and proposed == 0


def test_blocks_written_while_the_head_did_not_follow_give_no_mtp_drafts():
    model = bigram_model(CFG)
    prompts = [SHARED, SHARED + [3, 4]]
    with Engine(model, 2, compile=False, prefix_cache=True, speculative={"method": "mtp", "num_tokens": 2}) as e:
        kw = dict(max_new_tokens=12, stop_token_ids=[])
        first = e.generate(prompts[:1], prompt_logprobs=1, **kw)[0]  # its prompt runs the loop's way: no head
        proposed = e.stats().speculative["proposed"]
        second = e.generate(prompts[1:], **kw)[0]
        assert second.cached_tokens > 0 and e.stats().speculative["proposed"] == proposed
    assert [first.token_ids, second.token_ids] == plain(model, prompts, 12)


@pytest.mark.parametrize("next_token_kept", [True, False])
def test_restore_prefix_checks_the_head_entries_and_snapshots_cover_them(next_token_kept):
    model = HybridModel.from_preset(CFG, seed=1)
    cache = HybridCache(CFG, 2, 8, block_size=16, max_context=64, prefix_checkpoints=2)
    tokens = random_tokens(21, 4, CFG.vocab_size)  # a full block and 5 rows of a partial one
    cache.bind(model)
    cache.allocate(cache.block_needs([(0, 20)]))
    cache.commit({0: 20}, {0: tokens[:20]})
    # the head's entries of positions 0 .. 19, entry p having read tokens[p + 1] (the last: the token after them)
    cache.slot_blocks.head_written(0, 0, tokens[1:21] if next_token_kept else tokens[1:20] + [tokens[20] + 1])
    src = cache.slot_blocks.blocks[0][1]
    for pool in cache.mtp_k_caches + cache.mtp_v_caches:  # the head's rows of the partial block, to be copied
        pool[src].copy_(torch.randn(pool[src].shape, generator=torch.Generator().manual_seed(5)))
    assert cache.save_prefix(0)
    snap = cache.snapshot()
    assert restore_prefix(model, cache, 1, tokens) == 20
    assert cache.mtp_context_lens[1] == (20 if next_token_kept else 0)
    copied = cache.slot_blocks.blocks[1][1]  # the partial block, copied: the head's rows with it
    assert cache.slot_blocks.head[copied] == cache.slot_blocks.head[src][:4]
    for pool in cache.mtp_k_caches + cache.mtp_v_caches:
        assert torch.equal(pool[copied, :4], pool[src, :4])
    cache.restore(snap)  # (issue 37: a snapshot covers every pool and the host bookkeeping, the head's notes too)
    assert cache.mtp_context_lens == [0, 0] and cache.context_lens == [20, 0]
    assert cache.slot_blocks.head == snap.host[2].head and copied not in cache.slot_blocks.head
    assert restore_prefix(model, cache, 1, tokens) == 20
    assert cache.mtp_context_lens[1] == (20 if next_token_kept else 0)
