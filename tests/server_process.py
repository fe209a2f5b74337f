"""A real server process for tests: `python -m metrale_graph.tools.serve ...` (or a torchrun of it) on
127.0.0.1 at a free port, waited for until /health answers 200 (what /health answered meanwhile kept),
its output kept in files so that a failure shows it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on `port` now (SO_REUSEADDR, as servers bind: the closed connections'
    TIME_WAIT entries do not hold the port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class ServerProcess:
    """A server started with `argv` (after the interpreter: ["-m", "metrale_graph.tools.serve", ...]) that
    listens on `port`; stdout and stderr go to files in `folder`."""

    def __init__(self, argv: list[str], port: int, folder, launcher: list[str] | None = None):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.out_path, self.err_path = os.path.join(folder, "server.out"), os.path.join(folder, "server.err")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen((launcher or [sys.executable]) + argv, stdout=out, stderr=err, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        with open(self.out_path) as out, open(self.err_path) as err:
            return f"--- stdout ---\n{out.read()[-3000:]}\n--- stderr ---\n{err.read()[-5000:]}"

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health until it answers 200. `health_answers`: what it answered meanwhile, in order, a repeat
        of the previous one left out: its "status" field, or "refused" (no connection) or "failed" (none came)."""
        self.health_answers = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode} before it was healthy\n"
                                     + self.output())
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                answer = r.json().get("status") if r.headers.get("content-type") == "application/json" else r.text
            except httpx.ConnectError:
                answer, r = "refused", None
            except httpx.HTTPError:
                answer, r = "failed", None
            if not self.health_answers or self.health_answers[-1] != answer:
                self.health_answers.append(answer)
            if r is not None and r.status_code == 200:
                return
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"the server was not healthy within {timeout} s\n" + self.output())

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL (the whole session: torchrun's ranks too) if it has not exited in `timeout` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def running_server(checkpoint: str, folder, flags: list[str], timeout: float):
    """`metrale-serve --model checkpoint --eager --device cpu` with `flags` at a free port, healthy, for the
    block's duration; stopped after it."""
    port = free_port()
    proc = ServerProcess(["-m", "metrale_graph.tools.serve", "--model", checkpoint, "--port", str(port), "--eager",
                          "--device", "cpu", *flags], port, folder)
    proc.wait_healthy(timeout)
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def chain_server(tmp_path_factory, name: str, timeout: float, *flags: str):
    """running_server on the chain checkpoint (chain_model.py) as the tool, structured-output and client tests serve
    it: named `name`, 4 slots, 2048 tokens of context, a 512-token budget, then `flags`."""
    from chain_model import chain_checkpoint

    folder = chain_checkpoint(tmp_path_factory.mktemp("ckpt"))
    base = ["--served-model-name", name, "--num-slots", "4", "--max-context", "2048", "--token-budget", "512"]
    with running_server(folder, tmp_path_factory.mktemp("server"), base + list(flags), timeout) as proc:
        yield proc


def openai_client(server: ServerProcess, timeout: float):
    """The official client of `server`'s /v1 (no retries: a test sees each answer as sent)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
