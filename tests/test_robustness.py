"""A cache that never lies: failures inside the step (an op raising at layer k, Ctrl-C), eager and
through the runner; model.to(); many runners in one process; a cache of another model; two
threads on one cache."""

import threading

import pytest
import torch

from helpers import random_tokens, tiny_config
from metrics import rel_err
from metrale_graph import HybridModel, Stream
from metrale_graph.cache import CacheInUseError
from metrale_graph.capture import GraphRunner
from metrale_graph.ops import OPS


class Boom(RuntimeError):
    pass


# A runtime failure point inside the step: a real custom op (so it also fails inside compiled code,
# at run time rather than at trace time) wrapped around gdn_out's output.
_FAIL = {"at": None, "calls": 0, "exc": Boom}


@torch.library.custom_op("metrale_test::fail_point", mutates_args=())
def _fail_point(x: torch.Tensor) -> torch.Tensor:
    _FAIL["calls"] += 1
    if _FAIL["at"] is not None and _FAIL["calls"] == _FAIL["at"]:
        raise _FAIL["exc"]("injected failure")
    return x.clone()


@_fail_point.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def failing_layer(monkeypatch):
    """arm(k, exc): the k-th gdn_out call from now raises exc (layer k of a one-piece batch)."""
    real = OPS.gdn_out
    monkeypatch.setattr(OPS, "gdn_out", lambda *args: _fail_point(real(*args)))

    def arm(k, exc=Boom):
        _FAIL.update(at=k, calls=0, exc=exc)

    yield arm
    _FAIL.update(at=None, calls=0)


def _state(cache):
    return [t.clone() for t in cache.state_tensors()], list(cache.context_lens), cache.free_blocks


def _assert_reset(cache, slots, before):
    tensors, ctx, free = before
    for s in range(cache.num_slots):
        if s in slots:
            assert cache.context_lens[s] == 0
            assert all(not t[s].any() for t in cache.conv_states + cache.gdn_states)
            assert (cache.block_tables[s] == cache.null_block).all()
        else:
            assert cache.context_lens[s] == ctx[s]
            for t, old in zip(cache.conv_states + cache.gdn_states, tensors):
                assert torch.equal(t[s], old[s])
    held = sum(len(cache._blocks[s]) for s in range(cache.num_slots))
    assert cache.free_blocks + held == cache.num_blocks  # no block leaked


def _prefilled(model):
    cache = model.new_cache(6, 48, block_size=16)
    model.prefill(cache, [Stream(0, random_tokens(40, 1)), Stream(2, random_tokens(20, 2)),
                          Stream(5, random_tokens(9, 3))])
    return cache


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt], ids=["op-error", "ctrl-c"])
def test_failure_in_eager_step_resets_the_batch(failing_layer, exc):
    model = HybridModel.from_preset("tiny", seed=1)
    cache = _prefilled(model)
    before = _state(cache)
    failing_layer(2, exc)  # the second GDN layer: the first one's states are already written
    with pytest.raises(exc, match=r"slots \[0, 3\] were reset") as info:
        model.prefill(cache, [Stream(0, random_tokens(30, 4)), Stream(3, random_tokens(12, 5))])
    assert info.value.reset_slots == [0, 3]
    _assert_reset(cache, {0, 3}, before)
    # the slot is empty and usable: its next prefill equals a fresh one
    tokens = random_tokens(25, 6)
    fresh = model.prefill(model.new_cache(6, 48, block_size=16), [Stream(0, tokens)])
    assert rel_err(model.prefill(cache, [Stream(0, tokens)]), fresh) <= 1e-6


def test_failure_in_runner_resets_the_batch_and_compile_failures_touch_nothing(failing_layer, monkeypatch):
    model = HybridModel.from_preset("tiny", seed=1)
    cache = _prefilled(model)
    runner = GraphRunner(model, cache, batch_sizes=[2], token_counts=[32, 64])
    runner.warmup(progress=False)
    before = _state(cache)
    failing_layer(1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt, match=r"slots \[2, 4\] were reset"):
        runner.prefill([Stream(2, random_tokens(30, 7)), Stream(4, random_tokens(20, 8))])
    _assert_reset(cache, {2, 4}, before)

    # a batch split over two replays that fails in the second: both pieces' slots are reset
    before = _state(cache)
    failing_layer(4)  # tiny has 3 GDN layers per step: the 4th call is the first layer of piece 2
    with pytest.raises(Boom, match=r"slots \[1, 5\] were reset"):
        runner.prefill([Stream(1, random_tokens(50, 9)), Stream(5, random_tokens(40, 10))])
    _assert_reset(cache, {1, 5}, before)

    # an unwarmed bucket whose compile fails: raised before any state changes
    runner2 = GraphRunner(model, cache, batch_sizes=[2], token_counts=[16])

    def broken(*args):
        raise Boom("compile failed")

    monkeypatch.setattr(runner2, "step", broken)
    before = _state(cache)
    with pytest.raises(Boom, match="compile failed"):
        runner2.prefill([Stream(0, random_tokens(3, 11))])
    tensors, ctx, free = before
    assert all(torch.equal(a, b) for a, b in zip(cache.state_tensors(), tensors))
    assert cache.context_lens == ctx and cache.free_blocks == free


@pytest.mark.parametrize("convert", ["to-bf16", "half", "to-fp32-noop", "float-after-half"])
def test_model_to_keeps_weights_stacked_and_rope_fp32(convert):
    model = HybridModel.from_preset("tiny", seed=2)
    ref = model.prefill(model.new_cache(2, 8), [Stream(0, random_tokens(20, 1))])
    {"to-bf16": lambda: model.to(torch.bfloat16), "half": model.half,
     "to-fp32-noop": lambda: model.to(torch.float32), "float-after-half": lambda: model.half().float()}[convert]()
    assert model.rope_inv_freq.dtype == torch.float32
    a = model.layers[0].linear_attn
    qkv = a.in_proj_qkv.weight
    assert a.in_proj_z.weight.data_ptr() == qkv.data_ptr() + qkv.numel() * qkv.element_size()  # still stacked
    out = model.prefill(model.new_cache(2, 8), [Stream(0, random_tokens(20, 1))])
    assert out.dtype == model.dtype
    assert rel_err(out.float(), ref) <= (1e-6 if convert == "to-fp32-noop" else 5e-2)  # else: rounded weights


def test_model_to_unsupported_dtype_raises_and_changes_nothing():
    model = HybridModel.from_preset("tiny", seed=2)
    cache = model.new_cache(2, 8)
    for convert in (model.double, lambda: model.to(torch.float64)):
        with pytest.raises(ValueError, match=r"float64.*from_pretrained\(path, dtype=...\)"):
            convert()
    assert model.dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.parameters())
    model.prefill(cache, [Stream(0, [1, 2, 3])])


def test_runner_of_a_converted_model_refuses():
    model = HybridModel.from_preset("tiny", seed=2)
    runner = GraphRunner(model, model.new_cache(2, 8), batch_sizes=[1], token_counts=[16])
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="build a new GraphRunner"):
        runner.prefill([Stream(0, [1])])


def test_many_runners_in_one_process():
    """Each runner compiles its own step: the 12th runner (other caches, other models) still
    compiles, and none of them raises the global recompile limit."""
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit
    models = [HybridModel.from_preset("tiny", seed=s) for s in range(2)]
    for i in range(12):
        model = models[i % 2]
        cache = model.new_cache(2, 8 + i, block_size=16)  # another geometry each time
        runner = GraphRunner(model, cache, batch_sizes=[1], token_counts=[16])
        out = runner.prefill([Stream(1, random_tokens(5 + i, i))])
        ref = model.prefill(model.new_cache(2, 8 + i, block_size=16), [Stream(1, random_tokens(5 + i, i))])
        assert rel_err(out, ref) <= 1e-5
    assert dynamo_config.recompile_limit == limit


def test_cache_of_another_model_is_rejected():
    a, b = HybridModel.from_preset("tiny", seed=1), HybridModel.from_preset("tiny", seed=1)
    cache = a.new_cache(2, 8)
    a.prefill(cache, [Stream(0, [1, 2, 3])])
    before = _state(cache)
    with pytest.raises(ValueError, match="created by another model"):
        b.prefill(cache, [Stream(0, [4])])
    with pytest.raises(ValueError, match="created by another model"):
        GraphRunner(b, cache)
    assert cache.context_lens == before[1]


def test_a_runner_that_refuses_its_arguments_leaves_an_ownerless_cache_free():
    """A cache made without an owner is bound to the first model that uses it. A GraphRunner refused for
    its other arguments (a bad grid, graphs on the CPU) bound it anyway, so the cache then refused its
    actual model as 'another model'."""
    from metrale_graph.cache import HybridCache

    a, b = HybridModel.from_preset("tiny", seed=1), HybridModel.from_preset("tiny", seed=1)
    cache = HybridCache(a.local, 2, 8)
    for kwargs, msg in [(dict(batch_sizes=[0]), "batch_sizes must be"), (dict(token_counts=[]), "token_counts must be"),
                        (dict(use_graphs=True), "CUDA graphs need")]:
        with pytest.raises(ValueError, match=msg):
            GraphRunner(a, cache, **kwargs)
    b.prefill(cache, [Stream(0, [1, 2, 3])])
    with pytest.raises(ValueError, match="created by another model"):
        GraphRunner(a, cache)


def test_a_prefill_refused_for_its_streams_leaves_an_ownerless_cache_free():
    """model.prefill with bad streams bound an ownerless cache to the model before validating them, so the
    cache then refused the model that used it next."""
    from metrale_graph.cache import HybridCache

    a, b = HybridModel.from_preset("tiny", seed=1), HybridModel.from_preset("tiny", seed=1)
    cache = HybridCache(a.local, 2, 8)
    for streams in ([Stream(5, [1])], [Stream(0, [a.config.vocab_size])], []):
        with pytest.raises(ValueError):
            a.prefill(cache, streams)
    b.prefill(cache, [Stream(0, [1, 2, 3])])
    with pytest.raises(ValueError, match="created by another model"):
        a.prefill(cache, [Stream(1, [1])])


def test_one_caller_at_a_time():
    """A second thread's prefill or reset while a prefill runs gets CacheInUseError (a ValueError);
    the running prefill completes and the bookkeeping stays consistent."""
    model = HybridModel.from_preset("tiny", seed=3)
    cache = model.new_cache(4, 16, block_size=16)
    inside, release = threading.Event(), threading.Event()
    real = model.forward_packed

    def slow(cache_, batch):
        inside.set()
        assert release.wait(30)
        return real(cache_, batch)

    model.forward_packed = slow
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=model.prefill(cache, [Stream(1, random_tokens(20, 1))])))
    worker.start()
    assert inside.wait(30)
    try:
        for call in (lambda: model.prefill(cache, [Stream(1, [5])]), lambda: model.prefill(cache, [Stream(2, [5])]),
                     lambda: cache.reset(1)):
            with pytest.raises(CacheInUseError, match="one caller at a time"):
                call()
    finally:
        release.set()
        worker.join(30)
    del model.forward_packed
    assert result["out"].shape == (1, model.config.vocab_size)
    assert cache.context_lens == [0, 20, 0, 0] and cache.free_blocks == 16 - 2
    assert issubclass(CacheInUseError, ValueError)


def test_cache_and_runner_built_in_inference_mode_serve_outside_it():
    """A cache and a runner's bucket buffers made under torch.inference_mode() hold normal tensors: steps
    outside inference mode (and back inside it) update them in place and give the same logits."""
    from metrale_graph.batch import PackedBatch

    model = HybridModel.from_preset(tiny_config(), seed=0)
    with torch.inference_mode():
        cache = model.new_cache(2, 8, block_size=16)
        buffers = PackedBatch.padding(2, 16, cache)
    ref_cache = model.new_cache(2, 8, block_size=16)
    for batch in ([Stream(0, [1, 2, 3]), Stream(1, [4])], [Stream(0, [5])]):
        want = model.prefill(ref_cache, batch)
        assert torch.equal(model.prefill(cache, batch), want)
    with torch.inference_mode():
        assert torch.equal(model.prefill(cache, [Stream(1, [6])]), model.prefill(ref_cache, [Stream(1, [6])]))
    assert not any(t.is_inference() for t in cache.state_tensors()) and not buffers.tokens.is_inference()


def test_a_held_cache_serves_only_threads_acting_for_its_holder():
    """hold(): every other caller (prefill, reset, another thread) gets CacheInUseError naming the holder;
    acting_for(holder) lets the holder's own thread through; release() frees the cache; a copy is unheld."""
    import copy
    import threading

    model = HybridModel.from_preset("tiny")
    cache = model.new_cache(2, 8)
    token = object()
    cache.hold(token, "an Engine")
    assert cache.holder_name == "an Engine"
    with pytest.raises(CacheInUseError, match="held by an Engine"):
        model.prefill(cache, [Stream(0, [1, 2])])
    with pytest.raises(CacheInUseError, match="held by an Engine"):
        cache.reset(0)
    with pytest.raises(CacheInUseError, match="already held"):
        cache.hold(object(), "another")
    errors = []
    with cache.acting_for(token):
        model.prefill(cache, [Stream(0, [1, 2])])
        other = threading.Thread(target=lambda: errors.append(pytest.raises(CacheInUseError, cache.reset, 0)))
        other.start()
        other.join()
    assert errors and cache.context_lens[0] == 2  # the other thread acts for nobody
    assert copy.deepcopy(cache).holder_name is None
    cache.release(token)
    cache.reset(0)
    assert cache.holder_name is None and cache.context_lens[0] == 0


class _Halt(BaseException):
    """A BaseException that is not an Exception, as KeyboardInterrupt and SystemExit are."""


class _CharTokens:
    """A tokenizer object (one character a token) whose decode, in the engine loop's thread, raises `fail` (then
    disarms) once it meets token `bad`."""

    def __init__(self):
        self.bad, self.fail = None, None

    def encode(self, text):
        return [ord(c) % 500 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        if self.fail is not None and self.bad in ids and threading.current_thread().name == "metrale-engine-loop":
            fail, self.fail = self.fail, None
            raise fail("injected in decode")
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("where", ["decode", "save"])
def test_a_base_exception_taking_a_token_in_fails_only_its_request(where, overlap):
    """A BaseException that is not an Exception (KeyboardInterrupt, SystemExit, ...) raised while the loop took a
    read-back token into its request (the tokenizer's decode of the streamed text, the prefix save of a request that
    ends) stopped the engine loop: every request ended with EngineClosedError, the engine served no more, and the
    request whose prefix save raised got no end at all (its consumer waited for ever). As in the step itself, only
    that request fails with it; the others go on, the slots are freed and a later request gets a fresh engine's
    tokens."""
    from metrale_graph import Engine

    model = HybridModel.from_preset("tiny", seed=3)
    kw = dict(num_slots=3, token_budget=24, block_size=16, max_context=200, compile=False, overlap=overlap,
              prefix_cache=True, checkpoint_interval=64, prefix_checkpoints=8, tokenizer=_CharTokens())
    prompts = [random_tokens(n, seed=30 + n) for n in (70, 9, 33)]
    with Engine(model, **kw) as fresh:
        want = [r.token_ids for r in fresh.generate(prompts, max_new_tokens=6, stop_token_ids=[])]
    engine = Engine(model, **kw)
    if where == "decode":
        others = set(prompts[0][-5:] + prompts[1] + prompts[2] + want[1] + want[2])  # (what the others decode)
        engine.tokenizer.bad, engine.tokenizer.fail = next(t for t in want[0] if t not in others), _Halt
    else:  # the prefix save of the first request to end (its slot no longer a running request's)
        real = engine.cache.save_prefix

        def save_prefix(slot):
            if slot not in [r.slot for r in engine._loop.scheduler.running]:
                del engine.cache.save_prefix
                raise _Halt("injected in save")
            return real(slot)

        engine.cache.save_prefix = save_prefix
    handles = [engine.submit(p, max_new_tokens=6, stop_token_ids=[]) for p in prompts]
    outcomes = []
    for handle in handles:
        try:
            outcomes.append(handle.result(60).token_ids)
        except _Halt as e:
            outcomes.append(e)
    failed = [k for k, out in enumerate(outcomes) if isinstance(out, _Halt)]
    assert len(failed) == 1 and (where == "save" or failed == [0])
    assert [out for k, out in enumerate(outcomes) if k not in failed] == [w for k, w in enumerate(want) if k not in failed]
    assert not engine._loop.closed and engine.cache.context_lens == [0, 0, 0]
    assert not any(engine.cache._index.refs) and engine.cache.free_blocks == engine.cache.num_blocks
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=6, stop_token_ids=[])] == want
    engine.shutdown()


def test_a_base_exception_resetting_slots_at_the_loops_end_still_ends_every_request():
    """At the loop's end (shutdown) every slot still held is reset, best effort: a reset that raised an Exception
    did not stop the others, but one that raised a BaseException (KeyboardInterrupt, SystemExit, ...) left
    release_all before the outstanding requests were ended: every running and waiting request's consumer waited for
    ever. Now each still ends with EngineClosedError and the loop's thread ends."""
    from metrale_graph import Engine
    from metrale_graph.engine import EngineClosedError

    model = HybridModel.from_preset("tiny", seed=3)
    engine = Engine(model, num_slots=2, token_budget=8, block_size=16, max_context=200, compile=False)
    handles = [engine.submit(random_tokens(3, seed=k), max_new_tokens=150, stop_token_ids=[]) for k in range(3)]
    next(iter(handles[0]))  # two run, one waits
    real = engine.cache.reset

    def reset(slot):
        if engine._loop.is_loop_thread():
            raise _Halt("injected in reset")
        return real(slot)

    engine.cache.reset = reset
    engine.shutdown(timeout=30)
    for handle in handles:
        with pytest.raises(EngineClosedError, match="shut down"):
            handle.result(30)
    assert not engine._loop._thread.is_alive() and engine.cache.holder_name is None


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt, _Halt], ids=["error", "ctrl-c", "base-exception"])
@pytest.mark.parametrize("which", ["stopping", "other"])
def test_a_slot_reset_failing_after_a_failed_step_fails_only_that_steps_running_requests(which, exc, monkeypatch):
    """A step that fails after it ran (its sampling raised) resets its slots before the step before is delivered
    (a request ending there keeps its slot's context as a prefix). That reset raising a BaseException that is not an
    Exception (KeyboardInterrupt, a user's own, from the cache's reset) stopped the engine loop: every request ended
    with EngineClosedError and the engine served no more; an Exception left the slots after the one that raised
    unreset, and a request stopping at the step before then kept its slot's state one token on as its prefix, which
    a later prompt restored. Now each slot is reset on its own, and a request that stopped at the step before ends
    "stop" with its whole output whichever slot's reset raised (it failed with the later step's error when its own
    did), keeping nothing of its turn (its slot reset, or not to be trusted), never the failed step's state; the
    request still running fails with the step's error; the engine goes on: later prompts through the prompt's
    prefix give plain decoding's tokens, nothing is held."""
    import metrale_graph.loop as loop_module
    from metrale_graph import Engine

    model = HybridModel.from_preset("tiny", seed=3)
    kw = dict(num_slots=2, token_budget=64, block_size=16, max_context=256, compile=False)
    prompt, other = random_tokens(20, seed=81), random_tokens(9, seed=82)
    with Engine(model, **kw) as plain:
        free = plain.generate([prompt], max_new_tokens=8, stop_token_ids=[])[0].token_ids
        follow = prompt + free[:3] + random_tokens(5, seed=83)
        want = [r.token_ids for r in plain.generate([follow, other], max_new_tokens=6, stop_token_ids=[])]
    engine = Engine(model, prefix_cache=True, **kw)
    loop, stop = engine._loop, free[3]
    real_sample, real_reset, armed = loop_module.sample, engine.cache.reset, []

    def sample(logits, rows, *args):  # the step after the one that sampled `stop` for `prompt` fails in its sampling
        if armed == ["sample"]:
            armed[:] = ["reset"]
            raise RuntimeError("sampling failed")
        result = real_sample(logits, rows, *args)
        if any(r.prompt == prompt and t == stop for r, t in zip(rows, result.tokens.tolist())):
            armed.append("sample")
        return result

    def reset(slot):  # then the reset of `which` request's slot raises, once
        target = next((r for r in loop.scheduler.running if (r.prompt == prompt) == (which == "stopping")), None)
        if armed == ["reset"] and loop.is_loop_thread() and target is not None and slot == target.slot:
            armed.clear()
            raise exc("injected in reset")
        return real_reset(slot)

    monkeypatch.setattr(loop_module, "sample", sample)
    engine.cache.reset = reset
    long = engine.submit(other, max_new_tokens=40, stop_token_ids=[])  # (first: slot 0, its reset comes first)
    next(iter(long))
    ends = engine.submit(prompt, max_new_tokens=8, stop_token_ids=[stop])
    outcomes = []
    for handle in (ends, long):
        try:
            outcomes.append(handle.result(60))
        except BaseException as e:
            outcomes.append(e)
    monkeypatch.undo()
    del engine.cache.reset
    assert not armed, "the injected failures did not happen"
    assert outcomes[0].token_ids == free[:4] and outcomes[0].finish_reason == "stop"
    assert isinstance(outcomes[1], RuntimeError) and str(outcomes[1]) == "sampling failed"
    assert not loop.closed and engine.cache.context_lens == [0, 0]
    assert not any(engine.cache._index.refs) and engine.cache.free_blocks == engine.cache.num_blocks
    # of `follow` (prompt + 3 of its tokens + more), only what the prompt's prefill kept: nothing of its turn
    assert engine.cache._index.lookup(follow, len(follow)).length == len(prompt) - 1
    got = engine.generate([follow, other], max_new_tokens=6, stop_token_ids=[])
    assert [r.token_ids for r in got] == want
    engine.shutdown()
