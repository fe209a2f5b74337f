"""Prefix caching under tensor parallelism with a plan broadcast (plan_journal.py): 2 gloo ranks on the CPU, fp32,
rank 0 serving and rank 1 following. Requests sharing a system prompt, a conversation's second turn, the same
prompt again, a seeded sampled request, prefixes evicted from small pools and asked for again, a reset prefix
cache, and restores that raise (before their lookup and after it) give the tokens and cached-token counts of the
same engine in one process, and the tokens of the tensor-parallel engine without prefix caching; before every
step rank 1's bookkeeping (contexts, block tables, each slot's blocks, ref counts, free and cached blocks in LRU
order, checkpoint entries, counters) is rank 0's."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from helpers import cache_fingerprint, random_tokens, unit_gain
from metrale_graph import Engine, HybridModel

WORLD = 2
# 3 slots of up to 512 tokens in 40 blocks of 16 and 6 checkpoint entries: the workload evicts blocks and entries
KW = dict(num_slots=3, token_budget=96, block_size=16, max_context=512, num_blocks=40, compile=False)
PREFIX = dict(prefix_cache=True, checkpoint_interval=64, prefix_checkpoints=6)


def _failing_restores(modes: list[str]):
    """Make the engine loop's next prefix restores raise, one per mode: "before" its lookup (nothing done), "after"
    a whole restore (its slot holding the prefix); the restores after them run. Returns the undo."""
    import metrale_graph.loop as loop_module

    real, left = loop_module.restore_prefix, list(modes)

    def restore(*args):
        mode = left.pop(0) if left else None
        if mode == "after":
            real(*args)
        if mode is not None:
            raise RuntimeError(f"restore failed {mode} its lookup")
        return real(*args)

    loop_module.restore_prefix = restore
    return lambda: setattr(loop_module, "restore_prefix", real)


def workload(engine) -> list:
    """Each call's outcome: its requests' (token ids, cached tokens), or the error it raised. One call at a time,
    its requests queued together, so one process and the ranks schedule them alike."""
    system = random_tokens(140, 8)
    prompts = [system + random_tokens(n, 20 + n) for n in (9, 30, 17)]
    out = []

    def run(batch, n=6, **kw):
        try:
            results = engine.generate(batch, max_new_tokens=n, stop_token_ids=[], **kw)
        except RuntimeError as e:
            out.append(str(e).splitlines()[0])
            return None
        out.append([(r.token_ids, r.cached_tokens) for r in results])
        return results

    first = run(prompts)  # one system prompt: the first request keeps it, the two admitted with it find none yet
    run(prompts[1:])  # the system prompt's checkpoints now
    run([prompts[2] + first[2].token_ids + random_tokens(5, 99)])  # a second turn: the whole first restored
    run([prompts[0]])  # the same prompt again: all but its last token
    run([system + random_tokens(4, 23)], temperature=1.0, seed=3)
    run([random_tokens(100, 30 + i) for i in range(6)], n=4)  # other prompts: the pools evict the system's
    run(prompts[:2])  # asked for again, evicted (in part)
    engine.reset_prefix_cache()
    run([prompts[1]])  # nothing kept
    run([system + random_tokens(12, 40)])  # kept again
    undo = _failing_restores(["before", "after"])
    try:
        run([system + random_tokens(9, 41)])
        run([system + random_tokens(9, 42)])
    finally:
        undo()
    run([system + random_tokens(9, 43), prompts[2]])
    return out


def _served(model, prefix: bool):
    """Rank 0 runs the workload, rank 1 follows; each rank's fingerprint before every step, all gathered, and rank
    0's outcomes and cached-token counter."""
    import torch.distributed as dist

    from metrale_graph.plan_sync import STEP

    engine = Engine(model, broadcast_plans=True, **KW, **(PREFIX if prefix else {}))
    prints = []
    if model.tp.rank:
        step = engine._loop.follow_step

        def following(*args):
            prints.append(cache_fingerprint(engine.cache))
            step(*args)
        engine._loop.follow_step = following
        engine.follow()
        out = None
    else:
        send = engine._broadcast.send

        def sending(kind, *args, **kwargs):
            if kind == STEP:
                prints.append(cache_fingerprint(engine.cache))
            send(kind, *args, **kwargs)
        engine._broadcast.send = sending
        out = workload(engine), engine.stats().cached_tokens, engine.stats().prefix
        engine.shutdown()
    ranks = [None] * WORLD
    dist.all_gather_object(ranks, prints)
    return out, ranks


def _worker(rank, folder):
    import torch.distributed as dist

    from metrale_graph.parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel.current()
        model = HybridModel.from_pretrained(os.path.join(folder, "model"), tp=tp, progress=False)
        out = {"cached": _served(model, prefix=True), "plain": _served(model, prefix=False)}
        if rank == 0:
            torch.save(out, os.path.join(folder, "rank0.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the tensor-parallel runs, the one-process run's outcomes, cached-token counter and prefix counters)."""
    folder = tmp_path_factory.mktemp("prefix_tp")
    model = unit_gain(HybridModel.from_preset("tiny", seed=5), 5)
    model.save_pretrained(folder / "model")
    mp.start_processes(_worker, args=(str(folder),), nprocs=WORLD, start_method="spawn")
    with Engine(model, **KW, **PREFIX) as engine:
        one = workload(engine), engine.stats().cached_tokens, engine.stats().prefix
    return torch.load(folder / "rank0.pt"), one


def test_prefix_caching_under_tensor_parallelism_gives_one_process_tokens_and_hits(runs):
    tp, want = runs
    (got, cached, stats), _ = tp["cached"]
    stats.pop("checkpoint_bytes"), want[2].pop("checkpoint_bytes")  # (a rank's: its shard of each state)
    assert (got, cached, stats) == want
    # the workload hit what it meant to: the system prompt's 128 tokens; all but the last token of the same prompts
    # again; a second turn's whole first turn; the other prompts nothing; after them the first prompt nothing (its
    # prefixes evicted); after the reset nothing; the failed restores failed their calls
    system, p1, p2 = 140, 140 + 30, 140 + 17
    assert [c for _, c in got[0]] == [0, 128, 128] and [c for _, c in got[1]] == [p1 - 1, p2 - 1]
    assert got[2][0][1] == p2 + 6 - 1 and got[4][0][1] == 128 and not any(c for _, c in got[5])
    assert got[6][0][1] < system and got[7][0][1] == 0 and got[8][0][1] == 128
    assert got[9:11] == ["restore failed before its lookup", "restore failed after its lookup"]
    assert [c for _, c in got[11]] == [128, 128]
    assert stats["evicted_blocks"] > 0 and stats["evicted_checkpoints"] > 0


def test_prefix_caching_under_tensor_parallelism_gives_the_tokens_without_it(runs):
    tp, _ = runs
    (got, _, _), _ = tp["cached"]
    (plain, plain_cached, _), _ = tp["plain"]
    assert plain_cached == 0
    for k, (a, b) in enumerate(zip(got, plain)):
        if isinstance(a, list):  # (the failed restores: no restore without prefix caching)
            assert [t for t, _ in a] == [t for t, _ in b], f"call {k}"


@pytest.mark.parametrize("run", ["cached", "plain"])
def test_the_follower_holds_rank_0s_cache_before_every_step(runs, run):
    tp, _ = runs
    _, (first, second) = tp[run]
    assert len(first) == len(second) > 20
    for k, (a, b) in enumerate(zip(first, second)):
        assert a == b, f"step {k}: rank 1's bookkeeping is not rank 0's"


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
