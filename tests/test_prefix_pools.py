"""Prefix caching with checkpoint pools smaller than a step's checkpoints (issue 37, item 2), failures
inside planning and saving, and snapshots that hold the checkpoint pools (item 3).

The bookkeeping test drives HybridCache through the prefill protocol with a stand-in step that writes, into
every state a step would write, a mark of the tokens that state follows (`mark`): a checkpoint restored
later must carry the mark of exactly the tokens it is restored for."""

import bisect
import copy
import itertools
import random
import zlib
from array import array

import pytest
import torch

from helpers import unit_gain
from metrics import rel_err
from metrale_graph import Engine, HybridModel, Stream
from metrale_graph.protocol import prefill_call, restore_prefix

BS, EVERY = 16, 64


@pytest.fixture(scope="module")
def model():
    return unit_gain(HybridModel.from_preset("tiny", seed=5), 5)


def tokens(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mark(prefix) -> float:
    """A number that names a token sequence (exact in fp32)."""
    return float(zlib.crc32(array("q", prefix).tobytes()) % 65536)


def slot_mark(cache, slot) -> set[float]:
    return {pool[slot].flatten()[0].item() for pool in cache.conv_states + cache.gdn_states}


def entry_mark(cache, e) -> set[float]:
    return {pool[e].flatten()[0].item() for pool in cache.checkpoint_conv_states + cache.checkpoint_gdn_states}


def marking_step(cache, streams, vocab):
    """A stand-in for the model's step over `streams` ((slot, new tokens), packed in that order): each planned
    checkpoint entry and each slot's states get the mark of the tokens they follow."""
    starts = [0, *itertools.accumulate(len(new) for _, new in streams)]

    def step(packed):
        for t, e in zip(cache.checkpoint_tokens.tolist(), cache.checkpoint_entries.tolist()):
            if t >= 0:
                i = bisect.bisect_right(starts, t) - 1
                slot, new = streams[i]
                for pool in cache.checkpoint_conv_states + cache.checkpoint_gdn_states:
                    pool[e].fill_(mark(cache._tokens[slot] + new[:t - starts[i] + 1]))
        for slot, new in streams:
            for pool in cache.conv_states + cache.gdn_states:
                pool[slot].fill_(mark(cache._tokens[slot] + new))
        return torch.zeros(len(streams), vocab)

    return step


def assert_idle_and_exact(cache):
    """No checkpoint entry in flight (each free or recorded, once), the prefix index consistent with itself,
    and the blocks' ref counts, free lists and block tables those of the slots' contexts."""
    index = cache._index
    recorded = list(index._entries)
    assert sorted(index._free_entries + recorded) == list(range(cache.prefix_checkpoints))
    assert set(index._entry_lru) == set(recorded)
    assert sorted((m.full, m.tail, e) for e, m in index._entries.items()) == sorted(
        (full, tail, e) for full, at in index._by_prefix.items() for tail, e in at.items())
    holders = [0] * cache.num_blocks
    for slot, blocks in enumerate(cache._blocks):
        n = cache.context_lens[slot]
        assert len(blocks) == -(-n // BS) and len(cache._tokens[slot]) == n and len(cache._hashes[slot]) == n // BS
        for b in blocks:
            holders[b] += 1
        row = cache.block_tables[slot].tolist()
        assert row == blocks + [cache.null_block] * (len(row) - len(blocks))
    assert index.refs == holders
    plain, cached = set(index._plain), set(index._cached)
    assert len(plain) == len(index._plain) and not plain & cached
    assert plain | cached == {b for b, r in enumerate(holders) if r == 0}
    assert all(index._keys[b] for b in cached) and not any(index._keys[b] for b in plain)
    assert sorted(index._by_key.items()) == sorted((k, b) for b, keys in enumerate(index._keys) for k in keys)


class Failures:
    """Random failures, each at `rate`: taking a checkpoint entry (raises before the entry is taken: in
    planning, a failure after the entries taken before it), the step, and the copy of a save (the last
    checkpoint pool swapped for one that copy cannot go into, after the other pools were written)."""

    def __init__(self, cache, rng, rate):
        self.cache, self.rng, self.rate, self.count = cache, rng, rate, 0
        real = cache._index.new_entry

        def new_entry():
            if self.roll():
                raise RuntimeError("injected: taking an entry")
            return real()

        cache._index.new_entry = new_entry

    def roll(self) -> bool:
        hit = self.rng.random() < self.rate
        self.count += hit
        return hit

    def step(self, step):
        def failing(packed):
            if self.roll():
                raise RuntimeError("injected: the step")
            return step(packed)

        return failing

    def save(self, slot) -> bool:
        """save_prefix(slot), or False when an injected failure stopped it."""
        pools = self.cache.checkpoint_gdn_states
        real = pools[-1]
        if self.roll():
            pools[-1] = torch.zeros(real.shape[0], 1, 1, 2)
        try:
            return self.cache.save_prefix(slot)
        except RuntimeError as e:
            assert "injected" in str(e) or pools[-1] is not real
            return False
        finally:
            pools[-1] = real


def drive(model, cache, rng, prompts, fail_rate):
    """Run `prompts` through the cache's slots as the engine would: restore the longest kept prefix, feed
    the rest in chunks (several slots per call), decode a token or two, keep the context, reset. Checks
    every restored state's mark and the bookkeeping after every call."""
    vocab = model.config.vocab_size
    failures = Failures(cache, rng, fail_rate)
    todo = iter(prompts)
    work: dict[int, list[int]] = {}  # slot -> tokens still to feed
    restored = 0
    while True:
        for slot in range(cache.num_slots):
            if slot not in work and (prompt := next(todo, None)) is not None:
                n = restore_prefix(model, cache, slot, prompt)
                if n:
                    assert slot_mark(cache, slot) == {mark(prompt[:n])}
                    restored += n
                work[slot] = prompt[n:] + tokens(rng.randint(0, 2), rng.randrange(10**9))  # and a token or two
        if not work:
            return restored, failures.count
        streams = []
        for slot in rng.sample(sorted(work), rng.randint(1, len(work))):
            rest = work[slot]
            size = rng.choice([EVERY, 2 * EVERY, 3 * EVERY, rng.randint(1, 100)])
            streams.append((slot, rest[:size]))
            work[slot] = rest[size:]
        step = failures.step(marking_step(cache, streams, vocab))
        try:
            with prefill_call(model, cache, [Stream(s, new) for s, new in streams]) as call:
                call.run(step)
        except RuntimeError as e:
            assert "injected" in str(e)
            for slot, _ in streams:  # the transaction reset the batch's slots: their requests end
                assert cache.context_lens[slot] == 0
                work.pop(slot)
        assert_idle_and_exact(cache)
        for slot, _ in streams:
            if slot in work and not work[slot]:
                failures.save(slot)
                assert_idle_and_exact(cache)
                cache.reset(slot)
                del work[slot]
        for e in cache._index._entries:  # every recorded checkpoint holds the states of its tokens
            assert len(entry_mark(cache, e)) == 1


@pytest.mark.parametrize("entries", [1, 2, 3, 4])
def test_thousands_of_prompts_through_small_checkpoint_pools(model, entries):
    """Issue 37, item 2: a step that planned more checkpoints than the pool holds raised KeyError and kept
    the entries it had taken, so every later step failed too. Now a small pool keeps fewer checkpoints,
    failures anywhere in planning, the step or saving give back what they took, and every restored
    prefix carries the states of its own tokens."""
    rng = random.Random(entries)
    roots, prompts = [tokens(rng.randint(64, 400), 1000 * entries + i) for i in range(4)], []
    for _ in range(1000):  # parts of a few long prompts and of the latest ones, and a few tokens of their own
        root = rng.choice(roots + prompts[-2:])
        prompts.append((root[:rng.randint(1, len(root))] + tokens(rng.randint(0, 30), rng.randrange(10**9)))[:440])
    cache = model.new_cache(2, 2 * 28 + 12, block_size=BS, max_context=448, prefix_checkpoints=entries,
                            checkpoint_interval=EVERY)
    restored, failed = drive(model, cache, rng, prompts, fail_rate=0.03)
    stats = cache.prefix_stats()
    assert restored > 0 and failed > 0 and stats["evicted_checkpoints"] > 0 and stats["hits"] > 0
    assert cache.context_lens == [0, 0] and not any(cache._index.refs)


def test_a_step_plans_at_most_the_pool_and_keeps_the_deepest(model):
    """A 400-token prompt in one step reaches checkpoints at 64..384 (6); a pool of 4 keeps the deepest 4,
    the shallowest of them evicted first (by a prompt reaching 64), and a later prompt sharing 330 tokens
    restores 320."""
    prompt = tokens(400, 1)
    cache = model.new_cache(1, 30, block_size=BS, max_context=448, prefix_checkpoints=4, checkpoint_interval=EVERY)
    model.prefill(cache, [Stream(0, prompt)])
    assert sorted(m.length for m in cache._index._entries.values()) == [192, 256, 320, 384]
    cache.reset(0)
    model.prefill(cache, [Stream(0, tokens(70, 9))])
    assert sorted(m.length for m in cache._index._entries.values()) == [64, 256, 320, 384]
    cache.reset(0)
    other = prompt[:330] + tokens(20, 2)
    n = restore_prefix(model, cache, 0, other)
    assert n == 320
    assert rel_err(model.prefill(cache, [Stream(0, other[n:])]),
                   model.prefill(model.new_cache(1, 30, block_size=BS), [Stream(0, other)])) <= 1e-5
    cache.reset(0)
    assert_idle_and_exact(cache)


@pytest.mark.parametrize("num_slots,entries", [(1, 1), (1, 4), (2, 1), (2, 3)])
def test_engine_with_a_small_checkpoint_pool_gives_the_tokens_of_no_prefix_cache(model, num_slots, entries):
    """Prompts that reach more checkpoints than the pool holds: the same greedy tokens as without prefix
    caching, hits among them, and the bookkeeping idle at the end."""
    base = tokens(330, 3)
    prompts = [base + tokens(5, 5), base[:300] + tokens(9, 4), tokens(200, 6), base[:290] + tokens(3, 7)]
    kw = dict(num_slots=num_slots, token_budget=384, block_size=BS, max_context=448, compile=False)
    with Engine(model, **kw) as plain, Engine(model, prefix_cache=True, prefix_checkpoints=entries,
                                              checkpoint_interval=EVERY, **kw) as cached:
        want = plain.generate(prompts, max_new_tokens=3)
        got = cached.generate(prompts, max_new_tokens=3)
        turn = prompts[-1] + want[-1].token_ids + tokens(4, 8)  # the next turn: restores the last request
        again = cached.generate([turn], max_new_tokens=3)[0]
        assert again.token_ids == plain.generate([turn], max_new_tokens=3)[0].token_ids
        assert_idle_and_exact(cached.cache)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert again.cached_tokens == len(turn) - 5


def test_the_issue_case_one_slot_default_pool_long_prompt():
    """The issue's own case: one slot, the default pool (4) and interval (128), a 700-token prompt (5
    checkpoints): the request and every later one used to fail with KeyError."""
    m = HybridModel.from_preset("tiny")
    with Engine(m, num_slots=1, compile=False, prefix_cache=True) as e, Engine(m, num_slots=1, compile=False) as p:
        long = [i % 512 for i in range(700)]
        for prompt in (long, [1, 2, 3], long):
            want = p.generate([prompt], max_new_tokens=2)[0].token_ids
            assert e.generate([prompt], max_new_tokens=2)[0].token_ids == want
        assert e.stats().prefix["hits"] > 0
        assert_idle_and_exact(e.cache)


def test_a_save_without_its_copy_does_what_a_failed_copy_does(model):
    """PrefixStore.save(slot, written=False), what a follower of a plan broadcast replays of rank 0's save whose
    copy failed (plan_journal.py): the same entry taken (the only one, evicted) and given back as on the cache
    whose copy failed, so the two caches' bookkeeping stays the same."""
    a, b = tokens(100, 13), tokens(100, 14)
    caches = [model.new_cache(1, 16, block_size=BS, prefix_checkpoints=1) for _ in range(2)]
    for cache in caches:
        model.prefill(cache, [Stream(0, a[:80])])
        assert cache.save_prefix(0)
        cache.reset(0)
        model.prefill(cache, [Stream(0, b[:80])])
    failing, replaying = caches
    failures = Failures(failing, random.Random(0), 1.0)
    failing._index.new_entry = type(failing._index).new_entry.__get__(failing._index)  # (only the copy fails)
    assert not failures.save(0) and failures.count == 1
    with replaying.exclusive():
        assert not replaying.prefixes.save(0, written=False)
    for cache in caches:
        assert_idle_and_exact(cache)
    index, other = failing._index, replaying._index
    assert (index._entries, index._free_entries, index.stats()) == (other._entries, other._free_entries, other.stats())
    assert index.stats()["evicted_checkpoints"] == 1 and not index._entries


# snapshots (issue 37, item 3) ---------------------------------------------------------------------------

def test_restore_puts_back_the_checkpoint_pools(model):
    """Keep a prefix of A, snapshot, keep a prefix of B over the same (only) checkpoint entry, restore, then
    restore A's prefix: it used to come back with B's GDN states (no error, wrong logits)."""
    a, b = tokens(100, 11), tokens(100, 12)
    cache = model.new_cache(1, 16, block_size=BS, prefix_checkpoints=1)
    model.prefill(cache, [Stream(0, a[:80])])
    assert cache.save_prefix(0)
    cache.reset(0)
    snap = cache.snapshot()
    before = [t.clone() for t in cache.state_tensors()]
    model.prefill(cache, [Stream(0, b[:80])])
    assert cache.save_prefix(0) and cache.prefix_stats()["evicted_checkpoints"] == 1
    cache.reset(0)
    cache.restore(snap)
    assert all(torch.equal(x, y) for x, y in zip(cache.state_tensors(), before))
    assert_idle_and_exact(cache)
    assert restore_prefix(model, cache, 0, a) == 80
    got = model.prefill(cache, [Stream(0, a[80:])])
    assert rel_err(got, model.prefill(model.new_cache(1, 16, block_size=BS), [Stream(0, a)])) <= 1e-5


def test_a_snapshot_covers_every_tensor_and_the_host_bookkeeping(model):
    """Every tensor attribute of the cache is in state_tensors() (so in a snapshot), or a view of one there (the
    checkpoint targets' two rows), and a restore gives back the block ref counts, labels, prefix index,
    checkpoint entries, tokens and contexts."""
    cache = model.new_cache(2, 24, block_size=BS, max_context=192, prefix_checkpoints=3, checkpoint_interval=EVERY)
    model.prefill(cache, [Stream(0, tokens(150, 1)), Stream(1, tokens(40, 2))])
    cache.save_prefix(1)
    tensors = {id(t) for t in cache.state_tensors()}
    for name, value in vars(cache).items():
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, torch.Tensor):
                assert id(t) in tensors or (t._base is not None and id(t._base) in tensors), name
    def host():
        index = cache._index
        return (cache.context_lens, cache._blocks, cache._tokens, cache._hashes, index.refs, index._keys,
                index._by_key, index._plain, list(index._cached), index._entries, list(index._entry_lru),
                index._by_prefix, index._free_entries)

    want, snap = copy.deepcopy(host()), cache.snapshot()
    cache.reset(0)
    model.prefill(cache, [Stream(0, tokens(190, 3))])
    cache.save_prefix(0)
    cache.clear_prefixes()
    cache.restore(snap)
    assert host() == want
    assert_idle_and_exact(cache)


def test_restore_refuses_a_snapshot_of_another_cache_of_the_same_geometry(model):
    kw = dict(block_size=BS, prefix_checkpoints=2)
    cache, other = model.new_cache(1, 8, **kw), model.new_cache(1, 8, **kw)
    model.prefill(other, [Stream(0, tokens(30, 1))])
    other.save_prefix(0)
    before = [t.clone() for t in cache.state_tensors()]
    with pytest.raises(ValueError, match="not of this cache"):
        cache.restore(other.snapshot())
    assert all(torch.equal(x, y) for x, y in zip(cache.state_tensors(), before))
    assert cache.context_lens == [0] and cache.prefix_stats()["checkpoints"] == 0


def test_a_restore_that_fails_midway_leaves_an_empty_cache(model):
    """A copy failing midway (here a snapshot tensor of the wrong shape, standing in for a device error)
    leaves pools half restored: the cache then holds nothing, rather than bookkeeping that describes
    other pools, and serves again."""
    cache = model.new_cache(2, 8, block_size=BS, prefix_checkpoints=2)
    model.prefill(cache, [Stream(0, tokens(30, 1))])
    cache.save_prefix(0)
    snap = cache.snapshot()
    snap.tensors[-1] = torch.zeros(3, 5, 7, 11)
    with pytest.raises(RuntimeError):
        cache.restore(snap)
    assert_idle_and_exact(cache)
    assert cache.context_lens == [0, 0] and cache.free_blocks == cache.num_blocks
    assert cache.prefix_stats()["checkpoints"] == 0 and restore_prefix(model, cache, 0, tokens(30, 1)) == 0


@pytest.mark.parametrize("where", ["a step's checkpoints", "a save"])
def test_a_failure_recording_checkpoint_entries_gives_them_back(model, where):
    """The step ran (or the save's copies did) and recording its checkpoint entries raised (PrefixIndex.add_entry):
    the entries taken and not recorded were neither recorded nor given back, so the pool lost them for good (4 of 4
    after a few such failures: no checkpoint kept any more). Now each one is given back."""
    cache = model.new_cache(2, 24, block_size=BS, max_context=256, prefix_checkpoints=4, checkpoint_interval=EVERY)
    index, real, calls = cache._index, cache._index.add_entry, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: recording an entry")
        return real(*args)

    prompt = tokens(200, 21)
    if where == "a save":
        model.prefill(cache, [Stream(0, prompt)])  # (3 checkpoints recorded: 64, 128, 192)
    index.add_entry = failing
    with pytest.raises(RuntimeError, match="injected"):
        if where == "a save":
            cache.save_prefix(0)
        else:
            model.prefill(cache, [Stream(0, prompt)])
    del index.add_entry
    assert_idle_and_exact(cache)
    assert index.available_entries == 4
    cache.reset(0)
    assert_idle_and_exact(cache)
