"""Speculative decoding under tensor parallelism with a plan broadcast (speculative/following.py): 2 gloo ranks on
the CPU, fp32, eager, rank 0 serving and rank 1 following. With n-gram drafts (an oracle's, kept and rejected),
a random MTP head's (rejected) and the bigram checkpoint's (all kept), k 1 to 3, the eager acceptance and the
static-buffer one (SpeculativeGraphs uncompiled),
requests arriving at different steps, an abort, prefix-cache hits, a seeded sampled request, a penalized one and
one asking for prompt logprobs (its prompt's step run apart on every rank) beside greedy ones give rank 0 the tokens
of plain decoding on the same ranks, and the prompt logprobs of one process; before every message rank 1's cache
bookkeeping is rank 0's, and at the end neither rank holds a block."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from helpers import cache_fingerprint, random_tokens, tiny_config, unit_gain
from speculative_reference import Oracle, bigram_model, staggered, with_eager_tail, with_random_mtp
from metrale_graph import Engine, HybridModel

WORLD = 2
CFG = tiny_config(mtp_num_hidden_layers=1)
KW = dict(num_slots=3, token_budget=64, block_size=16, max_context=160, compile=False, prefix_cache=True)
PROMPTS = [random_tokens(n, s, CFG.vocab_size) for n, s in [(7, 1), (23, 2), (3, 3), (41, 4), (12, 5)]]
SHARED = random_tokens(70, 9, CFG.vocab_size)
GRID = dict(batch_sizes=[2, 4], token_counts=[16, 128])  # the static-buffer tail's buckets (128: every step fits)
OPTIONS = {  # name: (the model, speculative, whether the tail takes SpeculativeGraphs' static buffers)
    "ngram-1-buffers": ("random", {"method": "ngram", "num_tokens": 1}, True),
    "ngram-3": ("random", {"method": "ngram", "num_tokens": 3}, False),
    "mtp-1": ("random", {"method": "mtp", "num_tokens": 1}, False),
    "mtp-2-buffers": ("random", {"method": "mtp", "num_tokens": 2}, True),
    "mtp-3-bigram": ("bigram", {"method": "mtp", "num_tokens": 3}, False),
}


def workload(engine) -> list:
    """Rank 0's calls: requests at two times with one aborted; a prompt, then one that restores it; a seeded
    sampled request, a penalized one (the eager acceptance) and one asking for prompt logprobs beside a greedy
    one, whose prompts were kept; then that request's (prompt logprob, rank) of each prompt token but the first."""
    out = [staggered(engine, PROMPTS, abort=3)]
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    out.append([(r.token_ids, r.cached_tokens) for p in (SHARED, SHARED + [3, 4]) for r in engine.generate([p], **kw)])
    handles = [engine.submit(PROMPTS[0], temperature=0.8, top_k=20, seed=7, **kw),
               engine.submit(PROMPTS[1], repetition_penalty=1.3, **kw), engine.submit(PROMPTS[2], **kw),
               engine.submit(PROMPTS[3], prompt_logprobs=2, **kw)]
    results = [h.result() for h in handles]
    out.append([r.token_ids for r in results])
    out.append([(e.logprob, e.rank) for e in results[-1].prompt_logprobs[1:]])
    return out


def _served(model, speculative=None, buffers=False, oracle=None):
    """Rank 0 runs the workload, rank 1 follows; each rank's fingerprints (rank 0's as it sends each message, rank
    1's after replaying its journal), the blocks each holds at the end and its slots' contexts, all gathered; rank
    0's outcomes and speculative stats."""
    import torch.distributed as dist

    from metrale_graph.speculative import verify

    engine = Engine(model, broadcast_plans=True, speculative=speculative, **KW)
    if buffers:
        from metrale_graph.capture import make_grid

        with_eager_tail(engine, make_grid(GRID["batch_sizes"], GRID["token_counts"]))
    prints, out = [], None
    if model.tp.rank:
        replay = engine._loop.replay.replay

        def replaying(*args):
            replay(*args)
            prints.append(cache_fingerprint(engine.cache))
        engine._loop.replay.replay = replaying
        engine.follow()
    else:
        send = engine._broadcast.send

        def sending(*args, **kwargs):
            prints.append(cache_fingerprint(engine.cache))
            send(*args, **kwargs)
        engine._broadcast.send = sending
        real = verify.ngram_propose
        verify.ngram_propose = oracle or real
        try:
            out = workload(engine), engine.stats().speculative
        finally:
            verify.ngram_propose = real
        engine.shutdown()
    held = engine.cache.num_blocks - engine.cache.free_blocks, sum(engine.cache.context_lens)
    ranks = [None] * WORLD
    dist.all_gather_object(ranks, (prints, held))
    return out, ranks


def _worker(rank, folder):
    import torch.distributed as dist

    from metrale_graph.parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel.current()
        models = {name: HybridModel.from_pretrained(os.path.join(folder, name), tp=tp, progress=False)
                  for name in ("random", "bigram")}
        runs = {"plain": _served(models["random"]), "plain-bigram": _served(models["bigram"])}
        oracle = None
        if rank == 0:  # n-gram drafts that plain decoding's tokens decide (speculative_reference.Oracle)
            staggered_out, pair = runs["plain"][0][0][:2]
            prompts = PROMPTS + [SHARED, SHARED + [3, 4]]
            reference = [t if t is not None else [] for t in staggered_out] + [t for t, _ in pair]
            oracle = Oracle(prompts, reference, CFG.vocab_size)
        for name, (model, option, buffers) in OPTIONS.items():
            runs[name] = _served(models[model], option, buffers, oracle if option["method"] == "ngram" else None)
        if rank == 0:
            torch.save(runs, os.path.join(folder, "rank0.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speculative_tp")
    with_random_mtp(unit_gain(HybridModel.from_preset(CFG, seed=1), seed=2), seed=3).save_pretrained(folder / "random")
    bigram_model(CFG).save_pretrained(folder / "bigram")
    mp.start_processes(_worker, args=(str(folder),), nprocs=WORLD, start_method="spawn")
    return torch.load(folder / "rank0.pt")


def test_prompt_logprobs_under_a_plan_broadcast_are_one_process_ones(runs, tmp_path):
    """The prompt-logprob request's prompt ran apart on both ranks (rank 0's plan names its chunks), with speculation
    or without: the logprobs of one process's engine (fp32 within 1e-4; the ranks sum in another order)."""
    model = with_random_mtp(unit_gain(HybridModel.from_preset(CFG, seed=1), seed=2), seed=3)
    with Engine(model, **KW) as e:
        want = [(x.logprob, x.rank) for x in e.generate([PROMPTS[3]], max_new_tokens=1, prompt_logprobs=2,
                                                          stop_token_ids=[])[0].prompt_logprobs[1:]]
    for name in ("plain", "ngram-3", "mtp-2-buffers"):
        got = runs[name][0][0][3]
        assert len(got) == len(PROMPTS[3]) - 1 == len(want)
        assert max(abs(a - b) for (a, _), (b, _) in zip(got, want)) < 1e-4, name
        assert [r for _, r in got] == [r for _, r in want], name


@pytest.mark.parametrize("name", list(OPTIONS))
def test_speculative_steps_under_a_plan_broadcast_give_plain_decoding(runs, name):
    (want, _), _ = runs["plain" if OPTIONS[name][0] == "random" else "plain-bigram"]
    (got, stats), _ = runs[name]
    assert got[0] == want[0] and got[2] == want[2]
    assert [t for t, _ in got[1]] == [t for t, _ in want[1]]
    assert got[1][1][1] > 0  # the second prompt restored the first's prefix
    assert stats["proposed"] > 0 and stats["steps"] > 0
    if stats["method"] == "ngram":  # the oracle's drafts: some kept, some not (states copied from verify entries)
        assert 0 < stats["accepted"] < stats["proposed"]
    elif OPTIONS[name][0] == "bigram":  # the head drafts what the model decodes: greedy rows keep them (the step's
        assert stats["accepted"] > stats["proposed"] / 2  # own states; the penalized and sampled rows reject some)
    else:  # the random head's drafts: rejected
        assert stats["accepted"] < stats["proposed"]


@pytest.mark.parametrize("name", ["plain", "plain-bigram", *OPTIONS])
def test_the_follower_holds_rank_0s_cache_and_ends_with_nothing(runs, name):
    _, ((first, held0), (second, held1)) = runs[name]
    assert len(first) == len(second) > 20
    for k, (a, b) in enumerate(zip(first, second)):
        assert a == b, f"message {k}: rank 1's bookkeeping is not rank 0's"
    assert held0 == held1 == (0, 0)


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
