"""The engine loop's overlap (loop.py): it launches step N+1 before it reads step N's tokens back, and the
token streams are those of the loop without overlap (`Engine(..., overlap=False)`), token for token: greedy
and seeded sampling, queued and chunked prompts, stop tokens and stop strings, prefix caching, MoE and
Qwen3-Next families. A token sampled past a stop is never emitted nor counted."""

import pytest
import torch

from helpers import moe_config, random_tokens
from metrale_graph import Engine, HybridModel
from tokenizer_fixture import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KW = dict(num_slots=3, token_budget=24, block_size=16, max_context=160, compile=False)
LENGTHS = [5, 37, 1, 70, 12, 9, 64, 3]  # 8 prompts on 3 slots: queued; 37, 64 and 70 chunked by the budget


@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_preset("tiny", seed=11)


def _prompts(lengths=LENGTHS, seed=0):
    return [random_tokens(n, seed=seed + i) for i, n in enumerate(lengths)]


def _run(model, overlap, calls, **kw):
    """Each call's results (token ids, finish reasons) and the engine's generated-token count."""
    engine = Engine(model, overlap=overlap, **{**KW, **kw})
    try:
        out = []
        for args in calls:
            results = engine.generate(**args)
            out.append([(r.token_ids, r.finish_reason) for r in results])
        generated = engine.stats().generated_tokens
        assert generated == sum(len(t) for call in out for t, _ in call)  # nothing past a stop is counted
        cache = engine.cache
        assert cache.context_lens == [0] * cache.num_slots and cache.free_blocks == cache.num_blocks
        return out
    finally:
        engine.shutdown()


def _calls(prompts, stop):
    """Greedy, seeded sampling (temperature, top-k, top-p) and stop tokens, with varied lengths."""
    return [dict(prompts=prompts, max_new_tokens=9, stop_token_ids=[]),
            dict(prompts=prompts, max_new_tokens=7, temperature=0.9, top_k=20, top_p=0.9, seed=5,
                 stop_token_ids=[]),
            dict(prompts=prompts, max_new_tokens=12, stop_token_ids=stop),
            dict(prompts=prompts, max_new_tokens=1, temperature=1.3, seed=7, stop_token_ids=stop)]


def _stop_tokens(model, prompts):
    """Tokens that greedy decoding emits early for some prompts (so stop tokens end requests mid-batch)."""
    engine = Engine(model, **KW)
    try:
        results = engine.generate(prompts, max_new_tokens=6, stop_token_ids=[])
    finally:
        engine.shutdown()
    return sorted({r.token_ids[2] for r in results[:3]})


def test_overlap_gives_the_streams_of_the_loop_without_it(tiny):
    prompts = _prompts()
    calls = _calls(prompts, _stop_tokens(tiny, prompts))
    want = _run(tiny, False, calls)
    assert any(reason == "stop" for call in want for _, reason in call)  # stops mid-batch happen
    assert _run(tiny, True, calls) == want


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_overlap_gives_the_same_streams_for_moe_families(family):
    model = HybridModel.from_preset(moe_config(family), seed=2)
    prompts = [random_tokens(n, seed=20 + i, vocab=model.config.vocab_size) for i, n in enumerate([4, 30, 11, 2])]
    calls = [dict(prompts=prompts, max_new_tokens=6, stop_token_ids=[]),
             dict(prompts=prompts, max_new_tokens=5, temperature=0.8, seed=3, stop_token_ids=[])]
    assert _run(model, True, calls) == _run(model, False, calls)


def test_overlap_with_prefix_caching(tiny):
    """Prompts that share prefixes, then a second turn of each (its prompt + its output + more): hits on the
    blocks and checkpoints of prompts and of generated tokens (labelled once the host reads them back). The
    same streams with and without overlap, and as without prefix caching."""
    base = random_tokens(150, seed=40)
    prompts = [base[:n] + random_tokens(k, seed=41 + n) for n, k in ((130, 5), (70, 9), (150, 1), (64, 20))]

    def turns(**kw):
        engine = Engine(tiny, **{**KW, "max_context": 320, **kw})
        try:
            first = engine.generate(prompts, max_new_tokens=40, stop_token_ids=[])
            second = engine.generate([p + r.token_ids + random_tokens(3, seed=9) for p, r in zip(prompts, first)],
                                     max_new_tokens=6, stop_token_ids=[])
            return [r.token_ids for r in first + second], sum(r.cached_tokens for r in second)
        finally:
            engine.shutdown()

    kw = dict(prefix_cache=True, checkpoint_interval=64, prefix_checkpoints=8)
    plain, _ = turns(overlap=False)
    cached, hits = turns(overlap=False, **kw)
    assert cached == plain and hits > 4 * 64  # the second turns found their first turns
    overlapped, hits_overlapped = turns(overlap=True, **kw)
    assert overlapped == plain and hits_overlapped >= hits


def test_the_loop_launches_the_next_step_before_reading_the_last_back(tiny, monkeypatch):
    """The order of events in the loop thread: launch N+1, then read N back (overlap); without overlap
    each step is read back before the next is launched."""
    for overlap in (True, False):
        engine = Engine(tiny, overlap=overlap, **KW)
        loop, events = engine._loop, []
        launch, finish = loop.launch, loop._finish
        monkeypatch.setattr(loop, "launch", lambda s, d: events.append("launch") or launch(s, d))
        monkeypatch.setattr(loop, "_finish", lambda done, nxt: events.append("read") or finish(done, nxt))
        engine.generate([random_tokens(5, seed=1)], max_new_tokens=4, stop_token_ids=[])
        engine.shutdown()
        pairs = "".join("L" if e == "launch" else "R" for e in events)
        assert pairs == ("LLRLRLRR" if overlap else "LRLRLRLR"), pairs


def test_stop_strings_cut_the_same_text_with_overlap(tmp_path):
    """Streamed text with stop strings (a byte-level BPE tokenizer): the same outputs with and without
    overlap; the last token of a stopped request is the one that completed the stop string."""
    model = HybridModel.from_pretrained(tiny_checkpoint(tmp_path), progress=False)
    prompts = ["the cat sat on", "a b c d e", "hello there, how"]

    def outputs(overlap):
        engine = Engine(model, overlap=overlap, **{**KW, "num_slots": 2})
        try:
            free = [engine.submit(p, max_new_tokens=12).result(30) for p in prompts]
            stops = [r.text[2:4] for r in free if len(r.text) > 4]
            handles = [engine.submit(p, max_new_tokens=12, stop=stops) for p in prompts]
            return [(r.token_ids, r.text, r.finish_reason) for r in (h.result(30) for h in handles)], free
        finally:
            engine.shutdown()

    with_overlap, free = outputs(True)
    without, _ = outputs(False)
    assert with_overlap == without
    assert any(reason == "stop" for _, _, reason in without)
    for (ids, text, reason), whole in zip(without, free):
        assert ids == whole.token_ids[:len(ids)] and whole.text.startswith(text)


def test_tokens_stay_on_the_device_between_steps(tiny):
    """The step's decode streams read their token from last_tokens: poisoning a running request's entry
    changes what it feeds (the host's copy is never what the step reads)."""
    engine = Engine(tiny, overlap=False, **{**KW, "num_slots": 1})
    loop = engine._loop
    prompt = random_tokens(6, seed=3)
    want = engine.generate([prompt], max_new_tokens=5, stop_token_ids=[])[0].token_ids
    real = loop.launch
    seen = []

    def poisoned(streams, decodes):
        if decodes and not seen:
            seen.append(int(loop.last_tokens[streams[0].slot]))
            loop.last_tokens[streams[0].slot] = (seen[0] + 1) % tiny.config.vocab_size
        return real(streams, decodes)

    loop.launch = poisoned
    got = engine.generate([prompt], max_new_tokens=5, stop_token_ids=[])[0].token_ids
    engine.shutdown()
    assert seen == [want[0]] and got[0] == want[0] and got[1:] != want[1:]
    assert isinstance(loop.last_tokens, torch.Tensor) and loop.last_tokens.dtype == torch.int64
