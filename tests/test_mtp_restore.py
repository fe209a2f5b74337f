"""A prefix-cache hit keeps MTP drafting (docs/speculative.md, "The MTP head in the engine"): the head's entries
come with the restored blocks (its pools share the block table), and SlotBlocks notes the token each entry read,
so a restore whose entries are the new prompt's own sets mtp_context_lens and the request speculates with MTP
drafts; one whose are not (the token after a kept position differs, or the head did not follow the blocks'
writer) gets none. Greedy output stays plain decoding's either way. The prefix a request keeps when it ends has
the head's entries of its last step's positions too (drafting.catch_up_ending, before the delivery), so the next
turn of a conversation (prompt + reply + more), restoring the whole first turn, drafts again; only the requests a
step ends are caught up on, found without decoding a token twice (stops.may_end, StreamingText.ahead)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from helpers import random_tokens, tiny_config, unit_gain
from speculative_reference import bigram_model, with_eager_tail, with_random_mtp
from metrale_graph import Engine, HybridCache, HybridModel
from metrale_graph.capture import make_grid
from metrale_graph.protocol import restore_prefix
from metrale_graph.speculative.drafting import MtpDrafter
from metrale_graph.speculative.stops import may_end, stop_index
from metrale_graph.tools.engine_windows import DraftTimer

CFG = tiny_config(mtp_num_hidden_layers=1)
SHARED = random_tokens(70, 9, CFG.vocab_size)
TAIL_GRID = ([2, 4], [16, 128])  # (batch sizes, token counts: every step here fits a bucket)


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



def conversation(model, turns, k=2, new_tokens=12, tail=None, **kw):
    """Turns on one engine (k None: plain decoding), each prompt the one before + its reply + turns[i] (turns[0]:
    the first prompt): each turn's tokens, cached tokens, (proposed, accepted) deltas and the MTP drafts made for
    it, step by step (draft's: not those made behind the acceptance). kw: the Engine's, and generate's
    stop_token_ids (default none), temperature and seed. tail: a list, the engine's speculative steps then take
    SpeculativeGraphs' path (uncompiled: what CUDA captures) in the buckets of TAIL_GRID, its calls listed there."""
    out, drafts, prompt = [], [], []
    real = MtpDrafter.draft

    def draft(self, *args):
        made = real(self, *args)
        drafts.extend(made.values())
        return made

    sampling = {"stop_token_ids": [], **{key: kw.pop(key) for key in ("stop_token_ids", "temperature", "seed") if key in kw}}
    spec = {"speculative": {"method": "mtp", "num_tokens": k}} if k else {}
    with mock.patch.object(MtpDrafter, "draft", draft), Engine(model, 2, compile=False, **spec, **kw) as e:
        if tail is not None:
            graphs = with_eager_tail(e, make_grid(*TAIL_GRID))._loop.spec.graphs
            for name in ("accept", "draft", "draft_after"):
                method = getattr(graphs, name)
                setattr(graphs, name, lambda *a, _m=method, _n=name: tail.append(_n) or _m(*a))
        for more in turns:
            prompt = prompt + (out[-1][0] if out else []) + more
            before, drafts[:] = e.stats().speculative or {}, []
            r = e.generate([prompt], max_new_tokens=new_tokens, **sampling)[0]
            after = e.stats().speculative or {}
            out.append((r.token_ids, r.cached_tokens, after.get("proposed", 0) - before.get("proposed", 0),
                        after.get("accepted", 0) - before.get("accepted", 0), list(drafts)))
    return out


def tokens(turns):
    return [t[0] for t in turns]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_next_turn_of_a_conversation_gets_mtp_drafts(k):
    # the first turn's slot is kept when it ends: prompt + reply but the last token, whose last positions its last
    # step kept; the head catches up on them before the prefix is kept (drafting.catch_up_ending), so the next turn
    # (prompt + reply + more), restoring all of it, drafts again (the bigram checkpoint: every draft kept)
    model = bigram_model(CFG)
    turns = [SHARED, [3, 4, 5]]
    hit = conversation(model, turns, k, prefix_cache=True)
    without = conversation(model, turns, k, prefix_cache=False)
    assert tokens(hit) == tokens(without) == tokens(conversation(model, turns, None))
    (first, *_), (_, cached, proposed, accepted, _) = hit
    assert cached == len(SHARED) + len(first) - 1  # the whole first turn restored
    assert proposed > 0 and accepted == proposed == without[1][2]


@pytest.mark.parametrize("k, stop", [(1, 1), (1, 2), (2, 2), (2, 3), (3, 3), (3, 4)])
def test_the_next_turn_after_a_stop_token_gets_mtp_drafts(k, stop):
    # the first turn stops at a token its last step kept as a draft (its slot keeps it: stops.py; the head's entry
    # there read the step's token after it) or at the token the step added (never fed); the next turn goes on past
    # the stop token with the token the model gives after it, so the head's entries are its own in both cases
    model = bigram_model(CFG)
    seq = plain(model, [SHARED], 12)[0]
    assert seq[stop] not in seq[:stop]
    turns = [SHARED, [seq[stop + 1], 3, 4]]
    hit = conversation(model, turns, k, prefix_cache=True, stop_token_ids=[seq[stop]])
    without = conversation(model, turns, k, prefix_cache=False, stop_token_ids=[seq[stop]])
    assert tokens(hit) == tokens(without) == tokens(conversation(model, turns, None, stop_token_ids=[seq[stop]]))
    (first, *_), (_, cached, proposed, accepted, _) = hit
    assert first == seq[:stop + 1]
    at_draft = stop % (k + 1) != 0  # (every draft kept: the first step's one token, then k drafts and one added)
    assert cached == len(SHARED) + len(first) - (0 if at_draft else 1)
    assert proposed > 0 and accepted == proposed == without[1][2]


@pytest.mark.parametrize("k", [1, 3])
def test_the_next_turn_keeps_the_head_entries_a_fresh_run_writes(k):
    # random MTP weights: the drafts read the head's entries of every restored position, so the next turn drafts
    # exactly what its prompt run from scratch drafts, step by step
    model = with_random_mtp(unit_gain(HybridModel.from_preset(CFG, seed=1), seed=2), seed=3)
    first, hit = conversation(model, [SHARED, [3, 4, 5]], k, prefix_cache=True)
    fresh = conversation(model, [SHARED + first[0] + [3, 4, 5]], k, prefix_cache=True)[0]  # (nothing cached yet)
    assert hit[1] > 0 and fresh[1] == 0
    assert hit[0] == fresh[0]
    assert hit[2:] == fresh[2:] and hit[2] > 0


def test_the_next_turn_of_a_seeded_sampled_conversation_gets_mtp_drafts():
    model = bigram_model(CFG)  # (at temperature 0.02 some drafts are kept, some not)
    turns, kw = [SHARED, [3, 4, 5]], dict(temperature=0.02, seed=7)
    hit = conversation(model, turns, 2, prefix_cache=True, **kw)
    assert tokens(hit) == tokens(conversation(model, turns, 2, prefix_cache=False, **kw)) == \
        tokens(conversation(model, turns, None, **kw))
    assert hit[1][1] == len(SHARED) + len(hit[0][0]) - 1
    assert hit[1][2] > hit[1][3] > 0


@pytest.mark.parametrize("stop", [None, 2, 3])
def test_the_next_turn_gets_mtp_drafts_through_the_tails_buffers(stop):
    # the tail's static buffers (what CUDA captures): a step of speculating decodes alone drafts behind its
    # acceptance, catching up on every verify position (note_after); the first turn's last step here verifies no
    # draft (11 tokens at k 2: 1, then 3 a step, the 11th alone), so its catch-up runs through the drafting's entry
    # (catch_up_ending; no drafts after the hit without it); with a stop token (kept as a draft: 2, added after
    # them: 3) it ends in a step of drafts, whose drafting behind the acceptance caught up on it already
    model = bigram_model(CFG)
    seq = plain(model, [SHARED], 11)[0]
    assert stop is None or seq[stop] not in seq[:stop]
    kw = {} if stop is None else dict(stop_token_ids=[seq[stop]])
    turns = [SHARED, [3, 4, 5] if stop is None else [seq[stop + 1], 4, 5]]
    calls = []
    hit = conversation(model, turns, 2, 11, tail=calls, prefix_cache=True, **kw)
    without = conversation(model, turns, 2, 11, prefix_cache=False, **kw)
    assert tokens(hit) == tokens(without) == tokens(conversation(model, turns, None, 11, **kw))
    (first, *_), (_, cached, proposed, accepted, _) = hit
    assert cached == len(SHARED) + len(first) - (0 if stop == 2 else 1)
    assert proposed > 0 and accepted == proposed == without[1][2]
    assert "draft_after" in calls and (stop is not None or "draft" in calls)


def test_a_failing_catch_up_of_an_ending_request_fails_it_alone(monkeypatch):
    # the catch-up of a request the step's delivery ends runs before the delivery, in a transaction of its own
    # over that request's slot: raising there fails that request (its slot reset, no prefix kept), the step's
    # others (one going on, one that opted out) give plain decoding's tokens, and the engine goes on exact
    model = bigram_model(CFG)
    prompts = [SHARED, SHARED[::-1], SHARED[5:] + [7]]
    kws = [dict(max_new_tokens=6), dict(max_new_tokens=12), dict(max_new_tokens=12, speculate=False)]
    reference = [plain(model, [p], x["max_new_tokens"])[0] for p, x in zip(prompts, kws)]
    real_run, real_catch_up, caught, failed = MtpDrafter.run, MtpDrafter.catch_up_ending, [], []

    def catch_up(self, *args):
        caught.append(True)
        try:
            return real_catch_up(self, *args)
        finally:
            caught.pop()

    def run(self, batch, *args):
        if caught and not failed:
            failed.append(batch.slots)
            raise RuntimeError("catch-up failed")
        return real_run(self, batch, *args)

    monkeypatch.setattr(MtpDrafter, "catch_up_ending", catch_up)
    monkeypatch.setattr(MtpDrafter, "run", run)
    with Engine(model, 3, compile=False, prefix_cache=True, speculative={"method": "mtp", "num_tokens": 2}) as e:
        handles = [e.submit(p, stop_token_ids=[], **x) for p, x in zip(prompts, kws)]
        with pytest.raises(RuntimeError, match="catch-up failed"):
            handles[0].result()
        assert [h.result().token_ids for h in handles[1:]] == reference[1:]
        assert len(failed) == 1 and len(failed[0]) == 1  # (the first's catch-up alone: the second's ran later)
        monkeypatch.setattr(MtpDrafter, "run", real_run)
        assert [e.submit(p, stop_token_ids=[], **x).result().token_ids for p, x in zip(prompts, kws)] == reference
        assert e.stats().running == e.stats().used_blocks == 0


@pytest.fixture(scope="module")
def text_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tokenizer_fixture import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def spanning_stop(tokenizer, seq: list[int], k: int) -> tuple[int, str]:
    """(b, stop): a stop string of two characters, the last of token b's text and the first of token b + 1's, found
    nowhere before, where b is the last token of a verify step (every draft kept: the first token alone, then k + 1 a
    step): it spans two steps' tokens, and the request stops at the first draft of a step."""
    for b in range(k + 1, len(seq) - 2, k + 1):
        one, two = tokenizer.decode(seq[:b + 1]), tokenizer.decode(seq[:b + 2])
        if "\ufffd" not in two and two.startswith(one) and one != tokenizer.decode(seq[:b]) and len(two) > len(one):
            stop = one[-1] + two[len(one)]
            if stop not in one:
                return b, stop
    raise AssertionError(f"no stop string spans two steps' tokens of {seq}")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_requests_a_step_ends_are_caught_up_on_and_the_stop_checks_decode_nothing_twice(text_tokenizer, k,
                                                                                          monkeypatch):
    # catch_up_ending runs the head for the requests the step's delivery ends, found by stops.stop_index (a stop
    # string through a copy of the request's text, whose adds the text keeps for the delivery's own: StreamingText
    # .ahead): one ending at a stop string that spans two steps' tokens and one at max_new_tokens are caught up on,
    # once each, at their last step; one going on is not (no head run for it before its own end). Their next turns
    # keep every bigram draft. The stop checks (stops.kept_counts, then catch_up_ending) decode nothing twice: the
    # tokenizer decodes what plain decoding's delivery does, call for call, in another order (it decoded the tokens
    # of a request with stop strings three times)
    tok = text_tokenizer
    model = bigram_model(tiny_config(vocab_size=len(tok), mtp_num_hidden_layers=1))
    prompts = [random_tokens(40, seed, len(tok)) for seed in (26, 27, 28)]
    seq = plain(model, prompts[:1], 16)[0]
    b, stop = spanning_stop(tok, seq, k)
    kws = [dict(max_new_tokens=16, stop=[stop]), dict(max_new_tokens=1 + k + 1, stop=["END", "\n\n"]),
           dict(max_new_tokens=4 * (k + 1) + 3, stop=["END", "\n\n"])]
    decodes, decode = [], tok.decode

    def counted(ids, *args, **kwargs):
        decodes.append(tuple(ids))
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(tok, "decode", counted)

    def first_turn(e):
        decodes.clear()
        results = [h.result() for h in [e.submit(p, stop_token_ids=[], **kw) for p, kw in zip(prompts, kws)]]
        return [(r.token_ids, r.text, r.finish_reason) for r in results], sorted(decodes)  # (each call's ids)

    with Engine(model, 3, compile=False, tokenizer=tok) as e:
        reference, plain_decodes = first_turn(e)
    assert reference[0] == (seq[:b + 2], tok.decode(seq[:b + 2])[:-len(stop)], "stop")
    assert [r[2] for r in reference[1:]] == ["length", "length"]

    caught, real = [], MtpDrafter.catch_up_ending  # per catch-up head run: the prompts of the requests it ran for

    def catch_up_ending(self, out, reqs, *args):
        of_slot, run = {r.slot: tuple(r.prompt) for r in reqs if r is not None}, self.run
        self.run = lambda batch, *a: caught.append(sorted(of_slot[s] for s in batch.slots)) or run(batch, *a)
        try:
            return real(self, out, reqs, *args)
        finally:
            del self.run

    monkeypatch.setattr(MtpDrafter, "catch_up_ending", catch_up_ending)
    with Engine(model, 3, compile=False, tokenizer=tok, prefix_cache=True,
                speculative={"method": "mtp", "num_tokens": k}) as e:
        with DraftTimer(e) as timer:
            results, spec_decodes = first_turn(e)
        assert results == reference and spec_decodes == plain_decodes
        assert sorted(p for run in caught for p in run) == sorted(map(tuple, prompts))
        assert timer.ending_runs == len(caught)
        # the next turns restore all of the first (but the token the step added and never fed) and keep every draft
        for p, (first, _, _), more in zip(prompts, results, ([seq[b + 2], 3, 4], [3, 4, 5])):
            turn = p + first + more
            before = e.stats().speculative
            r = e.generate([turn], max_new_tokens=8, stop_token_ids=[])[0]
            after = e.stats().speculative
            assert r.token_ids == plain(model, [turn], 8)[0]
            assert r.cached_tokens == len(p) + len(first) - (0 if more[0] == seq[b + 2] else 1)
            assert after["proposed"] - before["proposed"] == after["accepted"] - before["accepted"] > 0


def test_may_end_is_false_exactly_where_stop_index_finds_no_stop():
    # catch_up_ending and kept_counts ask stop_index only where stops.may_end (its cheap part) does not rule an end
    # out: always for a grammar or stop strings, else where a token is a stop token or they reach max_new_tokens
    gen = random.Random(0)
    for _ in range(3000):
        max_new = gen.randrange(1, 12)
        r = SimpleNamespace(grammar=None, text=None, out=[0] * gen.randrange(max_new), max_new=max_new,
                            stop_ids=frozenset(gen.sample(range(6), gen.randrange(3))))
        tokens = [gen.randrange(6) for _ in range(gen.randrange(5))]
        assert may_end(r, tokens) == (stop_index(r, tokens) is not None)
        assert may_end(SimpleNamespace(**{**vars(r), "text": SimpleNamespace(stop=("x",))}), tokens)
        assert may_end(SimpleNamespace(**{**vars(r), "grammar": object()}), tokens)
