"""Engine(speculative=...): greedy output token-identical to plain decoding (dense, MoE, Qwen3-Next; n-gram and
MTP drafts; continuous batching, prefix-cache hits, aborts, stops inside an accepted run), the bigram checkpoint's
full acceptance, and sampling's distribution. fp32 on the CPU, eager (one compiled case)."""

from __future__ import annotations

import pytest
import torch

from helpers import moe_config, random_tokens, tiny_config, unit_gain
from speculative_reference import Oracle, bigram_model, staggered, with_eager_tail, with_random_mtp
from metrale_graph import Engine, HybridModel
from metrale_graph.speculative import ngram_propose, verify

CONFIGS = {
    "dense": tiny_config(mtp_num_hidden_layers=1),
    "moe": moe_config(mtp_num_hidden_layers=1, tie_word_embeddings=True),
    "next": moe_config("qwen3_next", mtp_num_hidden_layers=1),
}
PROMPTS = [(7, 1), (23, 2), (3, 3), (41, 4), (12, 5)]  # (length, seed)


@pytest.fixture(scope="module")
def models():
    return {name: with_random_mtp(unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2), seed=3)
            for name, cfg in CONFIGS.items()}


def prompts_of(cfg):
    return [random_tokens(n, s, cfg.vocab_size) for n, s in PROMPTS]


def plain(model, prompts, new_tokens=16, **kw):
    with Engine(model, 4, compile=False, **kw) as e:
        return [r.token_ids for r in e.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])]


def test_the_option_is_checked_first():
    model = HybridModel.from_preset(tiny_config())  # no MTP head
    with pytest.raises(ValueError, match="mtp.fc"):
        Engine(model, 2, compile=False, speculative="mtp")
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'"):
        Engine(model, 2, compile=False, speculative="eagle")
    with pytest.raises(ValueError, match="num_tokens"):
        Engine(model, 2, compile=False, speculative={"method": "ngram", "num_tokens": 0})
    with Engine(model, 2, compile=False, speculative="ngram") as e:
        assert e.stats().speculative == {"method": "ngram", "num_tokens": 3, "proposed": 0, "accepted": 0, "drafts": 0,
                                         "steps": 0}
        assert e.cache.verify_entries == 2 * 3
    with Engine(model, 2, compile=False) as e:
        assert e.stats().speculative is None and e.cache.checkpoint_tokens is None


@pytest.mark.parametrize("family", list(CONFIGS))
def test_verified_drafts_give_plain_decoding_under_continuous_batching(models, family, monkeypatch):
    model, cfg = models[family], CONFIGS[family]
    prompts = prompts_of(cfg)
    reference = plain(model, prompts)
    oracle = Oracle(prompts, reference, cfg.vocab_size)
    monkeypatch.setattr(verify, "ngram_propose", oracle)
    with Engine(model, 3, compile=False, speculative={"method": "ngram", "num_tokens": 3}) as e:
        assert staggered(e, prompts) == reference
        stats = e.stats().speculative
    # drafts were verified, some accepted and some not: the states of rejected tokens were dropped
    assert oracle.calls and 0 < stats["accepted"] < stats["proposed"]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_random_mtp_head_still_gives_plain_decoding(models, family):
    model = models[family]
    prompts = prompts_of(CONFIGS[family])
    with Engine(model, 3, compile=False, speculative={"method": "mtp", "num_tokens": 2}) as e:
        assert staggered(e, prompts) == plain(model, prompts)
        assert e.stats().speculative["proposed"] > 0


@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("family", ["dense", "next"])
def test_the_bigram_checkpoint_accepts_every_draft(family, method):
    model = bigram_model(CONFIGS[family])
    k, new = 3, 41
    with Engine(model, 2, compile=False, speculative={"method": method, "num_tokens": k}) as e:
        out = e.generate([[3, 5, 7]], max_new_tokens=new, stop_token_ids=[])[0].token_ids
        s = e.stats()
    assert out == plain(model, [[3, 5, 7]], new)[0]
    spec = s.speculative
    if method == "mtp":  # drafts from the first step on: k + 1 tokens per verify step, every draft kept
        assert spec == {"method": "mtp", "num_tokens": k, "proposed": k * spec["steps"], "accepted": k * spec["steps"],
                        "drafts": spec["steps"], "steps": (new - 1) // (k + 1)}  # one stream: a draft per step
        assert s.steps == 1 + spec["steps"]  # the prompt's step, then the verify steps
    else:  # prompt lookup has drafts once the bigram cycle has repeated; then every one is kept
        assert spec["accepted"] == spec["proposed"] > 0


def test_ngram_keeps_the_overlapped_step_until_lookup_hits(monkeypatch):
    """"ngram" reads the step in flight back only while a decode's prompt lookup over its tokens on the host
    proposes drafts (SpeculativeStep.worth_reading_back): on the bigram model's chain the steps before its cycle
    repeats stay overlapped, those after it read back and verify; the tokens are plain decoding's."""
    model = bigram_model(CONFIGS["dense"])
    new, seen = 41, []
    real = verify.SpeculativeStep.worth_reading_back

    def watched(self, step, decodes, in_flight):
        seen.append((in_flight, real(self, step, decodes, in_flight)))
        return seen[-1][1]

    monkeypatch.setattr(verify.SpeculativeStep, "worth_reading_back", watched)
    with Engine(model, 2, compile=False, speculative={"method": "ngram", "num_tokens": 3}) as e:
        out = e.generate([[3, 5, 7]], max_new_tokens=new, stop_token_ids=[])[0].token_ids
        spec = e.stats().speculative
    assert out == plain(model, [[3, 5, 7]], new)[0]
    overlapped = [i for i, (in_flight, back) in enumerate(seen) if in_flight and not back]
    read_back = [i for i, (in_flight, back) in enumerate(seen) if in_flight and back]
    assert overlapped and read_back and max(overlapped) < min(read_back), seen  # overlap, then the cycle's lookups
    assert spec["steps"] > 0 and spec["accepted"] == spec["proposed"] > 0


def test_one_stream_verifies_padded_only_where_its_call_is_not_decode_shaped():
    """verify.pads_one_stream: a one-stream verify step runs padded to two streams (on CUDA) only when the call its
    GDN ops see would take the chunked path whole (keeping chunk ends only): a bucket, or without one the step,
    of more than 64 tokens. A one-slot Engine's grid ([1] streams) has no 2-stream bucket, and padded, every such
    verify ran eagerly."""
    from types import SimpleNamespace

    from metrale_graph.capture.buckets import make_grid
    from metrale_graph.engine_sizes import default_grid

    one_slot = SimpleNamespace(grid=make_grid(*default_grid(1, 2048)))
    assert [b.streams for b in one_slot.grid] == [1] * len(one_slot.grid)
    assert not verify.pads_one_stream(one_slot, 4) and not verify.pads_one_stream(one_slot, 64)
    assert verify.pads_one_stream(one_slot, 65)  # its bucket holds 128 tokens
    coarse = SimpleNamespace(grid=make_grid([1, 2], [1, 2048]))  # the only bucket above 1 token holds 2048
    assert verify.pads_one_stream(coarse, 4)
    assert not verify.pads_one_stream(None, 4) and verify.pads_one_stream(None, 65)  # eager: the step itself


def test_steps_of_more_decodes_than_max_streams_do_not_speculate(monkeypatch):
    model = bigram_model(CONFIGS["dense"])
    prompts = [[3, 5, 7], [9, 2], [4, 4, 1, 6]]
    reference = plain(model, prompts, 12)
    seen = []

    def recorded(tokens, k, min_n, max_n):
        seen.append((min_n, max_n))
        return ngram_propose(tokens, k, min_n, max_n)

    monkeypatch.setattr(verify, "ngram_propose", recorded)
    for method in ("mtp", "ngram"):
        lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {}
        for max_streams, speculates in ((2, False), (3, True)):  # the three requests decode in the same steps
            option = {"method": method, "num_tokens": 2, "max_streams": max_streams, **lookup}
            with Engine(model, 3, compile=False, speculative=option) as e:
                out = [r.token_ids for r in e.generate(prompts, max_new_tokens=12, stop_token_ids=[])]
                s = e.stats().speculative
                assert e.cache.verify_entries == min(3, max_streams) * 2  # a stream of a step that may speculate
            assert out == reference
            assert (s["proposed"] > 0) == speculates and s["accepted"] == s["proposed"], (method, max_streams, s)
            assert s["drafts"] <= 3 * s["steps"]
    assert seen and set(seen) == {(1, 3)}  # prompt lookup asked only when the step may speculate


def test_stops_inside_an_accepted_run_end_the_request_there():
    model = bigram_model(CONFIGS["dense"])
    ref = plain(model, [[3, 5, 7]], 30)[0]
    stop = next(t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])  # first seen inside the first run
    cut = ref.index(stop) + 1
    assert 2 < cut < 5  # (the first verify step emits output tokens 1 .. 4: the stop's run goes on past it)
    with Engine(model, 2, compile=False, speculative={"method": "mtp", "num_tokens": 3}) as e:
        r = e.generate([[3, 5, 7]], max_new_tokens=30, stop_token_ids=[stop])[0]
        assert (r.token_ids, r.finish_reason) == (ref[:cut], "stop")
        for n in (2, 5, 6, 7):  # max_new_tokens falling inside a run of k + 1
            r = e.generate([[3, 5, 7]], max_new_tokens=n, stop_token_ids=[])[0]
            assert (r.token_ids, r.finish_reason) == (ref[:n], "length")
        assert e.stats().generated_tokens == cut + 2 + 5 + 6 + 7  # nothing past a stop counted
        assert e.stats().running == 0 and e.stats().used_blocks == 0


def test_aborts_leave_the_others_exact(models, monkeypatch):
    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = prompts_of(cfg)
    reference = plain(model, prompts)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, cfg.vocab_size))
    with Engine(model, 3, compile=False, speculative="ngram") as e:
        out = staggered(e, prompts, abort=3)
        assert out == [None if i == 3 else r for i, r in enumerate(reference)]
        assert e.stats().used_blocks == 0


def test_prefix_cache_hits_stay_exact_and_restored_streams_get_mtp_drafts(models, monkeypatch):
    model, cfg = models["dense"], CONFIGS["dense"]
    shared = random_tokens(70, 9, cfg.vocab_size)
    prompts = [shared, shared + [3, 4]]  # the second restores the first but its last token
    reference = plain(model, prompts, 12)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, cfg.vocab_size))
    for method in ("ngram", "mtp"):
        with Engine(model, 2, compile=False, prefix_cache=True, speculative={"method": method, "num_tokens": 2}) as e:
            first = e.generate(prompts[:1], max_new_tokens=12, stop_token_ids=[])[0]
            proposed = e.stats().speculative["proposed"]
            second = e.generate(prompts[1:], max_new_tokens=12, stop_token_ids=[])[0]
            assert [first.token_ids, second.token_ids] == reference
            assert second.cached_tokens > 0
            # the head's entries came with the restored blocks: MTP drafts after the hit too (test_mtp_restore.py:
            # the bigram checkpoint keeps them all, random heads draft what a fresh run does)
            assert proposed > 0 and e.stats().speculative["proposed"] > proposed


def test_requests_that_do_not_speculate_decode_beside_those_that_do(models):
    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = prompts_of(cfg)[:3]
    with Engine(model, 3, compile=False, speculative={"method": "mtp", "num_tokens": 2}) as e:
        kw = dict(max_new_tokens=10, stop_token_ids=[])
        penalized = e.submit(prompts[0], repetition_penalty=1.3, **kw)  # speculates (test_speculative_processors)
        # its prompt in the loop's step (prompt logprobs): the head does not follow it, one token per step
        with_logprobs = e.submit(prompts[1], logprobs=2, prompt_logprobs=1, **kw)
        speculating = e.submit(prompts[2], **kw)
        out = [penalized.result(), with_logprobs.result(), speculating.result()]
        proposed = e.stats().speculative["proposed"]
        assert proposed > 0
        opted_out = e.generate(prompts[2:], speculate=False, **kw)[0]  # decodes alone, drafting nothing
        assert opted_out.token_ids == out[2].token_ids and e.stats().speculative["proposed"] == proposed
        with pytest.raises(ValueError, match="speculate must be True or False"):
            e.submit(prompts[0], speculate=1)
    with Engine(model, 3, compile=False) as e:
        ref = [e.submit(prompts[0], repetition_penalty=1.3, **kw).result(),
               e.submit(prompts[1], logprobs=2, prompt_logprobs=1, **kw).result(), e.submit(prompts[2], **kw).result()]
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert len(out[1].logprobs) == len(ref[1].logprobs) == 10
    assert len(out[1].prompt_logprobs) == len(prompts[1]) and out[1].prompt_logprobs[1] is not None


def test_sampling_with_speculation_follows_plain_sampling(monkeypatch):
    """Each of the first 4 tokens' distribution over a vocabulary of 8, from N = 1200 seeded requests with and
    without speculation (random drafts, so tests accept and reject). Each token's two frequencies differ by a
    difference of two binomial proportions, sd sqrt(2 p (1 - p) / N) <= sqrt(0.5 / 1200) = 0.0204; a bound of
    4.5 sd (0.092) holds for all 32 (position, token) pairs with probability > 1 - 32 * 6.8e-6 under the null."""
    cfg = tiny_config(vocab_size=8, num_hidden_layers=2, hidden_size=32, mtp_num_hidden_layers=1)
    model = unit_gain(HybridModel.from_preset(cfg, seed=4), seed=5)
    N, new = 1200, 4
    prompts = [[1, 2, 3]] * N

    def drafts(tokens, k, *lookup):  # one-hot proposals that depend on the tokens so far (a sampled stream's own)
        g = torch.Generator().manual_seed(sum(int(t) * 31 ** i for i, t in enumerate(tokens)) % 2**31)
        return torch.randint(0, 8, (k,), generator=g).tolist()

    monkeypatch.setattr(verify, "ngram_propose", drafts)
    freqs, runs = [], []
    for spec in (None, {"method": "ngram", "num_tokens": 2, "max_streams": 64}):  # every step speculates
        with Engine(model, 64, compile=False, speculative=spec) as e:
            out = e.generate(prompts, max_new_tokens=new, temperature=1.0, seed=11, stop_token_ids=[])
            if spec:
                s = e.stats().speculative
                assert 0 < s["accepted"] < s["proposed"]
        tokens = torch.tensor([r.token_ids for r in out])  # [N, new]
        freqs.append(torch.stack([torch.bincount(tokens[:, j], minlength=8) for j in range(new)]).double() / N)
        runs.append(tokens)
    assert (freqs[0] - freqs[1]).abs().max() < 4.5 * (0.5 / N) ** 0.5
    # stronger, since acceptance draws each position as a plain step would with the same uniform: the same tokens
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_seeded_sampling_with_speculation_gives_plain_sampling(method):
    """A seeded sampled request emits the tokens plain sampling gives with its seed, whether or not its steps
    verify drafts and whatever shares them (acceptance.accept_drawn and Uniforms.settle). With "ngram" the loop
    overlaps its steps until some decode's lookup hits, so a neighbour's hit (a greedy request on the bigram
    chain, whose cycle repeats) turns a step into a verify in which the sampled request gets drafts of its own:
    before, the count of uniforms it drew then depended on the neighbour."""
    model = bigram_model(CONFIGS["dense"])  # (its MTP head drafts the greedy chain: some drafts are kept)
    spec = {"method": method, "num_tokens": 2}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1  # a repeated token is enough: the sampled stream gets drafts too
    sampled = dict(max_new_tokens=24, temperature=0.9, stop_token_ids=[])
    prompts = [[3, 5, 7, 3, 5], [11, 12, 13]]
    with Engine(model, 3, compile=False) as e:
        want = [r.token_ids for r in e.generate(prompts, seed=7, **sampled)]
    with Engine(model, 3, compile=False, speculative=spec) as e:
        alone = [r.token_ids for r in e.generate(prompts, seed=7, **sampled)]
        neighbour = e.submit([9, 4, 9, 4], max_new_tokens=30, stop_token_ids=[])  # greedy, beside them
        together = [r.token_ids for r in e.generate(prompts, seed=7, **sampled)]
        neighbour.result()
        s = e.stats().speculative
    assert s["proposed"] > 0 and s["accepted"] > 0
    assert alone == want and together == want


def test_seeded_sampling_with_mtp_drafts_is_deterministic(models):
    """A seeded request's uniforms come from its own generator, one per emitted position: the same seed gives the
    same tokens, whatever else shares the batch."""
    model, cfg = models["next"], CONFIGS["next"]
    prompts = prompts_of(cfg)[:3]
    kw = dict(max_new_tokens=12, temperature=0.8, top_k=20, stop_token_ids=[])
    with Engine(model, 3, compile=False, speculative={"method": "mtp", "num_tokens": 2}) as e:
        together = [r.token_ids for r in e.generate(prompts, seed=5, **kw)]
        alone = e.generate(prompts[1:2], seed=6, **kw)[0].token_ids  # request 1 of the first call drew seed 5 + 1
        assert e.stats().speculative["proposed"] > 0
    assert alone == together[1] and len(set(map(tuple, together))) == 3


def test_compiled_engine_verifies_in_its_compiled_hidden_states_step(models, monkeypatch):
    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = prompts_of(cfg)[:3]
    reference = plain(model, prompts, 10)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, cfg.vocab_size))
    with Engine(model, 2, compile=True, token_budget=64, batch_sizes=[2], token_counts=[64],
                speculative="ngram") as e:
        e.warmup()  # the hidden-states step of every bucket too
        assert set(e.runner.hidden_entries) == set(e.runner.grid)
        assert all(entry.report is not None for entry in e.runner.hidden_entries.values())
        runs, run_hidden = [], e.runner.run_hidden
        monkeypatch.setattr(e.runner, "run_hidden", lambda entry, packed: runs.append(1) or run_hidden(entry, packed))
        out = [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])]
        assert out == reference and e.stats().speculative["accepted"] > 0
        assert len(runs) >= e.stats().speculative["steps"]  # every verify step ran the compiled step, none eagerly


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_drafts_stop_at_max_context(method):
    """Requests whose max_new_tokens max_context caps (prompt + new = 17 tokens): k = 4 drafts would run past the
    slot's room near the end; each verify keeps to it (k = tokens still to emit - 1), the bigram checkpoint keeps
    every draft, and the tokens are plain decoding's under the same max_context, to its last position."""
    model, prompts = bigram_model(CONFIGS["dense"]), [[3, 5, 7], list(range(1, 11))]
    lookup = {"prompt_lookup_min": 1} if method == "ngram" else {}
    kw = dict(max_new_tokens=100, stop_token_ids=[])
    with Engine(model, 2, compile=False, max_context=17) as e:
        reference = [r.token_ids for r in e.generate(prompts, **kw)]
    assert [len(r) for r in reference] == [14, 7]
    with Engine(model, 2, compile=False, max_context=17, speculative={"method": method, "num_tokens": 4, **lookup}) as e:
        out = e.generate(prompts, **kw)
        s = e.stats()
    assert [r.token_ids for r in out] == reference and {r.finish_reason for r in out} == {"length"}
    assert s.speculative["accepted"] == s.speculative["proposed"] > 0 and s.used_blocks == 0


@pytest.mark.parametrize("where", ["_keep_states", "_deliver"])
def test_a_failed_speculative_step_leaves_later_requests_exact(models, monkeypatch, where):
    """An exception inside a speculative step (the accepted states' copy, inside the cache's transaction; the
    delivery, after it committed) fails that step's requests alone; later requests on the same engine (the same
    slots, the verify entries, the MTP head's entries) give plain decoding's tokens and nothing stays held."""
    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = prompts_of(cfg)[:3]
    reference = plain(model, prompts, 10)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, cfg.vocab_size))
    real, calls = getattr(verify.SpeculativeStep, where), []

    def once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args)

    kw = dict(max_new_tokens=10, stop_token_ids=[])
    for method in ("mtp", "ngram"):
        calls.clear()
        with Engine(model, 2, compile=False, speculative={"method": method, "num_tokens": 3}) as e:
            monkeypatch.setattr(verify.SpeculativeStep, where, once)  # (k = 3: the Oracle rejects some drafts)
            handles = [e.submit(p, **kw) for p in prompts]
            failed = 0
            for h, ref in zip(handles, reference):
                try:
                    assert h.result().token_ids == ref
                except RuntimeError as err:
                    assert str(err) == "injected"
                    failed += 1
            monkeypatch.setattr(verify.SpeculativeStep, where, real)
            assert failed > 0 and e.stats().used_blocks == 0
            assert [r.token_ids for r in e.generate(prompts, **kw)] == reference
            assert e.stats().running == 0 and e.stats().used_blocks == 0


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_a_step_failing_after_it_ended_a_request_still_delivers_that_request(models, monkeypatch, method):
    """A speculative step that fails after its tokens ended a request (its slot freed) but before its outputs reached
    their channels failed the step's other requests and skipped the ended one (_fail: a no-op once a request has
    ended), whose consumer then waited forever for its last output. The outputs the step had made are now delivered
    before the others fail; the engine goes on with plain decoding's tokens."""
    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = prompts_of(cfg)[:2]
    reference = plain(model, prompts, 10)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, cfg.vocab_size))
    real, raised = verify.deliver, []

    def deliver(outputs):
        if not raised and any(o.finish_reason for items in outputs.values() for o in items):
            raised.append(1)
            raise RuntimeError("injected")
        return real(outputs)

    monkeypatch.setattr(verify, "deliver", deliver)
    with Engine(model, 2, compile=False, speculative={"method": method, "num_tokens": 3}) as e:
        short, long = (e.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in zip(prompts, (3, 10)))
        out = short.result(60)  # (TimeoutError: its channel was never closed)
        assert raised and (out.token_ids, out.finish_reason) == (reference[0][:3], "length")
        with pytest.raises(RuntimeError, match="injected"):
            long.result(60)
        assert [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])] == reference
        assert e.stats().running == 0 and e.stats().used_blocks == 0


@pytest.mark.parametrize("call", [1, 2, 5])
def test_a_failing_draft_proposer_fails_its_request_alone(models, monkeypatch, call):
    """The n-gram proposer raising (prompt lookup is host code: a bug, a MemoryError) while a step is planned, before
    the step in flight is read back (worth_reading_back) or after (takes), once stopped the engine loop; then it
    failed every request of the step being planned, though the lookup is one request's. Now the lookup is made again
    once the step in flight has delivered (worth_reading_back reads back), and the request whose lookup raises fails
    alone and leaves the step; the others give plain decoding's tokens, nothing stays held, the engine goes on."""
    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = prompts_of(cfg)[:3]
    reference = plain(model, prompts, 10)
    oracle, calls, doomed = Oracle(prompts, reference, cfg.vocab_size), [], []

    def failing(tokens, *args):  # from its call-th call on, every lookup of that call's request raises
        calls.append(1)
        seq = list(tokens)
        if len(calls) == call:
            doomed.append(seq)
        if any(seq[:len(d)] == d for d in doomed):
            raise RuntimeError("proposer failed")
        return oracle(tokens, *args)

    monkeypatch.setattr(verify, "ngram_propose", failing)
    kw = dict(max_new_tokens=10, stop_token_ids=[])
    with Engine(model, 2, compile=False, speculative={"method": "ngram", "num_tokens": 3}) as e:
        failed = 0
        for h, ref in zip([e.submit(p, **kw) for p in prompts], reference):
            try:
                assert h.result(60).token_ids == ref
            except RuntimeError as err:
                assert str(err) == "proposer failed"
                failed += 1
        assert failed == 1 and e.stats().running == e.stats().waiting == e.stats().used_blocks == 0
        doomed.clear()
        assert [r.token_ids for r in e.generate(prompts, **kw)] == reference
        assert e.cache.context_lens == [0, 0] and e.stats().used_blocks == 0


def kept_prefixes(engine) -> list[tuple]:
    """The prefix cache's checkpoint entries (length, full blocks' hash, tail), sorted."""
    return sorted((m.length, m.full, m.tail) for m in engine.cache.slot_blocks.index._entries.values())


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_verify_streams_keep_no_prefix_checkpoints(models, monkeypatch, method):
    """A verify stream (x_n, d_1 .. d_k) whose last draft lands on a multiple of checkpoint_interval had a prefix
    checkpoint planned there, as a prompt chunk's last token has (PrefixStore.plan): the state after its drafts,
    rejected ones included, was recorded as a prefix-cache entry keyed by them, one that plain decoding never makes
    (its decodes keep none), evicting a kept prefix. Now a verify step plans checkpoints for its other streams only:
    the entries after each request are plain decoding's, and a later request continuing one restores it exactly."""
    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = [random_tokens(n, s, cfg.vocab_size) for n, s in ((60, 21), (59, 22), (61, 23))]
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    with Engine(model, 3, compile=False, prefix_cache=True, block_size=16, checkpoint_interval=64) as e:
        reference = [r.token_ids for r in e.generate(prompts, **kw)]
        plain_entries = kept_prefixes(e)
    conts = [p + r for p, r in zip(prompts, reference)]
    follow = plain(model, conts, 6)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, cfg.vocab_size))
    for k in (2, 3, 4):  # each verify stream of k + 1 tokens from context 60 or 61 ... ends on 64 for some request
        with Engine(model, 3, compile=False, prefix_cache=True, block_size=16, checkpoint_interval=64,
                    speculative={"method": method, "num_tokens": k}) as e:
            assert [r.token_ids for r in e.generate(prompts, **kw)] == reference
            assert e.stats().speculative["proposed"] > 0
            assert kept_prefixes(e) == plain_entries, k
            again = e.generate(conts, max_new_tokens=6, stop_token_ids=[])
            assert [r.token_ids for r in again] == follow and all(r.cached_tokens > 60 for r in again)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("k", [3, 6])
def test_a_stop_inside_an_accepted_run_keeps_nothing_past_it_for_the_next_turn(k, tail):
    """A request stopping at a draft its verify step kept (the bigram checkpoint keeps all) ended with the drafts
    after its stop in its slot, so with prefix caching the prefix kept at its end held tokens it never emitted:
    the next turn of the conversation (its prompt, its output, more) restored only the prompt's checkpoint. Now
    the slot keeps the drafts through the stop alone (speculative/stops.py; the captured acceptance, `tail`, has
    kept the state of all of them: it is replaced): the next turn restores what it restores after plain decoding,
    and gives its tokens."""
    from metrale_graph.capture import make_grid

    model = bigram_model(CONFIGS["dense"])
    prompt = list(range(3, 70))
    ref = plain(model, [prompt], 30)[0]
    stop = next(t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    cut = ref.index(stop) + 1
    turn = prompt + ref[:cut] + [1, 2, 3]
    results = []
    for spec in (None, {"method": "mtp", "num_tokens": k}):
        e = Engine(model, 2, compile=False, prefix_cache=True, block_size=16, speculative=spec)
        with with_eager_tail(e, make_grid([1, 2], [8, 16, 32])) if spec and tail else e:
            r = e.generate([prompt], max_new_tokens=30, stop_token_ids=[stop])[0]
            assert (r.token_ids, r.finish_reason) == (ref[:cut], "stop")
            results.append(e.generate([turn], max_new_tokens=5, stop_token_ids=[])[0])
    plain_turn, turn_after = results
    assert turn_after.token_ids == plain_turn.token_ids
    assert turn_after.cached_tokens == plain_turn.cached_tokens == len(prompt) + cut


@pytest.mark.parametrize("prefix", [False, True])
def test_a_failing_mtp_drafting_fails_the_requests_it_drafts_for_alone(models, monkeypatch, prefix):
    """The MTP head's drafting runs after a step delivered its tokens, for the requests the head follows. Raising
    there failed every request of the step, those it does not draft for too (a request that opted out, one asking
    for prompt logprobs), whose slots it never touched. Now only the requests it drafts for fail (its transaction
    reset their slots); the others give plain decoding's tokens, and the engine goes on exact, nothing held."""
    from metrale_graph.speculative.drafting import MtpDrafter

    model, cfg = models["dense"], CONFIGS["dense"]
    prompts = prompts_of(cfg)[:3]
    kws = [dict(speculate=False), {}, dict(prompt_logprobs=0)]
    kw = dict(max_new_tokens=10, stop_token_ids=[])
    with Engine(model, 3, compile=False) as e:
        reference = [e.submit(p, **kw, **x).result().token_ids for p, x in zip(prompts, kws)]
    real, calls = MtpDrafter.run, []

    def failing(self, batch, *args):
        calls.append(batch.slots)
        if len(calls) == 3:
            raise RuntimeError("drafting failed")
        return real(self, batch, *args)

    monkeypatch.setattr(MtpDrafter, "run", failing)
    with Engine(model, 3, compile=False, prefix_cache=prefix, speculative={"method": "mtp", "num_tokens": 2}) as e:
        handles = [e.submit(p, **kw, **x) for p, x in zip(prompts, kws)]
        with pytest.raises(RuntimeError, match="drafting failed"):
            handles[1].result()
        assert [handles[0].result().token_ids, handles[2].result().token_ids] == [reference[0], reference[2]]
        assert len(calls) >= 3 and all(len(slots) == 1 for slots in calls[:3]), calls  # (the head follows one)
        monkeypatch.setattr(MtpDrafter, "run", real)
        assert [e.submit(p, **kw, **x).result().token_ids for p, x in zip(prompts, kws)] == reference
        assert e.stats().running == e.stats().used_blocks == 0


SHAPES = {  # configs the verify step's state handling could trip on (the layer kinds each keep a state of their own)
    "one_gdn_layer": dict(num_hidden_layers=1, layer_types=("linear_attention",)),
    "one_attention_layer": dict(num_hidden_layers=1, layer_types=("full_attention",)),
    "gdn_only": dict(num_hidden_layers=3, layer_types=("linear_attention",) * 3),
    "mha_odd_heads": dict(num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=4, head_dim=24,
                          linear_key_head_dim=8, linear_value_head_dim=40),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_unusual_shapes_verify_to_plain_decoding(monkeypatch, shape):
    """One layer of either kind, GDN layers alone, attention heads without grouping and head sizes of other widths:
    n-gram drafts (some rejected) at k 3 and 5 and a random MTP head at k 3 give plain decoding's tokens under
    continuous batching, prompts of one token included."""
    cfg = tiny_config(mtp_num_hidden_layers=1, **SHAPES[shape])
    model = with_random_mtp(unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2), seed=3)
    prompts = [random_tokens(n, s, cfg.vocab_size) for n, s in ((7, 1), (1, 2), (23, 3), (2, 4))]
    reference = plain(model, prompts, 12)
    for spec in ({"method": "ngram", "num_tokens": 3}, {"method": "ngram", "num_tokens": 5},
                 {"method": "mtp", "num_tokens": 3}):
        monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, cfg.vocab_size))
        with Engine(model, 3, compile=False, speculative=spec) as e:
            assert staggered(e, prompts, 12) == reference, spec
            stats = e.stats()
        assert stats.speculative["proposed"] > 0 and stats.used_blocks == 0
        if spec["method"] == "ngram":
            assert 0 < stats.speculative["accepted"] < stats.speculative["proposed"]


def test_admission_counts_the_blocks_a_verify_step_left_a_slot():
    """A verify step gives a stream blocks for all its drafts and commits the kept ones alone: a slot may hold a
    block past its context (the rejected drafts' positions, within its reservation). The scheduler's admission
    counted what a running request still needs from its context (its reservation less the blocks its context
    fills), so such a block was counted twice (held, and still needed): a request that fits waited for a running
    one to end. It now counts the blocks the slot holds."""
    from metrale_graph import Stream
    from metrale_graph.protocol import prefill_call
    from metrale_graph.sampling import SamplingParams
    from metrale_graph.scheduler import Request, Scheduler

    model = HybridModel.from_preset(tiny_config())
    cache = model.new_cache(2, 6, 16, 48, verify_entries=8)
    sched = Scheduler(cache, 64)
    first, second = (Request(0, list(range(1, 11)), 38, SamplingParams(), None) for _ in range(2))  # 3 blocks each
    sched.add(first)
    assert [len(c.tokens) for c in sched.plan()] == [10]
    with prefill_call(model, cache, [Stream(first.slot, first.prompt)]) as call:
        call.run(lambda packed: model.hidden_states(cache, packed)[:1])
    with prefill_call(model, cache, [Stream(first.slot, list(range(9)))]) as call:  # a verify of 8 drafts, none kept
        call.run_settled(lambda packed: model.hidden_states(cache, packed), lambda h: [1], [0])
    assert cache.context_lens[first.slot] == 11 and len(cache.slot_blocks.blocks[first.slot]) == 2
    assert cache.free_blocks == 4  # the first needs one more block of its 3: the second's 3 fit
    sched.add(second)
    assert sched._fits(second)
