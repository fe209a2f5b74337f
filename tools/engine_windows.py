"""Timing windows over one Engine.generate call (tools.bench_speculative; bench --loop's measurement, in phases):
once every request decodes, each phase runs `settle` steps, then a window of `steps` timed steps between two marker
kernels; the call ends (its requests aborted) when the last window closes. Also the two hooks the speculative
workloads need: ForcedDrafts (drafts forced to k per decode, in place of prompt lookup) and DraftTimer (the MTP
drafter's calls timed).
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

FORCED = "each decode proposes exactly k drafts (its last token repeated; a stand-in for prompt lookup that never misses)"


class ForcedDrafts:
    """A stand-in for verify.ngram_propose (FORCED): `k` drafts (at most the engine's room), set by the measuring
    thread between phases."""

    def __init__(self):
        self.k = 0

    def __call__(self, tokens, room: int, *lookup) -> list[int]:  # (lookup: prompt lookup's suffix lengths)
        return [int(tokens[-1])] * min(self.k, room)


@contextlib.contextmanager
def forced_drafts():
    """verify.ngram_propose replaced by a ForcedDrafts while the block runs."""
    from metrale_graph.speculative import verify

    forced, real = ForcedDrafts(), verify.ngram_propose
    verify.ngram_propose = forced
    try:
        yield forced
    finally:
        verify.ngram_propose = real


class DraftTimer:
    """The MTP drafter's calls timed inside an engine's steps, wall time with the device synchronized around each
    (drafting.py, eager): whole calls (MtpDrafter.draft) and, inside them, each run of the head
    (drafting.mtp_hidden_states): the first of a call is the catch-up over the positions the step kept, the others
    the further drafts' single-token steps. With prefix caching the head also catches up, drafting nothing, on the
    last step of each request a step ends (MtpDrafter.catch_up_ending, outside the draft calls): those runs are
    counted apart (ending_runs, ending_ms), never as draft steps. A context manager: the hooks go when it exits."""

    def __init__(self, engine):
        from metrale_graph.speculative import drafting

        self.drafter, self.module = engine._loop.spec.mtp, drafting
        self.real_draft, self.real_head = self.drafter.draft, drafting.mtp_hidden_states
        self.real_ending = self.drafter.catch_up_ending
        self.sync = torch.cuda.synchronize if engine.model.device.type == "cuda" else (lambda: None)
        self.ms = self.catchup_ms = self.step_ms = self.ending_ms = 0.0
        self.calls = self.tokens = self.head_steps = self.ending_runs = self._runs = 0
        self._ending = False  # inside a catch_up_ending call

    def __enter__(self) -> "DraftTimer":
        self.drafter.draft, self.module.mtp_hidden_states = self._draft, self._head
        self.drafter.catch_up_ending = self._catch_up_ending
        return self

    def __exit__(self, *exc) -> None:
        del self.drafter.draft, self.drafter.catch_up_ending  # (the instance attributes: the class's methods again)
        self.module.mtp_hidden_states = self.real_head

    def _timed(self, fn, *args, **kwargs):
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        return out, 1e3 * (time.perf_counter() - t0)

    # the totals change in one assignment without calls and are read alike, so the measuring thread never sees a
    # call counted without its tokens (CPython switches threads at calls and jumps, not between two stores)
    def _draft(self, *args, **kwargs):
        self._runs = 0
        drafts, ms = self._timed(self.real_draft, *args, **kwargs)
        count = sum(len(d) for d in drafts.values())
        self.ms, self.calls, self.tokens = self.ms + ms, self.calls + 1, self.tokens + count
        return drafts

    def _catch_up_ending(self, *args, **kwargs):
        self._ending = True  # (its head runs, if any: _head; most steps end no request and run none)
        try:
            return self.real_ending(*args, **kwargs)
        finally:
            self._ending = False

    def _head(self, *args, **kwargs):
        out, ms = self._timed(self.real_head, *args, **kwargs)
        if self._ending:
            self.ending_ms, self.ending_runs = self.ending_ms + ms, self.ending_runs + 1
            return out
        if self._runs == 0:
            self.catchup_ms += ms
        else:
            self.step_ms, self.head_steps = self.step_ms + ms, self.head_steps + 1
        self._runs += 1
        return out

    def totals(self) -> tuple:
        return self.ms, self.calls, self.tokens, self.catchup_ms, self.step_ms, self.head_steps


class _Done(Exception):
    """Raised from on_token once the last window has closed: generate aborts the rest."""


class Windows:
    """on_token of one generate call of n requests: once every request decodes, for each phase (its k, set on
    `forced` when given) `settle` steps then a window of `steps` steps, marked by a marker kernel at
    each end on CUDA. Watches request 0's tokens (every request decodes in every step)."""

    def __init__(self, engine, n: int, phases: list, steps: int, settle: int, forced=None, timer=None):
        self.engine, self.phases, self.steps, self.settle = engine, phases, steps, settle
        self.forced, self.timer = forced, timer
        self.cuda = engine.model.device.type == "cuda"
        self.counts, self.phase, self.state, self.marks = [0] * n, -1, None, []
        if forced is not None:
            forced.k = 0  # no drafts while the prompts prefill (an earlier call's last phase set it)

    sampler = None  # a StackSampler of the engine loop's thread (run_windows' host_top)

    def _snapshot(self) -> dict:
        s = self.engine.stats()
        spec = s.speculative or {}
        return {"t": time.perf_counter(), "steps": s.steps, "tokens": s.generated_tokens,
                "proposed": spec.get("proposed", 0), "accepted": spec.get("accepted", 0),
                "verify_steps": spec.get("steps", 0), "draft": self.timer.totals() if self.timer else None,
                "host": self.sampler.counts() if self.sampler else None}

    def _begin(self, phase: int) -> None:
        self.phase, self.state = phase, ("settle", self.engine.stats().steps + self.settle)
        if self.forced is not None:
            self.forced.k = self.phases[phase]

    def __call__(self, index: int, _token: int) -> None:
        self.counts[index] += 1
        if self.phase < 0:
            if self.counts[index] == 2 and min(self.counts) >= 2:
                self._begin(0)
            return
        if index != 0:
            return
        kind, until = self.state
        if self.engine.stats().steps < until:
            return
        if kind == "settle":
            if self.cuda:
                torch.cuda._sleep(1000)  # the window's first marker, behind the steps launched so far
            start = self._snapshot()
            self.state, self.start = ("time", start["steps"] + self.steps), start
            return
        end = self._snapshot()
        if self.cuda:
            torch.cuda._sleep(1000)
        self.marks.append((self.phases[self.phase], self.start, end))
        if self.phase + 1 == len(self.phases):
            raise _Done
        self._begin(self.phase + 1)


def run_windows(engine, prompts: list[list[int]], phases: list[int], new: int, steps: int, settle: int,
                forced: ForcedDrafts | None = None, timer: DraftTimer | None = None, host_top: int = 0,
                trace: str | None = None) -> list[dict]:
    """One generate call of `prompts` (`new` tokens at most each: enough for every request to decode through every
    window) measured in Windows; a row per phase (k: its forced drafts, or the engine's own num_tokens): steps
    timed, wall ms per step, device ms and GPU busy (CUDA; else None), device activities a step (CUDA), tokens a
    stream gets per step, ms per emitted token (a stream's), drafts proposed and accepted, verify steps, on CUDA the
    window's largest device work by name (top_kernels: [name, ms a step, launches a step]), with `timer` the
    drafter's ms, and with host_top the engine loop thread's largest Python functions, sampled (host_top: [function,
    inclusive ms a step, self ms a step]; tools.profiling.StackSampler). `trace`: a path (".json.gz") for the call's
    profiler trace (CUDA only)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from metrale_graph.tools.profiling import activities_between_markers, busy_between_markers, kernels_between_markers

    n = len(prompts)
    windows = Windows(engine, n, phases, steps, settle, forced, timer)
    prof = profile(activities=[ProfilerActivity.CUDA]) if windows.cuda else contextlib.nullcontext()
    sampler = contextlib.nullcontext()
    if host_top:
        from metrale_graph.tools.profiling import StackSampler

        with engine._loop._cond:  # the loop's thread, started if no request ran yet (LoopIntake._start's lock)
            engine._loop._start()
        sampler = windows.sampler = StackSampler(engine._loop._thread.ident)
    gc.collect()  # then off for the call, as timeit does: a collection's pause is no step's cost
    gc.disable()
    try:
        with prof, sampler:
            with contextlib.suppress(_Done):
                engine.generate(prompts, max_new_tokens=new, on_token=windows)
            if windows.cuda:
                torch.cuda.synchronize()  # the last marker done inside the profile
    finally:
        gc.enable()
    if len(windows.marks) != len(phases):
        raise RuntimeError(f"{len(windows.marks)} of {len(phases)} windows closed: requests finished first")
    if trace is not None and windows.cuda:
        prof.export_chrome_trace(trace)
    events = prof.events() if windows.cuda else None
    busy = busy_between_markers(events, DeviceType.CUDA) if windows.cuda else None
    kernels = kernels_between_markers(events, DeviceType.CUDA) if windows.cuda else None
    activities = activities_between_markers(events, DeviceType.CUDA) if windows.cuda else None
    rows = []
    for i, (k, a, b) in enumerate(windows.marks):
        steps, wall_s = b["steps"] - a["steps"], b["t"] - a["t"]
        per_stream = max(b["tokens"] - a["tokens"], 1) / steps / n
        row = {"streams": n, "k": k, "steps": steps, "step_ms": round(1e3 * wall_s / steps, 3),
               "device_ms": None, "gpu_busy": None, "tokens_per_step": round(per_stream, 3),
               "ms_per_token": round(1e3 * wall_s / steps / per_stream, 3),
               "proposed": b["proposed"] - a["proposed"], "accepted": b["accepted"] - a["accepted"],
               "verify_steps": b["verify_steps"] - a["verify_steps"]}
        if busy is not None:
            row.update(gpu_busy=round(busy[i], 4), device_ms=round(busy[i] * 1e3 * wall_s / steps, 3),
                       device_activities=round(activities[i] / steps, 1),  # (kernels, copies, fills a step)
                       # the window's largest device work by name, ms and launches per step (profile by kernel first)
                       top_kernels=[[name[:120], round(us / 1e3 / steps, 4), round(count / steps, 2)]
                                    for name, us, count in kernels[i]])
        if host_top:
            from metrale_graph.tools.profiling import sampled_top

            row["host_top"] = sampled_top(a["host"], b["host"], 1e3 * wall_s / steps, host_top)
        if timer is not None:
            ms, calls, tokens, catchup, head_ms, head_steps = (y - x for x, y in zip(a["draft"], b["draft"]))
            row.update(draft_calls=calls, draft_tokens=tokens, draft_ms_per_step=round(ms / steps, 3),
                       draft_ms_per_position=round(ms / calls / k, 3) if calls and k else None,
                       draft_catchup_ms=round(catchup / calls, 3) if calls else None,
                       draft_head_step_ms=round(head_ms / head_steps, 3) if head_steps else None)
        rows.append(row)
    return rows
