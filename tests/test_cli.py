"""Bad flags of the command-line tools end with argparse's usage message and exit code 2 (no
traceback), before any work starts; the GPU tools say so when there is no GPU. The tools run
in-process through main(argv)."""

import json
import os

import pytest
import torch

from metrale_graph import PRESETS, HybridModel, load_config
from helpers import BENCHMARKS, benchmark_script
from metrale_graph.tools import bench, bench_prefix, bench_serve, export_onnx, prefill, serve, warmup

bench_ops = benchmark_script("kernels/bench_ops")  # not installed: benchmarks/ in a checkout

NO_GPU = f"cuda:{torch.cuda.device_count()}"  # a CUDA device this machine lacks


def _usage_error(capsys, main, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "usage:" in err and message in err, err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A good tiny checkpoint, one with a bad config and one with a truncated safetensors file."""
    root = tmp_path_factory.mktemp("checkpoints")
    HybridModel.from_preset("tiny").save_pretrained(str(root / "good"))
    HybridModel.from_preset("tiny").save_pretrained(str(root / "truncated"))
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (root / "bad_config").mkdir()
    (root / "bad_config" / "config.json").write_text(json.dumps({**PRESETS["tiny"].to_hf(), "rope_theta": 0,
                                                                 "rope_parameters": None}))
    return root


MODEL_FLAGS = [
    (["--device", NO_GPU], f"argument --device: '{NO_GPU}': this machine has"),
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--seed", "1.5"], "argument --seed: expected an integer in [-2**63, 2**64 - 1], got '1.5'"),
    (["--seed", str(2**64)], "argument --seed: expected an integer"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--model", "nope"], f"argument --model: 'nope' is neither a preset ({', '.join(PRESETS)}) nor"),
]


@pytest.mark.parametrize("argv, message", MODEL_FLAGS + [
    (["--lengths", "-5"], "argument --lengths: expected comma-separated positive integers, got '-5'"),
    (["--lengths", "abc"], "argument --lengths: expected comma-separated positive integers, got 'abc'"),
    (["--lengths", "5,0"], "argument --lengths: expected comma-separated positive integers, got '5,0'"),
    (["--lengths", ","], "argument --lengths: expected comma-separated positive integers, got ','"),
    (["--lengths", "5,,3"], "argument --lengths: expected comma-separated positive integers, got '5,,3'"),
    (["--lengths", "5,"], "argument --lengths: expected comma-separated positive integers, got '5,'"),
    (["--lengths", ",5"], "argument --lengths: expected comma-separated positive integers, got ',5'"),
    (["--lengths", "1_0"], "argument --lengths: expected comma-separated positive integers, got '1_0'"),
    (["--lengths", "\uff15"], "argument --lengths: expected comma-separated positive integers"),  # full-width 5
    (["--repeat", "1_0"], "argument --repeat: expected a positive integer, got '1_0'"),
    (["--repeat", "0"], "argument --repeat: expected a positive integer, got '0'"),
    (["--continue-tokens", "-3"], "argument --continue-tokens: expected a non-negative integer, got '-3'"),
    (["--lengths", "4000", "--continue-tokens", "100"],
     "a stream of 4100 tokens exceeds the model's max_position_embeddings (4096)"),
])
def test_prefill_flags(capsys, argv, message):
    _usage_error(capsys, prefill.main, argv, message)


def _no_model_load(monkeypatch):
    """Make loading a model fail the test: the flags must be refused before that (a big preset's weights take
    minutes and tens of GB to build)."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(HybridModel, "from_preset", load)
    monkeypatch.setattr(HybridModel, "from_pretrained", load)


@pytest.mark.parametrize("model", ["qwen3.5-9b", "good"])
def test_prefill_lengths_checked_before_the_model_loads(capsys, monkeypatch, checkpoints, model):
    """A stream longer than max_position_embeddings was refused only after the model was built (for the
    9B preset on a CPU: tens of GB of random weights, then the usage error)."""
    _no_model_load(monkeypatch)
    model = str(checkpoints / model) if model == "good" else model
    limit = load_config(model).max_position_embeddings
    _usage_error(capsys, prefill.main, ["--model", model, "--lengths", f"{limit},3", "--continue-tokens", "1"],
                 f"a stream of {limit + 1} tokens exceeds the model's max_position_embeddings ({limit})")


@pytest.mark.parametrize("main", [prefill.main, warmup.main, export_onnx.main])
def test_moe_parallel_without_tp(capsys, monkeypatch, tmp_path, main):
    """--moe-parallel without --tp was accepted and ignored (one process splits nothing)."""
    _no_model_load(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, main, ["--device", "cpu", "--moe-parallel", "expert"], "--moe-parallel says how --tp ranks")


@pytest.mark.parametrize("main", [prefill.main, warmup.main, export_onnx.main])
def test_torchrun_without_tp(capsys, monkeypatch, tmp_path, main):
    """Under torchrun --nproc-per-node 2 without --tp, every process ran the whole model alone and printed its own
    table and JSON line (on GPUs, all on cuda:0); tensor_parallel now names the missing --tp."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, main, ["--device", "cpu"], "this run has 2 processes (torchrun): pass --tp 2")


def test_model_flag_names_the_checkpoint_problem(capsys, checkpoints):
    config = checkpoints / "bad_config" / "config.json"
    _usage_error(capsys, prefill.main, ["--model", str(config)], "is a file; expected a preset")
    _usage_error(capsys, prefill.main, ["--model", str(config.parent)],
                 f"argument --model: invalid model config {config}: field 'rope_theta' must be a positive number")
    truncated = checkpoints / "truncated"
    _usage_error(capsys, prefill.main, ["--model", str(truncated)],
                 f"--model {truncated}: cannot read safetensors file {truncated / 'model.safetensors'}")


def test_prefill_valid_flags_unchanged(capsys, checkpoints):
    prefill.main(["--model", str(checkpoints / "good"), "--lengths", " 3, +4 ", "--repeat", "1",
                  "--continue-tokens", "0"])
    out = capsys.readouterr().out
    record = json.loads(out.strip().splitlines()[-1])
    assert record["tokens"] == 7 and record["continued"] == [] and "median" in out and "over 1 runs" in out


@pytest.mark.parametrize("argv, message", MODEL_FLAGS + [
    (["--batch-sizes", "64", "--token-counts", "32"], "no bucket: every batch size exceeds every token count"),
    (["--batch-sizes", "0"], "argument --batch-sizes: expected comma-separated positive integers, got '0'"),
    (["--token-counts", "1.5"], "argument --token-counts: expected comma-separated positive integers"),
    (["--batch-sizes", "1,,2"], "argument --batch-sizes: expected comma-separated positive integers, got '1,,2'"),
    (["--blocks", "0"], "argument --blocks: expected a positive integer, got '0'"),
    (["--slots", "-1"], "argument --slots: expected a positive integer, got '-1'"),
    # a cache or bucket buffers beyond the memory: a traceback (NotEnoughMemory) after the model loaded
    (["--slots", "20000000", "--blocks", "1000000000"],
     "--slots 20000000 / --blocks 1000000000 / --token-counts: the cache's pools need"),
    (["--batch-sizes", "1", "--token-counts", "100000000000", "--blocks", "4"],
     "--slots 64 / --blocks 4 / --token-counts: the buckets' static input buffers need"),
])
def test_warmup_flags(capsys, tmp_path, argv, message):
    _usage_error(capsys, warmup.main, argv + ["--cache-dir", str(tmp_path / "cache")], message)
    assert not (tmp_path / "cache").exists()


def test_warmup_blocks_stay_within_the_models_positions(capsys, tmp_path, monkeypatch):
    """--blocks' default gave every slot the blocks of the largest token count, past the model's
    max_position_embeddings when that is shorter (tiny: 4096 positions, the default grid's 8192 tokens): twice the
    blocks a slot can ever hold (its block table ends there), memory for nothing. The default now stops at the
    model's positions, and a --blocks past what every slot at max_position_embeddings holds is a usage error before
    the model loads (no folder left)."""
    limit = load_config("tiny").max_position_embeddings
    assert limit == 4096
    monkeypatch.setattr(HybridModel, "from_preset", lambda *a, **k: pytest.fail("the model loaded before --blocks"))
    _usage_error(capsys, warmup.main, ["--slots", "2", "--blocks", "129", "--cache-dir", str(tmp_path / "refused")],
                 "--blocks 129 exceeds what --slots 2 can use: a slot holds at most the model's max_position_embeddings "
                 "(4096 tokens, 64 blocks of 64): give at most 128")
    assert not (tmp_path / "refused").exists()
    monkeypatch.undo()
    _fake_warmup_compiles(tmp_path, monkeypatch, 1.0)
    for argv, blocks in ((["--token-counts", "16,8192"], 2 * 64), (["--token-counts", "16,100"], 2 * 2),
                         (["--token-counts", "16,8192", "--blocks", "128"], 128)):
        cache_dir = tmp_path / f"c{blocks}{len(argv)}"
        warmup.main(["--batch-sizes", "1", "--slots", "2", "--device", "cpu", "--cache-dir", str(cache_dir), *argv])
        out = capsys.readouterr().out
        assert f"blocks={blocks} ({blocks} free) x 64," in out, out
        assert json.loads((cache_dir / "cold_warmup.json").read_text())["run"]["blocks"] == blocks


def test_warmup_cache_dir_is_a_file(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    _usage_error(capsys, warmup.main, ["--cache-dir", str(tmp_path / "file")], "is a file; expected a folder")


@pytest.mark.parametrize("name, content, message", [
    ("compile_artifacts.bin", b"garbage", "compile_artifacts.bin is corrupt or from another torch version"),
    ("cold_warmup.json", b"{", "cold_warmup.json is not a cold warmup record of this tool"),
    ("cold_warmup.json", b'{"warmup_s": 1.0}', "cold_warmup.json is not a cold warmup record of this tool"),
    ("inductor", b"", "inductor is not a folder"),
])
def test_warmup_corrupt_cache_dir(capfd, tmp_path, name, content, message):
    """A damaged --cache-dir ends the tool at once with exit code 2 naming the file (it loaded garbage
    artifacts as a 'warm' start with torch's traceback on stderr, or failed with a traceback after the
    whole warmup)."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(SystemExit) as e:
        warmup.main(["--batch-sizes", "1", "--token-counts", "16", "--cache-dir", str(tmp_path)])
    err = capfd.readouterr().err
    assert e.value.code == 2 and "usage:" in err and message in err and "Traceback" not in err, err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a folder nobody can write into: /proc")
def test_warmup_cache_dir_not_writable(capsys):
    _usage_error(capsys, warmup.main, ["--cache-dir", "/proc"], "--cache-dir '/proc': cannot write into the folder")


@pytest.mark.parametrize("argv, message", MODEL_FLAGS + [
    (["-B", "0"], "argument -B/--batch-size: expected a positive integer, got '0'"),
    (["-T", "x"], "argument -T/--tokens: expected a positive integer, got 'x'"),
    (["--block-size", "-64"], "argument --block-size: expected a positive integer, got '-64'"),
    (["--max-context", "0"], "argument --max-context: expected a positive integer, got '0'"),
    (["-o", "/nonexistent/folder/x.onnx"], "argument -o/--output: '/nonexistent/folder/x.onnx': folder "
                                           "/nonexistent/folder does not exist"),
    (["--verify", "-B", "8", "--slots", "4"],
     "--verify needs 14 slots for a bucket of 8 streams and 256 tokens; pass --slots 14"),
    (["--verify", "--dtype", "bfloat16"], "--verify compares fp32 steps only: pass --dtype float32"),
])
def test_export_onnx_flags(capsys, argv, message):
    _usage_error(capsys, export_onnx.main, argv, message)


def test_output_into_a_folder(capsys, tmp_path):
    _usage_error(capsys, export_onnx.main, ["-o", str(tmp_path)], "is a folder; expected a file path")


@pytest.mark.parametrize("main, flag", [(bench.main, "--json"), (bench.main, "--markdown"),
                                        (bench_ops.main, "--markdown"), (export_onnx.main, "-o")])
def test_output_path_that_names_no_file(capsys, tmp_path, monkeypatch, main, flag):
    """An empty path, or one ending in a slash (a folder not made yet), passed the parse and failed when the file
    was opened, after the whole run (bench: with a traceback)."""
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, main, [flag, ""], f"argument {flag}")
    _usage_error(capsys, main, [flag, "results/"], "'results/' is a folder; expected a file path")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a folder nobody can write into: /proc")
@pytest.mark.parametrize("main, flag", [(export_onnx.main, "-o"), (bench.main, "--json"),
                                        (bench_ops.main, "--markdown")])
def test_output_into_a_folder_that_takes_no_files(capsys, main, flag):
    """Checked when parsing (export_onnx wrote its file after the export, and failed with a traceback)."""
    _usage_error(capsys, main, [flag, "/proc/out.x"], "'/proc/out.x': cannot write into folder /proc")


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "0"], "argument --repeat: expected a positive integer, got '0'"),
    (["--layers", "0"], "argument --layers: expected a positive integer, got '0'"),
    (["--layers", "33"], "--layers 33: the preset qwen3.5-9b has 32 layers; --layers takes at most that many"),
    (["--preset", "tiny", "--layers", "1000000"], "--layers 1000000: the preset tiny has 4 layers"),
    (["--workloads", "W1,W9"], "argument --workloads: expected comma-separated names out of W1, W2"),
    (["--variants", "fast"],
     "argument --variants: expected comma-separated names out of peer, eager, compiled, graphs"),
    (["--workloads", "W1,,W2"], "argument --workloads: expected comma-separated names out of W1, W2"),
    (["--workloads", ",W1"], "argument --workloads: expected comma-separated names out of W1, W2"),
    (["--workloads", "W1,"], "argument --workloads: expected comma-separated names out of W1, W2"),
    (["--workloads", ""], "argument --workloads: expected comma-separated names out of W1, W2"),
    (["--workloads", "W1,W2,W1"], "argument --workloads: W1 given more than once in 'W1,W2,W1'"),
    (["--preset", "tiny", "--workloads", "W1,W5,W6"],
     "--workloads: W5 (16384 positions) past the preset tiny's max_position_embeddings 4096"),
    (["--variants", "graphs, graphs"], "argument --variants: graphs given more than once in 'graphs, graphs'"),
    (["--json", "/nonexistent/r.json"], "argument --json: '/nonexistent/r.json': folder /nonexistent does not exist"),
    (["--seed", "x"], "argument --seed: expected an integer"),
    (["--tp", "2", "--variants", "peer,graphs"], "the peer runs on one GPU: leave it out of --variants under --tp"),
    (["--tp", "2", "--generate"],
     "--generate times one GPU against the peer; under --tp use metrale_graph.tools.generate --tp"),
    (["--baseline", "/nonexistent/b.json"], "--baseline: cannot read baseline /nonexistent/b.json"),
    (["--baseline", "b.json", "--variants", "eager"], "--baseline compares graphs timings"),
])
def test_bench_flags(capsys, argv, message):
    _usage_error(capsys, bench.main, argv, message)


def test_bench_leaves_out_by_default_the_workloads_past_the_presets_positions():
    """The tiny preset holds 4096 positions: W5's 16384-token stream failed its prefill after the model was
    built (the default ran every workload). By default it is left out; named, it is a usage error (above)."""
    from metrale_graph import PRESETS

    kept, too_long = bench.fitting_workloads(PRESETS["tiny"], list(bench.WORKLOADS))
    assert too_long == {"W5": 16384} and kept == [w for w in bench.WORKLOADS if w != "W5"]
    assert bench.fitting_workloads(PRESETS["qwen3.5-9b"], ["W5", "W7"]) == (["W5", "W7"], {})


def test_one_model_tools_leave_tp_out_of_their_help(capsys):
    """tools.export_onnx refuses --tp / --moe-parallel (one whole model); its help no longer offers them."""
    with pytest.raises(SystemExit):
        export_onnx.main(["--help"])
    out = capsys.readouterr().out
    assert "--tp" not in out and "--moe-parallel" not in out and "--model" in out
    with pytest.raises(SystemExit):
        prefill.main(["--help"])
    assert "--tp" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--tp", "2"], ["--moe-parallel", "expert"]])
def test_bench_prefix_refuses_tp_by_name(capsys, argv):
    """tools.bench_prefix leaves --tp / --moe-parallel out of its help; --tp 2 was answered "needs 2 processes
    (torchrun ...)", as if a torchrun launch would run it sharded, with no rank-0-only output or teardown."""
    _usage_error(capsys, bench_prefix.main, argv, "--tp / --moe-parallel: bench_prefix runs one whole model")
    with pytest.raises(SystemExit):
        bench_prefix.main(["--help"])
    out = capsys.readouterr().out
    assert "--tp" not in out and "--moe-parallel" not in out and "--model" in out


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "argument --tokens: expected comma-separated positive integers, got '0'"),
    (["--streams", "0"], "argument --streams: expected a positive integer, got '0'"),
    (["--tokens", "512,2", "--streams", "4"], "--tokens 2 is fewer than --streams 4"),
    (["--markdown", "/nonexistent/t.md"], "argument --markdown: '/nonexistent/t.md': folder /nonexistent does not"),
])
def test_bench_ops_flags(capsys, argv, message):
    _usage_error(capsys, bench_ops.main, argv, message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("main", [bench.main, bench_ops.main])
def test_gpu_tools_without_gpu(capsys, main):
    with pytest.raises(SystemExit) as e:
        main([])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "error: this benchmark needs a CUDA GPU" in err and "Traceback" not in err


def test_bench_files_must_differ(capsys, tmp_path, monkeypatch):
    """--json and --markdown into one file: the JSON overwrote the table; --json onto --baseline: the one-GPU
    record a later run compares with was replaced by this run's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.json").write_text(json.dumps({"tool": "bench", "preset": "qwen3.5-9b", "layers": 32, "tp": 1,
                                                   "results": [{"workload": "W2", "graphs_ms": 100.0}]}))
    _usage_error(capsys, bench.main, ["--json", "r.json", "--markdown", "./r.json"],
                 "--json and --markdown name the same file 'r.json'; give each its own")
    _usage_error(capsys, bench.main, ["--baseline", "one.json", "--json", str(tmp_path / "one.json")],
                 "--baseline and --json name the same file 'one.json'")


def test_bench_baseline_must_match(capsys, tmp_path):
    """--baseline takes a one-GPU run of the same preset and depth."""
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"tool": "bench", "preset": "qwen3.5-9b", "layers": 32, "tp": 1,
                                "results": [{"workload": "W2", "graphs_ms": 100.0}]}))
    _usage_error(capsys, bench.main, ["--baseline", str(path), "--layers", "4"],
                 "is a run of qwen3.5-9b (32 layers, tp 1); expected one GPU of qwen3.5-9b (4 layers)")
    assert bench.read_baseline(str(path), "qwen3.5-9b", 32) == {"W2": 100.0}
    path.write_text(json.dumps({"preset": "qwen3.5-9b", "layers": 32, "results": [{"workload": "W2"}]}))
    _usage_error(capsys, bench.main, ["--baseline", str(path)], "holds no graphs timings")
    # a timing that is not a positive number was accepted, and the speed-up column failed on it (a traceback)
    # after the whole benchmark
    for ms in ("fast", 0, -3.5, None, True):
        path.write_text(json.dumps({"preset": "qwen3.5-9b", "layers": 32,
                                    "results": [{"workload": "W1", "graphs_ms": 10.0},
                                                {"workload": "W2", "graphs_ms": ms}]}))
        _usage_error(capsys, bench.main, ["--baseline", str(path)],
                     f"graphs_ms must be positive numbers of milliseconds, got {{'W2': {ms!r}}}")



def test_result_files_are_written_whole(tmp_path, monkeypatch):
    """bench rewrote --json after every workload with open(path, "w") + json.dump (bench_ops and bench --markdown
    likewise): a Ctrl-C or a full disk mid-write left a torn file, losing the rows a cut-short run is meant to keep.
    files.write_whole, which they now use, leaves the previous file until the new one is whole."""
    import builtins

    from metrale_graph.tools import files

    path = tmp_path / "r.json"
    files.write_whole(str(path), '{"results": [1]}')
    real_open = builtins.open

    def interrupted_open(name, mode="r", *args, **kwargs):  # Ctrl-C halfway through a write
        f = real_open(name, mode, *args, **kwargs)
        if "w" in mode:
            f.write('{"resu')
            f.close()
            raise KeyboardInterrupt
        return f

    monkeypatch.setattr(builtins, "open", interrupted_open)
    with pytest.raises(KeyboardInterrupt):
        files.write_whole(str(path), '{"results": [1, 2]}')
    monkeypatch.undo()
    assert path.read_text() == '{"results": [1]}' and os.listdir(tmp_path) == ["r.json"]


TOOLS = ["prefill", "generate", "warmup", "bench", "export_onnx", "serve", "bench_serve", "bench_prefix", "quantize"]


@pytest.mark.parametrize("name", TOOLS)
def test_help_names_the_installed_command(capsys, name):
    """--help said `usage: python -m tools.prefill`, which works only from a checkout's root; the tools are
    installed as metrale_graph.tools (README uses that form, and the console scripts)."""
    import importlib

    module = importlib.import_module(f"metrale_graph.tools.{name}")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: python -m metrale_graph.tools.{name} "), out[:80]
    assert "python -m tools." not in out and "-m tools." not in out


def _parser_of(monkeypatch, main):
    """The ArgumentParser `main` builds (taken at its parse_args, before any work)."""
    import argparse

    class Parsed(Exception):
        pass

    def grab(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(Parsed) as e:
        main([])
    monkeypatch.undo()
    return e.value.args[0]


@pytest.mark.parametrize("name", TOOLS)
def test_help_describes_every_flag_and_its_default(monkeypatch, name):
    """--help listed flags with no description (generate's --max-new-tokens, warmup's --batch-sizes /
    --token-counts, bench's --preset and --seed, bench_prefix's --workloads, --num-slots, --max-new-tokens,
    --json) and defaults it did not show (--seed 0, --tp 1, prefill's --lengths / --continue-tokens / --repeat,
    --num-slots, warmup's --slots / --cache-dir, bench's --repeat): a user had to read the code to know what a
    plain run does. Every shown flag now has a description, and one with a default says it."""
    import argparse
    import importlib

    parser = _parser_of(monkeypatch, importlib.import_module(f"metrale_graph.tools.{name}").main)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert text.strip(), f"{name} {action.option_strings}: no description"
        if not (action.default is None or action.default is False):
            assert "default" in text, f"{name} {action.option_strings}: default {action.default!r} not shown: {text}"


@pytest.mark.parametrize("argv, message", MODEL_FLAGS + [
    (["--port", "70000"], "argument --port: expected a port in [0, 65535], got '70000'"),
    (["--port", "-1"], "argument --port: expected a non-negative integer, got '-1'"),
    (["--num-slots", "0"], "argument --num-slots: expected a positive integer, got '0'"),
    (["--max-waiting", "-1"], "argument --max-waiting: expected a non-negative integer, got '-1'"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: expected a number >= 0, got '-1'"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["--num-slots", "8", "--token-budget", "4"], "--token-budget 4 must be at least num_slots (--num-slots 8)"),
    (["--max-context", "5000"], "--max-context 5000 exceeds the model's max_position_embeddings (4096)"),
    (["--max-request-bytes", "0"], "argument --max-request-bytes: expected a positive integer, got '0'"),
    (["--responses-store-size", "-1"], "argument --responses-store-size: expected a non-negative integer, got '-1'"),
    (["--allowed-origins", "*"], "argument --allowed-origins: expected a JSON list of strings, got '*'"),
    (["--allowed-headers", '["a", 1]'], "argument --allowed-headers: expected a JSON list of strings, got '[\"a\", 1]'"),
])
def test_serve_flags(capsys, argv, message):
    _usage_error(capsys, serve.main, argv, message)


def _one_line_error(capsys, main, argv, message):
    """The tool ends with exit code 2 and one line on stderr, `message` in it (not argparse's usage)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("python -m metrale_graph.tools.serve: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_serve_port_in_use_fails_in_one_line_before_the_model_loads(capsys, monkeypatch):
    import socket

    def no_load(*args):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(serve, "load_model", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _one_line_error(capsys, serve.main, ["--port", str(port)],
                        f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use)")
    _one_line_error(capsys, serve.main, ["--host", "256.1.1.1"], "--host 256.1.1.1 --port 8000: cannot listen there")


def test_serve_prefix_cache_flag():
    """--prefix-cache / --no-prefix-cache go to Engine(prefix_cache=...) (absent: the engine's default), with --tp
    too (beside broadcast_plans: the plans carry rank 0's cache journal)."""
    assert serve._engine_kwargs(None, serve._parse_args(["--prefix-cache"])[1])["prefix_cache"] is True
    assert serve._engine_kwargs(None, serve._parse_args(["--no-prefix-cache"])[1])["prefix_cache"] is False
    assert "prefix_cache" not in serve._engine_kwargs(None, serve._parse_args([])[1])
    tp = serve._engine_kwargs(None, serve._parse_args(["--prefix-cache", "--tp", "2"])[1])
    assert tp["prefix_cache"] is True and tp["broadcast_plans"] is True


@pytest.mark.parametrize("argv, message", [
    (["--input-len", "0"], "argument --input-len: expected a positive integer N or a range LO:HI"),
    (["--input-len", "9:3"], "argument --input-len: expected a positive integer N or a range LO:HI (1 <= LO <= HI), "
                             "got '9:3'"),
    (["--output-len", "1:2:3"], "argument --output-len: expected a positive integer N or a range LO:HI"),
    (["--output-len", "x"], "argument --output-len: expected a positive integer N or a range LO:HI"),
    (["--request-rate", "0"], "argument --request-rate: expected a request rate > 0 (or inf), got '0'"),
    (["--max-concurrency", "0"], "argument --max-concurrency: expected a positive integer, got '0'"),
    (["--num-prompts", "0"], "argument --num-prompts: expected a positive integer, got '0'"),
    (["--json", "/nonexistent/r.json"], "argument --json: '/nonexistent/r.json': folder /nonexistent does not exist"),
])
def test_bench_serve_flags(capsys, argv, message):
    _usage_error(capsys, bench_serve.main, argv, message)


def test_bench_serve_without_a_server_says_so(capsys):
    from server_process import free_port

    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"])
    assert "cannot reach http://127.0.0.1:" in str(e.value.code)


SCRIPTS = ["kernels/bench_ops", "kernels/bench_w8a16", "kernels/check_attention_varlen", "kernels/check_decode",
           "kernels/check_fp8", "kernels/check_gdn_chunked", "kernels/check_gemv", "kernels/check_moe_direct",
           "kernels/check_moe_gemm", "kernels/check_small", "kernels/sweep_fp8_decode",
           "bench_host", "bench_structured", "check_verify_ahead", "load_walk", "trace_launches"]


@pytest.mark.parametrize("path", SCRIPTS)
def test_benchmark_scripts_help_names_how_they_run(capsys, path):
    """The kernel checks and sweeps live under benchmarks/ (not installed): run from a checkout's root as
    `python benchmarks/<path>.py`, which their --help says."""
    script = benchmark_script(path)
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: python benchmarks/{path}.py "), out[:80]


def test_every_benchmark_script_is_named():
    """SCRIPTS lists every script under benchmarks/ that has a main (the others are their shared modules)."""
    found = []
    for here, _, names in os.walk(BENCHMARKS):
        for name in names:
            path = os.path.join(here, name)
            if name.endswith(".py") and "def main(" in open(path).read():
                found.append(os.path.relpath(path, BENCHMARKS)[:-3])
    assert sorted(found) == sorted(SCRIPTS)


def test_bench_prefix_warms_its_eager_engines_before_timing(capsys, monkeypatch):
    """With --eager the engines were not warmed up: the first workload without the prefix cache took the first step's
    one-time initialization (about a second on 2 CPU cores), so its TTFT read 1164 ms against 123 ms with the cache
    (141 ms once warm), a speed-up the cache did not give. Each engine now runs Engine.warmup (eager: one 1-token
    request) before its first workload."""
    from metrale_graph import Engine

    warmed = []
    real = Engine.warmup

    def warmup(self, *args, **kwargs):
        warmed.append(self.runner is None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "warmup", warmup)
    bench_prefix.main(["--scale", "0.02", "--requests", "2", "--num-slots", "2", "--eager", "--max-new-tokens", "1",
                       "--workloads", "chat"])
    out = capsys.readouterr().out
    assert warmed == [True, True], warmed
    assert "without the prefix cache: warmup (eager)" in out and "with the prefix cache: warmup (eager)" in out


def test_bench_prefix_default_context_holds_its_longest_request(capsys):
    """The default --max-context ("the longest request") was a formula of the scaled sizes that fell short of chat's
    last turn at small scales: at --scale 0.01 it gave 56 tokens to a conversation whose fourth turn holds 4 x (1 +
    16), so its answers were cut ("length") and 52 new tokens were timed instead of 64, silently. It is now the
    chosen workloads' longest request (bench_prefix.longest_request)."""
    bench_prefix.main(["--scale", "0.01", "--requests", "2", "--num-slots", "2", "--eager", "--workloads", "chat"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    chat = record["workloads"]["chat"]
    assert chat["without"]["new_tokens"] == chat["with"]["new_tokens"] == 4 * 16  # one conversation, 4 turns


@pytest.mark.parametrize("argv, message", [
    (["--max-context", "50"], "--max-context 50: the longest request of system holds 248 tokens (prompt and "
                              "--max-new-tokens); give at least 248"),
    (["--max-context", "5000"], "--max-context 5000 exceeds the model's max_position_embeddings (4096)"),
    (["--token-budget", "10"], "--token-budget 10 must be at least num_slots (--num-slots 64)"),
    (["--token-budget", "100000000"], "--token-budget 100000000: a step never holds more than --num-slots x max context"),
    (["--scale", "1", "--max-new-tokens", "5000"],
     "--scale 1.0 / --max-new-tokens 5000: the longest request of system holds 7176 tokens (prompt and "
     "--max-new-tokens), past the model's max_position_embeddings (4096)"),
])
def test_bench_prefix_sizes_checked_before_the_model_loads(capsys, monkeypatch, argv, message):
    """bench_prefix passed --max-context, --token-budget and --num-slots to the Engine unchecked: a context below its
    longest request, past the model's positions, or a budget below the slots ended the run with the Engine's
    ValueError and a traceback, after the model had loaded (the first of them only once the first workload ran)."""
    _no_model_load(monkeypatch)
    _usage_error(capsys, bench_prefix.main, ["--scale", "0.1", "--requests", "2", "--workloads", "system", *argv],
                 message)


def test_bench_prefix_cache_too_big_for_memory_is_a_usage_error(capsys):
    _usage_error(capsys, bench_prefix.main, ["--scale", "0.1", "--requests", "2", "--workloads", "system", "--eager",
                                             "--num-slots", "100000000"],
                 "--num-slots 100000000 / --max-context / --token-budget: the cache does not fit in the memory of cpu")


@pytest.fixture
def fake_server(monkeypatch):
    """bench_serve's httpx client answered by a stand-in of the server in this process (httpx.MockTransport): one
    model of 512 tokens; a completion of ids in range streams `max_tokens` tokens, ids out of range are a 400 as the
    server answers them. `fake_server` counts the completions asked for."""
    import httpx

    asked = []

    def handle(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "vocab_size": 512, "max_model_len": 4096}]})
        body = json.loads(request.content)
        asked.append(body)
        if max(body["prompt"]) >= 512:
            return httpx.Response(400, json={"error": {"message": "prompt: token id out of range [0, 512)"}})
        events = [{"choices": [{"token_ids": [7]}]} for _ in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: real(transport=httpx.MockTransport(handle), **kwargs))
    return asked


def test_bench_serve_vocab_size_past_the_servers_is_refused(capsys, fake_server):
    """--vocab-size above the server's vocabulary drew prompt ids the model lacks: every request failed with a 400,
    and the run printed a table of failures (exit code 0). It is now refused before any request, naming the
    server's size."""
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "2"]
    bench_serve.main(args + ["--vocab-size", "512"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 2
    fake_server.clear()
    with pytest.raises(SystemExit) as e:
        bench_serve.main(args + ["--vocab-size", "100000"])
    assert "--vocab-size 100000: 'tiny' has 512 tokens (/v1/models)" in str(e.value.code)
    assert fake_server == []


def test_bench_serve_with_no_request_completed_fails(capsys, fake_server, monkeypatch):
    """A run in which every request failed (here each prompt is refused) printed its table of dashes and exit code
    0, so a script running the benchmark took it for a measurement. It still prints the table and the JSON line
    (failed: 2, the first error), then ends with exit code 1 and one line saying that nothing completed."""
    monkeypatch.setattr(bench_serve, "_workload", lambda args, vocab: [([600] * 8, 2)] * args.num_prompts)
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--num-prompts", "2", "--input-len", "8", "--output-len", "2"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["failed"] == 2 and "requests completed / failed" in out
    assert e.value.code == ("python -m metrale_graph.tools.bench_serve: error: none of the 2 requests completed (first "
                            "error: HTTP 400: {\"error\":{\"message\":\"prompt: token id out of range [0, 512)\"}})")


@pytest.mark.parametrize("model", ["tiny", "qwen3.5-9b"])
def test_export_onnx_max_context_past_the_models_positions(capsys, monkeypatch, tmp_path, model):
    """--max-context past max_position_embeddings was refused by the cache after the model was built (for the 9B
    preset on a CPU: tens of GB of random weights first), in words that named no flag ("max_context (100000)
    exceeds ..."). It is now a usage error naming --max-context, before the model loads."""
    _no_model_load(monkeypatch)
    limit = load_config(model).max_position_embeddings
    _usage_error(capsys, export_onnx.main, ["--model", model, "--max-context", str(limit + 1), "-o",
                                            str(tmp_path / "x.onnx")],
                 f"--max-context {limit + 1} exceeds the model's max_position_embeddings ({limit})")


@pytest.mark.parametrize("main", [prefill.main, export_onnx.main, bench_prefix.main, serve.main])
def test_requantize_fp8_refused_where_it_changes_nothing(capsys, monkeypatch, checkpoints, tmp_path, main):
    """--requantize-fp8 holds a compressed-tensors FP8 checkpoint's non-block scales as block FP8; for a preset or a
    checkpoint without such a quantization_config it was accepted and ignored, so a user who asked for FP8 weights ran
    in --dtype without a word. It is a usage error now, as --moe-parallel without --tp is (the compressed-tensors case
    runs: test_checkpoints_compressed.test_tools_requantize_flag)."""
    _no_model_load(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, main, ["--requantize-fp8"], "--requantize-fp8 applies to compressed-tensors FP8 checkpoints "
                 "(their non-block scales); --model tiny is a preset (random weights in --dtype): leave it out")
    good = str(checkpoints / "good")
    _usage_error(capsys, main, ["--requantize-fp8", "--model", good],
                 f"--model {good} has no compressed-tensors quantization_config: leave it out")


def _fake_warmup_compiles(tmp_path, monkeypatch, compile_s: float) -> None:
    """warmup.main in-process without compiling: every bucket reports `compile_s`, no cache artifacts saved, the
    compile caches main() points at restored after the test."""
    from metrale_graph.capture import BucketReport, GraphRunner

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # main() sets them: restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    monkeypatch.setattr(GraphRunner, "warmup", lambda self, progress=True, on_bucket=None: [
        on_bucket(r) or r for r in (BucketReport(b, compile_s=compile_s) for b in self.grid)])
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)


def test_warmup_without_graphs_shows_no_capture_figures(tmp_path, monkeypatch, capsys):
    """On the CPU (no CUDA graphs) every bucket's line, the table and the total showed "capture 0.000 s, graph 0.0
    MiB" and the JSON 0.0, figures of a capture that never ran. Without graphs they are left out (null in the
    JSON, "graphs": false); the compile times stay. In-process, with compiling faked."""
    _fake_warmup_compiles(tmp_path, monkeypatch, 1.5)
    warmup.main(["--batch-sizes", "1,2", "--token-counts", "16", "--slots", "2", "--cache-dir", str(tmp_path / "c"),
                 "--device", "cpu"])
    *lines, last = capsys.readouterr().out.strip().splitlines()
    record, out = json.loads(last), "\n".join(lines)
    assert "compiled step, no graphs" in out and "B2xT16: compile 1.50 s, " in out and "total: compile 3.0 s, " in out
    assert "capture" not in out and "graph MiB" not in out and "graph memory" not in out, out
    assert record["graphs"] is False and record["capture_s"] is None and record["graph_mib"] is None
    assert [(b["compile_s"], b["capture_s"], b["graph_mib"]) for b in record["buckets"]] == [(1.5, None, None)] * 2


def test_warmup_and_serve_records_carry_tp(tmp_path, monkeypatch, capsys):
    """warmup's and serve's JSON lines had no "tp" (warmup no "dtype" either), unlike prefill's and generate's: a
    tensor-parallel run's record read as a one-process one. In-process: warmup with compiling faked, serve's report
    of a --tp 2 run from stand-ins of its engine and state."""
    from types import SimpleNamespace

    from metrale_graph.server.metrics import FINISH_REASONS

    _fake_warmup_compiles(tmp_path, monkeypatch, 1.0)
    warmup.main(["--batch-sizes", "1", "--token-counts", "16", "--slots", "2", "--cache-dir", str(tmp_path / "c"),
                 "--device", "cpu", "--dtype", "bfloat16"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (record["tp"], record["dtype"]) == (1, "torch.bfloat16")
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(steps=3, speculative=None))
    totals = {**dict.fromkeys(FINISH_REASONS, 0), "length": 2, "prompt_tokens": 10, "generation_tokens": 8}
    serve._report(engine, SimpleNamespace(metrics=SimpleNamespace(totals=totals)), "tiny", "http://h:1", 1.0, tp=2)
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tool"] == "serve" and record["tp"] == 2 and record["requests"]["length"] == 2


def test_bench_serve_cookbook_past_the_servers_context_names_the_cookbook(fake_server):
    """--cookbook against a server whose context is shorter than its 8192 + 1024 tokens was told "--input-len 8192
    + --output-len 1024 tokens exceed ...", flags the user had not given; it now names the cookbook's workload."""
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--cookbook"])
    assert e.value.code == "--cookbook's 8192 prompt + 1024 new tokens exceed the server's max_model_len (4096)"
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--input-len", "4000", "--output-len", "100"])
    assert e.value.code == "--input-len 4000 + --output-len 100 tokens exceed the server's max_model_len (4096)"
    assert fake_server == []


def test_serve_prefix_cache_help_says_its_default(capsys):
    """--prefix-cache's help said "(default: the engine's); needs an engine with a prefix cache": neither the default
    (off) nor what the flag does was stated."""
    with pytest.raises(SystemExit):
        serve.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--prefix-cache, --no-prefix-cache prefix caching: a prompt starts from the KV blocks and GDN states" in out
    assert "default: off" in out and "needs an engine" not in out
    import inspect

    from metrale_graph import Engine

    assert "prefix_cache" not in serve._engine_kwargs(None, serve._parse_args([])[1])  # the Engine's default: off
    assert inspect.signature(Engine).parameters["prefix_cache"].default is False


def test_bench_prefix_warmup_bar_on_a_terminal_only(capsys, monkeypatch):
    """bench_prefix warmed its two engines' bucket grids (on a GPU minutes of compiling and capturing each, 30
    buckets in ~10 s on a CPU) with no progress bar, where generate and serve draw one. It now draws one when
    standard error is a terminal, none in a log. Compiling faked: only the flag Engine.warmup gets is looked at."""
    import sys

    from metrale_graph import Engine

    seen = []
    monkeypatch.setattr(Engine, "warmup", lambda self, progress=False: seen.append(progress) or [])
    argv = ["--scale", "0.02", "--requests", "2", "--num-slots", "2", "--max-new-tokens", "1", "--workloads", "chat",
            "--eager"]
    for tty in (True, False):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
        bench_prefix.main(argv)
    capsys.readouterr()
    assert seen == [True, True, False, False]


class _ClosedPipe:
    """Standard output whose reader has gone (`tool | head`, after head exits): every write fails."""

    def write(self, text=None):
        raise BrokenPipeError(32, "Broken pipe")

    flush = write

    def isatty(self):
        return False


CONSOLE_RUNS = [  # a quick run of each tool's console script (bench_serve against fake_server)
    ("prefill", ["--lengths", "3", "--repeat", "1"]),
    ("generate", ["--eager", "--max-new-tokens", "2"]),
    ("warmup", ["--batch-sizes", "1", "--token-counts", "16", "--cache-dir", "cache"]),
    ("bench_prefix", ["--scale", "0.02", "--requests", "2", "--eager"]),
    ("bench_serve", ["--num-prompts", "1", "--input-len", "2", "--output-len", "1"]),
    ("quantize", ["--out", "fp8"]),
    ("export_onnx", ["-B", "1", "-T", "8", "-o", "x.onnx"]),
]


@pytest.mark.parametrize("name, argv", CONSOLE_RUNS)
def test_a_closed_pipe_ends_the_tool_quietly(monkeypatch, tmp_path, capsys, checkpoints, fake_server, name, argv):
    """`metrale-generate ... | head`: once head had exited, the next print raised BrokenPipeError, a traceback (and
    Python's 'Exception ignored ... BrokenPipeError' at exit). The console scripts now end there as the shell's tools
    do: no traceback, exit code 141 (128 + SIGPIPE). In-process, through each tool's console-script entry."""
    import importlib
    import sys

    monkeypatch.chdir(tmp_path)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # warmup sets them: restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    module = importlib.import_module(f"metrale_graph.tools.{name}")
    if name == "quantize":
        argv = ["--model", str(checkpoints / "good"), *argv]
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    with pytest.raises(SystemExit) as e:
        getattr(module, "cli", module.main)()  # (export_onnx's console script is its main)
    assert e.value.code == 141 and "Traceback" not in capsys.readouterr().err


def test_export_onnx_bar_is_cleared_on_a_terminal(capsys, monkeypatch, tmp_path):
    """On a terminal export_onnx's step bar stayed on the screen when it closed ('done: ████ 5/5', then a new line)
    in front of the report, where the tools' bars are cleared (docs/tools.md); it is cleared now."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    export_onnx.main(["-B", "1", "-T", "8", "-o", str(tmp_path / "x.onnx")])
    err = capsys.readouterr().err
    assert "check_model" in err and not err.endswith("\n") and err.split("\r")[-2].strip() == "", repr(err[-200:])


@pytest.mark.parametrize("key, env, message", [
    ("", None, "argument --api-key: an empty key (from the flag, or $METRALE_API_KEY)"),
    (None, "", "argument --api-key: an empty key (from the flag, or $METRALE_API_KEY)"),
    ("secret ", None, "argument --api-key: a key with spaces at an end, which no request's key can match"),
])
def test_serve_api_key_no_request_can_send_is_refused(capsys, monkeypatch, key, env, message):
    """--api-key '' (or METRALE_API_KEY set to nothing, as `export METRALE_API_KEY=$KEY` with KEY unset sets it) started
    a server that refused every client's key with 401 and said nothing; a key with a space at an end could never
    match either (the server strips the key a request sends). Both are usage errors now, the key not echoed."""
    from metrale_graph import envs

    def no_server(*args):
        raise AssertionError("the server started")

    monkeypatch.setattr(serve, "_listen_socket", no_server)
    monkeypatch.setattr(envs, "METRALE_API_KEY", env)
    _usage_error(capsys, serve.main, [] if key is None else ["--api-key", key], message)
    assert "secret" not in capsys.readouterr().err
    monkeypatch.setattr(envs, "METRALE_API_KEY", "from-env")
    assert serve._parse_args([])[1].api_key == "from-env" and serve._parse_args(["--api-key", "k"])[1].api_key == "k"


@pytest.mark.parametrize("name, argv", CONSOLE_RUNS)
def test_ctrl_c_ends_the_tool_in_one_line(monkeypatch, tmp_path, capsys, checkpoints, fake_server, name, argv):
    """Ctrl-C ended every tool but generate and serve with a KeyboardInterrupt traceback (mid-warmup ~30 lines of
    torch's compile internals) and exit code 1. The console scripts now end with one line, 'interrupted (Ctrl-C)',
    and exit code 130, and ignore a second Ctrl-C while the process exits. In-process: the interrupt raised where
    each tool prints its JSON line (warmup: while compiling, export_onnx: while exporting)."""
    import importlib
    import signal
    import sys

    from metrale_graph import onnx
    from metrale_graph.capture import GraphRunner
    from metrale_graph.tools import report

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GraphRunner, "warmup", interrupted)
    monkeypatch.setattr(onnx, "export_prefill", interrupted)

    ignored = []
    monkeypatch.setattr(signal, "signal", lambda sig, handler: ignored.append((sig, handler)))  # (not pytest's own)
    monkeypatch.chdir(tmp_path)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # warmup sets them: restored after the test
        monkeypatch.setenv(var, str(tmp_path / var))
    module = importlib.import_module(f"metrale_graph.tools.{name}")
    for where in (module, report):
        if hasattr(where, "print_json"):
            monkeypatch.setattr(where, "print_json", interrupted)
    if name == "quantize":
        argv = ["--model", str(checkpoints / "good"), *argv]
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as e:
        try:
            getattr(module, "cli", module.main)()  # (export_onnx's console script is its main)
        except KeyboardInterrupt:  # (a failure of this test, not the end of the pytest session)
            pytest.fail("the KeyboardInterrupt went through the console script")
    err = capsys.readouterr().err
    assert e.value.code == 130 and "interrupted (Ctrl-C)" in err and "Traceback" not in err, err
    assert (signal.SIGINT, signal.SIG_IGN) in ignored


def test_export_onnx_refuses_an_fp8_model_before_loading_it(capsys, monkeypatch, checkpoints, tmp_path):
    """An FP8 checkpoint or preset was refused by export_prefill after the model had loaded (for Qwen3-Next-80B-FP8
    minutes of reading, on a CPU a memory error first), in words that named no flag. It is now a usage error naming
    --model, before the load."""
    from metrale_graph.tools.quantize import quantize_checkpoint

    quantize_checkpoint(str(checkpoints / "good"), str(tmp_path / "fp8"))
    _no_model_load(monkeypatch)
    for model in (str(tmp_path / "fp8"), "qwen3.5-9b-fp8"):
        _usage_error(capsys, export_onnx.main, ["--model", model, "-o", str(tmp_path / "x.onnx")],
                     f"--model {model}: the ONNX export does not write FP8 models")
