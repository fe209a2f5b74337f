"""Launching multi-process tests."""

from __future__ import annotations


def run_torchrun(nproc: int, args: list[str], cwd: str | None = None, timeout: int = 600):
    """`torchrun --nproc-per-node nproc <args>` on a free port (a fixed one collides with another run on the
    same machine); asserts it succeeded, with the error lines of its standard error in the message (the first
    and the last 60 when there are more: a rank's own traceback comes long before torchrun's summary, which
    alone fills the tail)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")  # a rank that aborts prints where each of its threads was
    done = subprocess.run([torchrun, "--nproc-per-node", str(nproc), "--master-port", str(port), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        marks = ("Error", "error:", "terminate", "what()", "Traceback", "Abort", "rank", "Fatal", "Thread", "File")
        errors = [line for line in done.stderr.splitlines() if any(m in line for m in marks)]
        if len(errors) > 120:
            errors = errors[:60] + ["..."] + errors[-60:]
        raise AssertionError(f"torchrun exited {done.returncode}\nerror lines:\n" + "\n".join(errors)
                             + "\n--- stdout tail ---\n" + done.stdout[-800:] + "\n--- stderr tail ---\n"
                             + done.stderr[-1500:])
    return done
