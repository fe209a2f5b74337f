"""The speculative step's tail on static buffers (speculative/tail.py, capture/speculative.py): its functions give
the eager path's tokens (acceptance.draw_positions + accept_drawn for rows with drafts, sampling.sample for rows
without), and an engine whose speculative steps take it (`tail_engine`: the buffers, their padding and the
host layouts of SpeculativeGraphs with the functions uncompiled, behind a stand-in for the runner's hidden-states
buckets) gives plain decoding's greedy tokens and the eager speculative engine's drafts and seeded sampled tokens.
One case compiles (torch.compile, fullgraph); graphs only on a GPU (test_gpu_speculative_graphs.py). fp32, CPU."""

from __future__ import annotations


import pytest
import torch

from helpers import moe_config, random_tokens, tiny_config, unit_gain
from speculative_reference import Oracle, bigram_model, with_eager_tail, with_random_mtp
from metrale_graph import Engine, HybridModel, Stream, envs
from metrale_graph.capture import make_grid
from metrale_graph.sampling import SampleRow, SamplingParams, new_generator, sample
from metrale_graph.speculative import accept_drawn, draw_positions, draw_uniforms, verify
from metrale_graph.speculative.drafting import MtpDrafter
from metrale_graph.speculative.tail import accept_greedy, accept_sampled, host_rows

CONFIGS = {
    "dense": tiny_config(mtp_num_hidden_layers=1),
    "moe": moe_config(mtp_num_hidden_layers=1, tie_word_embeddings=True),
    "next": moe_config("qwen3_next", mtp_num_hidden_layers=1),
}
PROMPTS = [(7, 1), (23, 2), (3, 3), (41, 4), (12, 5)]  # (length, seed)
GRID = dict(batch_sizes=[2, 4], token_counts=[16, 128])  # (128: every step of PROMPTS fits a bucket)


@pytest.fixture(scope="module")
def models():
    return {name: with_random_mtp(unit_gain(HybridModel.from_preset(cfg, seed=1), seed=2), seed=3)
            for name, cfg in CONFIGS.items()}


def prompts_of(family):
    return [random_tokens(n, s, CONFIGS[family].vocab_size) for n, s in PROMPTS]


def tail_engine(model, slots, speculative, calls=None, **kw):
    """An eager Engine whose speculative steps take SpeculativeGraphs' path (its functions uncompiled) in the
    buckets of GRID; `calls` counts them ("accept", "draft")."""
    e = with_eager_tail(Engine(model, slots, compile=False, speculative=speculative, **kw),
                        make_grid(GRID["batch_sizes"], GRID["token_counts"]))
    graphs = e._loop.spec.graphs
    if calls is not None:
        for name in ("accept", "draft", "draft_after"):
            method = getattr(graphs, name)
            setattr(graphs, name, lambda *a, _m=method, _n=name: calls.append(_n) or _m(*a))
    return e


def eager_tails(monkeypatch) -> list:
    """The eager tails' calls (SpeculativeStep._accept_eager, MtpDrafter._eager), by name."""
    seen = []
    for cls, name in ((verify.SpeculativeStep, "_accept_eager"), (MtpDrafter, "_eager")):
        method = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _m=method, _n=name: seen.append(_n) or _m(*a))
    return seen


def recorded_drafts(monkeypatch) -> list:
    """Every MtpDrafter.draft result and every take_after's (the drafting behind a captured acceptance), in order."""
    seen = []
    for name in ("draft", "take_after"):
        method = getattr(MtpDrafter, name)

        def recording(self, *a, _m=method, **kw):
            out = _m(self, *a, **kw)
            seen.append(out)
            return out

        monkeypatch.setattr(MtpDrafter, name, recording)
    return seen


def test_tail_functions_give_the_eager_tokens():
    """Rows of every kind over random hidden states, 24 draws: greedy and sampled rows with drafts (the argmax's,
    so that runs are kept, or random ones, so that rejections occur), sampled and greedy rows without drafts;
    top-k, top-p, min_p and temperatures. Each token equals the eager path's (the same per-row arithmetic on the
    CPU: exact)."""
    model = unit_gain(HybridModel.from_preset(tiny_config(), seed=1), seed=2)
    K, V, T = 3, model.config.vocab_size, 40
    greedy, plain_p = SamplingParams(), SamplingParams(temperature=1.2)
    params = [greedy, SamplingParams(temperature=0.9, top_k=20), SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05),
              plain_p, greedy, SamplingParams(temperature=1.0), greedy]
    num_drafts = [3, 3, 1, 0, 0, 2, 2]
    for draw in range(24):
        g = torch.Generator().manual_seed(draw)
        h = torch.randn(T, model.config.hidden_size, generator=g) * 3
        starts = torch.randint(0, T - K, (len(params),), generator=g).tolist()
        positions = [[s + min(t, n) for t in range(K + 1)] for s, n in zip(starts, num_drafts)]
        top = model.logits_of(h).argmax(dim=-1)
        drafts = []
        for b, (row, n) in enumerate(zip(positions, num_drafts)):
            d = [int(top[p]) for p in row[:n]]
            if b >= 5 or draw % 3 == 0:  # a wrong draft somewhere (or everywhere: random ids)
                at = draw % max(n, 1)
                d = [(t + 1 + draw) % V if (b == 5 or i == at) else t for i, t in enumerate(d)]
            drafts.append(d)
        seeds = [None if p.greedy else 100 * draw + b for b, p in enumerate(params)]
        gens = lambda: [None if s is None else new_generator(s) for s in seeds]  # noqa: E731
        ints, floats = host_rows(positions, drafts, params, draw_uniforms(gens(), num_drafts, K).values, K, V)
        got = accept_sampled(model, h, ints, floats, K)
        # eager: rows with drafts through draw_positions + accept_drawn, rows without through sampling.sample
        spec = [b for b, n in enumerate(num_drafts) if n]
        flat = torch.tensor([x for b in spec for x in positions[b]])
        padded = torch.tensor([drafts[b] + [0] * (K - len(drafts[b])) for b in spec])
        g_all = gens()
        u = draw_uniforms([g_all[b] for b in spec], [num_drafts[b] for b in spec], K)
        drawn = draw_positions(model.logits_of(h[flat]), [params[b] for b in spec], u.values)
        ref = accept_drawn(drawn, padded, torch.tensor([num_drafts[b] for b in spec]))
        assert got[spec, 0].tolist() == ref.counts.tolist(), draw
        assert got[spec, 1:].tolist() == ref.tokens.tolist(), draw
        for b in (b for b, n in enumerate(num_drafts) if not n):
            plain = sample(model.logits_of(h[positions[b][:1]]), [SampleRow(params[b], gens()[b])])
            assert got[b, 0] == 0 and got[b, 1].item() == plain.tokens.item() and (got[b, 2:] == -1).all()
        if draw % 3 == 0:  # the greedy rows alone, through the greedy variant
            rows = [b for b, p in enumerate(params) if p.greedy]
            alone = accept_greedy(model, h, ints[rows], K)
            assert alone.tolist() == got[rows].tolist()


@pytest.fixture
def mtp_after():
    """METRALE_MTP_AFTER on (opt-in): the MTP drafting behind the captured acceptance, alone (METRALE_VERIFY_AHEAD,
    on by default, off: test_speculative_ahead.py covers it)."""
    with envs.override(**{"METRALE_MTP_AFTER": "1", "METRALE_VERIFY_AHEAD": "0"}):
        yield


def test_mtp_drafting_after_the_read_back_when_the_setting_is_off(models, monkeypatch):
    """METRALE_MTP_AFTER=0 (the default) with METRALE_VERIFY_AHEAD=0 (on by default: it takes the drafting behind the
    acceptance): the captured MTP steps draft after the acceptance's read back (graphs.draft alone, no 'after'
    entry), with the same tokens and drafts as with it on."""
    model, prompts = models["dense"], prompts_of("dense")
    drafts = recorded_drafts(monkeypatch)
    runs = {}
    for after in ("1", "0"):
        drafts.clear()
        calls = []
        with envs.override(**{"METRALE_MTP_AFTER": after, "METRALE_VERIFY_AHEAD": "0"}), \
                tail_engine(model, 3, {"method": "mtp", "num_tokens": 2}, calls) as e:
            out = [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])]
            runs[after] = (out, [dict(d) for d in drafts], e.stats().speculative)
            kinds = {kind for kind, _ in e._loop.spec.graphs.entries}
        assert ("draft_after" in calls) == (after == "1") and ("after" in kinds) == (after == "1")
    assert runs["1"] == runs["0"]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_captured_path_gives_plain_decoding(models, family, monkeypatch, mtp_after):
    """n-gram (an oracle's drafts: partial runs, so the accepted-state copy) and MTP (a random head; k = 3 and
    max_new_tokens leave fewer drafts to the last steps: streams past their own drafts ride the draft steps on the
    scratch slot) through the tail's buffers, in buckets of 2 and 4 streams: plain decoding's tokens, the eager
    speculative engine's drafts, and no step's tail taken eagerly."""
    model, prompts = models[family], prompts_of(family)
    with Engine(model, 3, compile=False) as e:
        reference = [r.token_ids for r in e.generate(prompts, max_new_tokens=14, stop_token_ids=[])]
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, CONFIGS[family].vocab_size))
    drafts, eager = recorded_drafts(monkeypatch), eager_tails(monkeypatch)
    for option in ({"method": "ngram", "num_tokens": 3}, {"method": "mtp", "num_tokens": 3}):
        runs = {}
        for captured in (False, True):
            drafts.clear()
            eager.clear()
            calls = []
            make = tail_engine if captured else (lambda m, s, o, c: Engine(m, s, compile=False, speculative=o))
            with make(model, 3, option, calls) as e:
                out = [r.token_ids for r in e.generate(prompts, max_new_tokens=14, stop_token_ids=[])]
                runs[captured] = (out, e.stats().speculative, [dict(d) for d in drafts])
                tail = e._loop.spec.graphs
            assert out == reference, (option, captured)
        assert runs[True] == runs[False], option  # the same drafts, counts and tokens
        stats = runs[True][1]
        assert eager == [] and calls.count("accept") >= stats["steps"] > 0  # (steps without drafts take it too)
        assert (calls.count("draft") > 0) == (option["method"] == "mtp")
        # the MTP drafting behind the acceptance once every stream decodes (the steps with prompt chunks: after it)
        assert (calls.count("draft_after") > 0) == (option["method"] == "mtp")
        assert {kind for kind, _ in tail.entries} == ({"greedy", "drafts", "after"} if option["method"] == "mtp"
                                                      else {"greedy"})
        if option["method"] == "ngram":
            assert 0 < stats["accepted"] < stats["proposed"]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafting_after_one_stream_in_a_bucket_it_fills(models, k, mtp_after):
    """One stream verifying k drafts fills the k + 1 tokens of a 2-stream bucket (the default grid's (2, 2) for
    k = 1, (4, 2) for k = 3): the padding stream of the drafting behind the acceptance reads its catch-up row inside
    the bucket (its first row 0, as graphs.draft's padding; it was the real streams' end, out of range), and the
    tokens are plain decoding's."""
    model, prompt = models["dense"], prompts_of("dense")[0]
    with Engine(model, 1, compile=False) as e:
        reference = e.generate([prompt], max_new_tokens=12, stop_token_ids=[])[0].token_ids
    calls = []
    e = with_eager_tail(Engine(model, 1, compile=False, speculative={"method": "mtp", "num_tokens": k}),
                        make_grid([2], [k + 1, 16]))
    graphs = e._loop.spec.graphs
    method = graphs.draft_after
    graphs.draft_after = lambda *a: calls.append(1) or method(*a)
    with e:
        assert e.generate([prompt], max_new_tokens=12, stop_token_ids=[])[0].token_ids == reference
    assert calls


def test_mtp_drafting_after_reads_no_output_of_an_earlier_replay(models, mtp_after):
    """With graphs an entry's output is its graph's own buffer in the runner's shared pool, valid until the next
    replay (a graph captured earlier may use that memory for its intermediates: the acceptance entry of a sampled
    step, made after the bucket's 'after' entry, lies where the drafting behind it computes). Each replay here
    first overwrites the previous one's output, as such a pool may: the acceptance's counts and tokens read back
    after the drafting's replay are its copy in the drafting's own input buffer, and the tokens stay plain
    decoding's."""
    model, prompts = models["dense"], prompts_of("dense")[:3]
    with Engine(model, 3, compile=False) as e:
        reference = [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])]
    calls = []
    with tail_engine(model, 3, {"method": "mtp", "num_tokens": 2}, calls) as e:
        graphs, last = e._loop.spec.graphs, []
        real = graphs._run

        def replay(entry, h):
            for output in last:
                output.zero_()  # (its memory now another graph's)
            last[:] = [real(entry, h)]
            return last[0]

        graphs._run = replay
        assert [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])] == reference
    assert "draft_after" in calls


def test_plain_steps_after_captured_verify_steps_read_the_last_tokens_it_set(models, monkeypatch):
    """The acceptance sets each row's slot's last token on the device (tail.write_last_tokens) and the host copies
    none (verify._deliver): an oracle drafting on every other call only, so verify steps and the loop's plain
    decode steps (which read last_tokens on the device) alternate, gives plain decoding's tokens."""
    model, prompts = models["dense"], prompts_of("dense")[:3]
    with Engine(model, 3, compile=False) as e:
        reference = [r.token_ids for r in e.generate(prompts, max_new_tokens=14, stop_token_ids=[])]
    oracle = Oracle(prompts, reference, CONFIGS["dense"].vocab_size)

    def every_other(*args):
        drafts = oracle(*args)
        return drafts if oracle.calls % 2 else []

    monkeypatch.setattr(verify, "ngram_propose", every_other)
    copies = []
    real_to_device = verify.to_device
    monkeypatch.setattr(verify, "to_device", lambda *a: copies.append(1) or real_to_device(*a))
    with tail_engine(model, 3, {"method": "ngram", "num_tokens": 3}) as e:
        assert [r.token_ids for r in e.generate(prompts, max_new_tokens=14, stop_token_ids=[])] == reference
        stats = e.stats()
    assert 0 < stats.speculative["steps"] < stats.steps  # (verify steps and plain ones)
    assert copies == []  # (the captured path: no host copy of the slots' last tokens, nor of rows)


def test_captured_sampling_draws_the_eager_tokens(models, monkeypatch):
    """Seeded sampled requests (temperatures, top-k, top-p, min_p) beside greedy ones, random n-gram drafts (kept
    and rejected: residual draws) and MTP drafts: the captured tail's tokens are the eager speculative engine's,
    whose distribution tests/test_speculative_engine.py checks against plain sampling; so are they."""
    model, prompts = models["next"], prompts_of("next")

    def random_drafts(tokens, k, *lookup):
        g = torch.Generator().manual_seed(sum(int(t) * 31 ** i for i, t in enumerate(tokens)) % 2**31)
        return torch.randint(0, CONFIGS["next"].vocab_size, (k,), generator=g).tolist()

    monkeypatch.setattr(verify, "ngram_propose", random_drafts)
    samplers = [dict(temperature=0.8, top_k=20), dict(temperature=1.3, top_p=0.7), dict(), dict(temperature=0.6,
                                                                                              min_p=0.1)]
    for option in ({"method": "ngram", "num_tokens": 2}, {"method": "mtp", "num_tokens": 2}):
        runs = []
        for captured in (False, True):
            make = tail_engine if captured else (lambda m, s, o: Engine(m, s, compile=False, speculative=o))
            with make(model, 4, option) as e:
                handles = [e.submit(p, max_new_tokens=12, stop_token_ids=[], seed=7 + i, **samplers[i % 4])
                           for i, p in enumerate(prompts)]
                runs.append([h.result().token_ids for h in handles])  # (seeded: whatever shares the steps)
                assert e.stats().speculative["proposed"] > 0
                if captured:
                    assert {kind for kind, _ in e._loop.spec.graphs.entries} >= {"sampled"}
        assert runs[0] == runs[1], option


def test_logits_processors_keep_the_eager_tail(models, monkeypatch):
    """A step with a penalized request takes the eager tail (its processors per verify position), the others the
    captured one; both give plain decoding's tokens."""
    model, prompts = models["dense"], prompts_of("dense")[:3]
    kw = dict(max_new_tokens=10, stop_token_ids=[])
    with Engine(model, 3, compile=False) as e:
        reference = [e.submit(prompts[0], repetition_penalty=1.3, **kw).result().token_ids,
                     e.submit(prompts[1], **kw).result().token_ids]
    calls, eager = [], eager_tails(monkeypatch)
    with tail_engine(model, 3, {"method": "mtp", "num_tokens": 2}, calls) as e:
        penalized = e.submit(prompts[0], repetition_penalty=1.3, **kw).result().token_ids  # alone: eager tails
        assert "accept" not in calls and eager.count("_accept_eager") >= e.stats().speculative["steps"] > 0
        assert "_eager" not in eager and "draft" in calls  # (drafting has no processors: captured throughout)
        assert [penalized, e.generate(prompts[1:2], **kw)[0].token_ids] == reference
        assert "accept" in calls


@pytest.mark.parametrize("k", [1, 3])
def test_the_bigram_checkpoint_keeps_every_captured_draft(k):
    """Every draft kept (k = 1: the head's catch-up alone, no draft step), and a prompt of 41 tokens in chunks of
    at most 16 (token_budget): speculative steps of prompt chunks that sample no row."""
    model = bigram_model(CONFIGS["dense"])
    prompt = random_tokens(41, 6, CONFIGS["dense"].vocab_size)
    with Engine(model, 2, compile=False) as e:
        reference = [e.generate([p], max_new_tokens=41, stop_token_ids=[])[0].token_ids for p in ([3, 5, 7], prompt)]
    calls = []
    with tail_engine(model, 2, {"method": "mtp", "num_tokens": k}, calls, token_budget=16) as e:
        out = [e.generate([p], max_new_tokens=41, stop_token_ids=[])[0].token_ids for p in ([3, 5, 7], prompt)]
        s = e.stats().speculative
    assert out == reference
    assert s["accepted"] == s["proposed"] > 0 and "draft" in calls and "accept" in calls


def test_the_compiled_tail_gives_the_eager_tokens(models, monkeypatch, mtp_after):
    """torch.compile(fullgraph=True) of the four functions (warmup: each once for the one bucket; the drafting
    twice, from the host's inputs and behind the acceptance), then greedy and seeded sampled MTP requests: the eager
    engine's tokens and drafts."""
    model, prompts = models["dense"], prompts_of("dense")[:3]
    drafts = recorded_drafts(monkeypatch)
    runs = []
    for compile in (False, True):
        drafts.clear()
        with Engine(model, 2, compile=compile, token_budget=64, batch_sizes=[2], token_counts=[64],
                    speculative={"method": "mtp", "num_tokens": 2}) as e:
            if compile:
                e.warmup()
                graphs = e._loop.spec.graphs
                assert {kind for kind, _ in graphs.entries} == {"greedy", "sampled", "drafts", "after"}
                assert all(entry.warm for entry in graphs.entries.values())
            greedy = [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])]
            sampled = [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[], temperature=0.9,
                                                       top_k=30, seed=3)]
            runs.append((greedy, sampled, e.stats().speculative, [dict(d) for d in drafts]))
    assert runs[0] == runs[1] and runs[1][2]["proposed"] > 0


def test_accepted_states_are_kept_from_the_counts_on_the_device():
    """tail.keep_accepted_states: a row that kept c of its n > c drafts takes verify entry first + c into its slot
    (every conv and GDN pool), a row that kept all its drafts, a row without drafts and a row keeping nothing
    (the scratch pair: plain rows, padding) leave every slot as it was: the eager path's redo list, made from
    the counts on the device."""
    from metrale_graph.cache import HybridCache
    from metrale_graph.speculative.tail import keep_accepted_states

    cfg, K = tiny_config(), 3
    cache = HybridCache(cfg, 4, 16, block_size=16, max_context=64, verify_entries=4 * K)
    g = torch.Generator().manual_seed(0)
    for t in cache.conv_states + cache.gdn_states + cache.checkpoint_conv_states + cache.checkpoint_gdn_states:
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in cache.conv_states + cache.gdn_states]
    base = cache.prefix_checkpoints
    # rows: slot 2 kept 1 of 3 (entry base + 1), slot 0 kept 3 of 3, slot 3 kept 0 of 2 (entry base + 2K), a
    # plain row (slot 1, no drafts), then a padding row
    keep = torch.tensor([[2, 0, 3, cache.scratch_slot, cache.scratch_slot],
                         [base, base + K, base + 2 * K, cache.scratch_checkpoint, cache.scratch_checkpoint]])
    counts, num_drafts = torch.tensor([1, 3, 0, 0, 0]), torch.tensor([3, 3, 2, 0, 0])
    ints = torch.zeros(5, 2 * K + 4, dtype=torch.int64)
    ints[:, 2 * K + 1] = num_drafts
    result = torch.cat([counts[:, None], torch.zeros(5, K + 1, dtype=torch.int64)], dim=1)
    keep_accepted_states(cache, result, ints, keep, K)
    kept = {2: base + 1, 3: base + 2 * K}
    for pool, old, entries in zip(cache.conv_states + cache.gdn_states, before,
                                  cache.checkpoint_conv_states + cache.checkpoint_gdn_states):
        for slot in range(4):
            want = entries[kept[slot]] if slot in kept else old[slot]
            assert torch.equal(pool[slot], want), slot


def test_verify_targets_take_one_copy_kept_until_another_step(monkeypatch):
    """verify.targets writes the verify checkpoints past prefix_targets (tokens and entries, the rest none) in one
    copy, none when the device holds them already; they stay set after the verify step and are cleared (tokens -1,
    prefix caching's targets untouched) before the next step that is not a verify step (the prefill protocol);
    a snapshot put back makes them unknown, so the next verify writes them again."""
    from metrale_graph import cache_prefixes
    from metrale_graph.cache import HybridCache
    from metrale_graph.protocol import prefill_call

    model = HybridModel.from_preset(tiny_config(), seed=0)
    cache = model.new_cache(2, 16, block_size=16, max_context=128, prefix_checkpoints=2, checkpoint_interval=64,
                            verify_entries=6)
    assert isinstance(cache, HybridCache)
    P, scratch = cache.prefix_targets, cache.scratch_checkpoint
    copies = []
    write = cache_prefixes.write_targets
    monkeypatch.setattr(cache_prefixes, "write_targets", lambda *a: (a[1] == P and copies.append(a[1])) or write(*a))
    snap = cache.snapshot()
    cache.checkpoint_tokens[:P].fill_(7)
    verify.targets(cache, [4, 5], [3, 4])
    verify.targets(cache, [4, 5], [3, 4])  # the same again: no copy
    assert copies == [P]
    assert cache.checkpoint_tokens[P:].tolist() == [4, 5, -1, -1, -1, -1]
    assert cache.checkpoint_entries[P:].tolist() == [3, 4] + [scratch] * 4
    verify.targets(cache, [4], [3])
    assert copies == [P, P] and cache.checkpoint_tokens[P:].tolist() == [4, -1, -1, -1, -1, -1]
    cache_prefixes.clear_verify_targets(cache)
    assert cache.checkpoint_tokens[P:].tolist() == [-1] * 6 and (cache.checkpoint_tokens[:P] == 7).all()
    assert cache.verify_targets_held == ()
    verify.targets(cache, [4], [3])
    seen = []
    with prefill_call(model, cache, [Stream(0, [1, 2, 3])]) as call:  # a step that is not a verify step
        call.run(lambda packed: seen.append(cache.checkpoint_tokens[P:].tolist()) or model.forward_packed(cache, packed))
    assert seen == [[-1] * 6] and cache.verify_targets_held == ()
    verify.targets(cache, [4], [3])
    cache.restore(snap)
    assert cache.verify_targets_held is None
    verify.targets(cache, [4], [3])
    assert copies == [P, P, P, P, P] and cache.checkpoint_tokens[P:].tolist() == [4, -1, -1, -1, -1, -1]
    assert cache.checkpoint_targets.shape == (2, P + 6)
    assert cache.checkpoint_targets[0].data_ptr() == cache.checkpoint_tokens.data_ptr()


@pytest.mark.parametrize("where", ["keep_accepted_states", "write_last_tokens"])
def test_a_failed_state_copy_in_the_acceptance_leaves_later_requests_exact(models, monkeypatch, where):
    """The captured path's accepted-state copy or last-token write (tail.keep_accepted_states /
    tail.write_last_tokens, inside the acceptance entry) raising once fails that step's requests alone, inside the
    cache's transaction: later requests on the same engine (its slots, verify entries, last tokens and the tail's
    buffers) give plain decoding's tokens and no block stays held."""
    from metrale_graph.speculative import tail as tail_module

    model, prompts = models["dense"], prompts_of("dense")[:3]
    with Engine(model, 3, compile=False) as e:
        reference = [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])]
    monkeypatch.setattr(verify, "ngram_propose", Oracle(prompts, reference, CONFIGS["dense"].vocab_size))
    real, calls = getattr(tail_module, where), []

    def once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args)

    with tail_engine(model, 3, {"method": "ngram", "num_tokens": 3}) as e:
        monkeypatch.setattr(tail_module, where, once)
        handles = [e.submit(p, max_new_tokens=10, stop_token_ids=[]) for p in prompts]
        failed = 0
        for h, ref in zip(handles, reference):
            try:
                assert h.result().token_ids == ref
            except RuntimeError as err:
                assert str(err) == "injected"
                failed += 1
        assert failed > 0 and len(calls) > 0 and e.stats().used_blocks == 0
        assert [r.token_ids for r in e.generate(prompts, max_new_tokens=10, stop_token_ids=[])] == reference
        assert len(calls) > 1 and e.stats().running == 0 and e.stats().used_blocks == 0
