"""SpeculativeGraphs: the speculative step's tail (speculative/tail.py) compiled with torch.compile(fullgraph=True)
and, on CUDA, captured into CUDA graphs bucketed like the verify step (GraphRunner.hidden_bucket), beside a
GraphRunner, into its memory pool.

    graphs = SpeculativeGraphs(runner, K, True, last_tokens)  # the engine's SpeculativeStep makes it
    result = graphs.accept(bucket, h, ints, floats, keep, slots)  # [r, K + 2] on the device: counts, then tokens;
                                                       # the accepted runs' GDN / conv states into their slots and
                                                       # each row's last token into last_tokens[slots[i]]
    graphs.copy_states(slots, entries)                 # that copy alone (after the eager acceptance)
    drafts = graphs.draft(bucket, h, tok, strm)        # [b, K] on the device: the MTP head's drafts
    both = graphs.draft_after(bucket, h, result, tok, strm)  # the same from an acceptance's result, no read back:
                                                       # [b, K + 2 + K], that result (read it here) and the drafts

Per bucket of the runner's grid (the verify step's: the step's hidden states `h` are that bucket's graph output)
there are up to four entries, made and warmed on first use or by `warm(bucket)`: the greedy acceptance, the sampled
one (rows of temperature > 0 beside greedy ones: its sorts over the vocabulary are skipped by a greedy step), the
MTP head's catch-up with its draft steps, and the same made from an acceptance's result on the device ("after":
launched right behind the acceptance, so that one read back brings both). Their per-call inputs are static buffers
of the bucket's streams (rows) and tokens, at least 2 each, filled from host tensors by one copy per buffer, their
spare rows padding (tail.py's layouts); each function is traced once for every bucket (the rows and tokens
dimensions are marked dynamic, as the runner's buffers are) through its own copy of the function's code (the
runner's reason: dynamo's entries and recompile count are per code object). The state copy after acceptance is one
row-copy kernel per pool on CUDA (tail.keep_verified_states, ops/checkpoints.copy_rows: each accepted state read
and written once; index_select and index_copy_ on the CPU): not compiled (nothing to fuse, and a functionalized
in-place copy into a pool risks a copy of the whole pool). An acceptance entry runs it itself, after the compiled
acceptance, with its index made from the counts on the device (tail.keep_accepted_states: no read back and no
launch of its own between the verify step's read back and the next step, where the GPU idles); after the eager
acceptance `copy_states` runs it, captured on CUDA per row count (padded to the grid's stream sizes with
scratch-slot rows, which the kernel skips).

Capture follows the runner's recipe: two runs on a side stream (compile, then anything lazily initialized), then
the capture into the runner's pool; warming runs only padding (the tail reads; the copies and the draft steps
write the scratch slot and the null block). With graphs a replay's output is the graph's own buffer, valid until
that entry's next replay. Without graphs (CPU, use_graphs=False) the same compiled functions run on the same
buffers.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

from metrale_graph import envs
from metrale_graph.numbers import int_tensor, to_device
from metrale_graph.speculative import tail
from metrale_graph.speculative.tail import keep_verified_states

from .buckets import Bucket


@dataclass
class Graphed:
    """One function of static inputs: compiled (fn), and with graphs captured (graph, output)."""
    fn: Callable
    args: tuple
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None
    warm: bool = False


class SpeculativeGraphs:
    def __init__(self, runner, num_tokens: int, mtp: bool, last_tokens: torch.Tensor, compiled: bool = True):
        """runner: the GraphRunner whose hidden-states buckets run the verify steps; num_tokens: K, the most drafts a
        stream verifies; mtp: whether to make the MTP head's entries; last_tokens: the engine loop's [slots + 1]
        buffer of each slot's last token, which the acceptance sets for its rows on the device
        (tail.write_last_tokens). compiled=False runs tail.py's functions as they are, on the same buffers (tests:
        the path without compile times)."""
        self.runner, self.model, self.cache, self.last_tokens = runner, runner.model, runner.cache, last_tokens
        self.K, self.mtp = num_tokens, mtp
        self.use_graphs, self.pool, self.device = runner.use_graphs, runner.pool, runner.model.device
        self.vocab = self.model.config.vocab_size
        limit = len(runner.grid) + 8
        wrap = (lambda f: _compiled(f, limit)) if compiled else (lambda f: f)
        self._greedy, self._sampled = wrap(tail.accept_greedy), wrap(tail.accept_sampled)
        self._drafts = wrap(tail.mtp_drafts) if mtp else None
        self._after = wrap(tail.mtp_drafts_after) if mtp else None
        self.entries: dict[tuple[str, Bucket], Graphed] = {}
        self.copies: dict[int, Graphed] = {}
        self._hidden: dict[Bucket, torch.Tensor] = {}  # without graphs: each bucket's copy of h

    # the entries ---------------------------------------------------------------------------------
    def sizes(self, bucket: Bucket) -> tuple[int, int]:
        """(rows / streams, tokens) of a bucket's static buffers."""
        return max(bucket.streams, 2), max(bucket.tokens, 2)

    def warm(self, bucket: Bucket) -> None:
        """Make, compile and (on CUDA) capture every entry of `bucket` now (its hidden-states entry must exist:
        GraphRunner.hidden_bucket)."""
        # (the drafting behind the acceptance: opt-in, and what a verify step launched ahead takes)
        after = ("after",) if envs.METRALE_MTP_AFTER or envs.METRALE_VERIFY_AHEAD else ()
        for kind in ("greedy", "sampled") + (("drafts",) + after if self.mtp else ()):
            self._entry(kind, bucket)

    def hidden_source(self, bucket: Bucket) -> torch.Tensor:
        """The hidden states the bucket's entries read: with graphs the verify graph's own output, else a buffer
        the caller's h is copied into (run)."""
        if self.use_graphs:
            output = self.runner.hidden_entries[bucket].output
            torch._dynamo.mark_dynamic(output, 0)  # (one trace for every bucket's; the runner's step never reads it)
            return output
        if bucket not in self._hidden:
            with torch.inference_mode(False):
                self._hidden[bucket] = torch.zeros(self.sizes(bucket)[1], self.model.config.hidden_size,
                                                   dtype=self.model.dtype, device=self.device)
            torch._dynamo.mark_dynamic(self._hidden[bucket], 0)
        return self._hidden[bucket]

    def _entry(self, kind: str, bucket: Bucket) -> Graphed:
        key = (kind, bucket)
        if key not in self.entries:
            rows, tokens = self.sizes(bucket)
            K, h, dev = self.K, self.hidden_source(bucket), self.device
            with torch.inference_mode(False):
                if kind == "after":  # (padding: zero-length streams on the scratch slot, wanting no draft step)
                    result = torch.zeros(rows, K + 2, dtype=torch.int64, device=dev)
                    tok = torch.zeros(3, tokens, dtype=torch.int64, device=dev)
                    strm = torch.zeros(5, rows, dtype=torch.int64, device=dev)
                    strm[1].fill_(self.cache.scratch_slot)
                    args, fn = (self.model, self.cache, h, result, tok, strm, K), self._after
                    for t in (result, tok, strm):
                        torch._dynamo.mark_dynamic(t, 1 if t is not result else 0)
                elif kind == "drafts":
                    tok = torch.zeros(3, tokens, dtype=torch.int64, device=dev)
                    strm = torch.zeros(4 + 2 * (K - 1), rows, dtype=torch.int64, device=dev)
                    strm[1].fill_(self.cache.scratch_slot)  # the slot ids' rows: 1, then 5, 7, ...
                    strm[5::2].fill_(self.cache.scratch_slot)
                    args, fn = (self.model, self.cache, h, tok, strm, K), self._drafts
                    torch._dynamo.mark_dynamic(tok, 1)
                    torch._dynamo.mark_dynamic(strm, 1)
                else:
                    ints = torch.zeros(rows, 2 * K + 4, dtype=torch.int64, device=dev)
                    ints[:, 2 * K + 2:] = torch.tensor([self.vocab, 1])  # greedy padding rows
                    floats = torch.tensor([0.0] * (K + 1) + list(tail.GREEDY_ROW), device=dev).repeat(rows, 1)
                    keep = self._keep_rows([], rows).to(dev)
                    torch._dynamo.mark_dynamic(ints, 0)
                    torch._dynamo.mark_dynamic(floats, 0)
                    args = (self.model, h, ints, K, keep) if kind == "greedy" else (self.model, h, ints, floats, K, keep)
                    fn = self._keeping(self._greedy if kind == "greedy" else self._sampled)
            self.entries[key] = Graphed(fn, args)
        entry = self.entries[key]
        if not entry.warm:
            self._warm(entry)
        return entry

    def _keep_rows(self, keep: list, rows: int, slots: list[int] = ()) -> torch.Tensor:
        """A keep buffer's contents, [3, rows] on the host: keep[i] = (slot, first verify entry) of row i, or None;
        None and the rows past keep's keep nothing (the scratch slot / entry: tail.keep_accepted_states); row 2,
        the slot whose last token row i sets (slots[i]; the scratch slot past them: tail.write_last_tokens)."""
        scratch = self.cache.scratch_slot
        nothing = (scratch, self.cache.scratch_checkpoint)
        pairs = [nothing if pair is None else pair for pair in keep] + [nothing] * (rows - len(keep))
        last = list(slots) + [scratch] * (rows - len(slots))
        return int_tensor([x for column in zip(*pairs) for x in column] + last).view(3, rows)

    def _keeping(self, accept: Callable) -> Callable:
        """An acceptance entry's function: the compiled acceptance, then (not compiled) the accepted states' copy
        from its counts (tail.keep_accepted_states; the last argument the keep buffer)."""
        def run(*args):
            result = accept(*args[:-1])
            tail.keep_accepted_states(self.cache, result, args[2], args[-1], self.K)
            tail.write_last_tokens(self.last_tokens, result, args[-1][2])
            return result
        return run

    @torch.no_grad()
    def _warm(self, entry: Graphed) -> None:
        if self.use_graphs:
            entry.graph, entry.output = _capture(lambda: entry.fn(*entry.args), self.device, self.pool)
        else:
            entry.fn(*entry.args)
        entry.warm = True

    def _run(self, entry: Graphed, h: torch.Tensor) -> torch.Tensor:
        source = entry.args[2 if entry.fn in (self._drafts, self._after) else 1]
        if self.use_graphs:
            assert h.data_ptr() == source.data_ptr(), "h must be the bucket's hidden-states graph output"
            entry.graph.replay()
            return entry.output
        source[:h.shape[0]].copy_(h)
        return entry.fn(*entry.args)

    # the calls ----------------------------------------------------------------------------------
    def accept(self, bucket: Bucket, h: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor,
               keep: list | None = None, slots: list[int] = (), patch: Callable | None = None) -> torch.Tensor:
        """Acceptance of r rows (tail.accept_greedy / accept_sampled; ints [r, 2K + 4], floats [r, K + 4] on the
        host, tail.host_rows) over h, the verify step's hidden states of `bucket` (with graphs, its graph's
        output), and the accepted states' copy into the slots: keep[i] = (slot, first verify entry) of row i, or
        None (or keep None) for a row that keeps nothing (tail.keep_accepted_states); and slot slots[i]'s last
        token := row i's last emitted one (tail.write_last_tokens). patch(ints buffer, floats buffer or None): called once
        they are filled, before the replay (a verify step launched ahead writes its drafts and uniforms there from the
        device: speculative/ahead.py).
        Returns int64 [r, K + 2] on the device (counts, then tokens)."""
        sampled = bool((ints[:, 2 * self.K + 3] == 0).any())
        entry = self._entry("sampled" if sampled else "greedy", bucket)
        r = ints.shape[0]
        _fill(entry.args[2], ints)
        if sampled:
            _fill(entry.args[3], floats)
        if patch is not None:
            patch(entry.args[2], entry.args[3] if sampled else None)
        # every row of the keep buffer (not only r: an earlier call's rows past r must keep nothing now)
        buffer = entry.args[-1]
        buffer.copy_(self._keep_rows(keep or [], buffer.shape[1], slots), non_blocking=True)  # (numbers.to_device's reason)
        return self._run(entry, h)[:r]

    def replay(self, bucket: Bucket, h: torch.Tensor, positions: list[list[int]], sampled: bool) -> None:
        """A follower of a plan broadcast (speculative/following.py): the acceptance entry rank 0 runs (greedy, or
        `sampled`) over h, for its LM head: vocabulary-parallel, so this rank computes its part of the vocabulary
        for the rows rank 0's acceptance reads (positions [r][K + 1], tail.py's `ints` layout) and the gather
        joins them there. Its rows are greedy rows without drafts (the follower settles with rank 0's counts) and
        keep no state: the keep buffer of a follower's entry is never filled (its padding: nothing kept, the
        scratch slot's last token set)."""
        entry = self._entry("sampled" if sampled else "greedy", bucket)
        K = self.K
        _fill(entry.args[2], torch.tensor([p + [0] * (K + 1) + [self.vocab, 1] for p in positions], dtype=torch.int64))
        self._run(entry, h)

    def draft(self, bucket: Bucket, h: torch.Tensor, tok: torch.Tensor, strm: torch.Tensor) -> torch.Tensor:
        """The MTP head's catch-up and drafts (tail.mtp_drafts; tok [3, t] and strm [4 + 2(K - 1), b] on the host,
        drafting.py builds them) over h, the verify step's hidden states of `bucket`. int64 [b, K] on the device."""
        entry = self._entry("drafts", bucket)
        tok_buf, strm_buf = entry.args[3], entry.args[4]
        t, b, scratch = tok.shape[1], strm.shape[1], self.cache.scratch_slot
        _fill_columns(tok_buf, tok, ())  # spare tokens: id 0, position 0, in no stream
        # padding streams: zero-length, ending where the last real one does, on the scratch slot (draft steps: one
        # token there)
        _fill_columns(strm_buf, strm, ((0, t), (1, scratch), (slice(5, None, 2), scratch)))
        return self._run(entry, h)[:b]

    def draft_after(self, bucket: Bucket, h: torch.Tensor, result: torch.Tensor, tok: torch.Tensor,
                    strm: torch.Tensor, patch: Callable | None = None) -> torch.Tensor:
        """The MTP head's catch-up and drafts right after an acceptance of the same bucket (tail.mtp_drafts_after),
        its tokens and draft lengths taken from that acceptance's `result` [b, K + 2] on the device (copied into
        this entry's buffer: no read back); tok [3, t] and strm [5, b] on the host (tail.py's `after` layouts,
        verify.py builds them). int64 [b, K + 2 + K] on the device: `result` as copied, then the drafts (with graphs
        the acceptance's output is its graph's buffer in the shared pool, which this entry's replay may overwrite
        when it was captured first: read the copy). patch(tok buffer, strm buffer): called once they are filled,
        before the replay (speculative/ahead.py's positions and contexts from the device)."""
        entry = self._entry("after", bucket)
        result_buf, tok_buf, strm_buf = entry.args[3], entry.args[4], entry.args[5]
        result_buf[:result.shape[0]].copy_(result)
        t, b = tok.shape[1], strm.shape[1]
        _fill_columns(tok_buf, tok, ())  # spare tokens: index 0, position 0, in no stream
        # spare streams: zero-length, wanting no draft, on the scratch slot (their first catch-up row stays 0: row 0
        # + a stale count is inside the bucket's tokens, where t + it is not when the real streams fill them, an
        # index out of range)
        _fill_columns(strm_buf, strm, ((0, t), (1, self.cache.scratch_slot)))
        if patch is not None:
            patch(tok_buf, strm_buf)
        return torch.cat([result_buf[:b], self._run(entry, h)[:b]], dim=1)

    @torch.no_grad()
    def copy_states(self, slots: list[int], entries: list[int]) -> None:
        """Each slot's conv and GDN states of every layer := its checkpoint entry's (verify.py's accepted runs)."""
        cache, n = self.cache, len(slots)
        if not self.use_graphs:
            index = to_device(torch.tensor([slots, entries], dtype=torch.int64), self.device)
            keep_verified_states(cache, index)
            return
        size = next((s for s in sorted({b.streams for b in self.runner.grid} | {n}) if s >= n))
        if size not in self.copies:
            with torch.inference_mode(False):
                index = torch.tensor([[cache.scratch_slot], [cache.scratch_checkpoint]], device=self.device)
                index = index.repeat(1, size)
            entry = self.copies[size] = Graphed(keep_verified_states, (cache, index))
            self._warm(entry)
        entry = self.copies[size]
        pad = size - n
        host = torch.tensor([slots + [cache.scratch_slot] * pad, entries + [cache.scratch_checkpoint] * pad])
        entry.args[1].copy_(host, non_blocking=True)  # (numbers.to_device's reason)
        entry.graph.replay()


def _fill_columns(buffer: torch.Tensor, host: torch.Tensor, padding) -> None:
    """A drafting buffer [rows, columns] := `host` [rows, c] in its first c columns, zeros past them but where
    `padding` ((row index or slice, value) pairs) says otherwise; one copy to the device."""
    full = torch.zeros(buffer.shape, dtype=torch.int64)
    c = host.shape[1]
    full[:, :c] = host
    for rows, value in padding:
        full[rows, c:] = value
    buffer.copy_(full, non_blocking=True)  # (numbers.to_device's reason: no stream sync)


def _fill(buffer: torch.Tensor, host: torch.Tensor) -> None:
    """Rows 0 .. r - 1 of a tail buffer from `host` [r, ...]. The rest keep the padding or an earlier call's rows of
    the same bucket: valid inputs (h rows inside the bucket, a distribution per row) whose outputs nobody reads."""
    buffer[:host.shape[0]].copy_(host, non_blocking=True)  # (numbers.to_device's reason)


def _capture(fn: Callable[[], torch.Tensor | None], device: torch.device, pool):
    """fn warmed on a side stream (twice: compile, then anything lazily initialized), then captured into a CUDA
    graph in `pool`: (graph, its output)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = fn()
    torch.cuda.synchronize(device)
    return graph, output


def _compiled(func, recompile_limit: int):
    """`func` compiled with fullgraph=True through a copy of it with its own code object (capture/runner.py's
    _compile_step), under a recompile limit of at least `recompile_limit`."""
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    compiled = torch.compile(own, fullgraph=True, dynamic=False)  # dims: mark_dynamic
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    limit = max(recompile_limit, getattr(dynamo_config, name))

    def run(*args):
        with dynamo_config.patch(**{name: limit}):
            return compiled(*args)

    return run
