"""Prefix caching (metrale_graph/prefix_cache.py, HybridCache's save / restore, the protocol's checkpoints,
the engine's use of them): with and without it, the same logits (fp32, 1e-5) and the same greedy tokens;
ref counts and free blocks back to where they started."""

import random

import pytest
import torch

from helpers import unit_gain
from metrics import rel_err
from metrale_graph import Engine, HybridModel, Stream
from metrale_graph.prefix_cache import PrefixIndex, chain_hashes, prefix_key
from metrale_graph.protocol import restore_prefix

BS = 16


@pytest.fixture(scope="module")
def model():
    return unit_gain(HybridModel.from_preset("tiny", seed=5), 5)  # (unit gain: layers that matter)


def tokens(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(model, prompt):
    """Last-token logits of `prompt` prefilled into a fresh cache without prefix caching."""
    return model.prefill(model.new_cache(1, 64, block_size=BS), [Stream(0, prompt)])


def assert_empty(cache):
    assert cache.context_lens == [0] * cache.num_slots and not any(cache._index.refs)
    assert cache.free_blocks == cache.num_blocks


@pytest.mark.parametrize("kept,label", [(96, "block boundary"), (100, "inside a block")])
def test_a_kept_prefix_gives_the_logits_of_a_full_prefill(model, kept, label):
    prompt = tokens(150, 1)
    cache = model.new_cache(2, 40, block_size=BS, prefix_checkpoints=4)
    model.prefill(cache, [Stream(0, prompt[:kept])])
    assert cache.save_prefix(0) and not cache.save_prefix(0)  # the second: already kept
    cache.reset(0)
    n = restore_prefix(model, cache, 1, prompt)
    assert n == kept, label
    held = cache.free_blocks
    logits = model.prefill(cache, [Stream(1, prompt[n:])])
    assert rel_err(logits, alone(model, prompt)) <= 1e-5
    assert cache.free_blocks < held  # the copied partial block and the new ones are the slot's own
    cache.reset(1)
    assert_empty(cache)


def test_a_shared_block_is_never_written_and_serves_two_slots(model):
    """Two prompts restored from one prefix share its full blocks (ref 2) and continue independently."""
    base = tokens(64, 2)
    a, b = base + tokens(20, 3), base + tokens(30, 4)
    cache = model.new_cache(3, 40, block_size=BS, prefix_checkpoints=4)
    model.prefill(cache, [Stream(0, base)])
    cache.save_prefix(0)
    cache.reset(0)
    assert restore_prefix(model, cache, 1, a) == 64 and restore_prefix(model, cache, 2, b) == 64
    assert cache._blocks[1][:4] == cache._blocks[2][:4] and all(cache._index.refs[x] == 2 for x in cache._blocks[1][:4])
    got = model.prefill(cache, [Stream(1, a[64:]), Stream(2, b[64:])])
    assert rel_err(got[0], alone(model, a)[0]) <= 1e-5 and rel_err(got[1], alone(model, b)[0]) <= 1e-5
    cache.reset(1)
    cache.reset(2)
    assert_empty(cache)


def test_a_copied_cache_keeps_and_restores_prefixes_in_itself(model):
    """A cache's prefix caching (cache.prefixes, which works on its cache) and block bookkeeping (cache.slot_blocks)
    are parts of it: a deep copy and a pickled one (torch.save) keep, find and restore prefixes in themselves,
    never in the cache they were copied from."""
    import copy
    import io

    prompt = tokens(100, 6)
    cache = model.new_cache(2, 40, block_size=BS, prefix_checkpoints=4)
    model.prefill(cache, [Stream(0, prompt[:64])])
    refs, free = list(cache._index.refs), cache.free_blocks
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    for c in (copy.deepcopy(cache), torch.load(buffer, weights_only=False)):
        assert c.prefixes.cache is c
        assert c.save_prefix(0) and restore_prefix(model, c, 1, prompt) == 64
        assert rel_err(model.prefill(c, [Stream(1, prompt[64:])]), alone(model, prompt)) <= 1e-5
        assert c.prefix_stats()["hits"] == 1
    assert cache.prefix_stats()["checkpoints"] == cache.prefix_stats()["lookups"] == 0
    assert cache._index.refs == refs and cache.free_blocks == free and cache.context_lens == [64, 0]


def test_interval_checkpoints_inside_one_step(model):
    """A prompt of 200 tokens in one step with a checkpoint interval of 64 leaves states at 64, 128 and 192
    (the GDN ops keep them inside the step): a prompt sharing 150 tokens restores 128."""
    first, second = tokens(200, 6), None
    second = first[:150] + tokens(40, 7)
    cache = model.new_cache(2, 40, block_size=BS, prefix_checkpoints=8, checkpoint_interval=64)
    model.prefill(cache, [Stream(0, first)])
    assert cache.prefix_stats()["checkpoints"] == 3
    cache.reset(0)
    n = restore_prefix(model, cache, 1, second)
    assert n == 128
    assert rel_err(model.prefill(cache, [Stream(1, second[n:])]), alone(model, second)) <= 1e-5
    cache.reset(1)
    assert_empty(cache)


def test_restore_refuses_bad_calls_before_changing_anything(model):
    cache = model.new_cache(2, 8, block_size=BS, prefix_checkpoints=2)
    model.prefill(cache, [Stream(0, [1, 2, 3])])
    with pytest.raises(ValueError, match="slot 0 holds 3 tokens"):
        restore_prefix(model, cache, 0, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="out of range"):
        restore_prefix(model, cache, 1, [1, 600])
    with pytest.raises(ValueError, match="limit must be an int"):
        restore_prefix(model, cache, 1, [1, 2], limit=5)
    with pytest.raises(ValueError, match="limit must be an int in .*, got True"):  # (was taken as 1)
        restore_prefix(model, cache, 1, [1, 2], limit=True)
    assert cache.context_lens == [3, 0]
    with pytest.raises(ValueError, match="checkpoint_interval"):
        model.new_cache(2, 8, block_size=BS, prefix_checkpoints=2, checkpoint_interval=24)
    assert restore_prefix(model, model.new_cache(1, 8), 0, [1, 2, 3]) == 0  # no prefix caching: nothing cached


@pytest.mark.parametrize("where", ["take", "adopt"])
def test_a_restore_that_fails_taking_its_blocks_holds_none(model, monkeypatch, where):
    """A restore shares the prefix's full blocks, then takes a block for the partial one and gives the slot its
    blocks (SlotBlocks.adopt). A failure in between (the take, the adopt) reset the slot, which held no blocks yet:
    the shared blocks kept their refs with no holder, lost to the pool for good. Now the slot holds them from the
    start of the restore's transaction, so its reset drops them; a restore after gives the logits of a prefill."""
    from metrale_graph.cache_blocks import SlotBlocks
    from metrale_graph.prefix_cache import PrefixIndex

    prompt = tokens(100, 9)
    cache = model.new_cache(2, 24, block_size=BS, prefix_checkpoints=2)
    model.prefill(cache, [Stream(0, prompt[:70])])  # 4 full blocks and a partial one
    cache.save_prefix(0)
    cache.reset(0)
    owner = PrefixIndex if where == "take" else SlotBlocks
    real = getattr(owner, where)

    def failing(*args):
        raise RuntimeError(f"injected: {where}")

    monkeypatch.setattr(owner, where, failing)
    with pytest.raises(RuntimeError, match="injected"):
        restore_prefix(model, cache, 1, prompt)
    monkeypatch.setattr(owner, where, real)
    assert_empty(cache)
    assert restore_prefix(model, cache, 1, prompt) == 70
    assert rel_err(model.prefill(cache, [Stream(1, prompt[70:])]), alone(model, prompt)) <= 1e-5
    cache.reset(1)
    assert_empty(cache)


def test_the_index_evicts_least_recently_used_blocks_and_checkpoints():
    index = PrefixIndex(num_blocks=3, block_size=2, num_entries=1)
    blocks = [index.take() for _ in range(3)]
    assert blocks == [0, 1, 2] and index.free_blocks == 0
    hashes = chain_hashes([5, 6, 7, 8], 2)
    index.label(0, hashes[0])
    index.label(1, hashes[1])
    for b in blocks:
        index.drop(b)
    assert index.free_blocks == 3 and index.cached_blocks == 2
    assert index.take() == 2  # a plain block first: cached content stays findable
    e = index.new_entry()
    index.add_entry(e, 4, hashes[1], ())
    assert index.lookup([5, 6, 7, 8, 9], 5).length == 4
    assert index.take() == 0  # the least recently freed cached block: the prefix through it is gone
    assert index.lookup([5, 6, 7, 8, 9], 5) is None
    assert index.new_entry() == e and index.stats()["evicted_checkpoints"] == 1
    assert prefix_key(b"", [1]) != prefix_key(b"", [2])


@pytest.fixture(scope="module")
def engines(model):
    kw = dict(num_slots=3, token_budget=96, block_size=BS, max_context=512, compile=False)
    plain = Engine(model, **kw)
    cached = Engine(model, prefix_cache=True, checkpoint_interval=64, prefix_checkpoints=12, **kw)
    yield plain, cached
    plain.shutdown()
    cached.shutdown()


def test_engine_hits_give_the_same_greedy_tokens(engines):
    plain, cached = engines
    system = tokens(140, 8)
    prompts = [system + tokens(n, 20 + n) for n in (9, 30, 17)]
    want = plain.generate(prompts, max_new_tokens=6)
    got = cached.generate(prompts, max_new_tokens=6)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert got[0].cached_tokens == 0 and all(r.cached_tokens == 128 for r in got[1:])  # the system prompt's 128
    # the same prompt again: all but its last token restored (kept after all but the last prompt token)
    again = cached.generate([prompts[1]], max_new_tokens=6)[0]
    assert again.token_ids == want[1].token_ids and again.cached_tokens == len(prompts[1]) - 1
    # the next turn of a conversation: the whole previous request (prompt + new tokens but the last) restored
    turn = prompts[2] + want[2].token_ids + tokens(5, 99)
    a, b = plain.generate([turn], max_new_tokens=6)[0], cached.generate([turn], max_new_tokens=6)[0]
    assert a.token_ids == b.token_ids and b.cached_tokens == len(prompts[2]) + len(want[2].token_ids) - 1
    # a one-token suffix: a request's prompt and all its new tokens (it fed all but the last one)
    one = prompts[0] + want[0].token_ids
    a, b = plain.generate([one], max_new_tokens=3)[0], cached.generate([one], max_new_tokens=3)[0]
    assert a.token_ids == b.token_ids and b.cached_tokens == len(one) - 1
    stats = cached.stats()
    assert stats.cached_tokens > 0 and stats.prefix["hits"] >= 5 and stats.used_blocks == 0
    assert cached.cache._index.refs == [0] * cached.cache.num_blocks


def test_reset_prefix_cache_forgets_every_prefix_and_frees_its_blocks(engines):
    plain, cached = engines
    prompts = [tokens(140, 31) + tokens(n, 40 + n) for n in (7, 12)]
    first = cached.generate(prompts, max_new_tokens=4)
    assert first[1].cached_tokens == 128
    assert cached.stats().prefix["checkpoints"] > 0 and cached.cache._index.cached_blocks > 0
    hits = cached.stats().prefix["hits"]
    cached.reset_prefix_cache()
    index = cached.cache._index
    assert cached.stats().prefix["checkpoints"] == 0 and index.cached_blocks == 0 and index.hits == hits
    assert cached.cache.free_blocks == cached.cache.num_blocks and index.refs == [0] * cached.cache.num_blocks
    again = cached.generate([prompts[1]], max_new_tokens=4)[0]  # nothing kept: a full prefill, the same tokens
    assert again.cached_tokens == 0 and again.token_ids == first[1].token_ids
    plain.reset_prefix_cache()  # no prefix caching: nothing to forget


def test_clearing_the_index_keeps_held_blocks_held():
    index = PrefixIndex(num_blocks=4, block_size=2, num_entries=2)
    held, freed = index.take(), index.take()
    hashes = chain_hashes([1, 2, 3, 4], 2)
    index.label(held, hashes[0])
    index.label(freed, hashes[1])
    index.drop(freed)
    index.add_entry(index.new_entry(), 4, hashes[1], ())
    assert index.cached_blocks == 1 and index.lookup([1, 2, 3, 4, 5], 5) is not None
    index.clear()
    assert index.lookup([1, 2, 3, 4, 5], 5) is None and index.cached_blocks == 0 and index.free_blocks == 3
    assert index.refs[held] == 1 and index.block_of(hashes[0]) is None
    assert [index.take() for _ in range(3)] == sorted({0, 1, 2, 3} - {held})  # low ids first, as before
    assert index.new_entry() == 0


def test_random_prefixes_in_small_pools(model):
    """Many requests sharing random prefixes, few blocks and checkpoints (evictions all along): the same
    greedy tokens as without prefix caching, and every block free at the end."""
    rng = random.Random(0)
    roots = [tokens(rng.randint(20, 120), 100 + i) for i in range(4)]
    prompts = []
    for i in range(14):
        root = rng.choice(roots + prompts[-3:] if prompts else roots)
        prompts.append(root[:rng.randint(1, len(root))] + tokens(rng.randint(1, 40), 200 + i))
    kw = dict(num_slots=2, token_budget=80, block_size=BS, max_context=256, num_blocks=28, compile=False)
    with Engine(model, **kw) as plain, Engine(model, prefix_cache=True, checkpoint_interval=64,
                                              prefix_checkpoints=3, **kw) as cached:
        want = plain.generate(prompts, max_new_tokens=5)
        got = cached.generate(prompts, max_new_tokens=5)
        more = cached.generate(prompts[::-1], max_new_tokens=5)
        stats = cached.stats().prefix
        cache = cached.cache
        assert cache._index.refs == [0] * cache.num_blocks and cache.free_blocks == cache.num_blocks
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.token_ids for r in more] == [r.token_ids for r in want[::-1]]
    assert stats["hits"] > 0 and stats["evicted_checkpoints"] > 0 and stats["evicted_blocks"] > 0


def test_a_token_budget_below_64_still_admits_prompts(model):
    """With prefix caching a request waits for 64 tokens of budget; a budget below 64 (here 32) never has
    them, and the loop stopped on "requests that fit no step", every later request failing. Now the whole
    budget is enough: the same greedy tokens as without prefix caching, prompts longer than the budget too."""
    prompts = [tokens(100, 1), tokens(100, 1)[:70] + tokens(9, 2), tokens(3, 3)]
    kw = dict(num_slots=2, token_budget=32, block_size=BS, max_context=256, compile=False)
    with Engine(model, **kw) as plain, Engine(model, prefix_cache=True, **kw) as cached:
        want = plain.generate(prompts, max_new_tokens=3)
        got = cached.generate(prompts, max_new_tokens=3)
        again = cached.generate(prompts[:1], max_new_tokens=3)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert again[0].token_ids == want[0].token_ids



def test_prompts_chunked_below_64_tokens_keep_their_interval_checkpoints(model):
    """A token budget below 64 feeds a prompt in chunks shorter than 64 tokens, which end on the interval's
    multiples (the scheduler cuts them there) without a stream's context ever 64 tokens before one: the
    checkpoints at 64 and 128 are taken at those chunks' last tokens. None was written (every interval multiple
    had to lie a multiple of 64 past the context), so a prompt sharing 140 tokens with an earlier one restored
    nothing."""
    first = tokens(150, 71)
    nested = [first[:140] + tokens(5, 72), first[:100] + tokens(5, 73)]
    kw = dict(num_slots=2, token_budget=32, block_size=BS, max_context=256, compile=False)
    with (Engine(model, **kw) as plain,
          Engine(model, prefix_cache=True, checkpoint_interval=64, prefix_checkpoints=32, **kw) as cached):
        cached.generate([first], max_new_tokens=2)
        got = [cached.generate([p], max_new_tokens=4)[0] for p in nested]
        want = [plain.generate([p], max_new_tokens=4)[0] for p in nested]
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.cached_tokens for r in got] == [128, 64]
        # a decode reaching 64 keeps no checkpoint there: the request keeps its two (after all but its last prompt
        # token, and at its end), as before
        kept = cached.stats().prefix["checkpoints"]
        cached.generate([tokens(3, 74)], max_new_tokens=70)
        assert cached.stats().prefix["checkpoints"] == kept + 2


def test_a_failed_restore_fails_its_request_and_the_engine_goes_on(model, monkeypatch):
    """A prefix restore that raises at admission (its state copies failing on the device, as a step's ops may)
    fails that request with the error, as a failing step fails its requests; the others run, and later requests
    hit the prefix and give plain decoding's tokens. It stopped the engine loop: every request then and after
    ended with EngineClosedError."""
    import metrale_graph.loop as loop_module

    system = tokens(140, 8)
    prompts = [system + tokens(9, 60), tokens(30, 61), system + tokens(12, 62)]
    kw = dict(num_slots=3, token_budget=96, block_size=BS, max_context=512, compile=False)
    with Engine(model, **kw) as plain, Engine(model, prefix_cache=True, checkpoint_interval=64, **kw) as cached:
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=5)]
        cached.generate([system + tokens(3, 63)], max_new_tokens=2)  # the system prompt's prefix kept
        real, calls = loop_module.restore_prefix, []

        def failing(*args):
            calls.append(1)
            if len(calls) in (1, 3):
                raise RuntimeError("restore failed")
            return real(*args)

        monkeypatch.setattr(loop_module, "restore_prefix", failing)
        handles = [cached.submit(p, max_new_tokens=5) for p in prompts[:2]]
        with pytest.raises(RuntimeError, match="restore failed"):
            handles[0].result(60)
        assert handles[1].result(60).token_ids == want[1]
        with pytest.raises(RuntimeError, match="restore failed"):  # alone: its step then holds nothing
            cached.generate(prompts[2:], max_new_tokens=5)
        monkeypatch.undo()
        got = cached.generate(prompts, max_new_tokens=5)
        assert [r.token_ids for r in got] == want and got[0].cached_tokens == 128
        assert cached.cache.context_lens == [0] * 3 and cached.cache.free_blocks == cached.cache.num_blocks
        assert not any(cached.cache._index.refs)

def test_the_onnx_export_refuses_a_cache_that_keeps_checkpoints_in_the_step(model):
    pytest.importorskip("onnxscript")
    from metrale_graph.onnx import export_prefill

    cache = model.new_cache(2, 8, block_size=BS, prefix_checkpoints=2, checkpoint_interval=64)
    with pytest.raises(ValueError, match="prefix-caching checkpoints inside the step"):
        export_prefill(model, cache, 2, 16)


def test_bench_prefix_runs_its_workloads_with_the_same_tokens(capsys):
    """tools.bench_prefix on the tiny preset, shrunk: every workload with and without the cache gives the
    same greedy tokens, and the cache restores prefixes in each."""
    import json

    from metrale_graph.tools import bench_prefix

    bench_prefix.main(["--scale", "0.05", "--requests", "6", "--num-slots", "3", "--eager", "--max-new-tokens", "4",
                       "--checkpoint-interval", "64", "--prefix-checkpoints", "24", "--workloads", "system,chat,split"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name, w in record["workloads"].items():
        assert w["same_tokens"] and w["identical_requests"] == w["same_first_token"] == w["requests"] > 0, name
        assert w["with"]["cached_tokens"] > 0 and w["without"]["cached_tokens"] == 0, name


def test_bench_prefix_scales_its_interval_and_budget_with_the_workloads(capsys):
    """At --scale 0.1 (a quick CPU run) the defaults were the Engine's: a 2048-token budget started every short
    prompt in the first step, and the 128-token interval hardly fit the shared part: hit rates 0.0%, unexplained.
    The interval and budget scale with --scale (the interval a multiple of 64) and are printed; a shared part
    still shorter than the interval is named."""
    import json

    from metrale_graph.tools import bench_prefix

    bench_prefix.main(["--scale", "0.1", "--requests", "4", "--num-slots", "4", "--eager", "--max-new-tokens", "2",
                       "--workloads", "system,split"])
    out = capsys.readouterr().out
    assert "checkpoint interval 64 tokens, token budget 204 tokens (--scale 0.1)" in out and "note:" not in out
    record = json.loads(out.strip().splitlines()[-1])
    assert (record["checkpoint_interval"], record["token_budget"]) == (64, 204)
    for name, w in record["workloads"].items():
        assert w["with"]["hit_rate"] >= 0.5 and w["same_tokens"], name
    bench_prefix.main(["--scale", "0.02", "--requests", "2", "--num-slots", "2", "--eager", "--max-new-tokens", "1",
                       "--workloads", "system,chat,split"])
    out = capsys.readouterr().out
    assert ("note: the shared prefix of system (40 tokens), split (30 tokens) is shorter than the checkpoint interval "
            "(64): no checkpoint falls inside it") in out
    with pytest.raises(SystemExit):
        bench_prefix.main(["--checkpoint-interval", "100"])
    assert "--checkpoint-interval must be a multiple of 64" in capsys.readouterr().err


def test_take_many_hands_out_the_blocks_take_would():
    """PrefixIndex.take_many(n) (a batch's blocks at once) gives what n calls of take() give: plain free
    blocks lowest id first, then cached ones least recently freed first."""
    import copy

    index = PrefixIndex(num_blocks=8, block_size=2, num_entries=0)
    blocks = [index.take() for _ in range(8)]
    for k, b in enumerate([5, 1, 6, 2, 7]):
        if k < 2:
            index.label(b, bytes([k + 1]))  # 5 and 1 keep a key: cached once dropped
        index.drop(b)
    for n in range(index.free_blocks + 1):  # 3 plain, then 2 cached
        one_by_one = copy.deepcopy(index)
        together = copy.deepcopy(index)
        assert together.take_many(n) == [one_by_one.take() for _ in range(n)]
        assert together.refs == one_by_one.refs and together.free_blocks == one_by_one.free_blocks
    assert sorted(blocks) == list(range(8))


def test_a_sampling_failure_after_a_stop_keeps_no_state_past_the_prefix(model, monkeypatch):
    """With overlap a request that stops at step N is already in step N + 1, which feeds it the stop token. When
    N + 1's sampling raises (after its step ran), N is delivered first: the request ends "stop", and its slot's
    context is kept for later prompts. That slot's GDN state had been advanced by N + 1's uncommitted token, so the
    prefix kept under the request's fed tokens held the state one token further on, and a later prompt through that
    prefix restored it and gave other tokens than without prefix caching. Now a failed launch resets its slots
    before the step before is delivered: nothing wrong is kept, and later prompts give plain decoding's tokens."""
    import metrale_graph.loop as loop_module

    kw = dict(num_slots=2, token_budget=64, block_size=BS, max_context=256, compile=False)
    prompt, other = tokens(20, 81), tokens(9, 82)
    with Engine(model, **kw) as plain, Engine(model, prefix_cache=True, **kw) as cached:
        free = plain.generate([prompt], max_new_tokens=8, stop_token_ids=[])[0].token_ids
        stop = free[3]
        follow = prompt + free[:3] + tokens(5, 83)
        want = plain.generate([follow, other], max_new_tokens=6, stop_token_ids=[])
        real, armed = loop_module.sample, []

        def failing(logits, rows, *args):
            if armed:
                armed.clear()
                raise RuntimeError("sampling failed")
            result = real(logits, rows, *args)
            if stop in result.tokens.tolist():
                armed.append(1)
            return result

        monkeypatch.setattr(loop_module, "sample", failing)
        ended = cached.generate([prompt], max_new_tokens=8, stop_token_ids=[stop])[0]
        assert ended.token_ids == free[:4] and ended.finish_reason == "stop"
        monkeypatch.undo()
        assert cached.cache.context_lens == [0, 0] and not any(cached.cache._index.refs)
        got = cached.generate([follow, other], max_new_tokens=6, stop_token_ids=[])
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
