"""tools/generate.py in-process: a tiny run streams tokens and ends with a JSON line; user mistakes
exit with code 2 and a usage message, no traceback."""

import json
import re

import pytest

from helpers import tiny_config
from metrale_graph.tools.generate import main
from speculative_reference import bigram_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(capsys, *argv):
    main(["--device", "cpu", "--eager", *argv])
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_tiny_run_streams_and_prints_json(capsys):
    out, record = _run(capsys, "--prompt", "1,2,3", "--max-new-tokens", "5", "--num-slots", "2")
    assert record["tool"] == "generate" and record["tp"] == 1 and record["prompts"] == 1 and record["new_tokens"] == 5
    (ids,) = record["token_ids"]
    assert len(ids) == 5 and record["finish_reasons"] == ["length"] and record["texts"] == [None]
    assert ",".join(map(str, ids)) in out  # streamed as they came
    assert "time to first token" in out and "tokens/s" in out and record["tokens_per_s"] > 0
    # two prompts, sampled with a seed: reproducible; the batch gives each prompt its own tokens
    args = ("--prompt", "1,2,3", "--prompt", "7,8", "--max-new-tokens", "4", "--temperature", "0.8",
            "--top-k", "40", "--top-p", "0.9", "--seed", "3")
    _, a = _run(capsys, *args)
    _, b = _run(capsys, *args)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 2


@pytest.fixture(scope="module")
def bigram_folder(tmp_path_factory):
    """Issue 39's bigram checkpoint (tests/speculative_reference.py): every MTP draft is the model's own token."""
    folder = str(tmp_path_factory.mktemp("bigram"))
    bigram_model(tiny_config(mtp_num_hidden_layers=1)).save_pretrained(folder)
    return folder


def test_speculative_runs_print_their_acceptance(capsys, bigram_folder):
    args = ("--model", bigram_folder, "--prompt", "3,5,7", "--max-new-tokens", "13", "--num-slots", "2")
    _, plain = _run(capsys, *args)
    out, mtp = _run(capsys, *args, "--speculative", "mtp:3")
    assert plain["speculative"] is None and mtp["token_ids"] == plain["token_ids"]
    assert "eager, speculative=mtp k=3 max_streams=16, tokenizer=no" in out  # the engine's line
    # the prompt's step gives a token, then 3 verify steps keep all 3 drafts and one token more
    assert mtp["speculative"] == {"method": "mtp", "num_tokens": 3, "proposed": 9, "accepted": 9, "drafts": 3,
                                  "steps": 3, "acceptance": 1.0, "tokens_per_step": 4.0}
    assert ("speculative (mtp, k = 3): 9 drafts proposed, 9 accepted (100.0 %), 4.00 tokens per stream and verify "
            "step (3 verify steps verifying 3 drafts)") in out
    _, ngram = _run(capsys, *args, "--speculative",
                    '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}')
    s = ngram["speculative"]
    assert ngram["token_ids"] == plain["token_ids"] and (s["method"], s["num_tokens"]) == ("ngram", 2)
    assert s["accepted"] == s["proposed"] > 0  # the bigram cycle repeats: lookup drafts it once seen


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer"),
    (["--temperature", "-1"], "--temperature: expected a number >= 0"),
    (["--top-p", "1.5"], r"--top-p: expected a number in \(0, 1\]"),
    (["--top-k", "x"], "--top-k: expected a non-negative integer"),
    (["--num-slots", "0"], "--num-slots: expected a positive integer"),
    (["--prompt", "hello"], "this model has no tokenizer"),
    (["--prompt", "1,600"], "token id 600 is out of range"),
    (["--prompt", "1,,2"], "--prompt '1,,2': an empty token id between commas"),
    (["--prompt", "1,2,"], "--prompt '1,2,': an empty token id between commas"),
    (["--prompt", "1_0"], "--prompt '1_0': this model has no tokenizer"),
    (["--num-slots", "8", "--token-budget", "4"], "at least num_slots"),
    (["--max-context", "4", "--prompt", "1,2,3,4"], "must leave room for at least one new token"),
    (["--speculative", "mtp:3"], "--speculative: --model tiny: speculative method 'mtp' needs the model's "
                                 "multi-token-prediction head"),
    (["--speculative", "mtp:x"], r"--speculative: expected METHOD or METHOD:K"),
    (["--speculative", '{"method": "ngram",}'], "--speculative: not valid JSON"),
    (["--speculative", '{"method": "ngram", "k": 2}'], r"--speculative: unknown key\(s\) 'k'"),
])
def test_bad_flags_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--eager", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "1,600"], "token id 600 is out of range"),
    (["--max-context", "4", "--prompt", "1,2,3,4"], "must leave room for at least one new token"),
])
def test_bad_prompts_refused_before_the_warmup(capsys, monkeypatch, argv, message):
    """Requests were checked only after the warmup had compiled every bucket (32 s for the tiny model's grid
    on a CPU, minutes on a GPU), then refused."""
    from metrale_graph import Engine

    def warmup(self, progress=False):
        raise AssertionError("warmed up before the prompts were checked")

    monkeypatch.setattr(Engine, "warmup", warmup)
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--num-slots", "2", "--token-budget", "8", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and "Traceback" not in err and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--max-context", "4097"], "--max-context 4097 exceeds the model's max_position_embeddings (4096)"),
    (["--max-context", "10" * 11], "exceeds the model's max_position_embeddings (4096)"),
    (["--num-slots", "2", "--max-context", "100", "--token-budget", "201"],
     "--token-budget 201: a step never holds more than --num-slots x max context (2 x 100 = 200) tokens"),
    (["--num-slots", "8", "--token-budget", "1" + "0" * 20], "(8 x 4096 = 32768) tokens"),
    (["--model", "qwen3.5-9b", "--prompt", "hello"], "--prompt 'hello': this model has no tokenizer"),
    (["--model", "qwen3.5-9b", "--prompt", "1,,2"], "--prompt '1,,2': an empty token id between commas"),
    (["--max-context", "1"], "--max-context 1 leaves no room for a new token after a prompt: give at least 2"),
    (["--num-slots", "8", "--token-budget", "4"], "--token-budget 4 must be at least num_slots (--num-slots 8)"),
])
def test_sizes_beyond_the_model_refused_before_it_loads(capsys, monkeypatch, argv, message):
    """A --max-context past the model's positions or a huge --token-budget went on to size the cache and the
    bucket grid: a traceback (an overflowing size), or the process killed for memory (--token-budget 1e20:
    buffers for every bucket up to 1e20 tokens). Text prompts for a model without a tokenizer (a preset) were
    refused only after its weights were built."""
    from metrale_graph import HybridModel

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(HybridModel, "from_preset", load)
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and "Traceback" not in err and message in err, err


@pytest.mark.parametrize("slots", ["1" + "0" * 12, "1" + "0" * 20])
def test_a_cache_too_big_for_memory_names_the_flags(capsys, slots):
    """--num-slots 1e12 (petabytes of cache for tiny; 1e8 already asks 192 GB) or 1e20 ended in torch's allocator or
    overflow traceback."""
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--eager", "--num-slots", slots, "--token-budget", slots])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and "Traceback" not in err, err
    assert f"--num-slots {slots} / --max-context / --token-budget: the cache does not fit in the memory of cpu" in err


def test_help_says_what_seed_seeds(capsys):
    """--help said --seed seeds "inputs" (tools.prefill's random prompts); here it seeds the sampling."""
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "seed of random preset weights and of sampling" in out and "of inputs" not in out


def test_torchrun_without_tp(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--eager"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "this run has 2 processes (torchrun): pass --tp 2" in err and "Traceback" not in err


def test_warmup_bar_on_a_terminal_only(capsys, monkeypatch):
    """The warmup (8-9 s for the tiny grid on a CPU, minutes on a GPU) had no progress bar. It gets one when
    standard error is a terminal; in a log (not a terminal) none, whose text would precede the next line."""
    import sys

    from metrale_graph import Engine

    seen = []
    real = Engine.warmup
    monkeypatch.setattr(Engine, "warmup", lambda self, progress=False: seen.append(progress) or real(self, progress))
    for tty in (True, False):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
        _run(capsys, "--prompt", "1,2", "--max-new-tokens", "1", "--num-slots", "2")
    assert seen == [True, False]


def test_ctrl_c_in_a_log_prints_one_line_and_the_text_so_far(tmp_path):
    """Run as a user would, stderr and stdout into one log (a checkpoint folder, whose loading has a bar), and
    interrupted with Ctrl-C (SIGINT to the process group, as a terminal sends it) while tokens stream. The log
    began with the loading bar's text in front of the first output line, and Ctrl-C printed ~65 lines of
    torch internals; now the first line is the tool's, and the last one says where it stopped, after the
    tokens produced so far (exit code 130)."""
    import os
    import select
    import signal
    import subprocess
    import sys
    import time

    from metrale_graph import HybridModel

    HybridModel.from_preset("tiny").save_pretrained(str(tmp_path / "tiny"))
    cmd = [sys.executable, "-m", "metrale_graph.tools.generate", "--model", str(tmp_path / "tiny"), "--device",
           "cpu", "--eager", "--prompt", "1,2,3", "--max-new-tokens", "3000"]
    def as_from_a_terminal():  # (in the child, before exec)
        # SIGINT's default disposition and unblocked, as a shell gives its jobs: an ignored SIGINT (SIG_IGN) or a
        # blocked one is inherited across exec, and Python installs its Ctrl-C handler only where SIGINT is not
        # ignored. The suite's xdist worker can run with SIGINT ignored (.ci/run on a fresh clone at c78b79e:
        # the tool then generated all its tokens and exited 0).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=as_from_a_terminal)
    log, deadline = b"", time.monotonic() + 300
    try:
        while b"warmup" not in log or log.split(b"warmup", 1)[1].count(b",") < 3:  # a few tokens streamed
            assert time.monotonic() < deadline and proc.poll() is None, log.decode()
            if select.select([proc.stdout], [], [], 0.1)[0]:
                log += os.read(proc.stdout.fileno(), 65536)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = (log + rest).decode().split("\n")
    assert proc.returncode == 130, lines
    assert lines[0].startswith(f"model: {tmp_path / 'tiny'}  layers=4"), lines[:2]
    assert "Traceback" not in "\n".join(lines)
    while lines and not lines[-1]:
        lines.pop()
    ids = lines[-2].split(",")
    assert all(x.isdigit() for x in ids) and len(ids) >= 3, lines[-3:]
    assert re.fullmatch(rf"interrupted \(Ctrl-C\) while generating: {len(ids)} new tokens in [0-9.]+ s", lines[-1]), lines


def test_dtype_auto_runs_a_checkpoint_in_its_own_dtype(capsys, tmp_path):
    """--dtype auto: a checkpoint folder's config.json dtype (here bfloat16, on the CPU whose default is float32), the
    same tokens as --dtype bfloat16; a preset runs in the default. A config.json dtype the model does not run in
    exits 2 naming it. --dtype had no auto: a checkpoint ran in the device's default whatever it was saved in."""
    import torch

    from metrale_graph import HybridModel

    folder = str(tmp_path / "bf16")
    HybridModel.from_preset(tiny_config(), dtype=torch.bfloat16).save_pretrained(folder)
    args = ("--model", folder, "--prompt", "1,2,3", "--max-new-tokens", "4", "--num-slots", "2")
    _, auto = _run(capsys, *args, "--dtype", "auto")
    _, bf16 = _run(capsys, *args, "--dtype", "bfloat16")
    assert auto["dtype"] == "torch.bfloat16" and auto["token_ids"] == bf16["token_ids"]
    _, preset = _run(capsys, "--prompt", "1,2,3", "--max-new-tokens", "2", "--dtype", "auto")
    assert preset["dtype"] == "torch.float32"
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({**config, "dtype": "int8"}))
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--eager", *args, "--dtype", "auto"])
    assert e.value.code == 2
    assert re.search(r"--dtype auto: dtype='auto' reads 'dtype' of .*config\.json: unsupported dtype 'int8'",
                     capsys.readouterr().err)


def test_streamed_text_ends_as_the_results(capsys, tmp_path):
    """A stream whose last token left a partial UTF-8 character (here 12 random tokens of a byte-level BPE) never
    printed it: a partial character waits for the next token, and there was none, so the streamed line lacked the
    end of the text the JSON line reports ('...\\x05\\x05' against '...\\x05\\x05\\ufffd\\ufffd'). The stream's end now
    prints what is left."""
    from tokenizer_fixture import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "tok")
    out, record = _run(capsys, "--model", folder, "--max-new-tokens", "12", "--num-slots", "2")
    (text,) = record["texts"]
    assert text.endswith("\ufffd"), "the case needs a text cut inside a character"
    streamed = re.search(r"\nwarmup \(eager\): [0-9.]+ s\n(.*)\n\n1 prompt\(s\)", out, re.S).group(1)
    assert streamed == text


def test_output_into_a_pipe_closed_early_ends_quietly():
    """`python -m metrale_graph.tools.generate ... | head -1`, as a process: once the reader had gone, the next print
    raised BrokenPipeError, a traceback on standard error (exit code 1). It ends now as the shell's tools end there:
    nothing on standard error, exit code 141 (128 + SIGPIPE)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "metrale_graph.tools.generate", "--device", "cpu", "--eager",
                             "--max-new-tokens", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().startswith(b"model: tiny")
        proc.stdout.close()  # head -1 has its line and exits
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
