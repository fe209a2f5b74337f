"""The online engine on the CPU (tiny models, eager steps): submit from several threads, continuous
batching, abort, the bounded waiting queue, a failing step, streamed text (UTF-8 safe, stop strings),
asyncio consumers, shutdown (also during a warmup); numpy arguments; a model converted under an engine. Waits are bounded
(TIMEOUT) so that a hang fails fast."""

import asyncio
import gc
import threading
import time

import numpy as np
import pytest
import torch

from helpers import random_tokens
from metrale_graph import Engine, HybridModel, Stream
from metrale_graph.capture.runner import BucketReport
from metrale_graph.detokenizer import REPLACEMENT
from metrale_graph.engine import EngineBusyError, EngineClosedError, EngineFullError
from metrale_graph.sampling import SampleResult
from tokenizer_fixture import tiny_checkpoint

TIMEOUT = 60.0
KW = dict(num_slots=2, token_budget=12, block_size=16, max_context=96, compile=False)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_preset("tiny", seed=3)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A tiny model saved with a byte-level BPE tokenizer (tests/tokenizer_fixture.py)."""
    return HybridModel.from_pretrained(tiny_checkpoint(tmp_path_factory.mktemp("ckpt")), progress=False)


def _prompts(lengths, seed=0):
    return [random_tokens(n, seed=seed + i) for i, n in enumerate(lengths)]


def _alone(engine, prompt, **kw):
    """The request's tokens alone in the engine (generate of that one prompt)."""
    return engine.generate([prompt], **kw)[0].token_ids


def _assert_cache_empty(engine):
    cache = engine.cache
    assert cache.context_lens == [0] * cache.num_slots and cache.free_blocks == cache.num_blocks


class _Gate:
    """Records every step's streams as (slot, tokens); holds the loop inside step number `at` (from 1)
    until release(), so that a test can act while a known step runs."""

    def __init__(self, engine, monkeypatch, at=None, fail_at=None):
        self.steps, self.at, self.fail_at = [], at, fail_at
        self.entered, self.go = threading.Event(), threading.Event()
        loop = engine._loop
        real = loop.launch

        def spy(streams, decodes):
            # a decode feeds the token its slot sampled last, which the step reads on the device (read here)
            self.steps.append([(s.slot, [int(loop.last_tokens[s.slot])] if i < decodes else list(s.tokens))
                               for i, s in enumerate(streams)])
            if len(self.steps) == self.at:
                self.entered.set()
                assert self.go.wait(TIMEOUT), "the test never released the gate"
            if len(self.steps) == self.fail_at:
                raise RuntimeError("injected step failure")
            return real(streams, decodes)

        monkeypatch.setattr(loop, "launch", spy)

    def wait(self):
        assert self.entered.wait(TIMEOUT), "the loop never reached the gated step"

    def release(self):
        self.go.set()


def _plain_greedy(model, prompt, n):
    """Greedy tokens of `prompt` by a loop of model.prefill on a cache of its own: the reference."""
    cache, out = model.new_cache(1, 8, block_size=16), []
    logits = model.prefill(cache, [Stream(0, prompt)])
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = model.prefill(cache, [Stream(0, [out[-1]])])
    return out


def test_generate_stream_and_submit_give_the_tokens_of_a_plain_prefill_loop(tiny):
    """generate, stream and submit over the online loop (5 prompts on 2 slots, chunked by a budget of 12)
    give each prompt the greedy tokens of a plain model.prefill loop, and stream's events come in sampling
    order (a request's tokens in order, each request ending once)."""
    engine = Engine(tiny, **KW)
    prompts = _prompts([3, 20, 1, 9, 33], seed=40)
    want = [_plain_greedy(tiny, p, 7) for p in prompts]
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=7)] == want
    events = list(engine.stream(prompts, max_new_tokens=7))
    assert [[e.token_id for e in events if e.index == i] for i in range(len(prompts))] == want
    assert sum(e.finish_reason == "length" for e in events) == len(prompts) and events[-1].finish_reason
    handles = [engine.submit(p, max_new_tokens=7) for p in prompts]
    assert [h.result(TIMEOUT).token_ids for h in handles] == want
    _assert_cache_empty(engine)


def test_submit_from_several_threads(tiny):
    """Eight threads submit at once (greedy and seeded sampling) to an engine of two slots: every request
    gets the tokens it gets alone; generate and stream called meanwhile too."""
    engine = Engine(tiny, **KW)
    prompts = _prompts([3, 20, 1, 9, 14, 5, 30, 2], seed=4)
    sampled = dict(temperature=0.9, top_k=40, seed=5)
    want = [_alone(engine, p, max_new_tokens=6) for p in prompts]
    want_sampled = [_alone(engine, p, max_new_tokens=6, **sampled) for p in prompts]
    got, errors = {}, []

    def client(i):
        try:
            handles = [engine.submit(prompts[i], max_new_tokens=6), engine.submit(prompts[i], max_new_tokens=6,
                                                                                  **sampled)]
            got[i] = [h.result(timeout=TIMEOUT).token_ids for h in handles]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    batch = engine.generate(prompts[:3], max_new_tokens=6)
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [got[i] for i in range(len(prompts))] == [[w, s] for w, s in zip(want, want_sampled)]
    assert [r.token_ids for r in batch] == want[:3]
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.generated_tokens > 0 and stats.steps > 0
    _assert_cache_empty(engine)


def test_a_request_joins_the_running_batch_at_the_next_step(tiny, monkeypatch):
    """B is submitted while A's third step runs: the fourth step holds A's decode and B's prompt; both
    get the greedy tokens they get alone."""
    engine = Engine(tiny, **KW)
    a, b = _prompts([6, 9], seed=7)
    want = [_alone(engine, a, max_new_tokens=10), _alone(engine, b, max_new_tokens=4)]
    gate = _Gate(engine, monkeypatch, at=3)
    first = engine.submit(a, max_new_tokens=10)
    gate.wait()
    second = engine.submit(b, max_new_tokens=4)
    gate.release()
    assert [first.result(TIMEOUT).token_ids, second.result(TIMEOUT).token_ids] == want
    assert gate.steps[3] == [(0, [want[0][2]]), (1, b)]  # A decodes its third token, B's prompt joins
    assert len(gate.steps) == 10  # B ran beside A, in A's steps
    _assert_cache_empty(engine)


def test_abort_frees_the_slot_and_blocks_at_the_next_step(tiny, monkeypatch):
    """Aborting a running request frees its slot before the next step (which no longer holds it); its last
    output says "abort"; aborting a waiting one means it never runs; the others are unaffected."""
    engine = Engine(tiny, **{**KW, "num_slots": 1, "token_budget": 8})
    a, b, c = _prompts([5, 7, 3], seed=2)
    want_c = _alone(engine, c, max_new_tokens=3)
    gate = _Gate(engine, monkeypatch, at=3)
    running = engine.submit(a, max_new_tokens=50)
    gate.wait()
    waiting, last = engine.submit(b, max_new_tokens=5), engine.submit(c, max_new_tokens=3)
    running.abort()
    waiting.abort()
    gate.release()
    outputs = list(running)
    assert outputs[-1].finish_reason == "abort" and outputs[-1].token_ids == [] and len(outputs) == 4
    result = running.result(TIMEOUT)
    assert result.finish_reason == "abort" and len(result.token_ids) == 3
    assert waiting.result(TIMEOUT).finish_reason == "abort" and waiting.result().token_ids == []
    assert last.result(TIMEOUT).token_ids == want_c
    assert gate.steps[3] == [(0, c)]  # the step after the abort: only c, in the slot a had
    assert all(b != tokens for step in gate.steps for _, tokens in step)  # b never ran
    _assert_cache_empty(engine)
    with engine.submit(a, max_new_tokens=50) as handle:  # leaving the block aborts it
        next(iter(handle))
    assert handle.result(TIMEOUT).finish_reason == "abort"
    _assert_cache_empty(engine)
    running.abort()  # a no-op once ended


def test_a_full_waiting_queue_refuses_submit(tiny, monkeypatch):
    """With max_waiting requests waiting, submit raises EngineFullError (an EngineBusyError) and queues
    nothing; generate is never refused; once the queue drains submit works again."""
    engine = Engine(tiny, **{**KW, "num_slots": 1, "token_budget": 8}, max_waiting=2)
    prompts = _prompts([4, 5, 6, 7], seed=11)
    gate = _Gate(engine, monkeypatch, at=1)
    handles = [engine.submit(prompts[0], max_new_tokens=2)]
    gate.wait()  # the first request runs (it holds the slot); two may wait
    handles += [engine.submit(p, max_new_tokens=2) for p in prompts[1:3]]
    with pytest.raises(EngineFullError, match=r"waiting queue is full \(2 requests wait"):
        engine.submit(prompts[3], max_new_tokens=2)
    assert issubclass(EngineFullError, EngineBusyError) and issubclass(EngineFullError, RuntimeError)
    assert engine.stats().waiting == 2
    gate.release()
    assert len(engine.generate(prompts, max_new_tokens=2)) == 4  # past max_waiting: generate is not refused
    assert [h.result(TIMEOUT).finish_reason for h in handles] == ["length"] * 3
    assert engine.submit(prompts[3], max_new_tokens=2).result(TIMEOUT).token_ids == \
        _alone(engine, prompts[3], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_waiting must be an integer >= 0"):
        Engine(tiny, **KW, max_waiting=-1)


def test_aborting_waiting_requests_empties_the_waiting_queue(tiny, monkeypatch):
    """Waiting requests aborted when nothing else runs leave the queue at once: stats() shows none waiting
    and submit takes new requests (the count had stayed until a step ran, and an idle loop runs none, so a
    full queue aborted stayed full for ever)."""
    engine = Engine(tiny, **{**KW, "num_slots": 1}, max_waiting=3)
    prompts = _prompts([3, 4, 5, 6], seed=21)
    gate = _Gate(engine, monkeypatch, at=1)
    first = engine.submit(prompts[0], max_new_tokens=1)  # ends with step 1
    gate.wait()
    handles = [engine.submit(p, max_new_tokens=2) for p in prompts[1:]]  # the queue is full
    for h in handles:
        h.abort()  # handed in with them: the next iteration takes both, and has nothing to step
    gate.release()
    assert first.result(TIMEOUT).finish_reason == "length"
    assert [h.result(TIMEOUT).finish_reason for h in handles] == ["abort"] * 3
    assert engine.stats().waiting == 0 and engine.stats().running == 0
    assert engine.submit(prompts[0], max_new_tokens=2).result(TIMEOUT).token_ids == \
        _alone(engine, prompts[0], max_new_tokens=2)


def test_an_idle_engine_counts_the_slots_its_requests_freed(tiny):
    """submit's max_waiting counts the requests that would wait beyond the free slots, as the loop last published
    them. It published them when it planned a step, not when a request's end freed its slot: an idle engine of one
    slot with max_waiting 0 refused every submit after its first request (EngineFullError), for ever, with nothing
    running or waiting. Now a freed slot is published before its request's last output is delivered, so a consumer
    that saw the end finds it free (ended, aborted or failed)."""
    engine = Engine(tiny, **{**KW, "num_slots": 1}, max_waiting=0)
    prompt = _prompts([5], seed=31)[0]
    want = _alone(engine, prompt, max_new_tokens=3)
    for _ in range(3):  # each submitted as soon as the one before has ended
        assert engine.submit(prompt, max_new_tokens=3).result(TIMEOUT).token_ids == want
    handle = engine.submit(prompt, max_new_tokens=50)
    next(iter(handle))
    handle.abort()
    assert list(handle)[-1].finish_reason == "abort"
    assert engine.submit(prompt, max_new_tokens=3).result(TIMEOUT).token_ids == want
    _assert_cache_empty(engine)


def test_an_aborted_waiting_request_leaves_the_queue_before_its_end_is_seen(tiny, monkeypatch):
    """The loop put an aborted request's last output in its channel, then published the waiting queue without it:
    its consumer, woken by the output, could submit again while submit still counted it waiting (EngineFullError
    from a queue with nobody in it). Now the queue is published first."""
    engine = Engine(tiny, **{**KW, "num_slots": 1}, max_waiting=1)
    prompts = _prompts([3, 4], seed=41)
    gate = _Gate(engine, monkeypatch, at=1)
    first = engine.submit(prompts[0], max_new_tokens=2)
    gate.wait()  # the first holds the slot: the second waits
    waiting = engine.submit(prompts[1], max_new_tokens=2)
    seen, put = [], waiting._channel.put
    waiting._channel.put = lambda item: seen.append(engine._loop._scheduled_waiting) or put(item)
    waiting.abort()
    gate.release()
    assert waiting.result(TIMEOUT).finish_reason == "abort" and seen == [0]
    assert first.result(TIMEOUT).finish_reason == "length"
    _assert_cache_empty(engine)


def test_a_failing_step_fails_only_its_requests(tiny, monkeypatch):
    """The second step (A's decode, B's prompt) raises: A and B end with that error (result() and
    iteration raise it), C, waiting meanwhile, and D, submitted after, get their tokens; nothing leaks."""
    engine = Engine(tiny, **KW)
    a, b, c, d = _prompts([5, 8, 3, 6], seed=3)
    want = [_alone(engine, p, max_new_tokens=4) for p in (c, d)]
    gate = _Gate(engine, monkeypatch, at=1, fail_at=2)
    first = engine.submit(a, max_new_tokens=4)
    gate.wait()
    second, third = engine.submit(b, max_new_tokens=4), engine.submit(c, max_new_tokens=4)
    gate.release()
    for handle in (first, second):
        with pytest.raises(RuntimeError, match="injected step failure"):
            handle.result(TIMEOUT)
        with pytest.raises(RuntimeError, match="injected step failure"):
            list(handle)
        assert handle.done and "failed" in repr(handle)
    assert gate.steps[1] == [(0, [first._request.out[0]]), (1, b)]
    assert third.result(TIMEOUT).token_ids == want[0]
    assert engine.submit(d, max_new_tokens=4).result(TIMEOUT).token_ids == want[1]
    _assert_cache_empty(engine)


def test_a_channel_wakes_a_waiter_for_the_end_only_at_the_end():
    """get(until_ended=True) (generate without on_token) and wait_closed() return once every request has ended or one
    has failed, not at each put; get() returns at each put. A waiter in another thread is woken by the last end."""
    from metrale_graph.handle import Channel, Failure, RequestOutput

    channel, error = Channel(2), RuntimeError("failed")
    outputs = [RequestOutput(0, [5], None, None), RequestOutput(1, [6], None, None)]
    channel.put_all(outputs)
    with pytest.raises(TimeoutError):
        channel.get(timeout=0.05, until_ended=True)
    assert channel.get(timeout=TIMEOUT) == outputs
    ended = RequestOutput(0, [7], None, "stop")
    channel.put_all([ended])
    with pytest.raises(TimeoutError):
        channel.wait_closed(timeout=0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(channel.get(timeout=TIMEOUT, until_ended=True)))
    waiter.start()
    last = RequestOutput(1, [8], None, "length")
    channel.put_all([last])
    waiter.join(TIMEOUT)
    assert got == [[ended, last]] and channel.open == 0
    channel.wait_closed(timeout=TIMEOUT)
    channel = Channel(2)  # a failure wakes it with a request still open
    channel.put(Failure(0, error))
    assert channel.get(timeout=TIMEOUT, until_ended=True) == [Failure(0, error)] and channel.open == 1
    with pytest.raises(TimeoutError):  # (taken: it wakes nobody again)
        channel.get(timeout=0.05, until_ended=True)


def _scripted(monkeypatch, tokens):
    """The sampler returns `tokens` one by one (one request at a time): a model that says a known text."""
    import metrale_graph.loop as loop_module

    script = iter(tokens)
    monkeypatch.setattr(loop_module, "sample", lambda logits, rows, state, token_bitmask=None:
                        SampleResult(torch.tensor([next(script)]), [], None, []))


def test_streamed_text_is_whole_characters(with_tokenizer, monkeypatch):
    """A model that says a text of CJK, emoji and accented letters, token by token: no streamed piece holds
    a broken character, the pieces join to the text, and an incomplete character waits for its last byte."""
    engine = Engine(with_tokenizer, **KW)
    text = "東京 🦄 naïve 👋🌍 done"
    ids = engine.tokenizer.encode(text)
    _scripted(monkeypatch, ids)
    handle = engine.submit("Hello", max_new_tokens=len(ids), stop_token_ids=[])
    outputs = list(handle)
    assert [o.token_ids for o in outputs] == [[t] for t in ids]
    assert all(REPLACEMENT not in o.text for o in outputs) and "".join(o.text for o in outputs) == text
    assert any(o.text == "" for o in outputs)  # held back inside a character
    assert handle.result().text == text and outputs[-1].finish_reason == "length"


def test_stop_strings_across_tokens_end_the_request(with_tokenizer, monkeypatch):
    """A stop string completed across tokens ends the request with "stop" at the token that completes it;
    neither it nor anything after it is streamed; the slot is freed (the rest is never generated)."""
    engine = Engine(with_tokenizer, **KW)
    text = "The quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer.encode(text)
    _scripted(monkeypatch, ids)
    handle = engine.submit("Say it:", max_new_tokens=len(ids), stop=["never", "own fo"])
    outputs = list(handle)
    result = handle.result()
    assert result.finish_reason == "stop" and result.text == "The quick br" == "".join(o.text for o in outputs)
    assert "own fo" in engine.decode(result.token_ids) and "own fo" not in engine.decode(result.token_ids[:-1])
    assert result.token_ids == ids[:len(result.token_ids)] and len(result.token_ids) < len(ids)
    _assert_cache_empty(engine)
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        engine.submit("x", stop=[""])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        Engine(HybridModel.from_preset("tiny"), **KW).submit([1, 2], stop="x")


def test_kept_special_tokens_and_a_stop_token_in_the_streamed_text(with_tokenizer, monkeypatch):
    """keep_special_ids keeps those special tokens' text and skips the others; a stop token that ends the request
    adds no text (its text kept with include_stop_str_in_output); bad ids are a ValueError before anything runs."""
    engine = Engine(with_tokenizer, **KW)
    tok = engine.tokenizer
    start, end, eos = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    word = tok.encode(" fox")
    ids = [start, *tok.encode("The quick"), end, *word]
    import numpy as np

    for keep, include, want in (((), False, "The quick"), ([start], False, "<|im_start|>The quick"),
                                ([start, end], True, "<|im_start|>The quick<|im_end|> fox"),
                                (np.array([start, end]), True, "<|im_start|>The quick<|im_end|> fox"),
                                (torch.tensor([start]), False, "<|im_start|>The quick"),
                                ([np.int64(start)], False, "<|im_start|>The quick")):
        _scripted(monkeypatch, ids)
        handle = engine.submit("Say it:", max_new_tokens=len(ids), stop_token_ids=[word[-1], eos],
                               keep_special_ids=keep, include_stop_str_in_output=include)
        assert "".join(o.text for o in handle) == handle.result().text == want, keep
    for bad in ([tok.vocab_size + 50], [1.5], 3, [[start]], np.array([[start]])):
        with pytest.raises(ValueError, match="keep_special_ids"):
            engine.submit("x", keep_special_ids=bad)
    _assert_cache_empty(engine)


def test_a_text_prompt_holding_a_lone_surrogate_is_a_value_error(with_tokenizer):
    """A string prompt holding a lone UTF-16 surrogate (half of an emoji pair, as "\\ud83d" escapes carry) is a
    ValueError naming the prompt and the character, before anything is queued (was the fast tokenizer's TypeError
    "TextEncodeInput must be Union[...]"); the prompts beside it are not run."""
    engine = Engine(with_tokenizer, **KW)
    cases = [(lambda: engine.generate(["ok", "a\ud83d"], max_new_tokens=2), r"prompt 1: the text holds '\\ud83d' at 1"),
             (lambda: engine.stream(["ok", "a\ud83d"], max_new_tokens=2), r"prompt 1: the text holds '\\ud83d' at 1"),
             (lambda: engine.submit("\udc00b", max_new_tokens=2), r"prompt 0: the text holds '\\udc00' at 0")]
    for call, message in cases:
        with pytest.raises(ValueError, match=message + ", a lone UTF-16 surrogate"):
            call()
    assert engine.stats().steps == 0
    _assert_cache_empty(engine)
    ok = engine.generate(["ok \U0001F44B"], max_new_tokens=2, stop_token_ids=[])[0]  # the whole pair is fine
    assert len(ok.token_ids) == 2


def test_streamed_text_of_a_model_joins_to_its_decode(with_tokenizer):
    """The tiny model's own (random) tokens: the pieces join to tokenizer.decode of the new tokens, and
    no piece but the last ends inside a character."""
    engine = Engine(with_tokenizer, **KW)
    handle = engine.submit("Hello world, 東京", max_new_tokens=40, stop_token_ids=[])
    outputs = list(handle)
    assert "".join(o.text for o in outputs) == engine.decode(handle.result().token_ids)
    assert not any(o.text.endswith(REPLACEMENT) for o in outputs[:-1])


def test_asyncio_consumers(tiny):
    """Three requests consumed with `async for` in one event loop, one awaited with result_async(), and a
    consumer cancelled mid-stream (its request aborted, as a server does when a client disconnects)."""
    engine = Engine(tiny, **KW)
    prompts = _prompts([4, 9, 2], seed=8)
    want = [_alone(engine, p, max_new_tokens=5) for p in prompts]

    async def consume(handle):
        return [t async for out in handle for t in out.token_ids]

    async def main():
        handles = [engine.submit(p, max_new_tokens=5) for p in prompts]
        tokens = await asyncio.gather(*(consume(h) for h in handles))
        awaited = await engine.submit(prompts[0], max_new_tokens=5).result_async()
        slow = engine.submit(prompts[1], max_new_tokens=80)
        task = asyncio.ensure_future(consume(slow))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        slow.abort()
        return tokens, awaited, await slow.result_async()

    tokens, awaited, aborted = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert tokens == want and awaited.token_ids == want[0]
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 80
    _assert_cache_empty(engine)


def test_a_handle_whose_outputs_were_all_taken_iterates_to_its_end_at_once(tiny):
    """Iterating a handle again once its last output was taken (a second `for`, `async for` after result(), after
    an abort) ends at once, as an exhausted iterator does, rather than waiting for an output that never comes; a
    handle whose request failed raises its error again."""
    engine = Engine(tiny, **KW)
    prompt = _prompts([6], seed=3)[0]

    def drained(handle):  # a second iteration, in a thread so that a hang fails the test rather than blocking it
        seen = []
        t = threading.Thread(target=lambda: seen.append([out.token_ids for out in handle]), daemon=True)
        t.start()
        t.join(TIMEOUT)
        return seen

    h = engine.submit(prompt, max_new_tokens=3)
    assert [t for out in h for t in out.token_ids] == h.result(TIMEOUT).token_ids
    assert drained(h) == [[]]
    h = engine.submit(prompt, max_new_tokens=3)
    h.result(TIMEOUT)
    assert len(drained(h)[0]) == 3 and drained(h) == [[]]  # outputs not yet taken are still given, once
    h = engine.submit(prompt, max_new_tokens=80)
    next(iter(h))
    h.abort()
    assert drained(h)[0][-1] == [] and drained(h) == [[]]

    async def twice(handle):
        first = [t async for out in handle for t in out.token_ids]
        return first, [t async for out in handle for t in out.token_ids]

    h = engine.submit(prompt, max_new_tokens=3)
    first, second = asyncio.run(asyncio.wait_for(twice(h), TIMEOUT))
    assert first == h.result(TIMEOUT).token_ids and second == []
    _assert_cache_empty(engine)
    h = engine.submit(prompt, max_new_tokens=80)
    next(iter(h))
    engine.shutdown()
    for _ in range(2):
        with pytest.raises(EngineClosedError):
            for _ in h:
                pass
    with pytest.raises(EngineClosedError):
        asyncio.run(asyncio.wait_for(twice(h), TIMEOUT))


def test_shutdown_ends_a_warmup_after_the_bucket_in_progress(tiny, monkeypatch):
    """shutdown() during warmup() waited for the whole grid (a server stopped while it warmed: a minute on a large
    model, past a 30 s termination grace) and then for close()'s timeout; now the warmup ends after the bucket in
    progress with EngineClosedError, and shutdown() returns. Buckets are not compiled here (each one blocks until
    released)."""
    engine = Engine(tiny, num_slots=2, token_budget=8, block_size=16, max_context=32)
    assert len(engine.runner.grid) > 1
    started, release, warmed = threading.Event(), threading.Event(), []

    def warm(bucket, hidden=False):
        warmed.append(bucket)
        started.set()
        release.wait(TIMEOUT)
        return BucketReport(bucket)

    monkeypatch.setattr(engine.runner, "_warm", warm)
    errors = []
    warming = threading.Thread(target=lambda: errors.append(_raised(engine.warmup)))
    warming.start()
    assert started.wait(TIMEOUT)
    closing = threading.Thread(target=engine.shutdown)
    closing.start()
    while engine._loop._closing is None:
        time.sleep(0.001)
    release.set()
    warming.join(TIMEOUT)
    closing.join(TIMEOUT)
    assert not warming.is_alive() and not closing.is_alive() and len(warmed) == 1
    assert isinstance(errors[0], EngineClosedError), errors


def _raised(fn):
    try:
        fn()
    except Exception as e:
        return e


def test_shutdown_with_running_requests(tiny):
    """shutdown() ends running and waiting requests with EngineClosedError in bounded time and refuses new
    ones; the cache is released (usable directly); shutdown(wait_s) lets them finish first; a collected
    engine ends its loop thread."""
    engine = Engine(tiny, **KW)
    handles = [engine.submit(p, max_new_tokens=90) for p in _prompts([3, 4, 5])]
    next(iter(handles[0]))
    engine.shutdown(timeout=TIMEOUT)
    for h in handles:
        with pytest.raises(EngineClosedError, match="shut down"):
            h.result(TIMEOUT)
    with pytest.raises(EngineClosedError):
        engine.submit([1, 2])
    with pytest.raises(EngineClosedError):
        engine.generate([[1, 2]])
    assert engine.cache.holder_name is None and engine._loop._thread is not None
    assert not engine._loop._thread.is_alive()
    _assert_cache_empty(engine)
    tiny.prefill(engine.cache, [Stream(0, [1, 2])])
    engine.shutdown()  # idempotent

    with Engine(tiny, **KW) as engine:
        handle = engine.submit([1, 2, 3], max_new_tokens=4)
        engine.shutdown(wait_s=TIMEOUT)
        assert handle.result(TIMEOUT).finish_reason == "length"
    assert engine._loop.closed

    engine = Engine(tiny, **KW)
    assert len(engine.submit([1, 2], max_new_tokens=2).result(TIMEOUT).token_ids) == 2
    thread = engine._loop._thread
    del engine
    gc.collect()
    thread.join(TIMEOUT)
    assert not thread.is_alive()


def test_numpy_numbers_and_arrays_are_taken_as_python_ones(tiny):
    """Issue 23, item 6: np.float32 temperatures, np.int64 ids, stop ids, max_new_tokens and seeds, and 1-D
    integer arrays as prompts were refused with messages that read as range errors."""
    engine = Engine(tiny, **KW)
    prompts = _prompts([4, 7], seed=6)
    kw = dict(max_new_tokens=5, temperature=0.8, top_k=30, top_p=0.9, seed=3, stop_token_ids=[7, 9])
    want = [r.token_ids for r in engine.generate(prompts, **kw)]
    as_numpy = dict(max_new_tokens=np.int64(5), temperature=np.float32(0.8), top_k=np.int32(30),
                    top_p=np.float64(0.9), seed=np.uint64(3), stop_token_ids=[np.int64(7), np.int16(9)])
    arrays = [np.array(prompts[0], dtype=np.int64), [np.int32(t) for t in prompts[1]]]
    assert [r.token_ids for r in engine.generate(arrays, **as_numpy)] == want
    assert [r.token_ids for r in engine.generate(prompts, **{**as_numpy, "stop_token_ids": np.array([7, 9])})] == want
    greedy = engine.generate(prompts[:1], max_new_tokens=3)[0].token_ids
    assert engine.submit(np.array(prompts[0], dtype=np.uint16), max_new_tokens=np.int8(3),
                         temperature=np.float32(0)).result(TIMEOUT).token_ids == greedy
    for prompt, message in [(np.array([1.0, 2.0]), "prompt 0: token ids must be an integer array, got dtype float64"),
                            (np.array([[1, 2]]), r"prompt 0: token ids must be 1-D, got shape \(1, 2\)"),
                            (np.array([1, 600]), r"prompt 0: token id 600 is out of range"),
                            (np.array([True, False]), "token ids must be an integer array, got dtype bool")]:
        with pytest.raises(ValueError, match=message):
            engine.generate([prompt])
    with pytest.raises(ValueError, match="prompts must be a list of prompts"):
        engine.generate(np.array([prompts[0]]))
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        engine.generate(prompts, temperature=np.bool_(True))
    assert Engine(tiny, **{**KW, "num_slots": np.int64(2)}).num_slots == 2
    _assert_cache_empty(engine)


@pytest.mark.parametrize("compile", [False, True])
def test_a_model_converted_after_the_engine_was_built(compile):
    """Issue 23, item 6: after model.half() the engine said "build a new GraphRunner" (compile=True) or named
    the cache's dtype (compile=False): the user holds an Engine."""
    model = HybridModel.from_preset("tiny", seed=1)
    engine = Engine(model, **{**KW, "compile": compile})
    model.half()
    for call in (lambda: engine.generate([[1, 2]]), lambda: engine.submit([1, 2]),
                 lambda: engine.stream([[1, 2]])):
        with pytest.raises(ValueError, match="converted or moved .* after this Engine was built: .* build a new Engine"):
            call()
    _assert_cache_empty(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_loop_that_dies_delivering_still_ends_every_request(tiny, monkeypatch, overlap):
    """A bug that stops the loop between a step ending a request (its slot freed, out of the scheduler) and that
    step's outputs reaching their channels left the request's channel open: its consumer waited forever for the
    last output. The loop's end now delivers what the step had made, then ends the others with EngineClosedError."""
    import metrale_graph.loop_readback as readback

    real, raised = readback.deliver, []

    def deliver(outputs):
        if not raised and any(o.finish_reason for items in outputs.values() for o in items):
            raised.append(1)
            raise RuntimeError("a bug in the loop")
        return real(outputs)

    monkeypatch.setattr(readback, "deliver", deliver)
    engine = Engine(tiny, overlap=overlap, **KW)
    short, long = (engine.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in zip(_prompts([2, 3]), (2, 6)))
    out = short.result(TIMEOUT)  # (TimeoutError: its channel was never closed)
    assert raised and out.finish_reason == "length" and len(out.token_ids) == 2
    with pytest.raises(EngineClosedError, match="a bug in the loop"):
        long.result(TIMEOUT)
    with pytest.raises(EngineClosedError):
        engine.submit([1, 2])
