"""Batched varlen prefill: batching, chunking, cache bookkeeping and input validation."""

import pytest
import torch

from helpers import random_tokens
from metrics import rel_err
from metrale_graph import HybridModel, Stream

VOCAB = 512


@pytest.fixture(scope="module")
def model():
    return HybridModel.from_preset("tiny", seed=3)


def _snapshot(cache):
    return [t.clone() for t in cache.state_tensors()], list(cache.context_lens), cache.free_blocks


def _same(cache, snap):
    tensors, ctx, free = snap
    return (all(torch.equal(a, b) for a, b in zip(cache.state_tensors(), tensors))
            and cache.context_lens == ctx and cache.free_blocks == free)


def test_batched_equals_each_alone(model):
    lengths = [1, 63, 64, 65, 130, 7]
    streams = [random_tokens(n, i) for i, n in enumerate(lengths)]
    batched_cache = model.new_cache(8, 64, block_size=16)
    batched = model.prefill(batched_cache, [Stream(7 - i, t) for i, t in enumerate(streams)])
    for i, t in enumerate(streams):
        alone_cache = model.new_cache(8, 64, block_size=16)
        alone = model.prefill(alone_cache, [Stream(7 - i, t)])
        assert rel_err(batched[i], alone[0]) <= 1e-5
        # the stream's states end up the same too
        for a, b in zip(batched_cache.gdn_states + batched_cache.conv_states,
                        alone_cache.gdn_states + alone_cache.conv_states):
            assert rel_err(a[7 - i], b[7 - i]) <= 1e-5


def test_three_chunks_equal_one_shot(model):
    tokens = random_tokens(150, 11)
    one = model.prefill(model.new_cache(4, 32, block_size=16), [Stream(1, tokens)])
    cache = model.new_cache(4, 32, block_size=16)
    other = random_tokens(40, 12)  # another stream rides along in the middle chunk
    model.prefill(cache, [Stream(1, tokens[:2])])
    model.prefill(cache, [Stream(3, other), Stream(1, tokens[2:67])])
    last = model.prefill(cache, [Stream(1, tokens[67:])])
    assert cache.context_lens[1] == 150 and cache.context_lens[3] == 40
    assert rel_err(last[0], one[0]) <= 1e-5


def test_reset_starts_a_fresh_stream(model):
    a, b = random_tokens(50, 1), random_tokens(30, 2)
    cache = model.new_cache(2, 8, block_size=16)
    fresh = model.prefill(model.new_cache(2, 8, block_size=16), [Stream(0, b)])
    model.prefill(cache, [Stream(0, a)])
    assert cache.free_blocks == 8 - 4
    cache.reset(0)
    assert cache.free_blocks == 8 and cache.context_lens[0] == 0
    assert torch.equal(model.prefill(cache, [Stream(0, b)]), fresh)


def test_tensor_tokens_accepted(model):
    t = random_tokens(20, 5)
    lists = model.prefill(model.new_cache(2, 4), [Stream(0, t)])
    tensors = model.prefill(model.new_cache(2, 4), [Stream(0, torch.tensor(t, dtype=torch.int32))])
    assert torch.equal(lists, tensors)


BAD_BATCHES = [
    pytest.param(lambda c: [], "non-empty list", id="empty-batch"),
    pytest.param(lambda c: Stream(0, [1]), "single Stream", id="not-a-list"),
    pytest.param(lambda c: [Stream(0, [1]), (1, [2])], "expected a Stream", id="not-a-stream"),
    pytest.param(lambda c: [Stream(0, [1]), Stream(9, [2])], "unknown slot 9", id="unknown-slot"),
    pytest.param(lambda c: [Stream(-1, [1])], "unknown slot -1", id="negative-slot"),
    pytest.param(lambda c: [Stream(c.scratch_slot, [1])], "unknown slot", id="scratch-slot"),
    pytest.param(lambda c: [Stream(1.0, [1])], "slot must be an int", id="float-slot"),
    pytest.param(lambda c: [Stream(2, [1]), Stream(2, [3])], "duplicate slot 2", id="duplicate-slot"),
    pytest.param(lambda c: [Stream(0, [1]), Stream(1, [])], "stream 1 is empty", id="empty-stream"),
    pytest.param(lambda c: [Stream(0, [1, VOCAB])], f"token id {VOCAB} is out of range", id="token-too-big"),
    pytest.param(lambda c: [Stream(0, [-3, 1])], "token id -3 is out of range", id="negative-token"),
    pytest.param(lambda c: [Stream(0, [1]), Stream(1, [2, VOCAB + 5]), Stream(2, [-1])],
                 f"stream 1: token id {VOCAB + 5} is out of range", id="first-bad-stream-named"),
    pytest.param(lambda c: [Stream(0, [1, 2**70])], "stream 0: a token id does not fit in int64",
                 id="token-past-int64"),
    pytest.param(lambda c: [Stream(0, torch.tensor([1, 2**63 + 5], dtype=torch.uint64))],
                 f"stream 0: token id {2**63 + 5} does not fit in int64", id="uint64-token-past-int64"),
    pytest.param(lambda c: [Stream(0, [1, 2.0])], "is not an int", id="float-token"),
    pytest.param(lambda c: [Stream(0, torch.ones(3))], "integer tensor", id="float-tensor"),
    pytest.param(lambda c: [Stream(0, torch.ones(2, 2, dtype=torch.long))], "1-D", id="2d-tensor"),
    pytest.param(lambda c: [Stream(0, torch.ones(2, dtype=torch.long, device="meta"))], "on meta",
                 id="wrong-device"),
    pytest.param(lambda c: [Stream(0, "hello")], "sequence of ints", id="string-tokens"),
    pytest.param(lambda c: [Stream(0, torch.tensor([1, 2]).to_sparse())], "dense tensor", id="sparse-tensor"),
    pytest.param(lambda c: [Stream(1, [1] * 60)], "capacity of 128 tokens", id="past-capacity"),
    pytest.param(lambda c: [Stream(2, [1] * 100), Stream(3, [1] * 100)],
                 "needs 14 more KV blocks but the cache has 3 free", id="out-of-blocks"),
]


@pytest.mark.parametrize("make_batch, message", BAD_BATCHES)
def test_bad_input_raises_and_touches_nothing(model, make_batch, message):
    cache = model.new_cache(4, 12, block_size=16, max_context=128)
    model.prefill(cache, [Stream(0, random_tokens(20, 1)), Stream(1, random_tokens(100, 2))])  # prior context
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=message):
        model.prefill(cache, make_batch(cache))
    assert _same(cache, snap)


def test_cache_mismatch_is_rejected(model):
    other = HybridModel.from_preset("tiny", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the cache is torch.bfloat16"):
        model.prefill(other.new_cache(2, 4), [Stream(0, [1])])
    with pytest.raises(ValueError, match="unknown slot 5"):
        model.new_cache(2, 4).reset(5)
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        model.new_cache(2, 0)


def test_restore_of_another_cache_raises_and_copies_nothing(model):
    """A snapshot of a cache with the same pools but other block tables (another max_context) used to
    be copied pool by pool until the block table failed, leaving this cache's pools overwritten under
    its own bookkeeping."""
    cache = model.new_cache(2, 8, block_size=16, max_context=32)
    model.prefill(cache, [Stream(0, random_tokens(20, 1))])
    other = model.new_cache(2, 8, block_size=16, max_context=64)
    model.prefill(other, [Stream(1, random_tokens(30, 2))])
    snap = _snapshot(cache)
    for foreign in (other.snapshot(), model.new_cache(3, 8, block_size=16).snapshot()):
        with pytest.raises(ValueError, match="not of this cache"):
            cache.restore(foreign)
        assert _same(cache, snap)
    own = cache.snapshot()
    model.prefill(cache, [Stream(1, random_tokens(5, 3))])
    cache.restore(own)
    assert _same(cache, snap)



def test_restore_checks_the_block_geometry_without_kv_pools():
    """Without attention layers there are no KV pools, so pools and block tables of the same shapes can
    come from caches of other num_blocks / block_size. restore used to take such a snapshot: the cache
    then counted blocks it does not have (ids past its null block) as free."""
    from helpers import tiny_config

    linear = HybridModel.from_preset(tiny_config(vocab_size=VOCAB, layer_types=("linear_attention",) * 4), seed=1)
    cache = linear.new_cache(2, 4, block_size=4, max_context=32)  # 8 blocks a slot, 4 in all
    snap = _snapshot(cache)
    for num_blocks, block_size, max_context in ((8, 4, 32), (8, 2, 16)):
        other = linear.new_cache(2, num_blocks, block_size=block_size, max_context=max_context)
        linear.prefill(other, [Stream(0, random_tokens(5, 1))])
        with pytest.raises(ValueError, match="not of this cache"):
            cache.restore(other.snapshot())
        assert _same(cache, snap)
    own = cache.snapshot()
    linear.prefill(cache, [Stream(1, random_tokens(9, 2))])
    cache.restore(own)
    assert _same(cache, snap) and cache.free_blocks == 4

def test_cache_max_context_must_be_a_positive_int(model):
    for bad in (True, 0, 2.5):
        with pytest.raises(ValueError, match="max_context must be a positive integer"):
            model.new_cache(2, 8, block_size=16, max_context=bad)


def test_padding_a_padded_batch_keeps_spare_tokens_in_no_stream(model):
    """PackedBatch.fill ended the padding streams at the packed batch's token count; for a batch padded
    already (spare tokens past cu_seqlens[-1]) that made the first new padding stream own the old spare
    tokens, on the scratch slot, against the padding contract."""
    from helpers import packed_batch
    from metrale_graph.batch import PackedBatch

    cache = model.new_cache(4, 8, block_size=16)
    batch = packed_batch(model, cache, [Stream(0, random_tokens(3, 1)), Stream(2, random_tokens(2, 2))])
    once = batch.padded(3, 8, cache)
    assert once.cu_seqlens.tolist() == [0, 3, 5, 5]
    twice = once.padded(4, 10, cache)
    assert twice.cu_seqlens.tolist() == [0, 3, 5, 5, 5]
    assert twice.slot_ids.tolist() == [0, 2, cache.scratch_slot, cache.scratch_slot]
    assert batch.padded(2, 5, cache).cu_seqlens.tolist() == [0, 3, 5]  # B and T exactly at the limit
    assert PackedBatch.padding(2, 4, cache).padded(3, 6, cache).cu_seqlens.tolist() == [0, 0, 0, 0]


def test_a_cache_survives_pickling_and_deepcopy(model):
    """HybridCache.__getstate__ said it served pickle, but kept the owner's weak reference, which pickle
    refuses (TypeError). A pickled cache (torch.save) now loads ownerless, and the first model to use it
    claims it; a deep copy keeps its owner."""
    import copy
    import io

    tokens = random_tokens(9, 1)
    whole = model.prefill(model.new_cache(2, 8, block_size=4), [Stream(0, tokens)])
    cache = model.new_cache(2, 8, block_size=4)
    model.prefill(cache, [Stream(0, tokens[:4])])
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(cache)
    other = HybridModel.from_preset("tiny", seed=3)
    with pytest.raises(ValueError, match="created by another model"):
        other.prefill(twin, [Stream(0, tokens[4:])])
    for c in (cache, loaded, twin):
        assert rel_err(model.prefill(c, [Stream(0, tokens[4:])]), whole) <= 1e-5
    assert loaded.free_blocks == twin.free_blocks == cache.free_blocks == 5


def test_max_context_is_exact_and_within_the_model_positions():
    """The cache holds exactly max_context tokens per slot (it rounded up to whole blocks: 100 became 128),
    and never more than max_position_embeddings (block_size 3 let a 4098-token stream into a 4096-position
    model)."""
    model = HybridModel.from_preset("tiny")  # max_position_embeddings 4096
    cache = model.new_cache(2, 8, block_size=64, max_context=100)
    assert cache.max_context == 100 and cache.max_blocks_per_slot == 2
    model.prefill(cache, [Stream(0, [1] * 100)])
    with pytest.raises(ValueError, match="capacity of 100 tokens per slot"):
        model.prefill(cache, [Stream(1, [1] * 101)])
    assert cache.context_lens == [100, 0]
    odd = model.new_cache(1, 1400, block_size=3)
    assert odd.max_context == 4096
    with pytest.raises(ValueError, match="capacity of 4096"):
        model.prefill(odd, [Stream(0, [1] * 4098)])
    with pytest.raises(ValueError, match=r"max_context \(4097\) exceeds the model's max_position_embeddings"):
        model.new_cache(1, 100, max_context=4097)


def test_numpy_tokens_and_sizes_are_taken_as_users_pass_them():
    """1-D integer numpy arrays and numpy integer scalars are tokens; numpy ints are cache sizes; the
    results equal the same ids as a list. Non-integer arrays are named by their dtype."""
    np = pytest.importorskip("numpy")
    model = HybridModel.from_preset("tiny")
    a, b = model.new_cache(np.int64(2), np.int32(8), block_size=np.int64(16)), model.new_cache(2, 8, block_size=16)
    got = model.prefill(a, [Stream(0, np.array([5, 6, 7])), Stream(1, [np.int64(8), np.uint8(9)])])
    ref = model.prefill(b, [Stream(0, [5, 6, 7]), Stream(1, [8, 9])])
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="tokens must be integers, got a numpy array of dtype float32"):
        model.prefill(a, [Stream(0, np.array([1.0], dtype=np.float32))])
    with pytest.raises(ValueError, match="token True is not an int"):
        model.prefill(a, [Stream(0, [True])])
    with pytest.raises(ValueError, match="stream 0: token None is not an int"):  # (was torch.tensor's TypeError)
        model.prefill(a, [Stream(0, [1, None])])
    with pytest.raises(ValueError, match="num_slots must be a positive integer"):
        model.new_cache(np.float64(2.0), 8)


def test_the_bulk_checks_take_the_common_batches_and_agree_with_the_stream_by_stream_ones(model):
    """validate checks a batch of list tokens or of int64 CPU tensors in bulk (a decode step's host work);
    any other batch stream by stream. Both give the same slots, ids and lengths."""
    np = pytest.importorskip("numpy")
    from metrale_graph.batch import _checked_in_bulk, _checked_one_by_one, validate

    cache = model.new_cache(6, 48, block_size=16, max_context=128)
    model.prefill(cache, [Stream(1, random_tokens(40, 1)), Stream(4, random_tokens(16, 2))])
    lists = [Stream(4, [7]), Stream(1, random_tokens(5, 3)), Stream(0, [0, VOCAB - 1])]
    tensors = [Stream(s.slot, torch.tensor(s.tokens)) for s in lists]
    shared = [9, 2]  # one list every stream holds (a decode step's placeholder): checked once through it
    for batch in (lists, tensors, [Stream(5, [3])], [Stream(2, torch.tensor(random_tokens(88, 4))[::2])],
                  [Stream(0, shared), Stream(3, shared), Stream(2, shared)]):
        bulk = _checked_in_bulk(batch, cache)
        assert bulk is not None
        slots, ids, lengths, same, ends = _checked_one_by_one(batch, cache)
        assert bulk[0] == slots and torch.equal(bulk[1], ids) and bulk[2] == lengths and same is None
        assert bulk[4] == ends == [cache.context_lens[s] + n for s, n in zip(slots, lengths)]
        assert ids.dtype == torch.int64 and lengths == [len(s.tokens) for s in batch]
        one_list = isinstance(batch[0].tokens, list) and len({id(s.tokens) for s in batch}) == 1
        assert bulk[3] is (batch[0].tokens if one_list else None)
    with pytest.raises(ValueError, match=f"stream 0: token id {VOCAB} is out of range"):
        bad = [1, VOCAB]
        validate([Stream(0, bad), Stream(3, bad)], cache, VOCAB)
    others = [lists[:1] + tensors[1:],  # lists and tensors together
              [Stream(0, torch.tensor([1, 2], dtype=torch.int32))], [Stream(0, np.array([1, 2]))],
              [Stream(0, (1, 2))], [Stream(0, [1, np.int64(2)])],
              # tensors that cat refuses together (0-d, dims that differ) or makes what a step cannot take (2-D)
              [Stream(0, torch.tensor(3)), Stream(1, torch.tensor(4))], [Stream(0, torch.tensor([[3]]))],
              [Stream(0, torch.tensor([3])), Stream(1, torch.tensor([[4]]))],
              [Stream(0, torch.tensor([[3]])), Stream(1, torch.tensor([[4]]))],
              [Stream(0, torch.tensor([3])), Stream(1, torch.tensor([True]))],
              [Stream(1, [1] * 89)]]  # the last: past capacity
    for batch in others:
        assert _checked_in_bulk(batch, cache) is None
    slots, ids, lengths, _, ends = _checked_one_by_one(others[0], cache)
    assert slots == [4, 1, 0] and lengths == [1, 5, 2] and ids.tolist() == sum((s.tokens for s in lists), [])
    assert ends == [16 + 1, 40 + 5, 0 + 2]


def test_block_needs_to_gives_the_needs_block_needs_gives():
    """validate's needs from each slot's end (context + new tokens, computed once with the capacity check) are
    block_needs' own: only slots whose blocks hold fewer rows than their end, by as many blocks as they lack
    (slots holding blocks ahead of their context, empty slots, ends on and past block boundaries)."""
    import random

    from metrale_graph.cache_blocks import SlotBlocks

    rng = random.Random(0)
    for block_size in (1, 4, 16):
        held = SlotBlocks(num_slots=12, num_blocks=400, block_size=block_size, prefix_checkpoints=0)
        context = [rng.choice([0, rng.randrange(1, 5 * block_size)]) for _ in range(12)]
        held.take([(slot, -(-c // block_size) + rng.choice([0, 0, 1, 2])) for slot, c in enumerate(context)
                   if c or slot % 3 == 0], 64)
        for _ in range(20):
            slots = rng.sample(range(12), rng.randrange(1, 13))
            lengths = [rng.choice([1, 1, rng.randrange(1, 3 * block_size)]) for _ in slots]
            ends = [context[slot] + n for slot, n in zip(slots, lengths)]
            assert held.needs_to(slots, ends) == held.needs(zip(slots, lengths), context)


def test_a_decode_batch_packs_each_token_at_its_context(model):
    """pack's one-token path (positions = the contexts) and its general path lay out the same fields."""
    from helpers import packed_batch

    cache = model.new_cache(5, 40, block_size=16)
    model.prefill(cache, [Stream(0, random_tokens(31, 1)), Stream(3, random_tokens(32, 2)),
                          Stream(4, random_tokens(48, 3))])
    for streams in ([Stream(3, [5]), Stream(0, [6]), Stream(2, [7]), Stream(4, [8])],
                    [Stream(3, [5, 9]), Stream(0, [6]), Stream(2, [7, 1, 2]), Stream(4, [8])]):
        ctx = [cache.context_lens[s.slot] for s in streams]
        lengths = [len(s.tokens) for s in streams]
        batch = packed_batch(model, cache, streams)
        assert batch.tokens.tolist() == sum((s.tokens for s in streams), [])
        assert batch.positions.tolist() == [c + j for c, n in zip(ctx, lengths) for j in range(n)]
        assert batch.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(streams) + 1)]
        assert batch.slot_ids.tolist() == [s.slot for s in streams] and batch.context_lens.tolist() == ctx
        assert batch.cu_seqlens.dtype == batch.context_lens.dtype == torch.int32
        assert batch.slot_ids.dtype == batch.positions.dtype == torch.int64
        assert torch.equal(batch.block_tables, cache.block_tables[[s.slot for s in streams]])


def test_the_block_table_holds_each_slots_blocks(model):
    """allocate writes the block table once per batch: every slot's row is its blocks, then the null block,
    for streams that take no block, one block, or several."""
    cache = model.new_cache(4, 40, block_size=16)
    for streams in ([Stream(0, random_tokens(16, 1)), Stream(1, random_tokens(40, 2))],
                    [Stream(0, [3]), Stream(1, [4]), Stream(2, random_tokens(70, 3))],
                    [Stream(3, [5]), Stream(1, random_tokens(30, 4)), Stream(0, random_tokens(15, 5))]):
        model.prefill(cache, streams)
        for slot in range(cache.num_slots):
            blocks = cache._blocks[slot]
            assert len(blocks) == -(-cache.context_lens[slot] // 16)
            expected = blocks + [cache.null_block] * (cache.max_blocks_per_slot - len(blocks))
            assert cache.block_tables[slot].tolist() == expected
    held = sorted(b for blocks in cache._blocks for b in blocks)
    assert held == list(range(len(held)))  # handed out lowest first, none twice


def test_pieces_that_end_streams_out_of_order_give_logits_in_stream_order(model):
    """PrefillCall.run with pieces (a runner's split): each stream's logits are those of the piece holding
    its last range, in stream order, however the pieces order the streams."""
    from metrale_graph.protocol import prefill_call

    cache = model.new_cache(6, 16, block_size=16)
    tokens = [random_tokens(4, 1), random_tokens(2, 2), random_tokens(3, 3)]
    streams = [Stream(5, tokens[0]), Stream(2, tokens[1]), Stream(0, tokens[2])]
    fed = []

    def step(packed):  # row r: the slot of the piece's r-th range and its last token
        fed.append((packed.slot_ids.tolist(), packed.tokens.tolist(), packed.positions.tolist()))
        last = packed.tokens[packed.cu_seqlens[1:].long() - 1]
        return torch.stack([packed.slot_ids, last], dim=1).float()

    pieces = [[(1, 0, 2), (0, 0, 2)], [(2, 0, 3), (0, 2, 4)]]  # stream 1 ends first, then 2, then 0
    with prefill_call(model, cache, streams) as call:
        logits = call.run(step, pieces)
    assert logits.tolist() == [[5, tokens[0][-1]], [2, tokens[1][-1]], [0, tokens[2][-1]]]
    assert fed == [([2, 5], tokens[1] + tokens[0][:2], [0, 1, 0, 1]),
                   ([0, 5], tokens[2] + tokens[0][2:], [0, 1, 2, 2, 3])]
    assert [cache.context_lens[s] for s in (5, 2, 0)] == [4, 2, 3]
