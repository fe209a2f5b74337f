"""On a GPU: the whole batched prefill replayed through CUDA graphs, every bucket of a 4 x 4 grid
on a multi-layer bf16 model, against eager on an identical cache."""

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import replay_memory_growth
from metrics import rel_err
from metrale_graph import HybridModel, PRESETS, Stream
from metrale_graph.capture import GraphRunner

pytestmark = pytest.mark.gpu

BATCH_SIZES, TOKEN_COUNTS = [1, 2, 4, 8], [64, 256, 512, 1024]
# 9B head shapes, fewer heads and a small hidden size so 16 buckets compile quickly
CFG = PRESETS["qwen3.5-9b"].replace(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                                    linear_num_value_heads=4)


@pytest.fixture(scope="module")
def setup():
    model = HybridModel.from_preset(CFG, dtype=torch.bfloat16, device="cuda", seed=11)
    cache_g = model.new_cache(num_slots=12, num_blocks=400)
    cache_e = model.new_cache(num_slots=12, num_blocks=400)
    runner = GraphRunner(model, cache_g, batch_sizes=BATCH_SIZES, token_counts=TOKEN_COUNTS)
    counters.clear()
    reports = runner.warmup(progress=False)
    # one dynamic trace for the 12 buckets of several streams, one for the 4 of one stream (their own step)
    assert counters["stats"]["unique_graphs"] == 2
    assert all(runner.entries[b].batch.num_streams == b.streams for b in runner.grid)
    for r in reports:
        print(f"{r.bucket}: compile {r.compile_s:.2f} s, capture {r.capture_s:.3f} s, "
              f"graph memory {r.graph_bytes / 2**20:.1f} MiB")
    return model, runner, cache_g, cache_e


def _batch_for(bucket, lower, g, cache, vocab):
    """A random batch that lands in `bucket`: streams in (previous size, B], tokens in (previous, T]."""
    lo_b, lo_t = lower
    n = int(torch.randint(lo_b + 1, bucket.streams + 1, (1,), generator=g))
    total = int(torch.randint(max(lo_t + 1, n), bucket.tokens + 1, (1,), generator=g))
    cuts = sorted(torch.randperm(total - 1, generator=g)[: n - 1].add(1).tolist())
    lengths = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    slots = torch.randperm(cache.num_slots, generator=g)[:n].tolist()
    for s, L in zip(slots, lengths):  # keep room: restart slots that would overflow
        if cache.context_lens[s] + L > cache.max_context:
            return None
    return [Stream(s, torch.randint(0, vocab, (L,), generator=g)) for s, L in zip(slots, lengths)]


def _slot_rows(cache, slots):
    mask = torch.zeros(cache.num_slots + 1, dtype=torch.bool, device=cache.device)
    mask[slots] = True
    blocks = torch.zeros(cache.num_blocks + 1, dtype=torch.bool, device=cache.device)
    for s in slots:
        blocks[cache.block_tables[s][cache.block_tables[s] != cache.null_block].long()] = True
    return mask, blocks


def test_every_bucket_replays_like_eager(setup):
    model, runner, cache_g, cache_e = setup
    g = torch.Generator().manual_seed(0)
    grid = runner.grid
    for round_ in range(2):  # the second round continues streams of the first (prior context)
        for bucket in grid:
            prev_b = max([b for b in BATCH_SIZES if b < bucket.streams], default=0)
            prev_t = max([t for t in TOKEN_COUNTS if t < bucket.tokens], default=0)
            batch = _batch_for(bucket, (prev_b, prev_t), g, cache_g, CFG.vocab_size)
            if batch is None:
                continue
            tokens = sum(len(s.tokens) for s in batch)
            assert runner.grid and bucket == min(b for b in grid if b.holds(len(batch), tokens))
            before = [t.clone() for t in cache_g.state_tensors()]
            out = runner.prefill(batch)
            ref = model.prefill(cache_e, batch)
            err = rel_err(out.float(), ref.float())
            assert err <= 1e-2, f"{bucket}: logits {err:.2e}"
            slots, blocks = _slot_rows(cache_g, [s.slot for s in batch])
            pools = list(zip(cache_g.conv_states + cache_g.gdn_states, cache_e.conv_states + cache_e.gdn_states,
                             before[: 2 * len(cache_g.conv_states)]))
            for got, want, old in pools:
                assert torch.equal(got[~slots], old[~slots]), f"{bucket}: a slot outside the batch changed"
                assert rel_err(got[slots].float(), want[slots].float()) <= 1e-2
            n = 2 * len(cache_g.conv_states)
            for got, want, old in zip(cache_g.k_caches + cache_g.v_caches, cache_e.k_caches + cache_e.v_caches,
                                      before[n:]):
                assert torch.equal(got[~blocks], old[~blocks]), f"{bucket}: a block outside the batch changed"
                assert rel_err(got[blocks].float(), want[blocks].float()) <= 1e-2
        assert cache_g.context_lens == cache_e.context_lens


def test_no_memory_growth_over_1000_replays(setup):
    _, runner, _, _ = setup
    allocated, reserved = replay_memory_growth(runner, CFG.vocab_size)
    print(f"after 1000 replays: allocated {allocated:+d} B, reserved {reserved:+d} B")
    assert allocated <= 0 and reserved <= 0


def test_unwarmed_bucket_captures_before_the_batch_is_copied_in(setup):
    """prefill on a bucket warmup() never saw: capturing it (which pads the static buffers) must not
    clobber the batch that is replayed."""
    model, _, _, _ = setup
    cache_r, cache_e = model.new_cache(4, 64), model.new_cache(4, 64)
    runner = GraphRunner(model, cache_r, batch_sizes=[2], token_counts=[128])
    g = torch.Generator().manual_seed(5)
    batch = [Stream(3, torch.randint(0, CFG.vocab_size, (90,), generator=g)),
             Stream(1, torch.randint(0, CFG.vocab_size, (30,), generator=g))]
    out = runner.prefill(batch)
    assert rel_err(out.float(), model.prefill(cache_e, batch).float()) <= 1e-2
