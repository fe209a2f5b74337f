"""Acceptance of drafts (issue 39, item 4), on batched tensors: greedy rows keep exactly the drafts greedy decoding
would emit and add its next token, beside sampled rows in the same batch; speculative sampling's output follows
the target's distribution (the sampler's, with temperature, top-k and top-p), checked statistically on a small
vocabulary, for drawn drafts with their q and for one-hot (n-gram) drafts; what a wrongly stated q does, which the
same check catches; the engine's coupled acceptance of one-hot drafts (accept_drawn: each position's token drawn
as a plain step draws it) by the same check and token for token against plain sampling with the same seed, its
generators settled just past the uniforms used; seeded determinism and each row's independence of the others;
bad shapes named.

The statistical check. Speculative generation of the first two tokens after a start token, where the "target
model" is a Markov chain over V = 6 tokens (the next token's logits a function of the current token, processed as
the sampler processes them) and the drafter another chain; N streams at once. The empirical joint of the two
tokens is compared with the exact one (over its m nonzero outcomes; any outcome outside them is a failure by
itself: top-k / top-p kept exactly). Total variation bound: E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) <=
1/2 sqrt((m - 1) / N) (Cauchy-Schwarz), and one stream moves the empirical TV by at most 1/N, so by McDiarmid
P(TV > E[TV] + t) <= exp(-2 N t^2); with t = sqrt(ln(1e9) / (2 N)) a correct sampler fails once in 1e9 seeds.
N = 40000, m <= 16: bound <= 0.0258.
"""

import math

import pytest
import torch

from metrale_graph.sampling import SampleRow, SamplingParams, new_generator, probabilities, sample
from metrale_graph.speculative import (EMPTY, accept_drawn, draw_positions, draw_uniforms, rejection_sample,
                                       target_probabilities)

V, K = 6, 3
TARGET = SamplingParams(temperature=0.9, top_k=4, top_p=0.9)
N = 40000


def tv_bound(m: int, n: int = N) -> float:
    return 0.5 * math.sqrt((m - 1) / n) + math.sqrt(math.log(1e9) / (2 * n))


def greedy_reference(logits, drafts, n):
    """One greedy row: the drafts equal to the running argmax, then the argmax after them."""
    out = []
    for j in range(n):
        if drafts[j] != int(logits[j].argmax()):
            break
        out.append(drafts[j])
    return out + [int(logits[len(out)].argmax())]


def test_greedy_rows_emit_the_argmax_chain_beside_sampled_rows():
    g = torch.Generator().manual_seed(0)
    B = 64
    logits = torch.randn(B, K + 1, V, generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.randint(0, V, (B, K), generator=g)
    agree = torch.rand(B, K, generator=g) < 0.7  # most drafts right, so long runs occur
    drafts = torch.where(agree, argmax[:, :K], drafts)
    num = torch.randint(0, K + 1, (B,), generator=g)
    params = [SamplingParams() if b % 3 else SamplingParams(temperature=1.0) for b in range(B)]
    greedy = torch.tensor([p.greedy for p in params])
    result = rejection_sample(target_probabilities(logits, params), drafts, num, greedy,
                              torch.rand(B, K + 1, generator=g), torch.softmax(torch.randn(B, K, V, generator=g), -1))
    for b in range(B):
        n, count = int(num[b]), int(result.counts[b])
        row = result.tokens[b].tolist()
        assert row[count + 1:] == [EMPTY] * (K - count) and 0 <= count <= n
        if greedy[b]:
            assert row[:count + 1] == greedy_reference(logits[b], drafts[b].tolist(), n)
        else:
            assert row[:count] == drafts[b, :count].tolist()


def speculate(target_logits, draft_rows, q_given, seed, n=N, draft_probs=True, coupled=False):
    """The first two tokens of n streams from token 0 (module docstring): the target's next-token logits are
    target_logits[current], drafts are drawn from draft_rows[current] (one-hot rows: deterministic drafts), and
    rejection_sample is told q_given[current] (draft_probs=False: None, one-hot drafts); coupled: the engine's
    draw_positions + accept_drawn instead. Returns [n, 2]."""
    g = torch.Generator().manual_seed(seed)
    last = torch.zeros(n, dtype=torch.int64)
    out, have = torch.full((n, 2), -1), torch.zeros(n, dtype=torch.int64)
    while (have < 2).any():
        rows = (have < 2).nonzero().flatten()
        m = rows.shape[0]
        cur, drafts = last[rows], []
        for _ in range(K):
            cur = torch.multinomial(draft_rows[cur], 1, generator=g).flatten()
            drafts.append(cur)
        drafts = torch.stack(drafts, 1)
        context = torch.cat([last[rows, None], drafts], 1)  # the token each position's logits follow
        if coupled:
            drawn = draw_positions(target_logits[context].reshape(m * (K + 1), V), [TARGET] * m,
                                   torch.rand(m, K + 1, generator=g))
            result = accept_drawn(drawn, drafts, torch.full((m,), K))
        else:
            probs = target_probabilities(target_logits[context], [TARGET] * m)
            q = q_given[context[:, :K]] if draft_probs else None
            result = rejection_sample(probs, drafts, torch.full((m,), K), torch.zeros(m, dtype=torch.bool),
                                      torch.rand(m, K + 1, generator=g), q)
        for j in range(K + 1):
            take = (j <= result.counts) & (have[rows] < 2)
            out[rows[take], have[rows[take]]] = result.tokens[take, j]
            have[rows[take]] += 1
        last[rows] = result.tokens.gather(1, result.counts[:, None]).flatten()
    return out


def joint_tv(samples, target_logits):
    """(TV between the samples' joint of their two tokens and the exact one, the exact one's nonzero outcomes,
    the samples' mass outside them)."""
    p = probabilities(target_logits, [TARGET] * V).double()  # row t: the next token's distribution after t
    exact = p[0][:, None] * p  # [x1, x2]
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((samples[:, 0], samples[:, 1]), torch.ones(samples.shape[0], dtype=torch.float64),
                      accumulate=True)
    empirical = counts / samples.shape[0]
    return 0.5 * float((empirical - exact).abs().sum()), int((exact > 0).sum()), float(empirical[exact == 0].sum())


@pytest.fixture(scope="module")
def chains():
    g = torch.Generator().manual_seed(3)
    target_logits = 2.0 * torch.randn(V, V, generator=g)
    draft = torch.softmax(2.0 * torch.randn(V, V, generator=g), -1)
    return target_logits, draft


def test_speculative_sampling_follows_the_target_distribution(chains):
    target_logits, draft = chains
    tv, m, outside = joint_tv(speculate(target_logits, draft, draft, seed=1), target_logits)
    assert outside == 0.0  # top-k / top-p
    assert m <= 16 and tv <= tv_bound(m), (tv, tv_bound(m))


def test_one_hot_drafts_follow_the_target_distribution(chains):
    """Deterministic drafts (n-gram lookups, greedy MTP drafts): draft_probs None, q one-hot."""
    target_logits, _ = chains
    successor = torch.zeros(V, V)
    successor[torch.arange(V), (torch.arange(V) * 5 + 1) % V] = 1.0  # a fixed next token per token
    tv, m, outside = joint_tv(speculate(target_logits, successor, None, seed=2, draft_probs=False), target_logits)
    assert outside == 0.0 and tv <= tv_bound(m), (tv, tv_bound(m))


@pytest.mark.parametrize("drafter", ["one-hot", "drawn"])
def test_coupled_acceptance_follows_the_target_distribution(chains, drafter):
    """The engine's acceptance (draw_positions + accept_drawn), drafts proposed by a fixed successor or drawn from
    the draft chain: the same bound."""
    target_logits, draft = chains
    successor = torch.zeros(V, V)
    successor[torch.arange(V), (torch.arange(V) * 5 + 1) % V] = 1.0
    rows = successor if drafter == "one-hot" else draft
    tv, m, outside = joint_tv(speculate(target_logits, rows, None, seed=4, coupled=True), target_logits)
    assert outside == 0.0 and tv <= tv_bound(m), (tv, tv_bound(m))


def test_the_check_catches_a_sampler_told_the_wrong_q(chains):
    """Drafts drawn from one distribution, rejection_sample told another (uniform): the output leaves the target's
    distribution by several times the bound, so the checks above can fail."""
    target_logits, draft = chains
    tv, m, _ = joint_tv(speculate(target_logits, draft, torch.full((V, V), 1 / V), seed=1), target_logits)
    assert tv > 3 * tv_bound(m), (tv, tv_bound(m))


def test_seeded_rows_are_deterministic_and_independent_of_their_batch():
    g = torch.Generator().manual_seed(5)
    B = 6
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    num = torch.tensor([3, 2, 0, 3, 1, 3])
    params = [SamplingParams(temperature=1.0, top_k=3)] * B
    params[1] = SamplingParams()  # a greedy row draws nothing from its (absent) generator

    def run(rows, seeds):
        gens = [None if params[b].greedy else new_generator(seeds[b]) for b in rows]
        u = draw_uniforms(gens, [int(num[b]) for b in rows], K)
        index = torch.tensor(rows)
        drawn = draw_positions(logits[index].reshape(-1, V), [params[b] for b in rows], u.values)
        return accept_drawn(drawn, drafts[index], num[index])

    seeds = [11, 12, 13, 14, 15, 16]
    a, b = run(range(B), seeds), run(range(B), seeds)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.counts, b.counts)
    alone = run([3], seeds)
    assert torch.equal(alone.tokens[0], a.tokens[3])
    others = [run(range(B), [s + 100 * i for s in seeds]).tokens for i in range(1, 6)]
    assert any(not torch.equal(o, a.tokens) for o in others)  # the seed matters
    u = draw_uniforms([new_generator(7), None], [2, 3], K).values
    assert u[1].eq(0).all() and u[0, 3] == 0 and (u[0, :3] > 0).all()


def test_a_seeded_row_emits_plain_sampling_tokens_whatever_was_drafted():
    """A seeded request that speculates emits, position by position, the tokens plain sampling (sampling.sample,
    one uniform a token) draws with the same seed: drafts kept only where they equal those draws, and after each
    verify its generator settles just past the uniforms the emitted tokens used. A Markov chain target over V
    tokens (logits a function of the last token, with penalties off), drafts from a fixed random proposer."""
    g = torch.Generator().manual_seed(9)
    chain = 1.5 * torch.randn(V, V, generator=g)
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=5)
    new = 40

    def plain(seed):
        gen, out, last = new_generator(seed), [], 0
        for _ in range(new):
            row = SampleRow(params, gen, 0, len(out), [0], ())
            last = int(sample(chain[last][None], [row]).tokens[0])
            out.append(last)
        return out

    def speculative(seed, proposer_seed):
        gen, out, proposer = new_generator(seed), [], torch.Generator().manual_seed(proposer_seed)
        kept = 0
        while len(out) < new:
            n = int(torch.randint(0, K + 1, (1,), generator=proposer))
            drafts = torch.randint(0, V, (1, K), generator=proposer)
            u = draw_uniforms([gen], [n], K)
            context = torch.tensor(([out[-1]] if out else [0]) + drafts[0].tolist())
            result = accept_drawn(draw_positions(chain[context], [params], u.values), drafts, torch.tensor([n]))
            count = int(result.counts[0])
            u.settle([count])
            kept += count
            out += result.tokens[0, :count + 1].tolist()
        return out[:new], kept

    total = 0
    for seed in (1, 2, 3):
        want = plain(seed)
        for proposer_seed in (5, 6):
            got, kept = speculative(seed, proposer_seed)
            assert got == want, (seed, proposer_seed)
            total += kept
    assert total > 0  # some random drafts matched and were kept
    # drafts that are the plain continuation itself are all kept, and the tokens stay plain sampling's
    want = plain(4)
    gen, out = new_generator(4), []
    while len(out) < new:
        d = (want[len(out):] + [0] * K)[:K]
        n = min(K, new - len(out) - 1)
        u = draw_uniforms([gen], [n], K)
        context = torch.tensor(([out[-1]] if out else [0]) + d)
        result = accept_drawn(draw_positions(chain[context], [params], u.values), torch.tensor([d]), torch.tensor([n]))
        assert int(result.counts[0]) == n
        u.settle(result.counts.tolist())
        out += result.tokens[0, :n + 1].tolist()
    assert out == want


def test_bad_shapes_are_named():
    probs = torch.full((2, K + 1, V), 1 / V)
    drafts, num = torch.zeros(2, K, dtype=torch.int64), torch.full((2,), K)
    greedy, u = torch.zeros(2, dtype=torch.bool), torch.rand(2, K + 1)
    with pytest.raises(ValueError, match=r"draft_tokens \(2, 2\).*expected \[2, 3\]"):
        rejection_sample(probs, drafts[:, :2], num, greedy, u)
    with pytest.raises(ValueError, match=r"draft_probs \(2, 3, 5\), expected \(2, 3, 6\)"):
        rejection_sample(probs, drafts, num, greedy, u, torch.ones(2, K, V - 1))
    with pytest.raises(ValueError, match="3 sampling parameters for 2 rows"):
        target_probabilities(probs, [SamplingParams()] * 3)
    with pytest.raises(ValueError, match=r"accept_drawn: draft_tokens \(2, 2\)"):
        accept_drawn(torch.zeros(2, K + 1, dtype=torch.int64), drafts[:, :2], num)
    with pytest.raises(ValueError, match="row 0 has 4 drafts, outside 0 .. 3"):
        draw_uniforms([None], [4], K)
    with pytest.raises(ValueError, match="7 rows of logits and 2 sampling parameters for 2 rows of 4 positions"):
        draw_positions(torch.zeros(7, V), [SamplingParams()] * 2, torch.zeros(2, K + 1))
