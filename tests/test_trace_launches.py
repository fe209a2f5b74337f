"""benchmarks/trace_launches.py on a hand-made chrome trace: graph launches matched to their device work by correlation."""

import gzip
import json

from helpers import benchmark_script

trace_launches = benchmark_script("trace_launches")


def _trace(tmp_path):
    ev = [
        # graph A (3 kernels): launched at 0 for 100 us; GPU starts at 150 (after the call ends), idle since 20
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 100, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k0", "ts": 10, "dur": 10, "args": {"correlation": 0}},
        {"ph": "X", "cat": "kernel", "name": "a1", "ts": 150, "dur": 50, "args": {"correlation": 1}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "m", "ts": 200, "dur": 10, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "a2", "ts": 210, "dur": 40, "args": {"correlation": 1}},
        # graph B (1 kernel): its work starts 5 us into a 30 us call
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 300, "dur": 30, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 305, "dur": 20, "args": {"correlation": 2}},
        # a launch without device work (not in the trace's window) is left out
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 400, "dur": 30, "args": {"correlation": 3}},
        {"ph": "i", "name": "marker", "ts": 0},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return str(path)


def test_launches_matched_by_correlation(tmp_path):
    rows = trace_launches.launches(trace_launches.load(_trace(tmp_path)))
    assert [(r["nodes"], r["first"] - r["start"], r["last"] - r["first"]) for r in rows] == [(3, 150, 100), (1, 5, 20)]
    assert rows[0]["idle_before"] == 130 and rows[1]["idle_before"] == 55
    assert rows[0]["idle_inside"] == 0 and rows[1]["idle_inside"] == 0


def test_summary_and_cli(tmp_path, capsys):
    path = _trace(tmp_path)
    table = trace_launches.summary(trace_launches.launches(trace_launches.load(path)))
    assert [t["device_activities"] for t in table] == [3, 1]
    assert table[0]["first_device_after_call_end_ms"] == 0.05 and table[1]["first_device_after_call_end_ms"] == -0.025
    out = tmp_path / "t.json"
    trace_launches.main([path, "--json", str(out)])
    assert "| 3 | 1 | 0.100 | 0.150 | 0.050 | 0.100 | 0.000 | 0.130 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["tables"][path][1]["launches"] == 1


def test_gaps_name_the_host_calls_during_device_idle(tmp_path):
    g = trace_launches.gaps(trace_launches.load(_trace(tmp_path)), 20)
    # idle 20-150 (the launch call overlaps 20-100, nothing after) and 250-305 (graph B's call from 300)
    assert g["count"] == 2 and g["idle_ms"] == 0.185
    assert g["by_call"] == [["cudaGraphLaunch", 0.085, 2]]
    assert g["no_runtime_call_ms"] == 0.1
    assert [x[1] for x in g["longest"]] == [0.13, 0.055]
    assert trace_launches.gaps(trace_launches.load(_trace(tmp_path)), 60)["count"] == 1
    trace_launches.main([_trace(tmp_path), "--gaps", "20"])


def test_idle_inside_a_graph_sums_the_gaps_between_its_activities():
    work = [{"ts": 0, "dur": 10}, {"ts": 12, "dur": 3}, {"ts": 14, "dur": 10}, {"ts": 30, "dur": 1}]
    assert trace_launches._idle_inside(work) == 2 + 6  # (12 after 10; 14 overlaps 12-15; 30 after 24)
