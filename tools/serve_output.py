"""serve's output when standard output's reader has gone (`metrale-serve ... | head -1`): the server ends there as the
shell's tools do, without a traceback, exit code 141 (128 + SIGPIPE), as the other tools do (report.ends_quietly).

serve writes from several threads: the startup thread's lines (the model, the engine, "serving ..."), uvicorn's log
(its access log, --access-log, goes to standard output) in the event loop, the report at the end in the main thread.
A BrokenPipeError in the startup thread was a traceback and a thread that died (the server never became ready, 503
for ever), one in uvicorn's log a '--- Logging error ---' traceback per line. `ServeOutput` catches both: standard
output then points at /dev/null (nothing else fails on it) and the server ends as on SIGTERM (running requests get
--shutdown-timeout seconds), then the tool (`gone`: _serve exits 141; the main thread's own lines: cli's
report.closed_pipe_ends_quietly).
"""

from __future__ import annotations

import copy
import logging
import sys
import threading

from metrale_graph.tools.report import silence_stdout, stdout_closed


class ServeOutput:
    def __init__(self):
        self.gone = False  # standard output's reader has gone: the server was ended for it
        self.server = None  # the uvicorn.Server to end
        self.drain = None  # then called in a thread of its own: the engine's drain, as on SIGTERM

    def reader_gone(self, error: BaseException | None) -> bool:
        """From any thread, with what a write raised: whether it is standard output's reader gone (then later writes
        go nowhere and the server ends, as on SIGTERM)."""
        if not isinstance(error, BrokenPipeError) or not stdout_closed():
            return False
        silence_stdout()
        first, self.gone = not self.gone, True
        if first and self.server is not None:
            self.server.should_exit = True
            if self.drain is not None:
                threading.Thread(target=self.drain, name="metrale-serve-drain", daemon=True).start()
        return True

    def writing(self, target):
        """`target` (a thread's) with its writes' BrokenPipeError of a reader gone ending the server, quietly."""
        def run():
            try:
                target()
            except BrokenPipeError as e:
                if not self.reader_gone(e):
                    raise

        return run

    def log_config(self) -> dict:
        """uvicorn's logging config (uvicorn.config.LOGGING_CONFIG) with handlers whose write failing for standard
        output's reader gone ends the server instead of printing a '--- Logging error ---' traceback."""
        import uvicorn.config

        config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
        for handler in config["handlers"].values():
            if handler.get("class") == "logging.StreamHandler":
                del handler["class"]
                handler["()"] = lambda stream=None, output=self: _Handler(output, stream)
        return config


class _Handler(logging.StreamHandler):
    def __init__(self, output: ServeOutput, stream=None):
        super().__init__(stream)
        self.output = output

    def handleError(self, record) -> None:  # (in emit's except: sys.exc_info() is what the write raised)
        if not self.output.reader_gone(sys.exc_info()[1]):
            super().handleError(record)
