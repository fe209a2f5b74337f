"""tools/generate.py in-process: a tiny run streams tokens and ends with a JSON line; user mistakes
exit with code 2 and a usage message, no traceback."""

import json
import re

import pytest
import torch

from metrale_graph.tools.generate import main


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
        main(["--device", "cpu", "--num-slots", "2", "--token-budget", "16", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and "Traceback" not in err and message in err, err
