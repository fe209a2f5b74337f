"""GraphRunner: the packed prefill step compiled with `torch.compile(fullgraph=True)` and, on CUDA,
captured into one CUDA graph per bucket; `prefill(streams)` has model.prefill's contract.

One compiled step serves the buckets of several streams: the static buffers' token and stream
dimensions are marked dynamic, so dynamo and Inductor trace the step once instead of once per
bucket. Single-stream buckets have a second compiled step (`one_stream_step`, default on), traced
once with the token dimension dynamic and one stream: dynamo specializes sizes 0 and 1 even when
marked dynamic, so they cannot share the first trace, and inside the ops one stream takes its own
paths (attention by cuDNN's dense kernel; the GDN chunked path without the recurrent kernel). With
one_stream_step=False a single-stream bucket is padded with a zero-length stream into the first
trace instead. Everything the shapes decide inside the ops (the GDN op's chunk count, kernel grids,
the attention backend) is decided in their CUDA implementations from the real sizes, so each
bucket's CUDA graph is still fully static.

Capture follows the usual recipe: warm up on a side stream (dynamo / Inductor compile, Triton
autotuning) so nothing compiles inside a capture; capture the largest buckets first into one
shared memory pool; weights and cache pools are used in place (the graphs read and write them
where they live); per-call inputs are copied into each bucket's static buffers. Replay outputs
live in graph memory and are copied out before `prefill` returns.

A bucket is warmed (compiled, captured) before the batch touches the cache, so a compile or
capture failure leaves every slot as it was; a failure after that resets the batch's slots
(HybridCache.transaction).

Each runner compiles its own copies of the step function (one per kind of bucket): dynamo keeps
compiled entries, and counts recompiles against its limit, per code object, so runners (other
models, other cache geometries) neither share nor exhaust one function's entries, and a runner's
entries go when it does. The recompile limit is raised to the grid size + 8 only while this runner's step runs
(`torch._dynamo.config.patch`); no global torch setting is changed.

Without a GPU (or with use_graphs=False) the same code runs the compiled step on the static
buffers without graphs, so CPU users and CI exercise the same path.

Speculative decoding's verify step (hidden_bucket / run_hidden: the hidden states of every token) is compiled
and captured in layer pieces (verify_pieces, `layer_pieces`): a graph of the whole model took 1.9-2.2 ms to
launch on an H100 with the GPU idle until the launch returned; its pieces are launched one after another, so the
GPU starts on the first small one while the host launches the rest.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Sequence

import torch

from metrale_graph import envs
from metrale_graph.batch import PackedBatch, Stream, empty_batch
from metrale_graph.placement import check_memory
from metrale_graph.cache import HybridCache
from metrale_graph.model import HybridModel
from metrale_graph.protocol import prefill_call

from .buckets import DEFAULT_BATCH_SIZES, DEFAULT_TOKEN_COUNTS, Bucket, choose, make_grid, split


@dataclass
class BucketReport:
    bucket: Bucket
    compile_s: float = 0.0
    capture_s: float = 0.0
    graph_bytes: int = 0


@dataclass
class BucketEntry:
    """Everything a runner keeps for one bucket."""
    bucket: Bucket
    batch: PackedBatch  # static input buffers (at least 2 tokens; 1 stream for a single-stream bucket of
    # a runner with one_stream_step, else at least 2)
    report: BucketReport | None = None  # set once the bucket is compiled (and captured)
    graphs: list[torch.cuda.CUDAGraph] | None = None  # its CUDA graphs, replayed in order: one, or a hidden entry's
    # one per layer piece (verify_pieces)
    output: torch.Tensor | None = None  # the captured step's logits (hidden states: hidden_states), in graph memory
    filled: tuple[int, int] | None = None  # (streams, tokens) of the batch last filled in (None: not known)
    hidden: bool = False  # the hidden-states step's (speculative decoding's verify), not the logits step's
    between: list[torch.Tensor] | None = None  # the outputs of all graphs but the last (each the next one's input),
    # kept referenced so that no later capture takes their memory


class GraphRunner:
    def __init__(self, model: HybridModel, cache: HybridCache, batch_sizes=DEFAULT_BATCH_SIZES,
                 token_counts=DEFAULT_TOKEN_COUNTS, use_graphs: bool | None = None, one_stream_step: bool = True,
                 verify_pieces: Sequence[int] | None = None):
        """one_stream_step: single-stream buckets run one stream through a step compiled for one stream (a
        second trace, compiled when the first such bucket is warmed); False pads them to two streams in
        the shared trace (the ops then take their several-stream paths). verify_pieces: the hidden-states
        step's (speculative verify's) leading layer pieces, by layer count, each compiled and captured on its
        own, the remaining layers the last piece (see `layer_pieces`); default METRALE_VERIFY_PIECES, else
        DEFAULT_VERIFY_PIECES with graphs and one piece without."""
        self.grid = make_grid(batch_sizes, token_counts)
        if use_graphs is None:
            use_graphs = model.device.type == "cuda"
        self.hidden_pieces = layer_pieces(verify_pieces, len(model.local.layer_types), use_graphs)
        self.largest = max(self.grid)  # holds every bucket's streams and tokens (B <= T throughout)
        if use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        one = bool(one_stream_step)
        sizes = {b: (1 if one and b.streams == 1 else max(b.streams, 2), max(b.tokens, 2)) for b in self.grid}
        check_memory([(f"buckets of up to {self.largest.tokens} tokens (token_counts; an Engine's token_budget)",
                       sum(PackedBatch.padding_bytes(*bt, cache) for bt in sizes.values()))],
                     cache.device, "the buckets' static input buffers")
        model.check_cache(cache)  # last of the checks: it binds a cache made without an owner to the model
        self.model, self.cache = model, cache
        self.use_graphs = use_graphs
        self.entries = {b: BucketEntry(b, PackedBatch.padding(*sizes[b], cache)) for b in self.grid}
        for entry in self.entries.values():
            if entry.batch.num_streams == 1:
                _mark_tokens_dynamic(entry.batch)
            else:
                entry.batch.mark_dynamic()
        self.step = _compile_step(model, recompile_limit=len(self.grid) + 8)  # buckets of several streams
        self.step_one_stream = _compile_step(model, recompile_limit=len(self.grid) + 8) if one else None
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._model_version = model.version
        self._one = one
        # speculative decoding's verify (hidden_states): the hidden states of every token, per bucket, made on
        # first use (their own buffers and compiled steps; a runner without speculation never builds them)
        self.hidden_entries: dict[Bucket, BucketEntry] = {}
        self.hidden_steps: dict[bool, list] = {}  # one stream or several -> a compiled step per layer piece
        self._last_size, self._last_bucket = None, None  # launch's last (streams, tokens) and the bucket chosen

    @property
    def reports(self) -> dict[Bucket, BucketReport]:
        return {b: e.report for b, e in self.entries.items() if e.report is not None}

    # warmup ------------------------------------------------------------------------------------
    def warmup(self, progress: bool = True, on_bucket=None) -> list[BucketReport]:
        """Compile (and on CUDA capture) every bucket, largest first. Runs only padding: no slot or
        block of the cache is read or written except the scratch slot and the null block.
        `on_bucket(report)` is called as each bucket finishes. `progress`: a bar where standard error is a
        terminal."""
        from tqdm.auto import tqdm

        self._check_model()
        bar = tqdm(sorted(self.grid, reverse=True), desc="capturing buckets", unit="bucket",
                   disable=None if progress else True)  # on a terminal only (tqdm's None), never in a log
        with self.cache.exclusive():
            for bucket in bar:
                report = self._warm(bucket)
                bar.set_postfix_str(f"{bucket}: compile {report.compile_s:.1f} s")
                if on_bucket is not None:
                    on_bucket(report)
        return [self.entries[b].report for b in self.grid]

    def warm_bucket(self, bucket: Bucket) -> BucketReport:
        """Compile (and on CUDA capture) one bucket of the grid; ValueError for a bucket not in it."""
        try:
            known = bucket in self.entries
        except TypeError:  # unhashable, e.g. a list
            known = False
        if not known:
            raise ValueError(f"{bucket!r} is not a bucket of this runner's grid "
                             f"({', '.join(map(str, self.grid))}); pass one of runner.grid")
        self._check_model()
        with self.cache.exclusive():
            return self._warm(bucket)

    @torch.no_grad()
    def _warm(self, bucket: Bucket, hidden: bool = False) -> BucketReport:
        entry = (self.hidden_entries if hidden else self.entries)[bucket]
        if entry.report is not None:
            return entry.report
        report = BucketReport(bucket)
        entry.filled = None
        entry.batch.fill(empty_batch(self.cache), self.cache)
        entry.filled = (0, 0)
        dev = self.model.device
        t0 = time.perf_counter()
        pieces = self._pieces_of(entry)
        if self.use_graphs:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile, then a second run for anything lazily initialized
                    _run_pieces(pieces, self.cache, entry.batch)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            report.compile_s = time.perf_counter() - t0
            torch.cuda.empty_cache()  # capture empties the cache itself: measure from the same baseline
            before = torch.cuda.memory_reserved(dev)
            t1 = time.perf_counter()
            graphs, outputs, h = [], [], None
            for piece in pieces:  # one graph a piece, the pieces' outputs kept (each the next one's input)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    h = _run_pieces([piece], self.cache, entry.batch, h)
                graphs.append(graph)
                outputs.append(h)
            torch.cuda.synchronize(dev)
            report.capture_s = time.perf_counter() - t1
            report.graph_bytes = torch.cuda.memory_reserved(dev) - before
            entry.graphs, entry.output, entry.between = graphs, outputs[-1], outputs[:-1]
        else:
            _run_pieces(pieces, self.cache, entry.batch)
            report.compile_s = time.perf_counter() - t0
        entry.report = report
        return report

    def _pieces_of(self, entry: BucketEntry) -> list:
        """The compiled steps that make the entry's output, in order: the logits step (one stream or several), or
        the hidden-states step's pieces, each called as piece(cache, batch, h) on the previous piece's output."""
        one = entry.batch.num_streams == 1 and self._one
        if not entry.hidden:
            step = self.step_one_stream if one else self.step
            return [lambda cache, batch, h: step(cache, batch)]
        if one not in self.hidden_steps:
            limit = len(self.grid) + 8
            self.hidden_steps[one] = [_compile_step(self.model, limit, "hidden_states", layers)
                                      for layers in self.hidden_pieces]
        return self.hidden_steps[one]

    # speculative decoding's verify ----------------------------------------------------------------
    def hidden_bucket(self, num_streams: int, num_tokens: int) -> BucketEntry | None:
        """The hidden-states entry of the bucket a step of `num_streams` streams and `num_tokens` tokens fits,
        compiled (on CUDA captured) now, or None when it fits none. Call it before the step's checkpoint targets
        are set: warming runs padding only (the scratch slot, the null block)."""
        self._check_model()
        bucket = choose(self.grid, num_streams, num_tokens)
        if bucket is None:
            return None
        if bucket not in self.hidden_entries:
            main = self.entries[bucket].batch
            batch = PackedBatch.padding(main.num_streams, main.num_tokens, self.cache)
            if batch.num_streams == 1:
                _mark_tokens_dynamic(batch)
            else:
                batch.mark_dynamic()
            self.hidden_entries[bucket] = BucketEntry(bucket, batch, hidden=True)
        self._warm(bucket, hidden=True)
        return self.hidden_entries[bucket]

    def run_hidden(self, entry: BucketEntry, packed: PackedBatch) -> torch.Tensor:
        """The hidden states [packed tokens, hidden] (model.hidden_states) of `packed`, a step's batch inside its
        caller's prefill call, through `entry` (hidden_bucket's); with graphs, the graph's own output buffer,
        valid until the entry's next replay."""
        return self._run(entry, packed, copy=False, rows=packed.num_tokens)

    # prefill -----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, streams: Sequence[Stream]) -> torch.Tensor:
        """model.prefill's contract: logits [num_streams, vocab], bad input -> ValueError before any
        state changes, a failure while running resets the batch's slots. A batch larger than the
        largest bucket runs as several replays (streams too long for it are continued across them,
        as a chunked prefill)."""
        self._check_model()
        with prefill_call(self.model, self.cache, streams) as call:  # metrale_graph/protocol.py
            pieces = None  # the whole batch in one step
            buckets = {choose(self.grid, len(call.lengths), call.num_tokens)}
            if buckets == {None}:
                pieces = split(call.lengths, self.largest.streams, self.largest.tokens)
                buckets = {choose(self.grid, len(p), sum(b - a for _, a, b in p)) for p in pieces}
            # compile / capture first (a failure here changes no slot), the largest first as in warmup: the
            # smaller graphs then reuse the larger one's memory pool
            for bucket in sorted(buckets, reverse=True):
                self._warm(bucket)
            return call.run(lambda packed: self._run(self._bucket_of(packed), packed), pieces)

    def launch(self, streams: Sequence[Stream], last_tokens: torch.Tensor, k: int):
        """prefill's one step for the engine's asynchronous loop (PrefillCall.launch: the first k streams read
        their token from `last_tokens` on the device; returns (logits, commit)). The batch must fit one bucket
        (the engine's grid covers its steps). The logits are the graph's own output buffer, valid until the
        next replay: the caller samples from them before launching another step. Runs without grad (the engine
        loop's thread has it off already: no context entered per step)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._launch(streams, last_tokens, k)
        return self._launch(streams, last_tokens, k)

    def _launch(self, streams: Sequence[Stream], last_tokens: torch.Tensor, k: int):
        self._check_model()
        with prefill_call(self.model, self.cache, streams) as call:
            size = (len(call.lengths), call.num_tokens)
            if size != self._last_size:  # (a decode step's size repeats: the grid is not searched again)
                self._last_size, self._last_bucket = size, choose(self.grid, *size)
            bucket = self._last_bucket
            if bucket is None:
                raise ValueError(f"a step of {len(call.lengths)} streams and {call.num_tokens} tokens fits no bucket "
                                 f"of this runner (the largest is {self.largest})")
            entry = self.entries[bucket]
            if entry.report is None:  # (_warm returns at once for a warm bucket)
                self._warm(bucket)
            return call.launch(lambda packed: self._run(entry, packed, copy=False), last_tokens, k)

    def _bucket_of(self, packed: PackedBatch) -> "BucketEntry":
        return self.entries[choose(self.grid, packed.num_streams, packed.num_tokens)]

    def _run(self, entry: BucketEntry, packed: PackedBatch, copy: bool = True, rows: int | None = None) -> torch.Tensor:
        """copy=False: a replay's logits are the graph's output buffer itself (valid until the next replay).
        rows: the output's rows kept (default: one per stream)."""
        last, entry.filled = entry.filled, None  # (a fill that fails half way leaves the buffers unknown)
        entry.batch.fill(packed, self.cache, last)
        entry.filled = (packed.num_streams, packed.num_tokens)
        rows = packed.num_streams if rows is None else rows
        if self.use_graphs:
            for graph in entry.graphs:
                graph.replay()
            out = entry.output[:rows]
            return out.clone() if copy else out
        return _run_pieces(self._pieces_of(entry), self.cache, entry.batch)[:rows]

    def _check_model(self) -> None:
        if self.model.version != self._model_version:
            raise ValueError("the model's weights were converted or moved (model.to(...)) after this GraphRunner "
                             "was built; its compiled step and graphs hold the old weights: build a new GraphRunner")


def _mark_tokens_dynamic(batch: PackedBatch) -> None:
    """A single-stream bucket's buffers: the token dimension dynamic (one trace for every token count of at
    least 2), the stream dimension left static at 1."""
    for t in (batch.tokens, batch.positions):
        torch._dynamo.mark_dynamic(t, 0)


DEFAULT_VERIFY_PIECES = (1, 3, 8)  # with graphs: the verify's first graphs of 1, 3 and 8 layers, then the rest


def layer_pieces(counts: Sequence[int] | None, num_layers: int, use_graphs: bool) -> list[tuple[int, int]]:
    """The hidden-states step's layer ranges [(start, stop), ...] covering 0 .. num_layers - 1 in order: the leading
    pieces of `counts` layers each (default METRALE_VERIFY_PIECES, else DEFAULT_VERIFY_PIECES with graphs, one piece
    without: pieces only pay where a graph's launch would hold the GPU), the rest one more piece; counts that
    reach the last layer are cut there. ValueError for a count below 1 (0 alone: one piece)."""
    if counts is None:
        raw = envs.METRALE_VERIFY_PIECES
        if raw is not None:
            try:
                counts = [int(c) for c in raw.split(",") if c.strip()]
            except ValueError:
                raise ValueError(f"METRALE_VERIFY_PIECES takes layer counts separated by commas, got {raw!r}") from None
        else:
            counts = DEFAULT_VERIFY_PIECES if use_graphs else ()
    counts = list(counts)
    if counts == [0]:
        counts = []
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ValueError(f"verify_pieces must be layer counts of at least 1 (or [0]: one piece), got {counts!r}")
    pieces, start = [], 0
    for c in counts:
        if start + c >= num_layers:
            break
        pieces.append((start, start + c))
        start += c
    return pieces + [(start, num_layers)]


def _run_pieces(pieces: list, cache: HybridCache, batch: PackedBatch, h: torch.Tensor | None = None) -> torch.Tensor:
    """The pieces one after another, each on the previous one's output (its token dimension marked dynamic, as
    the batch's are: one trace serves every bucket)."""
    for piece in pieces:
        if h is not None:
            torch._dynamo.mark_dynamic(h, 0)
        h = piece(cache, batch, h)
    return h


def _compile_step(model: HybridModel, recompile_limit: int, method: str = "forward_packed",
                  layers: tuple[int, int] | None = None):
    """`model.forward_packed` (or another step method of the same signature: hidden_states) compiled with
    fullgraph=True, through a copy of the function with its own code object (see the module docstring), under a
    recompile limit of `recompile_limit`. layers: hidden_states' layer piece (start, stop); the step then takes the
    previous piece's output, step(cache, batch, h)."""
    func = getattr(model, method).__func__
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    if layers is not None:
        def piece(cache, batch, h):
            return own(model, cache, batch, h, layers)

        fn = types.FunctionType(piece.__code__.replace(), piece.__globals__, f"layers_{layers[0]}_{layers[1]}", None,
                                piece.__closure__)
    else:
        fn = types.MethodType(own, model)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)  # dims: mark_dynamic
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    limit = max(recompile_limit, getattr(dynamo_config, name))

    def step(cache: HybridCache, batch: PackedBatch, *h) -> torch.Tensor:
        with dynamo_config.patch(**{name: limit}):
            return compiled(cache, batch, *h)

    return step
