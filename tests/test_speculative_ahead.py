"""Verify ahead (METRALE_VERIFY_AHEAD, speculative/ahead.py): MTP verify step N + 1 launched before step N's accept
counts are read back, its tokens, positions and contexts made on the device from N's. Through the tail's static
buffers (test_speculative_tail.py's `tail_engine`: SpeculativeGraphs' functions uncompiled behind eager buckets):
plain decoding's greedy tokens and the synchronous captured path's drafts and counts, with requests stopping inside
a chain (stop tokens, max_new_tokens), arriving and aborted while a chain runs, and a launch that fails; a drained
step run the loop's way inside the KV reservation; every block back at the end. fp32, CPU; graphs on a GPU:
test_gpu_speculative_graphs.py. And a differential test: random small workloads with the setting off and on."""

from __future__ import annotations

import pytest
import torch

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


class _LetterTokenizer:
    """One token a letter of "abcdefgh" (id % 8): stop strings meet often; eos 0 (stop_token_ids None stops on it)."""
    eos_token_id = 0

    def encode(self, text):
        return [ord(c) % 200 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 8) for i in ids if not (skip_special_tokens and i == 0))


def _request(rng, k: int) -> dict:
    """One request's keywords: max_new_tokens often under 2k + 2, stop tokens (none, random, eos), stop strings,
    seeded sampling, and now and then a logits processor, prompt logprobs or speculate=False (no chain with it)."""
    vocab = CONFIGS["dense"].vocab_size
    kw = {"max_new_tokens": rng.choice([rng.randint(1, 2 * k + 2), rng.randint(5, 28), rng.randint(12, 32)])}
    if rng.random() < 0.6:
        kw["stop_token_ids"] = [] if rng.random() < 0.5 else rng.sample(range(vocab), 4)
    if rng.random() < 0.3:
        kw["stop"] = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 2))]
        kw["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.4:
        kw.update(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(1000))
        kw.update({name: value for name, value in (("top_k", 20), ("top_p", 0.9), ("min_p", 0.05)) if rng.random() < 0.4})
    other = rng.choice([{"logprobs": 2}, {"min_tokens": rng.randint(1, kw["max_new_tokens"])}, {"presence_penalty": 0.8},
                        {"logit_bias": {rng.randrange(vocab): 4.0}}, {"speculate": False}, {"prompt_logprobs": 1}]
                       + [{}] * 14)
    return {**kw, **other}


def _workload(rng) -> dict:
    """1-4 requests (some arriving once the first has output, some aborted), an engine (k, slots, prefix caching,
    overlap, max_streams, every block reserved at block_size 1 or plenty) and a model drawn from `rng`."""
    k, n = rng.choice([1, 2, 3]), rng.randint(1, 4)
    vocab = CONFIGS["dense"].vocab_size
    reqs = [dict(prompt=random_tokens(rng.randint(1, 30), rng.randrange(10 ** 6), vocab), kw=_request(rng, k),
                 late=i > 0 and rng.random() < 0.4, abort=rng.randint(1, 4) if rng.random() < 0.15 else None)
            for i in range(n)]
    engine = dict(prefix_cache=rng.random() < 0.1, overlap=rng.random() > 0.1)
    if rng.random() < 0.4:  # (block_size 1, the requests' reservations and no more: a chain past one fails)
        engine.update(block_size=1, num_blocks=sum(len(r["prompt"]) + r["kw"]["max_new_tokens"] - 1 for r in reqs))
    spec = {"method": "mtp", "num_tokens": k, "max_streams": rng.choice([16, 16, 16, 2])}
    return dict(model=rng.choice(["random", "bigram", "mixture"]), spec=spec, slots=rng.randint(max(2, n), 5),
                reqs=reqs, engine=engine)


def _observed(model, w: dict, setting: str):
    """The workload's results (tokens, text, finish reason, logprobs) through the online API, whether the cache was
    left clean, and the steps launched ahead."""
    with envs.override(**{"METRALE_VERIFY_AHEAD": setting, "METRALE_MTP_AFTER": "1"}), \
            tail_engine(model, w["slots"], w["spec"], tokenizer=_LetterTokenizer(), **w["engine"]) as e:
        handles, outputs, done = {}, {}, set()

        def pull(i, n):  # n outputs of request i, unless it finished
            for _ in range(n):
                if i not in done:
                    o = next(outputs[i], None)
                    if o is None or o.finish_reason is not None:
                        done.add(i)

        def submit(i):
            handles[i] = e.submit(w["reqs"][i]["prompt"], **w["reqs"][i]["kw"])
            outputs[i] = iter(handles[i])

        late = [i for i, r in enumerate(w["reqs"]) if r["late"]]
        for i, r in enumerate(w["reqs"]):
            if not r["late"]:
                submit(i)
        if late:
            pull(0, 2)
            for i in late:
                submit(i)
        for i, r in enumerate(w["reqs"]):
            if r["abort"] is not None:
                pull(i, r["abort"])
                handles[i].abort()
        results = [handles[i].result() for i in range(len(w["reqs"]))]
        c = e.cache
        clean = (c.context_lens == c.mtp_context_lens == [0] * c.num_slots and e.stats().running == 0
                 and (c.free_blocks == c.num_blocks or c.prefix_caching))
        return results, clean, chained(e) if setting == "1" else 0


def test_random_workloads_give_the_synchronous_steps_results():
    """A differential test of the default path: 24 small workloads drawn from a seeded generator (the dense model
    with a random head, the bigram checkpoint whose drafts are all kept, and a mixture of the two whose drafts are
    kept in part; greedy and seeded sampled requests, stop tokens, eos and stop strings met inside accepted runs,
    max_new_tokens under 2k + 2, processors and opt-outs beside chaining requests, requests arriving and aborted
    while a chain runs, every block reserved, prefix caching and overlap off), each run with verify ahead off and
    on: the same tokens, text, finish reasons and logprobs (an aborted request's tokens agree as far as both go), the
    cache left clean; most workloads chain."""
    import random

    cfg = CONFIGS["dense"]
    mixture = bigram_model(cfg, seed=5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # (the head's fc passes the embedding half, now perturbed: some drafts rejected)
        mixture.mtp.fc.weight[:, :cfg.hidden_size] += torch.randn(cfg.hidden_size, cfg.hidden_size, generator=g) * 0.35
    models = {"random": with_random_mtp(unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2), seed=3),
              "bigram": bigram_model(cfg), "mixture": mixture}
    rng, steps, chaining, stops = random.Random(2024), 0, 0, 0
    for case in range(40):
        w = _workload(rng)
        (off, clean_off, _), (on, clean_on, n) = (_observed(models[w["model"]], w, s) for s in "01")
        assert clean_off and clean_on, case
        for i, (a, b) in enumerate(zip(off, on)):
            if w["reqs"][i]["abort"] is not None and "abort" in (a.finish_reason, b.finish_reason):
                m = min(len(a.token_ids), len(b.token_ids))
                assert a.token_ids[:m] == b.token_ids[:m], (case, i)
                continue
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), (case, i, w)
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert x.rank == y.rank and [t for t, _ in x.top] == [t for t, _ in y.top]
                assert abs(x.logprob - y.logprob) <= 1e-4
            stops += n > 0 and b.finish_reason == "stop"
        steps, chaining = steps + n, chaining + (n > 0)
    assert chaining >= 12 and steps >= 120 and stops >= 4, (chaining, steps, stops)
