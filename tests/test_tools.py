"""The command-line tools on the CPU: the main job and the warmup (cold, then warm from its cache
folder in a new process). Timings are printed, never asserted."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, json.loads(done.stdout.strip().splitlines()[-1])


def test_prefill_main_job():
    out, record = _run("metrale_graph.tools.prefill", "--lengths", "5,70,1", "--repeat", "1", "--continue-tokens", "3")
    assert record["tool"] == "prefill" and record["tokens"] == 76 and len(record["top_tokens"]) == 3
    assert [c["context"] for c in record["continued"]] == [5]
    assert "tokens/s" in out and "top token" in out


def test_warmup_persists_artifacts(tmp_path):
    args = ("metrale_graph.tools.warmup", "--batch-sizes", "2", "--token-counts", "64", "--slots", "3",
            "--cache-dir", str(tmp_path), "--no-progress")
    _, cold = _run(*args)
    assert not cold["warm"] and [b["bucket"] for b in cold["buckets"]] == ["B2xT64"]
    assert os.path.getsize(tmp_path / "compile_artifacts.bin") > 0
    out, warm = _run(*args)
    assert warm["warm"] and warm["cold_warmup_s"] == cold["warmup_s"]
    assert "cold warmup" in out and "warm warmup" in out


def test_benchmark_records_say_what_produced_them():
    """tools.bench / bench_ops records carry the command line, this checkout's commit and the versions."""
    code = ("import sys, json; sys.argv = ['bench', '--repeat', '3']; "
            "from metrale_graph.tools.common import provenance; print(json.dumps(provenance()))")
    info = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (a clean clone in CI)
        assert info["commit"].removesuffix("-dirty") == head.stdout.strip()
    assert info["command"].endswith("--repeat 3") and info["torch"] and info["triton"]
