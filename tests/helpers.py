"""Models and batches for tests: tiny configs, unit-gain weights, random tokens, the packed step run through
the prefill protocol, and the CUDA allocator's growth over replayed batches."""

from __future__ import annotations

import importlib
import os
import sys

import torch

from metrale_graph.config import ModelConfig, default_layer_types


def run_step(model, step, cache, streams) -> torch.Tensor:
    """model.prefill with `step` (e.g. a compiled forward_packed) in the place of the eager step: the same
    prefill protocol (metrale_graph/protocol.py) around `step(cache, packed)`."""
    from metrale_graph.protocol import prefill_call

    with torch.no_grad(), prefill_call(model, cache, streams) as call:
        return call.run(lambda packed: step(cache, packed))


def packed_batch(model, cache, streams):
    """The PackedBatch a prefill of `streams` hands its step (through the prefill protocol: validated, KV
    blocks reserved; the step itself writes nothing, the slots' contexts advance as after a prefill)."""
    from metrale_graph.protocol import prefill_call

    seen = []

    def record(packed):
        seen.append(packed)
        return torch.zeros(packed.num_streams, 1)

    with prefill_call(model, cache, streams) as call:
        call.run(record)
    return seen[0]


def unit_gain(model, seed: int):
    """Overwrite, in place, every matrix of `model` (every parameter of 2 or more dims but the GDN conv1d
    kernels) by randn * in_features**-0.5 (unit gain) drawn from its own `seed`; returns
    the model. random_weights' std 0.02 (transformers' initializer_range) shrinks each layer's share of the
    residual stream and the spread of the GDN gates (a state outlives a token or two), and routes almost
    uniformly, which blunts comparisons of two paths of one model. The tests' one departure from
    random_weights (HybridModel.from_preset(..., seed=)); references.randomize_reference draws the
    transformers oracle's matrices the same way."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    """n token ids drawn with their own seed (512: the tiny preset's vocabulary)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiny_config(**overrides) -> ModelConfig:
    """A small random-shape config; overrides change any field."""
    base = dict(vocab_size=256, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                layer_types=default_layer_types(4), num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                max_position_embeddings=2048)
    base.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        base["layer_types"] = default_layer_types(base["num_hidden_layers"])
    return ModelConfig(**base)


def moe_config(model_type: str = "qwen3_5_moe_text", **overrides) -> ModelConfig:
    """A small random-shape MoE config of a family (qwen3_5_moe_text or qwen3_next): 5 experts,
    top-3, expert / shared-expert intermediate sizes 20 / 12; overrides change any field."""
    moe = dict(model_type=model_type, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=20,
               shared_expert_intermediate_size=12)
    if model_type == "qwen3_5_moe_text":
        moe["intermediate_size"] = 0  # no dense MLP in Qwen3.5-MoE
    return tiny_config(**{**moe, **overrides})


def replay_memory_growth(runner, vocab: int, replays: int = 1000, seed: int = 1) -> tuple[int, int]:
    """(allocated, reserved) bytes the CUDA caching allocator gained over `replays` random batches through
    `runner` (1-8 streams in random slots, up to 1024 tokens together, slots reset before they pass 900
    tokens of context), after 20 batches of warm-up; both <= 0 when replaying grows nothing."""
    from metrale_graph import Stream

    cache, g = runner.cache, torch.Generator().manual_seed(seed)
    for s in range(cache.num_slots):
        cache.reset(s)

    def one():
        n = int(torch.randint(1, 9, (1,), generator=g))
        slots = torch.randperm(cache.num_slots, generator=g)[:n].tolist()
        for s in slots:
            if cache.context_lens[s] > 900:
                cache.reset(s)
        lengths = torch.randint(1, 1024 // n + 1, (n,), generator=g).tolist()
        runner.prefill([Stream(s, torch.randint(0, vocab, (L,), generator=g)) for s, L in zip(slots, lengths)])

    for _ in range(20):
        one()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(replays):
        one()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - allocated, torch.cuda.memory_reserved() - reserved


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def benchmark_script(path: str):
    """The module of a script under benchmarks/ (`path` without ".py", e.g. "kernels/check_fp8"), imported as it
    runs: its folder first on sys.path, where the scripts beside it (kernels/measure.py) are found."""
    folder, name = os.path.split(os.path.join(BENCHMARKS, path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def cache_fingerprint(cache) -> tuple:
    """A rank's host bookkeeping of `cache` that must equal rank 0's under a plan broadcast (contexts, the MTP head's
    contexts, block tables and lists, the prefix index's refs, lists, entries, LRU, free entries and counters):
    test_prefix_tp and test_speculative_tp compare it rank by rank."""
    index = cache._index
    return (list(cache.context_lens), list(cache.mtp_context_lens), cache.block_tables.tolist(),
            [list(b) for b in cache._blocks], list(index.refs), list(index._plain), list(index._cached),
            sorted((e, m.length) for e, m in index._entries.items()), list(index._entry_lru),
            list(index._free_entries), index.stats())


def read_checkpoint(folder: str) -> tuple[dict, dict]:
    """A safetensors checkpoint folder's config.json and every tensor of its files (shards merged): what the foreign
    and compressed checkpoint tests rewrite."""
    import glob
    import json

    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    tensors = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        tensors.update(load_file(path))
    return config, tensors


def write_sharded(folder: str, tensors: dict, shards: int) -> None:
    """`tensors` as `shards` safetensors files in `folder` (every shards-th name, sorted, to each: a weight and its
    scale in different files) and their model.safetensors.index.json, as sharded checkpoints are written."""
    import json

    from safetensors.torch import save_file

    keys, weight_map = sorted(tensors), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys[i::shards]}, os.path.join(folder, name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys[i::shards], name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
