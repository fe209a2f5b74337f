"""The workloads of tools.bench (docs/benchmarking.md) and the one cache that holds any of
them for our model's three modes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from metrale_graph import Stream
from metrale_graph.tools.floors import StepFloor, step_floor


@dataclass(frozen=True)
class Workload:
    new: tuple[int, ...]  # new tokens per stream
    cached: tuple[int, ...]  # tokens already cached per stream

    @property
    def label(self) -> str:
        groups = sorted(Counter(zip(self.new, self.cached)).items(), key=lambda kv: -kv[1])
        if len(groups) > 2:
            return f"{len(self.new)} ragged, {sum(self.new)} tok"
        return " + ".join(f"{n}x{new}" + (f" +{c} cached" if c else "") for (new, c), n in groups)


WORKLOADS = {
    "W1": Workload((512,), (0,)),
    "W2": Workload((512,) * 8, (0,) * 8),
    "W3": Workload((1500, 37, 900, 256, 700, 128, 420, 155), (0,) * 8),
    "W4": Workload((128,) * 32, (0,) * 32),
    "W5": Workload((16384,), (0,)),
    "W6": Workload((512,) * 4, (2048,) * 4),
    "W7": Workload((1,) * 31 + (512,), (2048,) * 31 + (0,)),  # a mixed step: 31 decodes + 1 prompt
    "D1": Workload((1,), (2048,)),
    "D32": Workload((1,) * 32, (2048,) * 32),
    "D128": Workload((1,) * 128, (2048,) * 128),  # decode at serving concurrency
}


def fitting_workloads(cfg, names: list[str]) -> tuple[list[str], dict[str, int]]:
    """The workloads of `names` whose streams fit cfg.max_position_embeddings (cached + new tokens), and
    the others with the positions they need."""
    need = {w: max(n + c for n, c in zip(WORKLOADS[w].new, WORKLOADS[w].cached)) for w in names}
    too_long = {w: n for w, n in need.items() if n > cfg.max_position_embeddings}
    return [w for w in names if w not in too_long], too_long


def workload_floor(cfg, w: Workload, gpus: int = 1) -> StepFloor:
    """The floors of one step of `w` on `gpus` GPUs (tools/floors.py)."""
    return step_floor(cfg, w.new, w.cached, gpus)


CONTEXT_TOKENS = 65536  # most cached tokens prefilled in one untimed call (D128 holds 262144)


def bench_cache(model, workloads: list[Workload]):
    """One cache that holds any of the workloads, stream i in slot i: a slot per stream of the widest, KV
    blocks (of 64 tokens) for all streams of the largest, max_context the longest stream (cached + new)."""
    per_slot = max(n + c for w in workloads for n, c in zip(w.new, w.cached))
    blocks = max(sum(-(-(n + c) // 64) for n, c in zip(w.new, w.cached)) for w in workloads)
    return model.new_cache(num_slots=max(len(w.new) for w in workloads), num_blocks=blocks, max_context=per_slot)


def prefill_contexts(model, cache, contexts: list[torch.Tensor | None], max_tokens: int = CONTEXT_TOKENS) -> None:
    """Reset every slot, then prefill contexts[i] (None: nothing cached) into slot i, in calls of at most
    `max_tokens` tokens (a context longer than that in a call of its own), so that D128's 128 x 2048 need no
    more activation memory than D32's."""
    for s in range(cache.num_slots):
        cache.reset(s)
    batch, tokens = [], 0
    for stream in [Stream(i, c) for i, c in enumerate(contexts) if c is not None]:
        if batch and tokens + len(stream.tokens) > max_tokens:
            model.prefill(cache, batch)
            batch, tokens = [], 0
        batch.append(stream)
        tokens += len(stream.tokens)
    if batch:
        model.prefill(cache, batch)


class Ours:
    """Our model in the three modes over one cache (bench_cache); the cache is restored before each
    timed call."""

    def __init__(self, model, workloads: list[Workload], grid):
        from metrale_graph.capture import GraphRunner

        self.model = model
        self.cache = bench_cache(model, workloads)
        batch_sizes, token_counts = grid
        self.graphs = GraphRunner(model, self.cache, batch_sizes, token_counts, use_graphs=True)
        self.compiled = GraphRunner(model, self.cache, batch_sizes, token_counts, use_graphs=False)
        self.snapshot = None

    def prepare_context(self, contexts: list[torch.Tensor | None]):
        """Prefill each stream's cached context (untimed, prefill_contexts) and remember the cache state to
        restore."""
        self.snapshot = None  # freed before the next one is taken
        prefill_contexts(self.model, self.cache, contexts)
        self.snapshot = self.cache.snapshot()

    def restore(self):
        self.cache.restore(self.snapshot)

    def run(self, mode, streams):
        if mode == "eager":
            return self.model.prefill(self.cache, streams)
        return (self.graphs if mode == "graphs" else self.compiled).prefill(streams)


def grid_of(names: list[str]) -> tuple[list[int], list[int]]:
    """A bucket grid holding one bucket per workload's (streams, new tokens)."""
    return (sorted({len(WORKLOADS[w].new) for w in names}), sorted({sum(WORKLOADS[w].new) for w in names}))
