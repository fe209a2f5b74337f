"""When does the GPU start on a CUDA graph's work? Reads torch.profiler chrome traces (`bench --speculative ...
--trace DIR` writes them) and matches each `cudaGraphLaunch` on the host with the device activity (kernels,
copies, memsets) that carries its correlation id. Per graph (told apart by its device activity count), the
medians of: the launch call's host time, the delay from the launch call's start to the graph's first device
activity, that activity's start relative to the call's end (negative: the GPU began before the call returned),
the device span of the graph, the idle time inside that span (between its own activities), and the GPU's idle
time just before it. `--gaps US`: also every stretch of at least
US microseconds with no device activity, and what the host's CUDA runtime calls were during those stretches (by
name: the time each overlaps them; "no runtime call" is the rest: Python between calls, or a wait outside CUDA):
where a step's idle device time goes.

    python benchmarks/trace_launches.py TRACE.json.gz [...] [--gaps 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

from metrale_graph.tools.provenance import provenance
from metrale_graph.tools.report import print_json

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    """The trace's complete ("X") events."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def launches(events: list[dict]) -> list[dict]:
    """One row per cudaGraphLaunch (microseconds): its start, host duration, device activities, first device start,
    last device end, and the device's idle gap before the graph's first activity."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    by_corr = defaultdict(list)
    for e in device:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            by_corr[corr].append(e)
    rows = []
    for e in events:
        if e.get("cat") != "cuda_runtime" or e.get("name") != "cudaGraphLaunch":
            continue
        work = by_corr.get((e.get("args") or {}).get("correlation"), [])
        if not work:
            continue
        first = min(w["ts"] for w in work)
        last = max(w["ts"] + w.get("dur", 0) for w in work)
        before = [w["ts"] + w.get("dur", 0) for w in device if w["ts"] < first]
        rows.append({"start": e["ts"], "host": e.get("dur", 0), "nodes": len(work), "first": first, "last": last,
                     "idle_before": first - max(before) if before else None, "idle_inside": _idle_inside(work)})
    return rows


def _idle_inside(work: list[dict]) -> float:
    """The time between a graph's first and last device activity during which none of them runs (the gaps
    between its kernels: a graph of many small kernels idles the GPU at each boundary)."""
    idle, end = 0.0, None
    for w in sorted(work, key=lambda w: w["ts"]):
        if end is not None and w["ts"] > end:
            idle += w["ts"] - end
        end = w["ts"] + w.get("dur", 0) if end is None else max(end, w["ts"] + w.get("dur", 0))
    return idle


def summary(rows: list[dict]) -> list[dict]:
    """Medians per graph size (device activity count), the largest graphs first."""
    groups = defaultdict(list)
    for r in rows:
        groups[r["nodes"]].append(r)
    out = []
    for nodes, rs in sorted(groups.items(), reverse=True):
        def med(f):
            vals = [v for v in map(f, rs) if v is not None]
            return statistics.median(vals) / 1e3 if vals else None
        out.append({"device_activities": nodes, "launches": len(rs),
                    "launch_host_ms": med(lambda r: r["host"]),
                    "start_to_first_device_ms": med(lambda r: r["first"] - r["start"]),
                    "first_device_after_call_end_ms": med(lambda r: r["first"] - r["start"] - r["host"]),
                    "device_span_ms": med(lambda r: r["last"] - r["first"]),
                    "idle_inside_ms": med(lambda r: r["idle_inside"]),
                    "gpu_idle_before_ms": med(lambda r: r["idle_before"])})
    return out


def gaps(events: list[dict], least_us: float) -> dict:
    """The device's idle stretches of at least `least_us` (between the first and the last device activity), their
    total, and the host's runtime calls overlapping them: {"count", "idle_ms", "by_call": [[name, ms, calls]],
    "no_runtime_call_ms", "longest": [[start_us, ms, [call names in order]]] (the ten longest)}."""
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in DEVICE_CATEGORIES)
    calls = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events if e.get("cat") == "cuda_runtime")
    idle, end = [], None
    for a, b in device:
        if end is not None and a - end >= least_us:
            idle.append((end, a))
        end = b if end is None else max(end, b)
    by_call: dict = defaultdict(lambda: [0.0, 0])
    covered_total, longest = 0.0, []
    for a, b in idle:
        inside = [(max(a, s), min(b, e), n) for s, e, n in calls if s < b and e > a]
        for s, e, n in inside:
            by_call[n][0] += e - s
            by_call[n][1] += 1
        covered, reach = 0.0, a  # the union of the overlapping calls (they may nest)
        for s, e, _ in sorted(inside):
            if e > reach:
                covered += e - max(s, reach)
                reach = e
        covered_total += covered
        longest.append([a, (b - a) / 1e3, [n for _, _, n in sorted(inside)]])
    total = sum(b - a for a, b in idle)
    return {"count": len(idle), "idle_ms": total / 1e3,
            "by_call": sorted(([n, v[0] / 1e3, v[1]] for n, v in by_call.items()), key=lambda x: -x[1]),
            "no_runtime_call_ms": (total - covered_total) / 1e3,
            "longest": sorted(longest, key=lambda x: -x[1])[:10]}


def render_gaps(g: dict, least_us: float) -> str:
    lines = [f"device idle stretches of at least {least_us:g} us: {g['count']}, {g['idle_ms']:.3f} ms in all; "
             f"no runtime call during {g['no_runtime_call_ms']:.3f} ms of them", "| runtime call | ms overlapping | calls |",
             "|---|---|---|"]
    lines += [f"| {n} | {ms:.3f} | {c} |" for n, ms, c in g["by_call"]]
    return "\n".join(lines)


def render(path: str, table: list[dict]) -> str:
    def f(x):
        return "-" if x is None else f"{x:.3f}"
    lines = [path, "| device activities | launches | launch call ms | call start -> first on GPU ms | "
             "first on GPU after call end ms | device span ms | idle inside ms | GPU idle before ms |",
             "|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['device_activities']} | {t['launches']} | {f(t['launch_host_ms'])} | "
                     f"{f(t['start_to_first_device_ms'])} | {f(t['first_device_after_call_end_ms'])} | "
                     f"{f(t['device_span_ms'])} | {f(t['idle_inside_ms'])} | {f(t['gpu_idle_before_ms'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/trace_launches.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="chrome-format profiler traces (.json or .json.gz)")
    p.add_argument("--gaps", type=float, default=None, metavar="US",
                   help="also the device's idle stretches of at least US microseconds and the host's runtime calls in them")
    p.add_argument("--json", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)
    tables, idle = {}, {}
    for path in args.traces:
        events = load(path)
        tables[path] = summary(launches(events))
        print(render(path, tables[path]))
        if args.gaps is not None:
            idle[path] = gaps(events, args.gaps)
            print(render_gaps(idle[path], args.gaps))
    record = {"tool": "trace_launches", "tables": tables, **({"gaps": idle} if idle else {}), **provenance(argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print_json(record)


if __name__ == "__main__":
    main()
