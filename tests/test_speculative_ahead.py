"""Verify ahead (METRALE_VERIFY_AHEAD, speculative/ahead.py): MTP verify step N + 1 launched before step N's accept
counts are read back, its tokens, positions and contexts made on the device from N's. Through the tail's static
buffers (test_speculative_tail.py's `tail_engine`: SpeculativeGraphs' functions uncompiled behind eager buckets):
plain decoding's greedy tokens and the synchronous captured path's drafts and counts, with requests stopping inside
a chain (stop tokens, max_new_tokens), arriving and aborted while a chain runs, and a launch that fails; a drained
step run the loop's way inside the KV reservation; every block back at the end. fp32, CPU; graphs on a GPU:
test_gpu_speculative_graphs.py."""

from __future__ import annotations

import pytest

from helpers import random_tokens, unit_gain
from speculative_reference import bigram_model, staggered, with_random_mtp
from test_speculative_tail import CONFIGS, prompts_of, recorded_drafts, tail_engine
from metrale_graph import Engine, HybridModel, envs
from metrale_graph.speculative.ahead import VerifyAhead

MTP = {"method": "mtp", "num_tokens": 2}


@pytest.fixture(scope="module")
def models():
    return {name: with_random_mtp(unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2), seed=3)
            for name, cfg in CONFIGS.items()}


@pytest.fixture
def ahead():
    with envs.override(**{"METRALE_VERIFY_AHEAD": "1"}):
        yield


def plain(model, prompts, slots=3, **kw):
    with Engine(model, slots, compile=False) as e:
        return [r.token_ids for r in e.generate(prompts, **kw)]


def chained(e) -> int:
    return e._loop.spec.ahead.chained


def no_block_held(e) -> bool:
    s = e.stats()
    return s.used_blocks == 0 and s.running == 0


@pytest.mark.parametrize("family, k", [("dense", 1), ("dense", 3), ("moe", 2), ("next", 2)])
def test_verify_ahead_gives_plain_decoding_and_the_synchronous_drafts(models, family, k, monkeypatch):
    """Greedy MTP requests of different prompt lengths: plain decoding's tokens, and the same drafts, counts and
    verify steps as the synchronous captured path (the drafting behind the acceptance, read back each step);
    most steps launched ahead (the last ones, with fewer than 2k + 2 tokens left, read back first)."""
    model, prompts = models[family], prompts_of(family)[:3]
    kw = dict(max_new_tokens=24, stop_token_ids=[])
    reference = plain(model, prompts, **kw)
    drafts = recorded_drafts(monkeypatch)
    runs = {}
    for setting in ("METRALE_MTP_AFTER", "METRALE_VERIFY_AHEAD"):
        drafts.clear()
        with envs.override(**{"METRALE_VERIFY_AHEAD": "0", setting: "1"}), \
                tail_engine(model, 3, {"method": "mtp", "num_tokens": k}) as e:
            out = [r.token_ids for r in e.generate(prompts, **kw)]
            runs[setting] = (out, e.stats().speculative, [dict(d) for d in drafts])
            assert out == reference, setting
            assert no_block_held(e)
            if setting == "METRALE_VERIFY_AHEAD":
                assert chained(e) >= 3
            else:
                assert e._loop.spec.ahead is None
    assert runs["METRALE_MTP_AFTER"] == runs["METRALE_VERIFY_AHEAD"]


@pytest.mark.parametrize("k", [1, 3])
def test_every_draft_kept_moves_each_chained_step_k_plus_one_tokens(k, ahead):
    """The bigram checkpoint, whose head drafts what the model emits: every draft kept, so each step launched ahead
    starts k + 1 positions past the one before it (its context, positions, tokens and drafts from the device); a
    prompt of 41 tokens beside a short one: plain decoding's tokens."""
    model = bigram_model(CONFIGS["dense"])
    prompts = [[3, 5, 7], random_tokens(41, 6, CONFIGS["dense"].vocab_size)]
    kw = dict(max_new_tokens=41, stop_token_ids=[])
    reference = plain(model, prompts, **kw)
    with tail_engine(model, 2, {"method": "mtp", "num_tokens": k}) as e:
        assert [r.token_ids for r in e.generate(prompts, **kw)] == reference
        s = e.stats().speculative
        assert s["accepted"] == s["proposed"] > 0 and chained(e) > 0 and no_block_held(e)


def test_requests_stopping_inside_a_chain(models, ahead):
    """Stop tokens met inside a chain (the step launched ahead holds the stopped request: its tokens there dropped,
    its slot reset behind it) and requests of different max_new_tokens (one ends while the others chain on):
    plain decoding's tokens, nothing emitted past a stop."""
    model, prompts = models["dense"], prompts_of("dense")[:3]
    long = plain(model, prompts, max_new_tokens=30, stop_token_ids=[])
    stop = [long[0][9], long[2][14]]  # tokens the first and third requests meet part way
    reference = plain(model, prompts, max_new_tokens=30, stop_token_ids=stop)
    assert any(len(r) < 30 for r in reference)
    with tail_engine(model, 3, MTP) as e:
        assert [r.token_ids for r in e.generate(prompts, max_new_tokens=30, stop_token_ids=stop)] == reference
        handles = [e.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in zip(prompts, (9, 30, 17))]
        out = [h.result().token_ids for h in handles]
        assert chained(e) > 0 and no_block_held(e)
    assert out == [r[:n] for r, n in zip(long, (9, 30, 17))]


def test_requests_arriving_and_aborted_while_a_chain_runs(models, ahead):
    """Two requests chain; three more arrive once the first has 3 tokens out (the chain ends, the new prompts run,
    a new chain starts) and one of them is aborted after its first token: the others give plain decoding's tokens
    and every block is given back."""
    model, prompts = models["dense"], prompts_of("dense")
    kw = dict(max_new_tokens=20, stop_token_ids=[])
    reference = plain(model, prompts, slots=5, **kw)
    with tail_engine(model, 5, MTP) as e:
        out = staggered(e, prompts, new_tokens=20, abort=3)
        assert chained(e) > 0 and no_block_held(e)
    assert [o for i, o in enumerate(out) if i != 3] == [r for i, r in enumerate(reference) if i != 3]


def test_a_failed_launch_ahead_fails_its_requests_and_leaves_the_others_exact(models, ahead, monkeypatch):
    """A chained launch that raises (its transaction resets the slots, so the step before cannot commit either):
    that step's requests fail with the error, nothing leaks, and requests after it give plain decoding's tokens."""
    model, prompts = models["dense"], prompts_of("dense")[:2]
    kw = dict(max_new_tokens=20, stop_token_ids=[])
    reference = plain(model, prompts, **kw)
    real, calls = VerifyAhead.launch, []

    def failing(self, step, prev, rows=None):
        if prev is not None:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected launch failure")
        return real(self, step, prev, rows)

    monkeypatch.setattr(VerifyAhead, "launch", failing)
    with tail_engine(model, 3, MTP) as e:
        handles = [e.submit(p, **kw) for p in prompts]
        for h in handles:
            with pytest.raises(RuntimeError, match="injected launch failure"):
                h.result()
        assert no_block_held(e)
        assert [r.token_ids for r in e.generate(prompts, **kw)] == reference
        assert no_block_held(e)


def test_seeded_sampled_requests_chain_and_draw_plain_decodings_tokens(models, ahead):
    """Sampled rows (top-k, top-p, min-p) launched ahead: each step's uniforms picked on the device after the step
    before's count from the host's draws, each generator settled as the synchronous step settles it, so seeded
    requests give plain decoding's tokens; greedy rows beside them too."""
    model, prompts = models["dense"], prompts_of("dense")[:3]
    kw = dict(max_new_tokens=20, stop_token_ids=[], temperature=0.8, top_k=20, top_p=0.9, seed=5)
    reference = plain(model, prompts, **kw)
    with tail_engine(model, 3, MTP) as e:
        assert [r.token_ids for r in e.generate(prompts, **kw)] == reference
        n = chained(e)
        assert n > 0
        handles = [e.submit(prompts[0], max_new_tokens=20, stop_token_ids=[])] + [
            e.submit(p, **{**kw, "seed": 9 + i}) for i, p in enumerate(prompts[1:])]
        out = [h.result().token_ids for h in handles]
        assert chained(e) > n and no_block_held(e)
    mixed = plain(model, prompts[:1], max_new_tokens=20, stop_token_ids=[])
    mixed += [plain(model, [p], **{**kw, "seed": 9 + i})[0] for i, p in enumerate(prompts[1:])]
    assert out == mixed


def test_seeded_sampled_requests_stopping_arriving_and_aborted_inside_a_chain(models, ahead):
    """Sampled rows where a chain ends: requests meeting stop tokens inside it (the step launched ahead drew their
    uniforms; they draw nothing after), and requests arriving and aborted while it runs (the pending step drained,
    each generator settled where the next synchronous step draws): plain decoding's tokens for every other
    request."""
    model, prompts = models["dense"], prompts_of("dense")
    kw = dict(max_new_tokens=30, temperature=0.9, top_k=30, min_p=0.02, seed=3)
    long = plain(model, prompts[:3], stop_token_ids=[], **kw)
    stop = [long[0][9], long[2][14]]
    reference = plain(model, prompts[:3], stop_token_ids=stop, **kw)
    assert any(len(r) < 30 for r in reference)
    alone = [plain(model, [p], stop_token_ids=[], **{**kw, "seed": 20 + i})[0] for i, p in enumerate(prompts)]
    with tail_engine(model, 5, MTP) as e:
        assert [r.token_ids for r in e.generate(prompts[:3], stop_token_ids=stop, **kw)] == reference
        n = chained(e)
        assert n > 0
        handles = [e.submit(p, stop_token_ids=[], **{**kw, "seed": 20 + i}) for i, p in enumerate(prompts[:2])]
        for seen, _ in enumerate(handles[0]):
            if seen == 6:
                break
        handles += [e.submit(p, stop_token_ids=[], **{**kw, "seed": 22 + i}) for i, p in enumerate(prompts[2:])]
        next(iter(handles[3]))
        handles[3].abort()
        out = [None if i == 3 else h.result().token_ids for i, h in enumerate(handles)]
        assert chained(e) > n and no_block_held(e)
    assert [o for i, o in enumerate(out) if i != 3] == [r for i, r in enumerate(alone) if i != 3]


def test_prefix_caching_and_no_overlap_take_the_synchronous_step(models, ahead):
    """Engines with prefix caching and engines without overlap (each step read back first) never launch ahead: the
    tokens are the synchronous path's."""
    model, prompts = models["dense"], prompts_of("dense")[:2]
    greedy = plain(model, prompts, max_new_tokens=12, stop_token_ids=[])
    for kw in (dict(prefix_cache=True), dict(overlap=False)):
        with tail_engine(model, 3, MTP, **kw) as e:
            assert [r.token_ids for r in e.generate(prompts, max_new_tokens=12, stop_token_ids=[])] == greedy
            assert chained(e) == 0


def test_a_drained_step_run_the_loops_way_stays_inside_the_kv_reservation(ahead, monkeypatch):
    """A step launched ahead, then a plan with more decodes than max_streams (a prompt asking for prompt logprobs
    ran its last chunk the loop's way beside it): the pending step is delivered and the plan runs the loop's own
    overlapped steps. Its tokens count for max_new_tokens as the plan counted them, so no request is planned past
    its last token (which fed a token past its KV reservation: with every block reserved, the other request's
    last step had no block left and failed). Both give plain decoding's tokens; every block back."""
    model = bigram_model(CONFIGS["dense"])
    prompts = [[3, 5, 7], random_tokens(20, 6, CONFIGS["dense"].vocab_size)]
    new = (12, 11)  # (request 0's last token and request 1's one step apart: the step after 0's last is 1's last)
    reference = [plain(model, [p], max_new_tokens=n, stop_token_ids=[])[0] for p, n in zip(prompts, new)]
    launches = []
    real = VerifyAhead.launch
    monkeypatch.setattr(VerifyAhead, "launch", lambda self, step, prev: launches.append(prev) or real(self, step, prev))
    blocks = sum(len(p) + n - 1 for p, n in zip(prompts, new))  # (block_size 1: every request's reservation, no more)
    with tail_engine(model, 2, {"method": "mtp", "num_tokens": 1, "max_streams": 1}, token_budget=16, block_size=1,
                     num_blocks=blocks) as e:
        submit, held = e._loop.submit, []

        def together(requests, max_waiting=None):  # both handed to the loop at once: its steps never depend on
            held.extend(requests)  # when the loop thread wakes (it caught the bug only now and then without this)
            if len(held) == 2:
                submit(held, max_waiting)

        monkeypatch.setattr(e._loop, "submit", together)
        handles = [e.submit(prompts[0], max_new_tokens=new[0], stop_token_ids=[]),
                   e.submit(prompts[1], max_new_tokens=new[1], stop_token_ids=[], prompt_logprobs=1)]
        assert [h.result().token_ids for h in handles] == reference
        assert launches and no_block_held(e)


def test_a_chain_goes_on_with_the_requests_a_stop_leaves(models, ahead, monkeypatch):
    """Three requests, the first stopping on a stop token part way: the step launched ahead of its stop holds it
    (dropped), and the next one takes the others' rows of that step (gathered on the device) instead of ending the
    chain; greedy and seeded sampled requests give plain decoding's tokens."""
    model, prompts = models["dense"], prompts_of("dense")[:3]
    real, subsets = VerifyAhead.launch, []

    def launch(self, step, prev, rows=None):
        if prev is not None and len(rows) < len(prev.reqs):
            subsets.append((len(prev.reqs), len(rows)))
        return real(self, step, prev, rows)

    monkeypatch.setattr(VerifyAhead, "launch", launch)
    for kw in (dict(), dict(temperature=0.8, top_k=20)):
        def alone(i, **more):
            return plain(model, [prompts[i]], max_new_tokens=30, seed=i, **kw, **more)[0]

        stop = [[alone(0, stop_token_ids=[])[10]], [], []]
        reference = [alone(i, stop_token_ids=stop[i]) for i in range(3)]
        assert len(reference[0]) < 30
        with tail_engine(model, 3, MTP) as e:
            handles = [e.submit(p, max_new_tokens=30, stop_token_ids=stop[i], seed=i, **kw) for i, p in enumerate(prompts)]
            assert [h.result().token_ids for h in handles] == reference
            assert no_block_held(e)
    assert subsets
