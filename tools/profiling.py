"""Timing and profiling a step on the GPU for tools.bench: CUDA-event medians, device time by phase
and by kernel, and the GPU-busy fraction (the union of the step's device intervals over its wall time)."""

from __future__ import annotations

import statistics
import sys
import threading

import torch

from metrale_graph.ops import REGISTRY, kernels

# kernel name -> phase, first match wins: each op's own kernels (its spec), then the GEMMs (cuBLAS /
# CUTLASS kernels have many names), then the row kernels several ops share
PHASES = ([(f"{name} (own kernels)", spec.kernels) for name, spec in REGISTRY.items() if spec.kernels]
          + [("GEMM", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "splitK", "sm90_", "sm80_")),
             ("shared row kernels (norms, SiLU-mul)", kernels.SHARED_KERNELS)])


OTHER = "other (copies, gathers, Inductor)"


def phase_of(kernel: str, phases=PHASES) -> str:
    """The phase a kernel's time counts to: the first of `phases` with a substring of its name, else OTHER."""
    return next((p for p, keys in phases if any(k in kernel for k in keys)), OTHER)


def time_cuda(fn, setup, repeat: int, warmup: int = 2) -> float:
    """Median ms of fn() with CUDA events (host work inside fn included); setup() (untimed) runs before
    each call."""
    times = []
    for i in range(warmup + repeat):
        setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_profile(fn, setup, runs: int = 10, top: int = 15) -> list[dict]:
    """Where the host's time in fn() goes: cProfile over `runs` calls (setup() and a device sync outside
    each), the `top` functions by cumulative time, in ms per call (time blocked in CUDA calls included:
    a function that waits for the GPU shows it)."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    prof = cProfile.Profile()
    for _ in range(runs):
        setup()
        sync()
        prof.enable()
        fn()
        prof.disable()
        sync()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]
    return [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})", "calls": calls / runs,
             "self_ms": 1e3 * tottime / runs, "cum_ms": 1e3 * cumtime / runs}
            for (file, line, name), (_, calls, tottime, cumtime, _) in rows]


class StackSampler:
    """Where one thread's time goes, sampled: every `interval` s a daemon thread reads that thread's Python stack
    (sys._current_frames) and counts each function on it once (inclusive) and the innermost one (self). For a
    thread cProfile cannot reach (the engine loop's, while the caller's thread measures); time blocked in a CUDA
    call counts for the function that waits. `counts()` snapshots (samples, inclusive, self) for diffs between
    marks; a context manager (the sampling thread stops on exit)."""

    def __init__(self, thread_ident: int, interval: float = 2e-4):
        import collections

        self.ident, self.interval = thread_ident, interval
        self.samples, self.incl, self.leaf = 0, collections.Counter(), collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrale-stack-sampler", daemon=True)

    @staticmethod
    def _key(code) -> str:
        return f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.ident)
            if frame is None:
                continue
            seen, leaf = set(), self._key(frame.f_code)
            while frame is not None:
                seen.add(self._key(frame.f_code))
                frame = frame.f_back
            self.incl.update(seen)
            self.leaf[leaf] += 1
            self.samples += 1

    def counts(self) -> tuple:
        return self.samples, dict(self.incl), dict(self.leaf)

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def sampled_top(before: tuple, after: tuple, ms: float, top: int = 15) -> list[list]:
    """StackSampler counts between two snapshots as [function, inclusive ms, self ms] over `ms` of wall time
    (each function's share of the samples times ms): the `top` by inclusive time and the `top` by self time (where
    the time is spent, often deep below the top inclusive ones), ordered by inclusive time."""
    n = after[0] - before[0]
    if n <= 0:
        return []
    diff = lambda a, b: {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0) > 0}  # noqa: E731
    incl, leaf = diff(after[1], before[1]), diff(after[2], before[2])
    by_self = sorted(leaf, key=lambda k: -leaf[k])[:top]
    rows = sorted(set(sorted(incl, key=lambda k: (-incl[k], -leaf.get(k, 0)))[:top]) | set(by_self),
                  key=lambda k: (-incl.get(k, 0), -leaf.get(k, 0)))
    return [[k[:120], round(ms * incl.get(k, 0) / n, 3), round(ms * leaf.get(k, 0) / n, 3)] for k in rows]


def union_ms(intervals) -> float:
    """Length of the union of (start, end) intervals, in their unit: time covered by at least one of
    them, so overlapping kernels (several streams) count once. Empty -> 0."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def device_intervals(events, device_type) -> list[tuple[float, float]]:
    """(start, end) in microseconds of the profiler's events (torch.profiler's prof.events()) that ran on
    `device_type` (torch.autograd.DeviceType.CUDA: kernels, copies and fills)."""
    return [(e.time_range.start, e.time_range.end) for e in events if e.device_type == device_type]


def marker_windows(events, device_type) -> list[tuple[float, float]]:
    """The windows the measuring thread marked with pairs of marker kernels (torch.cuda._sleep, "spin" kernels;
    window i between markers 2i and 2i + 1, in time order): (first marker's end, second marker's start) each."""
    spins = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == device_type and "spin" in e.name)
    if len(spins) % 2:
        raise ValueError(f"{len(spins)} marker kernels: the windows' markers come in pairs")
    return [(lo, hi) for (_, lo), (hi, _) in zip(spins[::2], spins[1::2])]


def busy_between_markers(events, device_type) -> list[float]:
    """The GPU-busy fraction of each marked window (marker_windows): the union of the device intervals inside it
    over its length."""
    intervals = device_intervals(events, device_type)
    busy = []
    for lo, hi in marker_windows(events, device_type):
        inside = [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]
        busy.append(union_ms(inside) / (hi - lo))
    return busy


def activities_between_markers(events, device_type) -> list[int]:
    """How many device activities (kernels, copies, fills; not the markers) overlap each marked window (as
    kernels_between_markers counts them): with the window's steps, the launches a step costs the GPU (each boundary
    between two idles it a little)."""
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == device_type and "spin" not in e.name]
    return [sum(b > lo and a < hi for a, b in spans) for lo, hi in marker_windows(events, device_type)]


def kernels_between_markers(events, device_type, top: int = 12) -> list[list[tuple[str, float, int]]]:
    """Each marked window's (marker_windows) device work by name: (name, microseconds, count), the `top` largest,
    each event's time clipped to the window (the markers themselves not counted)."""
    work = [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == device_type and "spin" not in e.name]
    windows = []
    for lo, hi in marker_windows(events, device_type):
        by_name: dict[str, list] = {}
        for name, a, b in work:
            if b > lo and a < hi:
                entry = by_name.setdefault(name, [0.0, 0])
                entry[0] += min(b, hi) - max(a, lo)
                entry[1] += 1
        windows.append(sorted(((n, t, c) for n, (t, c) in by_name.items()), key=lambda x: -x[1])[:top])
    return windows


def device_busy_ms(fn, setup, runs: int = 3) -> float | None:
    """Median over `runs` calls of fn() of the time the GPU was busy with its work (ms): the union of its
    device intervals from torch.profiler, one profile per call (setup() outside it). None when the
    profiler saw no device activity (CUPTI unavailable)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    busy = []
    for i in range(runs + 1):  # the first profile pays the profiler's own start-up
        setup()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        intervals = device_intervals(prof.events(), DeviceType.CUDA)
        if not intervals:
            return None
        if i:
            busy.append(union_ms(intervals) / 1e3)
    return statistics.median(busy)


def kernel_breakdown(fn, setup, phases=PHASES, runs: int = 3) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Device time per call by phase and by kernel (ms, largest first), from torch.profiler over `runs`
    calls. `phases`: (phase, kernel-name substrings) pairs, first match wins; the rest is "other"."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    setup()
    fn()  # anything lazy happens outside the profile
    by_kernel: dict[str, float] = {}
    for _ in range(runs):  # one profile per call: setup's kernels (the cache restore) stay outside
        setup()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == DeviceType.CUDA:
                by_kernel[e.key] = by_kernel.get(e.key, 0.0) + e.self_device_time_total / 1e3 / runs
    if not by_kernel:
        raise RuntimeError("torch.profiler recorded no CUDA kernels")
    by_phase: dict[str, float] = {}
    for name, ms in by_kernel.items():
        phase = phase_of(name, phases)
        by_phase[phase] = by_phase.get(phase, 0.0) + ms
    by = lambda d: sorted(d.items(), key=lambda kv: -kv[1])  # noqa: E731
    return by(by_phase), by(by_kernel)
