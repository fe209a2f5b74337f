"""GraphRunner: the packed prefill step compiled with `torch.compile(fullgraph=True)` and, on CUDA,
captured into one CUDA graph per bucket; `prefill(streams)` has model.prefill's contract.

One compiled step serves the whole grid: the static buffers' token and stream dimensions are
marked dynamic, so dynamo and Inductor trace the 32-layer step once instead of once per bucket
(StaticBatch gives single-stream buckets a second, zero-length padding stream so that no size
is 1). Everything the shapes decide inside the ops (the GDN op's chunk count, kernel grids) is
decided in their CUDA implementations from the real sizes, so each bucket's CUDA graph is still
fully static.

Capture follows the usual recipe: warm up on a side stream (dynamo / Inductor compile, Triton
autotuning) so nothing compiles inside a capture; capture the largest buckets first into one
shared memory pool; weights and cache pools are used in place (the graphs read and write them
where they live); per-call inputs are copied into each bucket's static buffers. Replay outputs
live in graph memory and are copied out before `prefill` returns.

Without a GPU (or with use_graphs=False) the same code runs the compiled step on the static
buffers without graphs, so CPU users and CI exercise the same path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from metrale_graph.batch import PackedBatch, Stream, pack
from metrale_graph.cache import HybridCache
from metrale_graph.model import HybridModel

from .buckets import DEFAULT_BATCH_SIZES, DEFAULT_TOKEN_COUNTS, Bucket, StaticBatch, choose, make_grid, split


@dataclass
class BucketReport:
    bucket: Bucket
    compile_s: float = 0.0
    capture_s: float = 0.0
    graph_bytes: int = 0


class GraphRunner:
    def __init__(self, model: HybridModel, cache: HybridCache, batch_sizes=DEFAULT_BATCH_SIZES,
                 token_counts=DEFAULT_TOKEN_COUNTS, use_graphs: bool | None = None):
        model.check_cache(cache)
        self.model, self.cache = model, cache
        self.grid = make_grid(list(batch_sizes), list(token_counts))
        self.largest = Bucket(max(b.tokens for b in self.grid), max(b.streams for b in self.grid))
        if use_graphs is None:
            use_graphs = model.device.type == "cuda"
        if use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.use_graphs = use_graphs
        _allow_recompiles(len(self.grid))
        self.step = torch.compile(model.forward_packed, fullgraph=True, dynamic=False)  # dims: _mark_dynamic
        self.static = {b: StaticBatch(b, cache) for b in self.grid}
        for static in self.static.values():
            _mark_dynamic(static.batch)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Bucket, torch.Tensor] = {}
        self.reports: dict[Bucket, BucketReport] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    # warmup ------------------------------------------------------------------------------------
    def warmup(self, progress: bool = True, on_bucket=None) -> list[BucketReport]:
        """Compile (and on CUDA capture) every bucket, largest first. Runs only padding: no slot or
        block of the cache is read or written except the scratch slot and the null block.
        `on_bucket(report)` is called as each bucket finishes."""
        from tqdm.auto import tqdm

        bar = tqdm(sorted(self.grid, reverse=True), desc="capturing buckets", unit="bucket", disable=not progress)
        for bucket in bar:
            report = self.warm_bucket(bucket)
            bar.set_postfix_str(f"{bucket}: compile {report.compile_s:.1f} s")
            if on_bucket is not None:
                on_bucket(report)
        return [self.reports[b] for b in self.grid]

    @torch.no_grad()
    def warm_bucket(self, bucket: Bucket) -> BucketReport:
        if bucket in self.reports:
            return self.reports[bucket]
        report = BucketReport(bucket)
        static = self.static[bucket]
        static.fill(_empty_batch(self.cache))
        dev = self.model.device
        t0 = time.perf_counter()
        if self.use_graphs:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile, then a second run for anything lazily initialized
                    self.step(self.cache, static.batch)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            report.compile_s = time.perf_counter() - t0
            torch.cuda.empty_cache()  # capture empties the cache itself: measure from the same baseline
            before = torch.cuda.memory_reserved(dev)
            t1 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bucket] = self.step(self.cache, static.batch)
            torch.cuda.synchronize(dev)
            report.capture_s = time.perf_counter() - t1
            report.graph_bytes = torch.cuda.memory_reserved(dev) - before
            self.graphs[bucket] = graph
        else:
            self.step(self.cache, static.batch)
            report.compile_s = time.perf_counter() - t0
        self.reports[bucket] = report
        return report

    # prefill -----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, streams: Sequence[Stream]) -> torch.Tensor:
        """model.prefill's contract: logits [num_streams, vocab], bad input -> ValueError before any
        state changes. A batch larger than the largest bucket runs as several replays (streams
        too long for it are continued across them)."""
        tokens, lengths = self.model.prepare(self.cache, streams)
        n, total = len(streams), sum(lengths)
        if choose(self.grid, n, total) is not None:
            return self._run(streams, tokens, lengths)
        logits = [None] * n
        for piece in split(lengths, self.largest.streams, self.largest.tokens):
            sub = [Stream(streams[i].slot, tokens[i][a:b]) for i, a, b in piece]
            out = self._run(sub, [s.tokens for s in sub], [b - a for _, a, b in piece])
            for row, (i, a, b) in enumerate(piece):
                if b == lengths[i]:
                    logits[i] = out[row]
        return torch.stack(logits)

    def _run(self, streams, tokens, lengths) -> torch.Tensor:
        """Run one batch that fits a bucket (validated, blocks allocated), then commit it."""
        bucket = choose(self.grid, len(streams), sum(lengths))
        self.warm_bucket(bucket)  # a no-op once warm; it fills the static buffers with padding, so first
        static = self.static[bucket]
        static.fill(pack(streams, tokens, self.cache))
        if self.use_graphs:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket][: len(streams)].clone()
        else:
            logits = self.step(self.cache, static.batch)[: len(streams)]
        self.model.commit(self.cache, streams, lengths)
        return logits


def _empty_batch(cache: HybridCache) -> PackedBatch:
    """A batch of no streams: the static buffers become all padding."""
    dev = cache.device
    return PackedBatch(tokens=torch.zeros(0, dtype=torch.int64, device=dev),
                       positions=torch.zeros(0, dtype=torch.int64, device=dev),
                       cu_seqlens=torch.zeros(1, dtype=torch.int32, device=dev),
                       slot_ids=torch.zeros(0, dtype=torch.int64, device=dev),
                       context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
                       block_tables=torch.zeros(0, cache.max_blocks_per_slot, dtype=torch.int32, device=dev))


def _mark_dynamic(batch: PackedBatch) -> None:
    """Mark the token and stream dimensions of a bucket's static buffers dynamic, so every bucket
    reuses one trace (StaticBatch keeps both sizes >= 2, which dynamo does not specialize)."""
    for t in (batch.tokens, batch.positions, batch.cu_seqlens, batch.slot_ids, batch.context_lens,
              batch.block_tables):
        torch._dynamo.mark_dynamic(t, 0)


def _allow_recompiles(n: int) -> None:
    """Keep dynamo's per-function recompile limit above grid size + 8. A runner traces its grid
    once, but every runner (another model, another cache) adds an entry on the same
    `forward_packed`, and past the limit dynamo stops compiling new ones."""
    import torch._dynamo.config as cfg

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n + 8:
            setattr(cfg, name, n + 8)
