"""On a GPU: generation through CUDA graphs (every step a replay, decode buckets included) against
the eager engine on the same bf16 model, greedy; prompts queue for slots and are chunked."""

import pytest
import torch

from metrale_graph import PRESETS, Engine, HybridModel

pytestmark = pytest.mark.gpu

# 9B head shapes, few heads, a small hidden size: quick to capture
CFG = PRESETS["qwen3.5-9b"].replace(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                                    linear_num_value_heads=4)


def test_graph_engine_greedy_equals_eager_engine():
    model = HybridModel.from_preset(CFG, dtype=torch.bfloat16, device="cuda", seed=5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (5, 37, 100, 3, 64, 130)]
    opts = dict(num_slots=4, max_context=512, token_budget=64)
    graphs = Engine(model, **opts)
    assert graphs.runner is not None and graphs.runner.use_graphs
    eager = Engine(model, compile=False, **opts)
    out_g = graphs.generate(prompts, max_new_tokens=24)
    out_e = eager.generate(prompts, max_new_tokens=24)
    replayed = [b for b, e in graphs.runner.entries.items() if e.graphs is not None]
    print(f"buckets captured and replayed: {len(replayed)} ({', '.join(map(str, sorted(replayed)))})")
    for i, (a, b) in enumerate(zip(out_g, out_e)):
        same = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        print(f"prompt {i}: {len(a.token_ids)} tokens, first difference at {same}")
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"
    assert any(b.tokens == b.streams for b in replayed)  # a pure-decode bucket ran from a graph


def test_prefix_cache_under_graphs_gives_the_same_greedy_tokens():
    """Prefix caching on CUDA, every step a graph replay: the interval checkpoints written inside the step by
    the GDN kernels (chunked and recurrent) and the prompt-end / request-end states restore prefixes that give
    the same greedy tokens as an engine without the cache (fp32: no bf16 near-tie flips a token)."""
    model = HybridModel.from_preset(CFG, dtype=torch.float32, device="cuda", seed=6)
    g = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    system = draw(200)
    first = [system + draw(n) for n in (9, 40)]
    second = [system + draw(n) for n in (17, 3, 70)]
    # two buckets (decode 4 x 4, prefill 4 x 128): each fp32 bucket of another size compiles again (~10 s)
    opts = dict(num_slots=4, max_context=512, token_budget=128, block_size=64, batch_sizes=[4], token_counts=[4, 128])
    with Engine(model, **opts) as plain, Engine(model, prefix_cache=True, checkpoint_interval=64,
                                                prefix_checkpoints=16, **opts) as cached:
        assert cached.runner is not None and cached.runner.use_graphs
        want = plain.generate(first, max_new_tokens=12) + plain.generate(second, max_new_tokens=12)
        got = cached.generate(first, max_new_tokens=12)
        in_step = cached.stats().prefix["checkpoints"]
        got += cached.generate(second, max_new_tokens=12)
        turn = second[2] + want[4].token_ids + draw(30)  # the next turn of a conversation
        a, b = plain.generate([turn], max_new_tokens=12)[0], cached.generate([turn], max_new_tokens=12)[0]
        print(f"checkpoints after the first prompts: {in_step}; cached tokens "
              f"{[r.cached_tokens for r in got]}, next turn {b.cached_tokens}; {cached.stats().prefix}")
        assert [r.token_ids for r in got] == [r.token_ids for r in want] and a.token_ids == b.token_ids
        assert in_step >= 3  # 64 / 128 / 192 of the system prompt, kept inside a step
        assert all(r.cached_tokens == 192 for r in got[2:]) and b.cached_tokens == len(second[2]) + 11


def test_overlapped_loop_under_graphs_gives_the_streams_of_the_plain_loop():
    """The overlapped loop on CUDA (step N+1 launched before N's tokens reach the host, decodes reading their
    token from the device): the same greedy and seeded-sampling streams as the loop without overlap, every
    step a graph replay, prompts queued and chunked, stop tokens ending requests mid-batch, prefix caching on."""
    model = HybridModel.from_preset(CFG, dtype=torch.bfloat16, device="cuda", seed=7)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (5, 37, 100, 3, 64, 130, 9)]
    opts = dict(num_slots=4, max_context=512, token_budget=64, prefix_cache=True, checkpoint_interval=64)
    runs = {}
    for overlap in (False, True):
        with Engine(model, overlap=overlap, **opts) as engine:
            greedy = engine.generate(prompts, max_new_tokens=20, stop_token_ids=[])
            stops = sorted({r.token_ids[4] for r in greedy[:3]})
            stopped = engine.generate(prompts, max_new_tokens=20, stop_token_ids=stops)
            sampled = engine.generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.95, seed=3,
                                      stop_token_ids=[])
            again = engine.generate(prompts, max_new_tokens=20, stop_token_ids=[])  # prefix hits
            runs[overlap] = [[(r.token_ids, r.finish_reason) for r in out] for out in (greedy, stopped, sampled, again)]
            assert engine.stats().generated_tokens == sum(len(t) for out in runs[overlap] for t, _ in out)
    for name, a, b in zip(("greedy", "stop tokens", "sampled", "prefix hits"), runs[True], runs[False]):
        print(f"{name}: {sum(x == y for x, y in zip(a, b))} of {len(a)} streams equal")
        assert a == b, name
    assert any(reason == "stop" for _, reason in runs[False][1])


def test_the_loop_never_waits_for_the_device_but_to_read_tokens_back():
    """Planning, launching a step (pack, the graph's buffers, replay, sampling, the tokens' copy out) and
    taking a step's tokens in (stop checks, slot resets, prefix saves) never synchronize with the device
    (torch.cuda's sync debug mode raises on a blocking copy, .item(), ...): the one wait is the event behind
    the tokens' copy, so the host plans step N+1 while N runs. Seeded sampling, stop tokens and prefix hits."""
    model = HybridModel.from_preset(CFG, dtype=torch.bfloat16, device="cuda", seed=8)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (5, 70, 130, 3, 64)]
    with Engine(model, num_slots=4, max_context=512, token_budget=64, prefix_cache=True,
                checkpoint_interval=64) as engine:
        engine.warmup()  # compiling and capturing synchronize: before the check
        want = engine.generate(prompts, max_new_tokens=10, stop_token_ids=[])
        stops = sorted({r.token_ids[3] for r in want[:2]})
        loop, sched = engine._loop, engine._loop.scheduler

        def checked(fn):
            def run(*args):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return fn(*args)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            return run

        loop._launch, loop._advance, loop._commit = checked(loop._launch), checked(loop._advance), checked(loop._commit)
        sched.plan = checked(sched.plan)
        again = engine.generate(prompts, max_new_tokens=10, stop_token_ids=[])  # prefix hits
        sampled = engine.generate(prompts, max_new_tokens=10, temperature=0.8, seed=4, stop_token_ids=stops)
    assert [r.token_ids for r in again] == [r.token_ids for r in want]
    assert all(len(r.token_ids) >= 1 for r in sampled)
