"""Speculation with the logits processors (speculative/verify.py's `_processed`): requests with penalties,
min_tokens, logit_bias, logprobs or a grammar speculate, and give plain decoding's tokens (greedy) and logprobs,
beside requests that do not speculate; seeded sampling is deterministic and follows plain sampling's
distribution. Drafts from the Oracle (plain decoding's output with one token in three wrong), so verify steps
keep partial runs, full runs and none. Tiny fp32 models on the CPU, eager."""

from __future__ import annotations

import pytest
import torch

from helpers import random_tokens, tiny_config, unit_gain
from speculative_reference import Oracle
from metrale_graph import Engine, HybridModel
from metrale_graph.speculative import verify

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = tiny_config()
PROMPTS = [random_tokens(n, s, CFG.vocab_size) for n, s in ((7, 1), (23, 2), (3, 3), (41, 4))]
NEW = 16
# logprobs: the verify step computes a position's logits from a (k + 1)-token chunk, plain decoding from one token:
# the same fp32 arithmetic summed in another order (chunked against recurrent GDN, a longer attention call), so
# they differ by rounding: a few ulps (2^-23 ~ 1.2e-7 relative) of each of the 4 layers' sums, amplified through
# the layers and carried to logits of magnitude ~10 and through log_softmax (whose error is at most twice its
# inputs' plus the sum's): ~1e-5 (measured here: at most 8e-6). 1e-4 leaves an order of magnitude, and is far
# below what a processor moves if it leaked into logprobs (a penalty or a mask moves a logit by 0.5 or more).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return unit_gain(HybridModel.from_preset(CFG, seed=1), seed=2)


def run(model, prompts, kws, spec=None, slots=4, **engine_kw):
    """Each prompt submitted with its own keywords at once; (results, speculative stats)."""
    with Engine(model, slots, compile=False, speculative=spec, **engine_kw) as e:
        handles = [e.submit(p, **{"max_new_tokens": NEW, "stop_token_ids": [], **kw}) for p, kw in zip(prompts, kws)]
        results = [h.result() for h in handles]
        return results, e.stats().speculative


def assert_same(results, reference, tol=LOGPROB_TOL):
    for r, ref in zip(results, reference):
        assert (r.token_ids, r.finish_reason) == (ref.token_ids, ref.finish_reason)
        assert (r.logprobs is None) == (ref.logprobs is None)
        for a, b in zip(r.logprobs or [], ref.logprobs or []):
            assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) <= tol
            assert max((abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)), default=0.0) <= tol


def speculated(model, prompts, kws, monkeypatch, **engine_kw):
    """Plain decoding's results, and speculation's with the Oracle's drafts of them; checks that drafts were
    accepted and rejected."""
    reference, _ = run(model, prompts, kws, **engine_kw)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, [r.token_ids for r in reference], model.config.vocab_size))
    results, stats = run(model, prompts, kws, {"method": "ngram", "num_tokens": 3}, **engine_kw)
    assert 0 < stats["accepted"] < stats["proposed"], stats
    return results, reference


PROCESSORS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=-1.5),  # (negative: tokens repeat, so counts past 1 matter)
    "repetition": dict(repetition_penalty=1.8),
    "all_penalties_and_bias": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3,
                                   logit_bias={5: 3.0, 9: -2.0}),
    "logprobs": dict(logprobs=3),
    "logprobs_and_penalty": dict(logprobs=0, frequency_penalty=1.0),
}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_greedy_speculation_with_a_processor_gives_plain_decoding(model, name, monkeypatch):
    kw = PROCESSORS[name]
    results, reference = speculated(model, PROMPTS, [kw] * len(PROMPTS), monkeypatch)
    assert_same(results, reference)
    if "logprobs" not in name:  # the processor changes the output: a test it can fail
        unprocessed, _ = run(model, PROMPTS, [{}] * len(PROMPTS))
        assert [r.token_ids for r in unprocessed] != [r.token_ids for r in reference]
    else:
        assert all(len(r.logprobs) == NEW for r in results)


def test_min_tokens_holds_the_stop_tokens_through_the_drafts(model, monkeypatch):
    """Every even id a stop token: plain decoding stops within 4 tokens without min_tokens; min_tokens 3, 5 and 7 hold
    them (a verify position j counts the drafts before it), and then each request stops soon after, inside a
    verify run: holding a position too many or too few would move its stop."""
    stops = list(range(0, CFG.vocab_size, 2))
    unheld, _ = run(model, PROMPTS, [dict(stop_token_ids=stops)] * len(PROMPTS))
    assert all(len(r.token_ids) <= 4 for r in unheld)
    for n in (3, 5, 7):
        kws = [dict(stop_token_ids=stops, min_tokens=n)] * len(PROMPTS)
        results, reference = speculated(model, PROMPTS, kws, monkeypatch)
        assert_same(results, reference)
        assert all(r.finish_reason == "stop" and n < len(r.token_ids) < NEW for r in reference)


def test_a_mixed_batch_of_processors_and_opt_outs(model, monkeypatch):
    kws = [dict(repetition_penalty=1.5, logprobs=2), dict(speculate=False, presence_penalty=1.0),
           dict(min_tokens=5, stop_token_ids=[7], frequency_penalty=0.4), dict(logprobs=1, prompt_logprobs=1)]
    results, reference = speculated(model, PROMPTS, kws, monkeypatch, slots=3)  # 3 slots: continuous batching
    assert_same(results, reference)
    assert results[3].prompt_logprobs == reference[3].prompt_logprobs or all(
        (a is None and b is None) or abs(a.logprob - b.logprob) <= LOGPROB_TOL
        for a, b in zip(results[3].prompt_logprobs, reference[3].prompt_logprobs))


def test_mtp_drafts_with_processors_give_plain_decoding():
    cfg = tiny_config(mtp_num_hidden_layers=1)
    model = unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2)
    kws = [dict(frequency_penalty=0.8, logprobs=2), dict(min_tokens=6, stop_token_ids=[3]),
           dict(prompt_logprobs=0, repetition_penalty=1.4)]  # the head does not follow the last (prompt logprobs)
    reference, _ = run(model, PROMPTS[:3], kws)
    results, stats = run(model, PROMPTS[:3], kws, {"method": "mtp", "num_tokens": 2})
    assert_same(results, reference)
    assert stats["proposed"] > 0


def test_seeded_sampling_with_processors_is_deterministic(model, monkeypatch):
    """A seeded sampled request's tokens depend on its seed and drafts alone (acceptance.draw_uniforms): the same
    twice, alone or beside others."""
    greedy, _ = run(model, PROMPTS, [{}] * len(PROMPTS))
    monkeypatch.setattr(verify, "ngram_propose", Oracle(PROMPTS, [r.token_ids for r in greedy], CFG.vocab_size))
    kw = dict(temperature=0.9, top_k=40, frequency_penalty=0.6, min_tokens=4, stop_token_ids=[11], logprobs=2)
    spec = {"method": "ngram", "num_tokens": 3}
    together, stats = run(model, PROMPTS, [dict(kw, seed=20 + i) for i in range(4)], spec)
    again, _ = run(model, PROMPTS, [dict(kw, seed=20 + i) for i in range(4)], spec)
    alone, _ = run(model, PROMPTS[2:3], [dict(kw, seed=22)], spec)
    assert stats["proposed"] > 0
    # the same tokens; logprobs within rounding (which requests share a step depends on when each arrives)
    assert_same(again, together)
    assert_same(alone, together[2:3])
    assert len({tuple(r.token_ids) for r in together}) == 4


def test_sampling_with_processors_follows_plain_sampling(monkeypatch):
    """As test_speculative_engine's distribution test, with a frequency penalty, a logit bias and min_tokens
    holding a stop token: each of the first 4 tokens' distribution over a vocabulary of 8 from N = 1200 seeded
    requests, with and without speculation (a request that stopped counts as a ninth outcome). Each frequency
    difference has sd <= sqrt(0.5 / N) = 0.0204; 4.5 sd holds for all 36 (position, outcome) pairs with
    probability > 1 - 36 * 6.8e-6 under the null."""
    cfg = tiny_config(vocab_size=8, num_hidden_layers=2, hidden_size=32)
    model = unit_gain(HybridModel.from_preset(cfg, seed=4), seed=5)
    N, new = 1200, 4

    def drafts(tokens, k, *lookup):  # random one-hot proposals that depend on the tokens so far
        g = torch.Generator().manual_seed(sum(int(t) * 31 ** i for i, t in enumerate(tokens)) % 2**31)
        return torch.randint(0, 8, (k,), generator=g).tolist()

    monkeypatch.setattr(verify, "ngram_propose", drafts)
    kw = dict(max_new_tokens=new, temperature=1.0, seed=11, frequency_penalty=1.5, logit_bias={2: 1.0},
              min_tokens=3, stop_token_ids=[0])
    freqs = []
    for spec in (None, {"method": "ngram", "num_tokens": 2, "max_streams": 64}):
        with Engine(model, 64, compile=False, speculative=spec) as e:
            out = e.generate([[1, 2, 3]] * N, **kw)
            if spec:
                s = e.stats().speculative
                assert 0 < s["accepted"] < s["proposed"]
        tokens = torch.tensor([r.token_ids + [8] * (new - len(r.token_ids)) for r in out])  # 8: ended before
        freqs.append(torch.stack([torch.bincount(tokens[:, j], minlength=9) for j in range(new)]).double() / N)
    assert (freqs[0][:3, 0] == 0).all()  # min_tokens held the stop token
    assert (freqs[0] - freqs[1]).abs().max() < 4.5 * (0.5 / N) ** 0.5


# structured output ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from tokenizer_fixture import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def text_model(tokenizer):
    return unit_gain(HybridModel.from_preset(tiny_config(vocab_size=len(tokenizer) + 7), seed=0), seed=3)


def mask_of(masks, r):
    """A plain step's mask row of request r (every token allowed when it has no grammar started)."""
    row = masks.fill([r])
    return torch.full((masks.host.shape[1],), -1, dtype=torch.int32) if row is None else row[0].clone()


def test_verify_masks_follow_the_matcher_along_the_drafts(tokenizer, text_model):
    """TokenMasks.fill_drafts' row j of a request is what a plain step's mask is after its drafts d_1 .. d_j were
    taken in, for every j whose drafts the grammar allows (the rows acceptance reads); the row before a draft the
    grammar refuses does not allow it, and later rows (never read) allow every token, as do rows past a stop token,
    rows of a grammar not yet started (it starts after a draft equal to starts_after) and rows without a grammar.
    The matchers end as they began."""
    from metrale_graph.grammar import TokenMasks
    from metrale_graph.scheduler import Request
    from metrale_graph.structured import StructuredOutputError, structured_output

    K, V, eos = 6, text_model.config.vocab_size, tokenizer.eos_token_id
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    cases = [  # (spec, drafts)
        ({"regex": "(ab|c)+d"}, enc("ab") + enc("x") + enc("cd")),  # "x": refused, the rest never read
        ({"regex": "(ab|c)+d"}, enc("abcd") + [eos] + enc("c")),  # complete, a stop token, then past the end
        ({"regex": "c+d", "starts_after": enc("x")[0]}, enc("ab") + enc("x") + enc("cc")),
        (None, enc("abc")),
        ({"regex": "(ab|c)+d"}, enc("c")),  # fewer drafts than K
    ]
    with Engine(text_model, 2, compile=False, tokenizer=tokenizer) as e:
        def request(spec, drafts):
            r = Request(0, [1], 8, None, None)
            if spec is not None:
                checked = structured_output(spec)
                compiled = e.compile_grammar(checked).result()  # (makes e._grammars)
                r.grammar = e._grammars.matcher(compiled, checked, {eos})
            r.drafts = list(drafts)
            return r

        plain = TokenMasks(1, V, torch.device("cpu"))
        reqs = [request(spec, drafts) for spec, drafts in cases]
        before = [mask_of(plain, r) for r in reqs]
        rows = TokenMasks(4, V, torch.device("cpu")).fill_drafts(reqs, K).view(len(cases), K + 1, -1)
        for r, b in zip(reqs, before):  # rolled back
            assert torch.equal(mask_of(plain, r), b)
        every = torch.full_like(rows[0, 0], -1)
        refused = []
        for b, (spec, drafts) in enumerate(cases):
            walk = request(spec, drafts)  # a second matcher, walked as plain decoding would
            read = True
            for j in range(K + 1):
                g = walk.grammar
                filled = read and j <= len(drafts) and g is not None and g.started and not g.matcher.is_terminated()
                expected = plain.fill([walk])[0] if filled else every
                assert torch.equal(rows[b, j], expected), (b, j)
                if j < len(drafts) and read and g is not None:
                    try:
                        g.accept(drafts[j])
                    except StructuredOutputError:  # refused: the row before (when read) masks it
                        assert not (filled and (int(expected[drafts[j] // 32]) >> (drafts[j] % 32)) & 1)
                        read = False
            refused.append(not read)
        assert refused == [True, True, False, False, False]  # "x"; "c" after the stop token


def test_structured_outputs_speculate_and_give_plain_decoding(tokenizer, text_model, monkeypatch):
    """Greedy requests under a JSON schema (eos its stop), a regex without stop tokens (ends when complete), a
    choice, and a regex that starts after a token the free output emits, beside a free request; the Oracle's wrong
    drafts are mostly tokens the grammar refuses. Then a seeded sampled run twice."""
    import json

    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc(s) for s in ("Hello world", "The quick brown fox", "def fibonacci(n):", "東京は", "Ça va?")]
    free, _ = run(text_model, prompts, [{}] * len(prompts), slots=5, tokenizer=tokenizer)
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
              "required": ["kind", "age"]}
    kws = [dict(structured={"json": schema}, stop_token_ids=[tokenizer.eos_token_id], max_new_tokens=40),
           dict(structured={"regex": "[0-9]{3}-[a-z]{2,5}"}),
           dict(structured={"choice": ["yellow", "yes", "no"]}, stop_token_ids=[tokenizer.eos_token_id]),
           dict(structured={"regex": "(ab|c)+d", "starts_after": free[3].token_ids[2]}),
           {}]
    results, reference = speculated(text_model, prompts, kws, monkeypatch, slots=5, tokenizer=tokenizer)
    assert_same(results, reference)
    assert json.loads(tokenizer.decode(reference[0].token_ids[:-1]))["kind"] in ("cat", "dog")
    assert reference[1].finish_reason == "stop" and reference[3].finish_reason == "stop"
    assert reference[3].token_ids[:3] == free[3].token_ids[:3]  # free until its starts_after token
    sampled = [dict(kw, temperature=1.0, seed=7 + i) for i, kw in enumerate(kws)]
    spec = {"method": "ngram", "num_tokens": 3}
    once, _ = run(text_model, prompts, sampled, spec, slots=5, tokenizer=tokenizer)
    twice, _ = run(text_model, prompts, sampled, spec, slots=5, tokenizer=tokenizer)
    assert [r.token_ids for r in once] == [r.token_ids for r in twice]
    assert json.loads(tokenizer.decode(once[0].token_ids[:-1]))["kind"] in ("cat", "dog")


@pytest.mark.gpu
def test_cuda_speculation_with_processors_gives_plain_decoding(tokenizer, monkeypatch):
    """On CUDA, fp32, eager: penalties with logprobs, min_tokens, a JSON schema (the verify mask's pinned buffer
    and its copy behind the step) and a repetition penalty, together, equal to plain decoding. Logprobs within
    1e-2: as on the CPU, the verify's chunk sums in another order than a one-token step, and Triton's fp32 dots
    may round their inputs to TF32 (2^-11 relative), a few 1e-3 on logits of ~10."""
    model = unit_gain(HybridModel.from_preset(tiny_config(vocab_size=len(tokenizer) + 7), seed=0), seed=3).cuda()
    prompts = [tokenizer.encode(s, add_special_tokens=False) for s in ("Hello world", "東京は", "Ça va?", "def f")]
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}
    kws = [dict(frequency_penalty=-1.0, logprobs=2), dict(min_tokens=5, stop_token_ids=list(range(0, 400, 2))),
           dict(structured={"json": schema}, stop_token_ids=[tokenizer.eos_token_id], max_new_tokens=30),
           dict(repetition_penalty=1.5, presence_penalty=0.5, logit_bias={5: 2.0})]
    results, reference = speculated(model, prompts, kws, monkeypatch, tokenizer=tokenizer)
    assert_same(results, reference, tol=1e-2)


def test_stop_strings_and_complete_grammars_inside_accepted_runs_keep_nothing_past_them(tokenizer, text_model,
                                                                                        monkeypatch):
    """With prefix caching the slot of a request that ends is kept for later prompts. Requests ending at a stop
    string, a stop token id (the stop string's text kept, or cut) or a grammar whose output is complete (no end
    tokens) at a draft their verify step kept, with more drafts kept after it (drafted from their free
    continuation), kept those drafts in the prefix: the next turn (prompt, output, more) restored a few tokens
    instead of the whole previous turn. Now the slot keeps the drafts through the stopping one alone
    (speculative/stops.py): the tokens are plain decoding's, and the next turn restores all but at most the last
    output token (plain decoding, overlapped, feeds the stopping token in the step after it)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc(s) for s in ("Hello world", "The quick brown fox", "def fibonacci(n):", "東京は", "Ça va?")]

    def run(kws, spec=None):
        with Engine(text_model, 5, compile=False, tokenizer=tokenizer, prefix_cache=True, block_size=16,
                    speculative=spec) as e:
            results = [h.result() for h in [e.submit(p, **{"max_new_tokens": 16, "stop_token_ids": [], **kw})
                                            for p, kw in zip(prompts, kws)]]
            turns = [p + r.token_ids + enc(" more") for p, r in zip(prompts, results)]
            return results, e.generate(turns, max_new_tokens=3, stop_token_ids=[])

    free, _ = run([dict(max_new_tokens=24)] * 5)
    text = [tokenizer.decode(r.token_ids) for r in free]
    kws = [dict(stop=[text[0][6:9]]), dict(stop=[text[1][8:10]], include_stop_str_in_output=True),
           dict(structured={"regex": "[a-z]{3,6}-[0-9]"}), dict(stop_token_ids=[free[3].token_ids[5]]),
           dict(stop=[text[4][4:7]])]
    reference, plain_turns = run(kws)
    assert all(r.finish_reason == "stop" and len(r.token_ids) > 2 for r in reference), reference
    # drafts: each request's free continuation (the grammar's output, then what follows it unmasked)
    grammar_turn = prompts[2] + reference[2].token_ids
    with Engine(text_model, 1, compile=False) as e:
        beyond = e.generate([grammar_turn], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    drafts = [r.token_ids for r in free]
    drafts[2] = reference[2].token_ids + beyond
    for k in (2, 4):
        monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, drafts, text_model.config.vocab_size))
        results, turns = run(kws, {"method": "ngram", "num_tokens": k})
        assert [(r.token_ids, r.text) for r in results] == [(r.token_ids, r.text) for r in reference]
        assert [t.token_ids for t in turns] == [t.token_ids for t in plain_turns]
        for i, (p, r, t) in enumerate(zip(prompts, results, turns)):
            assert len(p) + len(r.token_ids) - 1 <= t.cached_tokens <= len(p) + len(r.token_ids), (k, i, t.cached_tokens)


def test_a_decode_failing_in_the_stop_check_fails_its_request_alone(tokenizer, text_model, monkeypatch):
    """With prefix caching a verify step replays its requests' stop checks over their kept drafts before it commits
    (speculative/stops.py). A tokenizer whose decode raises on a token (a stop string's check decodes the text)
    raised there, inside the step: every request of the step failed. Now that check cuts nothing, and the delivery,
    meeting the same error, fails that request alone; the other gives plain decoding's tokens."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc("Hello world"), enc("The quick brown fox")]
    kw = dict(max_new_tokens=12, stop_token_ids=[], stop=["zzz"])
    with Engine(text_model, 2, compile=False, tokenizer=tokenizer) as e:
        reference = [e.submit(p, **kw).result().token_ids for p in prompts]
    bad = next(t for t in reference[0][3:] if t not in reference[1] + prompts[0] + prompts[1])
    decode = tokenizer.decode

    def failing(ids, *args, **kwargs):
        if bad in list(ids):
            raise RuntimeError("decode failed")
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, text_model.config.vocab_size))
    monkeypatch.setattr(tokenizer, "decode", failing)
    with Engine(text_model, 2, compile=False, tokenizer=tokenizer, prefix_cache=True,
                speculative={"method": "ngram", "num_tokens": 4}) as e:
        first, second = (e.submit(p, **kw) for p in prompts)
        with pytest.raises(RuntimeError, match="decode failed"):
            first.result()
        assert second.result().token_ids == reference[1]
        assert e.submit(prompts[1], **kw).result().token_ids == reference[1]
        assert e.stats().running == e.stats().used_blocks == 0


def test_min_tokens_beside_a_grammar_holds_the_stop_per_verify_position(tokenizer, text_model, monkeypatch):
    """min_tokens beside structured output (4f9d5cf): the stop tokens are held back only in rows whose grammar
    mask leaves something else. A verify step applies the rule at each position j with the drafts before it
    counted (process_logits over TokenMasks.fill_drafts' rows): eos, pulled up by a logit bias, is drafted at
    positions where min_tokens still holds it (it must be refused there) beside the reference's own tokens; a
    choice whose word ends below min_tokens keeps its eos (the grammar wins); a JSON schema and a request without a
    grammar beside them. The tokens are plain decoding's (counting a position's drafts wrongly fails the test)."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.eos_token_id
    prompts = [enc(s) for s in ("Hello world", "The quick brown fox", "def fibonacci(n):", "東京は")]
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}
    kws = [dict(structured={"regex": "[a-z]{1,40}"}, min_tokens=6), dict(structured={"choice": ["yes", "no"]}, min_tokens=8),
           dict(structured={"json": schema}, min_tokens=10), dict(min_tokens=5)]
    kws = [dict(kw, logit_bias={eos: 8.0}, stop_token_ids=[eos], max_new_tokens=24) for kw in kws]
    unheld, _ = run(text_model, prompts, [dict(kw, min_tokens=0) for kw in kws], tokenizer=tokenizer)
    reference, _ = run(text_model, prompts, kws, tokenizer=tokenizer)
    assert all(len(unheld[i].token_ids) < len(reference[i].token_ids) for i in (0, 3))  # (eos held, then drawn)
    assert reference[1].text == "yes" and len(reference[1].token_ids) < 8 and reference[3].finish_reason == "stop"
    drafted = []
    for r, kw in zip(reference, kws):  # the reference's tokens, eos at every other position min_tokens holds
        seq = list(r.token_ids)
        drafted.append([eos if j % 2 and j < min(kw["min_tokens"] - 1, len(seq) - 1) else t for j, t in enumerate(seq)])

    def drafts(tokens, k, *lookup):
        tokens = list(tokens)
        p, seq = next((p, s) for p, s in zip(prompts, drafted) if tokens[:len(p)] == p)
        return seq[len(tokens) - len(p):len(tokens) - len(p) + k]

    monkeypatch.setattr(verify, "ngram_propose", drafts)
    for k in (2, 5):
        results, stats = run(text_model, prompts, kws, {"method": "ngram", "num_tokens": k}, tokenizer=tokenizer)
        assert_same(results, reference)
        assert 0 < stats["accepted"] < stats["proposed"]
