"""The command-line tools on the CPU: the main job and the warmup (cold, then warm from its cache
folder in a new process). Timings are printed, never asserted."""

import json
import os
import subprocess
import sys

import pytest

from helpers import benchmark_script

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


def test_generate_under_torchrun_says_tp_as_prefill_does():
    """Under torchrun --tp 2 rank 0 prints the one JSON line, and it carries "tp" as tools.prefill's does (it
    had no "tp": a tensor-parallel run's record read as a one-GPU one)."""
    from distributed import run_torchrun

    done = run_torchrun(2, ["-m", "metrale_graph.tools.generate", "--device", "cpu", "--eager", "--tp", "2",
                            "--prompt", "1,2,3", "--max-new-tokens", "3"], cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # rank 1 prints nothing
    record = json.loads(lines[0])
    assert record["tool"] == "generate" and record["tp"] == 2 and record["new_tokens"] == 3


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
    """tools.bench's records (and the benchmark scripts') carry the command line, this checkout's commit and the versions."""
    code = ("import sys, json; sys.argv = ['bench', '--repeat', '3']; "
            "from metrale_graph.tools.provenance import provenance; print(json.dumps(provenance()))")
    info = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (a clean clone in CI)
        assert info["commit"].removesuffix("-dirty") == head.stdout.strip()
    assert info["command"].endswith("--repeat 3") and info["torch"] and info["triton"]
    # a copy whose .git is not its tree's (a device machine's) is told its commit
    stated = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                       check=True, env={**os.environ, "METRALE_COMMIT": "abc1234"}).stdout)
    assert stated["commit"] == "abc1234"


def test_warm_warmup_compares_only_with_a_cold_run_of_the_same_grid(tmp_path, monkeypatch, capsys):
    """The cold record names what was warmed: a warm run of another grid (or model, cache, ...) says so
    instead of printing the other run's time as its cold time. In-process, with compiling faked."""
    import torch

    from metrale_graph.capture import BucketReport, GraphRunner
    from metrale_graph.tools import warmup

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # main() sets them: restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))

    def fake_warmup(self, progress=True, on_bucket=None):
        reports = [BucketReport(b, compile_s=float(b.tokens)) for b in self.grid]
        for r in reports:
            on_bucket(r)
        return reports

    monkeypatch.setattr(GraphRunner, "warmup", fake_warmup)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    monkeypatch.setattr(warmup, "_load_artifacts", lambda path: True)

    def run(*argv):
        warmup.main([*argv, "--cache-dir", str(tmp_path), "--no-progress"])
        out = capsys.readouterr().out
        return out, json.loads(out.strip().splitlines()[-1])

    _, cold = run("--batch-sizes", "2", "--token-counts", "64", "--slots", "3")
    assert not cold["warm"] and cold["cold_warmup_s"] == cold["warmup_s"]
    for other in (["--batch-sizes", "1,2", "--token-counts", "16,64", "--slots", "3"],
                  ["--batch-sizes", "2", "--token-counts", "64", "--slots", "4"],
                  ["--batch-sizes", "2", "--token-counts", "64", "--slots", "3", "--seed", "0", "--model", "tiny",
                   "--blocks", "7"]):
        out, warm = run(*other)
        assert warm["warm"] and warm["cold_warmup_s"] is None, out
        assert "records a cold warmup of another run" in out and "cold warmup " not in out.replace("a cold warmup", "")
    out, warm = run("--batch-sizes", "2", "--token-counts", "64", "--slots", "3")
    assert warm["warm"] and warm["cold_warmup_s"] == cold["warmup_s"] and "cold warmup" in out


def test_warmup_files_are_per_rank_and_written_whole(tmp_path):
    """Under --tp the ranks warm up at the same time: each keeps its own artifacts and record (they wrote one
    file together); a write that fails midway leaves the previous file as it was, and no temporary file."""
    import pytest

    from metrale_graph.tools.files import write_whole
    from metrale_graph.tools.warmup import ARTIFACTS, RECORD, own_files

    assert own_files(None) == (ARTIFACTS, RECORD)
    assert own_files(1) == ("compile_artifacts.rank1.bin", "cold_warmup.rank1.json") != own_files(0)
    path = tmp_path / RECORD
    write_whole(str(path), b'{"warmup_s": 1}')  # the artifacts are bytes
    with pytest.raises(TypeError):  # the write fails after the file was opened
        write_whole(str(path), 12345)
    assert path.read_bytes() == b'{"warmup_s": 1}' and os.listdir(tmp_path) == [RECORD]


def test_console_scripts_of_tp_tools_end_the_group(monkeypatch):
    """The console scripts called main() alone, so under torchrun they skipped the barrier, flush and os._exit ending
    teardown that `python -m` runs (end_tensor_parallel). Each tool that takes --tp is installed as its cli(),
    which runs main() and then end_tensor_parallel."""
    import importlib
    import tomllib

    from metrale_graph.tools import distributed

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    for name in ("prefill", "warmup", "bench", "generate"):
        assert scripts[f"metrale-{name}"] == f"metrale_graph.tools.{name}:cli"
        module = importlib.import_module(f"metrale_graph.tools.{name}")
        calls = []
        monkeypatch.setattr(module, "main", lambda: calls.append("main"))
        monkeypatch.setattr(distributed, "end_tensor_parallel", lambda: calls.append("end"))
        if hasattr(module, "end_tensor_parallel"):
            monkeypatch.setattr(module, "end_tensor_parallel", lambda: calls.append("end"))
        module.cli()
        assert calls == ["main", "end"], name


def test_bench_host_times_the_runners_and_the_engines_steps(capsys):
    """benchmarks/bench_host.py runs the decode step's host path (the runner's, the engine loop's) over a no-op step,
    and (--mtp) an MTP engine's verify steps; its figures are printed, never asserted beyond being times."""
    import pytest

    bench_host = benchmark_script("bench_host")

    for extra, path in (([], "runner"), (["--engine"], "engine")):
        bench_host.main(["--streams", "1,3", "--cached", "70", "--repeat", "2", *extra])
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert record["tool"] == "bench_host" and record["path"] == path and record["cached"] == 70
        assert [r["streams"] for r in record["results"]] == [1, 3]
        assert all(0 < r["min_ms"] <= r["median_ms"] for r in record["results"])
    with pytest.raises(SystemExit) as e:
        bench_host.main(["--cached", "4096"])
    assert e.value.code == 2 and "past the tiny preset's max_position_embeddings" in capsys.readouterr().err
    # --mtp: an MTP engine's verify steps (prefix caching, text, stop strings), its stop checks timed apart
    bench_host.main(["--mtp", "2", "--stop", "--streams", "1,3", "--cached", "8", "--repeat", "2"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["path"] == "mtp" and record["k"] == 2 and record["stop"] == ["\n\n", "END"]
    assert [r["streams"] for r in record["results"]] == [1, 3]
    assert all(0 < r["host_ms"] < r["step_ms"] and r["catch_up_ending_us"] > 0 for r in record["results"])
    with pytest.raises(SystemExit) as e:
        bench_host.main(["--stop"])
    assert e.value.code == 2 and "--stop needs --mtp" in capsys.readouterr().err


def test_load_walk_counts_the_stays_of_a_sharded_fp8_mtp_load(capsys):
    """benchmarks/load_walk.py traces from_pretrained of an FP8 checkpoint with an MTP head as rank 0 of 2: its walk
    starts in from_pretrained, its counts agree with the walk it prints (stays per file, returns = stays - files)."""
    load_walk = benchmark_script("load_walk")

    load_walk.main(["--walk"])
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert record["tool"] == "load_walk" and record["ranks"] == 2 and record["moe"] == "within"
    walk = [line.split(None, 1)[1] for line in lines[:record["stays"]]]
    assert walk[0].startswith("metrale_graph/model.py: HybridModel.from_pretrained")
    files = [stay.split(":")[0] for stay in walk]
    assert record["entered"] == {f: files.count(f) for f in set(files)}
    assert record["returns"] == record["stays"] - record["files"] == len(files) - len(set(files))
    assert "metrale_graph/sharding.py" in record["entered"] and record["crossings"] > record["stays"]
    reader = record["reader"]  # the same walk less property getters, comprehensions and lambdas
    assert reader["functions"] < record["functions"] and reader["stays"] <= record["stays"]
    assert reader["returns"] == reader["stays"] - reader["files"] == reader["stays"] - len(reader["entered"])


def test_warmup_usage_errors_leave_no_cache_folder_behind(tmp_path, capsys):
    """A usage error found after --cache-dir was made (--moe-parallel without --tp): the folder this run made
    is removed again (it was left empty); a folder that was there before stays."""
    from metrale_graph.tools import warmup

    fresh = tmp_path / "fresh"
    with pytest.raises(SystemExit) as e:
        warmup.main(["--model", "tiny", "--moe-parallel", "expert", "--cache-dir", str(fresh)])
    assert e.value.code == 2 and "--moe-parallel" in capsys.readouterr().err and not fresh.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(SystemExit):
        warmup.main(["--model", "tiny", "--moe-parallel", "expert", "--cache-dir", str(kept)])
    assert kept.is_dir()
