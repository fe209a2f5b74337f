"""On a GPU: the speculative step's tail captured into CUDA graphs (capture/speculative.py: acceptance, the
accepted-state copy, the MTP head's catch-up and drafts, per verify bucket) against the eager speculative engine,
fp32: greedy tokens equal to plain decoding's, the same drafts and seeded sampled tokens as the eager tail, every
entry captured; and each acceptance graph's replay equal to its function run eagerly on the same buffers."""

import pytest
import torch

from helpers import moe_config, random_tokens, tiny_config, unit_gain
from speculative_reference import Oracle, bigram_model, with_random_mtp
from metrale_graph import Engine, HybridModel, envs
from metrale_graph.sampling import SamplingParams
from metrale_graph.speculative import draw_uniforms, verify
from metrale_graph.speculative.drafting import MtpDrafter
from metrale_graph.speculative.tail import accept_greedy, accept_sampled, host_rows

pytestmark = pytest.mark.gpu

CONFIGS = {
    "dense": tiny_config(mtp_num_hidden_layers=1),
    "moe": moe_config(mtp_num_hidden_layers=1, tie_word_embeddings=True),
    "next": moe_config("qwen3_next", mtp_num_hidden_layers=1),
}
GRID = dict(token_budget=128, batch_sizes=[2, 4], token_counts=[16, 128])


def cuda_model(family):
    return with_random_mtp(unit_gain(HybridModel.from_preset(CONFIGS[family], seed=1), seed=2), seed=3).to("cuda")


def prompts_of(family):
    return [random_tokens(n, s, CONFIGS[family].vocab_size) for n, s in ((7, 1), (23, 2), (3, 3), (41, 4), (12, 5))]


def run(model, prompts, compile, speculative=None, **kw):
    with Engine(model, 3, compile=compile, speculative=speculative, **GRID) as e:
        out = [r.token_ids for r in e.generate(prompts, max_new_tokens=14, stop_token_ids=[], **kw)]
        graphs = e._loop.spec.graphs if speculative is not None else None
        if graphs is not None:  # every entry the steps used was captured
            assert graphs.entries and all(g.graph is not None for g in list(graphs.entries.values())
                                          + list(graphs.copies.values()))
        return out, graphs


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("after", ["0", "1"])
def test_captured_tails_give_the_eager_tokens_and_drafts(family, after, monkeypatch):
    """n-gram and MTP drafts through the captured tails (MTP with its drafting after the read back, and behind the
    acceptance: METRALE_MTP_AFTER) against the eager engine: the same tokens, drafts and seeded draws."""
    with envs.override(**{"METRALE_MTP_AFTER": after, "METRALE_VERIFY_AHEAD": "0"}):
        _captured_tails_give_the_eager_tokens_and_drafts(family, monkeypatch)


def _captured_tails_give_the_eager_tokens_and_drafts(family, monkeypatch):
    model, prompts = cuda_model(family), prompts_of(family)
    reference, _ = run(model, prompts, False)
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, CONFIGS[family].vocab_size))
    seen = []  # every drafting's {slot: drafts}, from the host's inputs (draft) or behind the acceptance (take_after)
    for name in ("draft", "take_after"):
        method = getattr(MtpDrafter, name)
        monkeypatch.setattr(MtpDrafter, name, lambda self, *a, _m=method, **kw: seen.append(_m(self, *a, **kw)) or seen[-1])
    sampled = dict(temperature=0.8, top_k=20, seed=5)
    for spec in ({"method": "ngram", "num_tokens": 3}, {"method": "mtp", "num_tokens": 2}):
        runs = []
        for compile in (False, True):
            seen.clear()
            greedy, graphs = run(model, prompts, compile, spec)
            runs.append((greedy, list(seen), run(model, prompts, compile, spec, **sampled)[0]))
        assert runs[0][0] == runs[1][0] == reference, spec
        assert runs[0][1] == runs[1][1], spec  # the captured head's drafts are the eager head's
        assert runs[0][2] == runs[1][2], spec  # seeded sampling: the same draws
        # (ngram's partial runs: their states kept inside the acceptance graphs, tail.keep_accepted_states; a
        # step outside the buckets takes the eager acceptance and copy_states' graph: both give these tokens)


def test_acceptance_replays_equal_their_functions():
    """Random hidden states in each bucket's verify output buffer and random rows (greedy, sampled, with and
    without drafts): graphs.accept's replay gives accept_greedy / accept_sampled's tokens on the same inputs."""
    model, K = cuda_model("dense"), 3
    V = model.config.vocab_size
    with Engine(model, 3, compile=True, speculative={"method": "mtp", "num_tokens": K}, **GRID) as e:
        e.warmup()
        runner, graphs = e.runner, e._loop.spec.graphs
        with torch.no_grad():
            for bucket in runner.grid:
                out = graphs.hidden_source(bucket)  # with graphs: the verify graph's output buffer
                g = torch.Generator().manual_seed(bucket.tokens + bucket.streams)
                out.copy_(torch.randn(out.shape, generator=g) * 3)
                r = min(bucket.streams, 3)
                params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=30), SamplingParams(top_p=0.8,
                                                                                                      temperature=1.1)][:r]
                n = [K, 2, 0][:r]
                starts = torch.randint(0, out.shape[0] - K, (r,), generator=g).tolist()
                positions = [[s + min(t, m) for t in range(K + 1)] for s, m in zip(starts, n)]
                drafts = [torch.randint(0, V, (m,), generator=g).tolist() for m in n]
                gens = [None if p.greedy else torch.Generator().manual_seed(i) for i, p in enumerate(params)]
                ints, floats = host_rows(positions, drafts, params, draw_uniforms(gens, n, K).values, K, V)
                for rows in ([0], list(range(r))):  # greedy alone (its own graph), then all
                    got = graphs.accept(bucket, out, ints[rows], floats[rows]).clone()
                    if len(rows) == 1:
                        want = accept_greedy(model, out, ints[rows].cuda(), K)
                    else:
                        want = accept_sampled(model, out, ints[rows].cuda(), floats[rows].cuda(), K)
                    assert torch.equal(got, want), (bucket, rows)


def test_captured_bigram_drafts_are_all_kept():
    model = bigram_model(CONFIGS["dense"]).to("cuda")
    with Engine(model, 2, compile=False) as e:
        reference = e.generate([[3, 5, 7]], max_new_tokens=41, stop_token_ids=[])[0].token_ids
    with Engine(model, 2, compile=True, speculative={"method": "mtp", "num_tokens": 3}, **GRID) as e:
        out = e.generate([[3, 5, 7]], max_new_tokens=41, stop_token_ids=[])[0].token_ids
        s = e.stats().speculative
        assert any(kind == "drafts" and g.graph is not None for (kind, _), g in e._loop.spec.graphs.entries.items())
    assert out == reference and s["accepted"] == s["proposed"] == 30  # 10 verify steps of 3


@pytest.mark.parametrize("stop", [None, 2, 3])
def test_captured_next_turn_of_a_conversation_gets_mtp_drafts(stop):
    """With prefix caching the head catches up on the positions a request's last step kept before its prefix is
    kept (drafting.catch_up_ending through the drafting's graph, or behind the captured acceptance): the second turn
    of a conversation (prompt + reply + more) restores the first whole and keeps every bigram draft, with plain
    decoding's tokens. stop: the first turn ends at max_new_tokens (None) or at a stop token its last step kept as a
    draft (2) or added after its drafts (3), the next turn going on with the token the model gives after it."""
    model, first = bigram_model(CONFIGS["dense"]).to("cuda"), random_tokens(70, 9, CONFIGS["dense"].vocab_size)
    with Engine(model, 2, compile=False) as e:
        seq = e.generate([first], max_new_tokens=14, stop_token_ids=[])[0].token_ids
    kw = dict(max_new_tokens=14, stop_token_ids=[] if stop is None else [seq[stop]])
    more = [3, 4, 5] if stop is None else [seq[stop + 1], 4, 5]
    assert stop is None or seq[stop] not in seq[:stop]
    got = {}
    for name, options in (("plain", dict(compile=False)), ("without", dict(compile=True, **GRID)),
                          ("hit", dict(compile=True, prefix_cache=True, **GRID))):
        spec = {} if name == "plain" else dict(speculative={"method": "mtp", "num_tokens": 2})
        with Engine(model, 2, **options, **spec) as e:
            a = e.generate([first], **kw)[0]
            before = e.stats().speculative or {}
            b = e.generate([first + a.token_ids + more], **kw)[0]
            after = e.stats().speculative or {}
        got[name] = (a.token_ids, b.token_ids, b.cached_tokens, after.get("proposed", 0) - before.get("proposed", 0),
                     after.get("accepted", 0) - before.get("accepted", 0))
    assert got["hit"][:2] == got["without"][:2] == got["plain"][:2]
    first_reply, _, cached, proposed, accepted = got["hit"]
    assert cached == len(first) + len(first_reply) - (0 if stop == 2 else 1)  # the whole first turn restored
    assert proposed > 0 and accepted == proposed == got["without"][3]


@pytest.mark.parametrize("family", ["dense", "next"])
def test_verify_ahead_gives_the_synchronous_tokens_and_drafts(family, monkeypatch):
    """METRALE_VERIFY_AHEAD (speculative/ahead.py): MTP verify steps launched, captured, before the step before them
    is read back: plain decoding's tokens and the drafts and seeded sampled tokens of the synchronous captured path
    (METRALE_MTP_AFTER); and the bigram checkpoint, every draft kept, chains k + 1 tokens a step."""
    model, prompts = cuda_model(family), prompts_of(family)[:3]
    reference, _ = run(model, prompts, False)
    seen = []  # every drafting's {slot: drafts}: from the host's inputs (draft) or behind the acceptance (take_after)
    for name in ("draft", "take_after"):
        method = getattr(MtpDrafter, name)
        monkeypatch.setattr(MtpDrafter, name, lambda self, *a, _m=method, **kw: seen.append(_m(self, *a, **kw)) or seen[-1])
    runs = {}
    for setting in ("METRALE_MTP_AFTER", "METRALE_VERIFY_AHEAD"):
        seen.clear()
        with envs.override(**{"METRALE_VERIFY_AHEAD": "0", setting: "1"}), \
                Engine(model, 3, compile=True, speculative={"method": "mtp", "num_tokens": 2}, **GRID) as e:
            out = [r.token_ids for r in e.generate(prompts, max_new_tokens=14, stop_token_ids=[])]
            sampled = [r.token_ids for r in e.generate(prompts, max_new_tokens=14, stop_token_ids=[], temperature=0.8,
                                                       top_k=20, seed=5)]
            runs[setting] = (out, list(seen), e.stats().speculative, sampled)
            if setting == "METRALE_VERIFY_AHEAD":
                assert e._loop.spec.ahead.chained > 0
    assert runs["METRALE_MTP_AFTER"] == runs["METRALE_VERIFY_AHEAD"] and runs["METRALE_VERIFY_AHEAD"][0] == reference
    bigram = bigram_model(CONFIGS["dense"]).to("cuda")
    with Engine(bigram, 2, compile=False) as e:
        reference = e.generate([[3, 5, 7]], max_new_tokens=41, stop_token_ids=[])[0].token_ids
    with envs.override(**{"METRALE_VERIFY_AHEAD": "1"}), \
            Engine(bigram, 2, compile=True, speculative={"method": "mtp", "num_tokens": 3}, **GRID) as e:
        assert e.generate([[3, 5, 7]], max_new_tokens=41, stop_token_ids=[])[0].token_ids == reference
        s = e.stats().speculative
        assert s["accepted"] == s["proposed"] == 30 and e._loop.spec.ahead.chained > 0
