"""The server's start as real processes (tools/serve.py on 127.0.0.1, a free port), called with httpx and
the official `openai` client: it listens before the model loads, answering /health 503 "loading" and every
other path 503 with Retry-After in OpenAI's shape; SIGTERM then ends it at once (one line, exit code 128 +
15); a checkpoint that does not load ends it with the error (exit code 2), not a server answering 503 for
ever; a --num-blocks that cannot hold one request at the full context ends it before it listens (exit code 2); its
output into a pipe whose reader has gone (`| head -1`) ends it without a traceback (exit code 141).
(A start that goes on to serve: every server fixture, whose /health answers test_serve.py checks.)
Waits are bounded so that a hang fails fast."""

import importlib.metadata
import signal
import time

import httpx
import openai
import pytest

from metrale_graph import HybridModel
from metrale_graph.tools.serve import _check_blocks, _parse_args, main
from server_process import ServerProcess, free_port, port_is_free
from tokenizer_fixture import tiny_checkpoint

TIMEOUT = 120


def _start(checkpoint, folder) -> ServerProcess:
    port = free_port()
    return ServerProcess(["-m", "metrale_graph.tools.serve", "--model", str(checkpoint), "--port", str(port),
                          "--eager", "--device", "cpu", "--num-slots", "2", "--max-context", "256"], port, folder)


def _first_answer(server: ServerProcess) -> httpx.Response:
    """/health's first answer (connections are refused until the process has started)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"the server exited with {server.proc.returncode}\n{server.output()}")
        try:
            return httpx.get(server.url + "/health", timeout=10)
        except httpx.ConnectError:
            time.sleep(0.02)
    raise AssertionError(f"the server never answered within {TIMEOUT} s\n{server.output()}")


def test_while_the_model_loads_every_path_is_503_and_sigterm_ends_it_at_once(tmp_path):
    server = _start(tiny_checkpoint(tmp_path / "ckpt"), tmp_path)
    try:
        health = _first_answer(server)
        assert (health.status_code, health.json()) == (503, {"status": "loading"}), server.output()
        slash = httpx.get(server.url + "/health/", timeout=10)  # (served with a trailing slash, as the app serves it)
        assert (slash.status_code, slash.json()) == (503, {"status": "loading"}), slash.text
        for method in ("GET", "POST"):  # vLLM's /ping answers as /health
            ping = httpx.request(method, server.url + "/ping", timeout=10)
            assert (ping.status_code, ping.json()) == (503, {"status": "loading"}), ping.text
        version = httpx.get(server.url + "/version", timeout=10)  # known before the model is
        assert version.status_code == 200 and version.json() == {"version": importlib.metadata.version("metrale-graph")}
        for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/metrics"), ("GET", "/nothing")]:
            r = httpx.request(method, server.url + path, json={"prompt": "hi"} if method == "POST" else None,
                              timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.text)
            assert r.json()["error"] | {"message": ""} == {"message": "", "type": "server_error", "param": None,
                                                           "code": "loading"}, (path, r.text)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)
        try:
            client.completions.create(model="m", prompt="hi", max_tokens=1)
            raise AssertionError("a completion was served while the model loaded")
        except openai.APIStatusError as e:
            assert e.status_code == 503 and e.body["code"] == "loading" and "loading" in e.message, e
        server.signal(signal.SIGTERM)
        assert server.proc.wait(30) == 128 + signal.SIGTERM, server.output()
    finally:
        server.stop()
    assert "stopped (SIGTERM) before the model had loaded: nothing was served" in server.output()
    assert port_is_free(server.port)


def test_a_model_that_does_not_load_ends_the_process_with_its_error(tmp_path):
    folder = tmp_path / "truncated"
    HybridModel.from_preset("tiny").save_pretrained(str(folder))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    server = _start(folder, tmp_path)
    try:
        code = server.proc.wait(TIMEOUT)
    finally:
        server.stop()
    output = server.output()
    assert code == 2 and f"--model {folder}: cannot read safetensors file" in output, output
    assert f"listening at {server.url}" in output  # it answered while it loaded


def test_too_few_kv_blocks_for_the_context_end_the_tool_before_it_listens(capsys):
    """--num-blocks x --block-size must hold one request at the full context (max context - 1 tokens), as vLLM
    refuses a KV cache smaller than max_model_len: served, /v1/models announced a context no request could use and
    a chat without max_tokens (which runs to the context) was a 400 "need 4 KV blocks; the cache has 3" whatever
    its prompt. Exactly one full context is taken."""
    flags = ["--model", "tiny", "--device", "cpu", "--eager", "--port", "0", "--block-size", "64"]
    with pytest.raises(SystemExit) as e:
        main(flags + ["--max-context", "256", "--num-blocks", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert ("--num-blocks 3 x --block-size 64 hold 192 tokens, less than one request at the full context needs "
            "(255: max context 256 - 1): raise --num-blocks to at least 4 or lower --max-context to 193") in err, err
    with pytest.raises(SystemExit):  # the default max context (the tiny preset's 4096) too
        main(flags + ["--num-blocks", "63"])
    assert "(4095: max context 4096 - 1)" in capsys.readouterr().err
    _check_blocks(*_parse_args(flags + ["--max-context", "257", "--num-blocks", "4"]))  # 256 tokens: the full context


@pytest.mark.parametrize("when", ["loading", "serving", "ending"])
def test_output_into_a_pipe_closed_early_ends_the_server_quietly(tmp_path, when):
    """`metrale-serve ... | head -1`: once the reader had gone, the next line the server wrote raised BrokenPipeError.
    From the startup thread (the model's line, while loading) it was a traceback and a thread that died: the server
    never became ready and answered 503 for ever; from uvicorn's access log (--access-log, a request once serving) a
    '--- Logging error ---' traceback per request; from the report at the end (SIGTERM) a traceback and exit code 1.
    The server now ends there as the shell's tools do: no traceback, exit code 141 (128 + SIGPIPE), the port freed."""
    import subprocess
    import sys

    port = free_port()
    argv = [sys.executable, "-m", "metrale_graph.tools.serve", "--model", "tiny", "--port", str(port), "--eager",
            "--device", "cpu", "--num-slots", "2", "--max-context", "256"] + (["--access-log"] if when == "serving" else [])
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        lines = [proc.stdout.readline()]
        assert lines[0].startswith(b"listening at "), lines
        while when != "loading" and not lines[-1].startswith(b"serving 'tiny'"):
            lines.append(proc.stdout.readline())
            assert lines[-1], (lines, (tmp_path / "err").read_text())
        proc.stdout.close()  # head has its lines and exits
        if when == "serving":
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)  # (its access log line)
        elif when == "ending":
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (tmp_path / "err").read_text()
    assert code == 141 and "Traceback" not in err and "Error" not in err, (code, err)
    assert port_is_free(port)
