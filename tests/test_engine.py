"""The generation engine on the CPU: greedy generation against transformers' generate (queued
requests, reused slots, chunked prompts, stop tokens), batch independence and seeded sampling,
bad requests, max_context, streaming, tokenizers; one test through the compiled GraphRunner."""

import json

import pytest
import torch

from helpers import random_tokens, tiny_config
from references import hf_reference
from metrale_graph import Engine, HybridModel, TokenEvent
from metrale_graph.engine import default_grid
from metrale_graph.sampling import SampleRow, SamplingParams, new_generator, sample as sample_rows

LENGTHS = [5, 37, 1, 70, 12]  # 70 and 37 tokens exceed the budget of 16: chunked
NEW = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_generate(hf, prompt, n, **kw):
    """transformers' greedy tokens; the all-ones mask keeps a prompt's token 0 from being read as padding when a
    call names pad_token_id=0 (transformers infers the mask from the pad id without one)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random transformers model saved as a checkpoint, our model loaded from it, the prompts,
    and transformers' greedy tokens for each prompt alone (no eos: nothing stops early)."""
    cfg = tiny_config()
    hf = hf_reference(cfg)
    folder = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(folder)
    model = HybridModel.from_pretrained(str(folder), progress=False)
    prompts = [random_tokens(n, seed=10 + i, vocab=cfg.vocab_size) for i, n in enumerate(LENGTHS)]
    expected = [_hf_generate(hf, p, NEW) for p in prompts]
    return dict(cfg=cfg, hf=hf, folder=folder, model=model, prompts=prompts, expected=expected)


def _record_steps(engine, monkeypatch):
    """Every step's streams as (slot, number of tokens)."""
    steps, real = [], engine._loop.launch

    def spy(streams, decodes):
        steps.append([(s.slot, len(s.tokens)) for s in streams])
        return real(streams, decodes)

    monkeypatch.setattr(engine._loop, "launch", spy)
    return steps


def _assert_cache_empty(engine):
    cache = engine.cache
    assert cache.context_lens == [0] * cache.num_slots and cache.free_blocks == cache.num_blocks


def _check_greedy_against_hf(engine, checkpoint, monkeypatch):
    steps = _record_steps(engine, monkeypatch)
    results = engine.generate(checkpoint["prompts"], max_new_tokens=NEW)
    for i, (r, want) in enumerate(zip(results, checkpoint["expected"])):
        assert r.token_ids == want, f"prompt {i} (length {LENGTHS[i]})"
        assert r.finish_reason == "length" and r.text is None and r.prompt_tokens == LENGTHS[i]
    assert all(len(s) <= engine.num_slots and sum(n for _, n in s) <= engine.token_budget for s in steps)
    assert any(n > 1 and sum(m for _, m in s) == engine.token_budget for s in steps for _, n in s)  # chunks
    assert any(n == 1 for s in steps for _, n in s if len(s) > 1)  # decodes share steps with chunks
    assert len(steps) < sum(LENGTHS) + len(LENGTHS) * NEW  # batched
    _assert_cache_empty(engine)
    return steps


def test_greedy_matches_transformers_queued_and_chunked(checkpoint, monkeypatch):
    """5 prompts on 2 slots (queueing, slots reused), budget 16 (prompts of 37 and 70 tokens chunked):
    each request's tokens are transformers' greedy generate of that prompt alone."""
    engine = Engine(checkpoint["model"], num_slots=2, token_budget=16, block_size=16, max_context=128,
                    compile=False)
    steps = _check_greedy_against_hf(engine, checkpoint, monkeypatch)
    assert {slot for s in steps for slot, _ in s} == {0, 1}


def test_compiled_runner_matches_transformers(checkpoint, monkeypatch):
    """The default path: the GraphRunner's compiled step (on the CPU, no graphs) on the default grid."""
    engine = Engine(checkpoint["model"], num_slots=3, token_budget=16, block_size=16, max_context=128)
    assert engine.runner is not None and not engine.runner.use_graphs
    calls = []
    real = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda streams, *a: calls.append(len(streams)) or real(streams, *a))
    steps = _check_greedy_against_hf(engine, checkpoint, monkeypatch)
    assert len(calls) == len(steps)  # each step is one call of the runner


def test_stop_token_matches_transformers(checkpoint, tmp_path):
    """A stop token ends its request with "stop" and is kept, as transformers' generate keeps eos;
    the other request of the batch goes on to max_new_tokens. The default stop tokens come from
    generation_config.json."""
    hf, prompts, expected = checkpoint["hf"], checkpoint["prompts"], checkpoint["expected"]
    eos = expected[0][3]
    assert eos not in expected[0][:3] and eos not in expected[1]
    want = _hf_generate(hf, prompts[0], NEW, eos_token_id=eos, pad_token_id=0)
    assert want == expected[0][:4]
    engine = Engine(checkpoint["model"], num_slots=2, token_budget=16, block_size=16, max_context=128,
                    compile=False)
    assert engine.stop_token_ids == frozenset()  # the checkpoint names no eos
    r = engine.generate(prompts[:2], max_new_tokens=NEW, stop_token_ids=[eos])
    assert r[0].token_ids == want and r[0].finish_reason == "stop"
    assert r[1].token_ids == expected[1] and r[1].finish_reason == "length"
    # the eos of generation_config.json is the default, as in transformers' generate
    hf.generation_config.eos_token_id = eos
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    engine = Engine(model, num_slots=2, block_size=16, max_context=128, compile=False)
    assert engine.stop_token_ids == {eos}
    r = engine.generate(prompts[:2], max_new_tokens=NEW)
    assert r[0].token_ids == want and r[0].finish_reason == "stop" and r[1].token_ids == expected[1]
    assert engine.generate(prompts[:1], max_new_tokens=NEW, stop_token_ids=[])[0].token_ids == expected[0]


def test_default_stop_tokens_of_a_multimodal_config(tmp_path):
    """A multimodal qwen3_5 config.json keeps eos_token_id in its text_config; without a
    generation_config.json, transformers' generate stops on it (GenerationConfig.from_model_config reads the
    text config for what the outer config leaves unset), and so does the engine by default."""
    from transformers import GenerationConfig

    HybridModel.from_preset("tiny", seed=3).save_pretrained(str(tmp_path))
    text = json.loads((tmp_path / "config.json").read_text())
    text["model_type"] = "qwen3_5_text"
    eos = [7, 9]
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
             "text_config": dict(text, eos_token_id=eos)}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    assert not (tmp_path / "generation_config.json").exists()
    assert GenerationConfig.from_model_config(outer).eos_token_id == eos  # transformers' default
    engine = Engine(HybridModel.from_pretrained(str(tmp_path), progress=False), num_slots=1, max_context=16,
                    compile=False)
    assert engine.stop_token_ids == set(eos)
    # an eos of the outer config wins, as in transformers
    outer["eos_token_id"] = 3
    (tmp_path / "config.json").write_text(json.dumps(outer))
    assert GenerationConfig.from_model_config(outer).eos_token_id == 3
    engine = Engine(HybridModel.from_pretrained(str(tmp_path), progress=False), num_slots=1, max_context=16,
                    compile=False)
    assert engine.stop_token_ids == {3}


@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_preset("tiny", seed=3)


def sample(logits, params, generators):
    """sample()'s tokens for rows of these parameters and generators."""
    return sample_rows(logits, [SampleRow(p, g) for p, g in zip(params, generators)]).tokens


def _prompts(lengths, seed=0):
    return [random_tokens(n, seed=seed + i) for i, n in enumerate(lengths)]


def test_greedy_and_seeded_sampling_are_batch_independent(tiny):
    """A request's tokens are the same alone and in any batch (greedy, and sampled with seed + its
    index); the same seed reproduces, another seed differs."""
    engine = Engine(tiny, num_slots=3, token_budget=12, block_size=16, max_context=96, compile=False)
    prompts = _prompts([3, 20, 1, 9])
    greedy = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6)]
    assert greedy == [engine.generate([p], max_new_tokens=6)[0].token_ids for p in prompts]
    order = [2, 0, 3, 1]
    assert [r.token_ids for r in engine.generate([prompts[i] for i in order], max_new_tokens=6)] == \
        [greedy[i] for i in order]
    for params in [dict(temperature=0.9), dict(temperature=1.3, top_k=20), dict(temperature=0.8, top_p=0.8),
                   dict(temperature=1.0, top_k=50, top_p=0.9)]:
        batched = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6, seed=7, **params)]
        assert batched == [r.token_ids for r in engine.generate(prompts, max_new_tokens=6, seed=7, **params)]
        alone = [engine.generate([p], max_new_tokens=6, seed=7 + i, **params)[0].token_ids
                 for i, p in enumerate(prompts)]
        assert batched == alone, params
        other = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6, seed=8, **params)]
        assert other != batched and batched != greedy
    _assert_cache_empty(engine)


def test_the_engines_cache_is_its_own_while_a_stream_is_paused(tiny):
    """Issue 23, item 1: between two tokens of a stream a prefill into engine.cache, a reset of one of its slots
    or the runner's prefill succeeded and the stream then produced wrong tokens (or died for blocks another
    prefill took). Now each raises CacheInUseError naming the engine, and the stream's tokens are right."""
    from metrale_graph import Stream
    from metrale_graph.cache import CacheInUseError

    engine = Engine(tiny, num_slots=2, token_budget=12, block_size=16, max_context=96, num_blocks=6,
                    compile=False)
    prompts = _prompts([5, 9])
    clean = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6)]
    stream = engine.stream(prompts, max_new_tokens=6)
    events = [next(stream), next(stream)]
    for use in (lambda: tiny.prefill(engine.cache, [Stream(0, [1, 2])]), lambda: engine.cache.reset(0),
                lambda: tiny.prefill(engine.cache, [Stream(1, [3] * 40)]),
                lambda: engine.cache.restore(engine.cache.snapshot())):
        with pytest.raises(CacheInUseError, match="held by the Engine that built it"):
            use()
    events += list(stream)
    assert [[e.token_id for e in events if e.index == i] for i in range(2)] == clean
    _assert_cache_empty(engine)


@pytest.mark.parametrize("where", ["step", "sample"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_failure_mid_generation_leaves_the_engine_as_new(tiny, monkeypatch, where, k):
    """The k-th step (first prompt chunks, mixed, decodes only) or its sampling raises: every slot and block
    is given back, and the next generate gives a fresh engine's tokens, greedy and seeded."""
    import metrale_graph.loop as loop_module

    kw = dict(num_slots=2, token_budget=12, block_size=16, max_context=96, compile=False)
    prompts = _prompts([3, 20, 9])
    fresh = Engine(tiny, **kw)
    want = [[r.token_ids for r in fresh.generate(prompts, max_new_tokens=5, **p)]
            for p in (dict(), dict(temperature=0.9, top_k=40, seed=2))]
    engine = Engine(tiny, **kw)
    owner, name = (tiny, "forward_packed") if where == "step" else (loop_module, "sample")
    calls, real = [], getattr(owner, name)

    def failing(*args):
        calls.append(1)
        if len(calls) == k:
            raise RuntimeError("failed here")
        return real(*args)

    monkeypatch.setattr(owner, name, failing)
    with pytest.raises(RuntimeError, match="failed here"):
        engine.generate(prompts, max_new_tokens=5)
    monkeypatch.undo()
    _assert_cache_empty(engine)
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)] == want[0]
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=5, temperature=0.9, top_k=40,
                                                 seed=2)] == want[1]


def test_sampling_masks_and_distribution():
    """sample(): greedy rows take the argmax; top-k and top-p keep only their tokens; the draws follow
    the tempered distribution; a row's draw does not depend on the other rows."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15], [0.4, 0.1, 0.2, 0.3]]))
    def draws(p, n=2000):  # row 0 n times, each row with its own generator
        return sample(logits[:1].expand(n, 4), [p] * n, [new_generator(k) for k in range(n)])

    assert sample(logits, [SamplingParams(), SamplingParams()], [None, None]).tolist() == [1, 0]
    assert set(draws(SamplingParams(1.0, top_k=2)).tolist()) == {1, 2}
    assert set(draws(SamplingParams(1.0, top_p=0.75)).tolist()) == {1, 2}  # 0.5 < 0.75 <= 0.8
    assert set(draws(SamplingParams(1.0, top_p=0.45)).tolist()) == {1}
    assert set(draws(SamplingParams(5.0, top_k=1)).tolist()) == {1}
    freq = torch.bincount(draws(SamplingParams(1.0), 4000), minlength=4).float() / 4000
    assert (freq - torch.tensor([0.05, 0.5, 0.3, 0.15])).abs().max() < 0.04
    hot = torch.bincount(draws(SamplingParams(0.5), 4000), minlength=4).float() / 4000
    want = torch.softmax(logits[0] / 0.5, 0)
    assert (hot - want).abs().max() < 0.04
    # rows are independent: row 1 with its generator gives the same tokens alone or beside row 0
    p = SamplingParams(1.0, top_k=3)
    ga, gb, gc = new_generator(5), new_generator(5), new_generator(9)
    together = [sample(logits, [p, p], [gc, ga])[1].item() for _ in range(50)]
    alone = [sample(logits[1:], [p], [gb])[0].item() for _ in range(50)]
    assert together == alone


def test_tiny_temperatures_sample_the_maximum(tiny):
    """A temperature so small that logits / temperature overflows fp32 (or the temperature itself rounds
    to 0 in fp32) still samples: the row's largest logit, as greedy does, not NaN probabilities (which
    crashed the draw with an index of -1 mid-generation)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0], [100.0, 50.0, 0.0, -100.0]])
    for t in (1e-30, 1e-38, 1e-45, 5e-324):
        for k, p in ((0, 1.0), (2, 1.0), (0, 0.5)):
            params = [SamplingParams(t, top_k=k, top_p=p)] * 2
            assert sample(logits, params, [new_generator(0), new_generator(1)]).tolist() == [1, 0], (t, k, p)
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32, compile=False)
    prompts = _prompts([3, 5])
    greedy = [r.token_ids for r in engine.generate(prompts, max_new_tokens=4)]
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=4, temperature=1e-40, seed=0)] == greedy
    _assert_cache_empty(engine)


def test_top_k_beyond_the_vocabulary_is_off(tiny):
    """top_k at or beyond the vocabulary keeps every token, as transformers' top-k does (min(top_k, vocab)),
    however large: a top_k past int64 used to fail mid-generation with torch's overflow error."""
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32, compile=False)
    prompts = _prompts([3, 5])
    kw = dict(max_new_tokens=4, temperature=1.0, seed=4)
    off = [r.token_ids for r in engine.generate(prompts, **kw)]
    for top_k in (tiny.config.vocab_size, 2**63, 10**30):
        assert [r.token_ids for r in engine.generate(prompts, top_k=top_k, **kw)] == off, top_k
    _assert_cache_empty(engine)


def test_tiny_top_p_keeps_the_most_likely_token(tiny):
    """top_p keeps at least the most likely token however small it is: a top_p that rounds to 0 in fp32
    (below 1.4e-45) masked every token and crashed the draw with an index of -1 mid-generation."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0], [100.0, 50.0, 0.0, -100.0]])
    for p in (1e-30, 1e-46, 1e-300, 5e-324):
        params = [SamplingParams(1.0, top_p=p)] * 2
        assert sample(logits, params, [new_generator(0), new_generator(1)]).tolist() == [1, 0], p
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32, compile=False)
    prompts = _prompts([3, 5])
    greedy = [r.token_ids for r in engine.generate(prompts, max_new_tokens=4)]
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=4, temperature=1.0, top_p=1e-300,
                                                 seed=0)] == greedy
    _assert_cache_empty(engine)


def test_seeds_at_the_ends_of_torch_range(tiny):
    """Request i draws with seed + i: a seed near 2**64 - 1 wraps around for the later requests rather than
    failing with torch's overflow error; a seed outside what torch takes is a ValueError naming it."""
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32, compile=False)
    prompts = _prompts([3, 5])
    kw = dict(max_new_tokens=4, temperature=1.0)
    top = engine.generate(prompts, seed=2**64 - 1, **kw)
    assert top[0].token_ids == engine.generate(prompts[:1], seed=2**64 - 1, **kw)[0].token_ids
    assert top[1].token_ids == engine.generate(prompts[1:], seed=0, **kw)[0].token_ids  # 2**64 wraps to 0
    assert len(engine.generate(prompts, seed=-2**63, **kw)) == 2
    for seed in (2**64, -2**63 - 1, True):
        with pytest.raises(ValueError, match="seed must be an integer or None"):
            engine.generate(prompts, seed=seed, **kw)
    _assert_cache_empty(engine)


def test_bad_requests_raise_and_touch_nothing(tiny):
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32, compile=False)
    before = [t.clone() for t in engine.cache.state_tensors()]
    ok = [1, 2, 3]
    cases = [
        (dict(prompts=[ok, [1, 512]]), "prompt 1: token id 512 is out of range"),
        (dict(prompts=[[-1]]), "token id -1 is out of range"),
        (dict(prompts=[ok, []]), "prompt 1 is empty"),
        (dict(prompts=[[1] * 32]), "must leave room for at least one new token"),
        (dict(prompts=[[1, 2.0]]), "token 2.0 is not an int"),
        (dict(prompts=[[1, True]]), "token True is not an int"),
        (dict(prompts=[ok, [None]]), "prompt 1: token None is not an int"),  # (was torch.tensor's TypeError)
        (dict(prompts=[torch.tensor([1.0, 2.0])]), "prompt 0: tokens must be an integer tensor"),
        (dict(prompts=[torch.tensor([[1, 2]])]), r"prompt 0: tokens must be 1-D, got shape \(1, 2\)"),
        (dict(prompts=[[1, 2**70]]), "prompt 0: a token id does not fit in int64"),
        (dict(prompts=["hello"]), "no tokenizer"),
        (dict(prompts="hello"), "list of prompts"),
        (dict(prompts=[None]), "prompt 0: expected a list of token ids"),
        (dict(prompts=[ok], max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(prompts=[ok], max_new_tokens=2.5), "max_new_tokens must be an integer >= 1"),
        (dict(prompts=[ok], temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(prompts=[ok], temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(prompts=[ok], temperature=10**400), "temperature must be a finite number >= 0"),
        (dict(prompts=[ok], top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        (dict(prompts=[ok], top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        (dict(prompts=[ok], top_k=-1), "top_k must be an integer >= 0"),
        (dict(prompts=[ok], seed="x"), "seed must be an integer or None"),
        (dict(prompts=[ok], stop_token_ids=[600]), "stop token 600 is not a token id"),
        (dict(prompts=[ok], stop_token_ids=[5, 2.0]), "stop token 2.0 must be an int, got float"),
        (dict(prompts=[ok], stop_token_ids=[True]), "stop token True must be an int, got bool"),
    ]
    for kwargs, msg in cases:
        for call in (engine.generate, engine.stream):
            with pytest.raises(ValueError, match=msg):
                call(**kwargs)
            assert all(torch.equal(a, b) for a, b in zip(engine.cache.state_tensors(), before))
            _assert_cache_empty(engine)
    steps = []
    real = engine._loop.launch
    engine._loop.launch = lambda streams, decodes: steps.append(streams) or real(streams, decodes)
    with pytest.raises(ValueError, match="on_token must be a callable"):
        engine.generate([ok], max_new_tokens=2, on_token=5)
    assert steps == []  # nothing ran
    del engine._loop.launch
    assert engine.generate([ok], max_new_tokens=2)[0].finish_reason == "length"
    for kwargs, msg in [(dict(num_slots=0), "num_slots must be an integer >= 1"),
                        (dict(num_slots=4, token_budget=2), "at least num_slots"),
                        (dict(max_context=1), "max_context must be an integer >= 2"),
                        # past the positions the model has (the CLI refused it; a huge one hit the allocator)
                        (dict(max_context=4097), r"max_context \(4097\) exceeds the model's max_position_emb"),
                        (dict(max_context=2**40), "exceeds the model's max_position_embeddings"),
                        (dict(compile=False, use_graphs=True), "needs compile=True"),
                        (dict(tokenizer=123), "encode\\(\\) and decode\\(\\)"),
                        (dict(tokenizer="/no/such/folder"), "does not exist"),
                        # an empty grid is refused, not replaced by the default one
                        (dict(batch_sizes=[]), "batch_sizes must be a non-empty list"),
                        (dict(token_counts=()), "token_counts must be a non-empty list"),
                        # a grid whose largest bucket holds fewer streams or tokens than a step (was: accepted, then
                        # every step of 3 decodes or of a 16-token chunk failed its requests: 'fits no bucket')
                        (dict(num_slots=3, token_budget=16, batch_sizes=[2], token_counts=[2, 16]),
                         r"largest bucket B2xT16 holds fewer than num_slots \(3\) streams"),
                        (dict(num_slots=2, token_budget=16, batch_sizes=[2], token_counts=[2, 8]),
                         r"largest bucket B2xT8 holds fewer than .* token_budget \(16\) tokens"),
                        (dict(num_slots=4, token_budget=16, batch_sizes=[4, 8], token_counts=[4]),
                         r"largest bucket B4xT4 holds"),
                        # sizes of the prefix cache while it is off (was: accepted)
                        (dict(prefix_checkpoints=-5), "prefix_checkpoints=-5 sizes the prefix cache, which is off"),
                        (dict(checkpoint_interval=64), "checkpoint_interval=64 sizes the prefix cache, which is off"),
                        # sizes beyond the memory free, named (were the allocator's RuntimeError)
                        (dict(prefix_cache=True, prefix_checkpoints=10**12), r"the cache's pools need \d+\.\d PiB of "
                         r"memory and cpu has \d+\.\d [MGT]iB free of \d+\.\d [MGT]iB: GDN state checkpoints "
                         r"\(prefix_checkpoints=1000000000000\) \d+\.\d PiB, "),
                        (dict(num_slots=10**12), r"PiB of memory .* slot states \(num_slots=1000000000000\) "),
                        (dict(num_blocks=10**12), r"PiB of memory .*: KV blocks \(num_blocks=1000000000000 of "),
                        (dict(block_size=2**30, max_context=64), r"KV blocks \(num_blocks=64 of block_size=1073741824\)"),
                        (dict(token_budget=10**12), r"the buckets' static input buffers need \d+\.\d TiB of memory "
                         r"and cpu has .*: buckets of up to 1000000000000 tokens \(token_counts; an Engine's "
                         r"token_budget\)")]:
        with pytest.raises(ValueError, match=msg):
            Engine(tiny, **kwargs)
    small = Engine(tiny, num_slots=2, block_size=16, max_context=64, num_blocks=2, compile=False)
    with pytest.raises(ValueError, match="need 3 KV blocks; the cache has 2"):
        small.generate([[1] * 30], max_new_tokens=10)



def test_a_model_of_one_position_is_refused_by_its_max_position_embeddings():
    """max_context defaults to the model's max_position_embeddings: a model of one position (transformers runs one
    token through it) leaves a request no room for a new token. The error named max_context ('must be an integer >= 2,
    got 1'), which the call never set; it now names the model's field."""
    one = HybridModel.from_preset(tiny_config(max_position_embeddings=1), seed=0)
    with pytest.raises(ValueError, match=r"the model's max_position_embeddings \(1\) leaves no room for a new token"):
        Engine(one, num_slots=1, compile=False)
    with pytest.raises(ValueError, match="max_context must be an integer >= 2, got 1"):  # set: named as before
        Engine(one, num_slots=1, max_context=1, compile=False)
    two = HybridModel.from_preset(tiny_config(max_position_embeddings=2), seed=0)
    assert len(Engine(two, num_slots=1, compile=False).generate([[1]], max_new_tokens=4)[0].token_ids) == 1

def test_max_context_ends_with_length_while_others_go_on(tiny):
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=40, compile=False)
    roomy = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=128, compile=False)
    long, short = _prompts([35, 3], seed=5)
    r = engine.generate([long, short], max_new_tokens=20)
    assert len(r[0].token_ids) == 5 and r[0].finish_reason == "length"  # 35 + 5 == max_context
    assert len(r[1].token_ids) == 20 and r[1].finish_reason == "length"
    full = roomy.generate([long, short], max_new_tokens=20)
    assert r[0].token_ids == full[0].token_ids[:5] and r[1].token_ids == full[1].token_ids
    assert engine.generate([[7] * 39], max_new_tokens=4)[0].token_ids == roomy.generate(
        [[7] * 39], max_new_tokens=1)[0].token_ids  # one token of room
    _assert_cache_empty(engine)


def test_admission_waits_for_kv_blocks(tiny, monkeypatch):
    """With too few KV blocks for every slot, a request waits until its worst case can be reserved;
    no step ever runs out of blocks, and the tokens are the same."""
    prompts = _prompts([20, 14, 30, 5], seed=9)
    roomy = Engine(tiny, num_slots=4, token_budget=16, block_size=16, max_context=64, compile=False)
    want = [r.token_ids for r in roomy.generate(prompts, max_new_tokens=10)]
    tight = Engine(tiny, num_slots=4, token_budget=16, block_size=16, max_context=64, num_blocks=4,
                   compile=False)
    steps = _record_steps(tight, monkeypatch)
    assert [r.token_ids for r in tight.generate(prompts, max_new_tokens=10)] == want
    assert max(len(s) for s in steps) == 2  # 2 + 2 blocks at most: never 3 requests at once
    _assert_cache_empty(tight)


def test_streaming_and_concurrent_calls(tiny):
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=64, compile=False)
    prompts = _prompts([4, 11, 2])
    seen = []
    results = engine.generate(prompts, max_new_tokens=5, stop_token_ids=[], on_token=lambda i, t: seen.append((i, t)))
    assert sorted(seen) == sorted((i, t) for i, r in enumerate(results) for t in r.token_ids)
    events = list(engine.stream(prompts, max_new_tokens=5))
    assert all(isinstance(e, TokenEvent) for e in events)
    for i, r in enumerate(results):
        mine = [e for e in events if e.index == i]
        assert [e.token_id for e in mine] == r.token_ids
        assert [e.finish_reason for e in mine] == [None] * 4 + ["length"]
    assert all(r.first_token_s is not None and r.first_token_s >= 0 for r in results)
    # an open stream no longer holds the engine: a generate meanwhile shares the loop (it raised
    # EngineBusyError); closing the stream early frees every slot
    stream = engine.stream(prompts, max_new_tokens=5)
    first = next(stream)
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)] == [r.token_ids for r in results]
    assert first.token_id == results[first.index].token_ids[0]
    stream.close()
    _assert_cache_empty(engine)
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)] == [r.token_ids for r in results]
    # a callback that raises frees the cache too
    with pytest.raises(KeyError):
        engine.generate(prompts, max_new_tokens=5, on_token=lambda i, t: {}[i])
    _assert_cache_empty(engine)


def test_a_stream_frees_the_engine_when_its_last_request_finishes(tiny):
    """Issue 23, item 2: breaking out of a stream after the last finish_reason left the engine busy (the lock
    was freed only on the stream's next advance or close): the next generate raised EngineBusyError. Now
    every slot is free when the last event arrives, with the stream still open."""
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=64, compile=False)
    prompts = _prompts([4, 11, 2])
    want = [r.token_ids for r in engine.generate(prompts, max_new_tokens=3)]
    stream = engine.stream(prompts, max_new_tokens=3)
    finished = set()
    for event in stream:
        if event.finish_reason is not None:
            finished.add(event.index)
        if len(finished) == len(prompts):
            break
    _assert_cache_empty(engine)
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=3)] == want
    stream.close()


def test_warmup_of_a_compiled_engine_runs_between_steps(tiny, monkeypatch):
    """warmup() with compile=True ran the runner's captures during an open stream: a capture under a running
    generation failed it. It then raised EngineBusyError; now it runs in the engine loop between two steps,
    and the stream goes on. The runner's steps run eagerly here (no compile in this test)."""
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32)
    warmed, steps = [], []
    monkeypatch.setattr(engine._loop, "runner", None)  # the loop's steps eager
    real = engine._loop.launch
    monkeypatch.setattr(engine._loop, "launch", lambda streams, decodes: steps.append("step") or real(streams, decodes))
    monkeypatch.setattr(engine.runner, "warmup",
                        lambda progress=False, on_bucket=None: warmed.append(progress) or steps.append("warmup") or [])
    stream = engine.stream([[1, 2, 3]], max_new_tokens=3)
    first = next(stream)
    assert engine.warmup(progress=True) == [] and warmed == [True]
    assert [first.token_id] + [e.token_id for e in stream] == \
        engine.generate([[1, 2, 3]], max_new_tokens=3)[0].token_ids
    assert steps.count("warmup") == 1 and steps.count("step") == 6
    _assert_cache_empty(engine)


class _CharTokenizer:
    """A tokenizer object: one token per character."""
    eos_token_id = 0

    def encode(self, text):
        return [ord(c) % 500 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(96 + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def test_tokenizer_object_and_folder(tiny, tmp_path):
    engine = Engine(tiny, num_slots=2, block_size=16, max_context=64, tokenizer=_CharTokenizer(), compile=False)
    assert engine.stop_token_ids == {0}  # the tokenizer's eos
    r = engine.generate(["hello", [1, 2, 3]], max_new_tokens=4, stop_token_ids=[])
    assert r[0].prompt_tokens == 5 and r[0].text == _CharTokenizer().decode(r[0].token_ids)
    assert r[0].token_ids == engine.generate([_CharTokenizer().encode("hello")], max_new_tokens=4,
                                             stop_token_ids=[])[0].token_ids
    # a checkpoint folder with tokenizer files: found through model.name_or_path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>", "hello", "world", "the", "cat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    tiny.save_pretrained(str(tmp_path))
    model = HybridModel.from_pretrained(str(tmp_path), progress=False)
    assert model.name_or_path == str(tmp_path)
    engine = Engine(model, num_slots=2, block_size=16, max_context=64, compile=False)
    assert engine.tokenizer is not None and engine.stop_token_ids == {1}
    (r,) = engine.generate(["hello the cat"], max_new_tokens=3, stop_token_ids=[])
    assert r.prompt_tokens == 3 and isinstance(r.text, str)
    assert r.token_ids == engine.generate([[2, 4, 5]], max_new_tokens=3, stop_token_ids=[])[0].token_ids
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 512


def test_default_grid_holds_every_step():
    batch_sizes, token_counts = default_grid(64, 2048)
    assert batch_sizes == [2, 4, 8, 16, 32, 64] and token_counts[0] == 2 and token_counts[-1] == 2048
    assert default_grid(6, 100) == ([2, 4, 6], [2, 4, 8, 16, 32, 64, 100])
    assert default_grid(1, 1) == ([1], [1])


class _PlainTokenizer:
    """A tokenizer object whose decode takes the ids only (as tiktoken's and sentencepiece's do)."""

    def encode(self, text):
        return [ord(c) % 500 + 1 for c in text]

    def decode(self, ids):
        return "".join(chr(96 + i % 26) for i in ids)


def test_tokenizer_whose_decode_takes_ids_only(tiny):
    """An object with encode() and decode() is accepted as the tokenizer; one whose decode has no
    skip_special_tokens used to fail with a TypeError after the whole generation had run (its results
    lost); its decode(ids) is now called as it is."""
    engine = Engine(tiny, num_slots=2, block_size=16, max_context=64, tokenizer=_PlainTokenizer(), compile=False)
    (r,) = engine.generate(["hi"], max_new_tokens=3, stop_token_ids=[])
    assert r.text == _PlainTokenizer().decode(r.token_ids) and engine.decode([1, 2]) == "ab"
    _assert_cache_empty(engine)


def test_interrupts_and_abandoned_streams_leave_the_engine_as_new(tiny, monkeypatch):
    """A KeyboardInterrupt from the step or from on_token, an exception thrown into a stream, and a stream
    dropped mid-way: each frees every slot and block and the engine's lock; the next generate matches."""
    engine = Engine(tiny, num_slots=2, token_budget=4, block_size=4, max_context=32, compile=False)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [3, 3, 3]]
    want = [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)]

    def interrupt(*args):
        raise KeyboardInterrupt

    def again():
        _assert_cache_empty(engine)
        assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)] == want

    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, max_new_tokens=5, on_token=interrupt)
    again()
    calls, real = [], tiny.forward_packed
    monkeypatch.setattr(tiny, "forward_packed", lambda *a: calls.append(1) or (interrupt() if len(calls) == 3
                                                                               else real(*a)))
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, max_new_tokens=5)
    monkeypatch.undo()
    again()
    stream = engine.stream(prompts, max_new_tokens=5)
    next(stream)
    with pytest.raises(ValueError, match="thrown"):
        stream.throw(ValueError("thrown"))
    again()
    stream = engine.stream(prompts, max_new_tokens=5)
    next(stream)
    del stream  # dropped: closed when collected
    again()
