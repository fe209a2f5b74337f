"""An OpenAI-compatible HTTP server over the Engine: /v1/completions, /v1/chat/completions, /v1/responses,
/v1/models, vLLM's /tokenize and /detokenize, /health and /metrics (Prometheus), with FastAPI and uvicorn (the
`serve` extra).

    python -m metrale_graph.tools.serve --model FOLDER_OR_PRESET [--host 127.0.0.1] [--port 8000]
        [--served-model-name NAME [NAME ...]] [--api-key KEY] [--num-slots 64] [--max-context N] [--token-budget N]
        [--max-waiting N] [--max-request-bytes N] [--eager] [--no-warmup] [--tp N]
        [--tool-call-parser auto|qwen3_xml|qwen3_json|none] [--reasoning-parser auto|qwen3|none]
        [--enable-tokenizer-info-endpoint] [--responses-store-size N]
        [--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}']
        [--allowed-origins '["*"]'] [--allowed-methods '["*"]'] [--allowed-headers '["*"]'] [--allow-credentials]

The server listens before the model loads (a port in use fails at once, in one line) and answers from
then on: /health 503 {"status": "loading"} while the model loads, "warming up" while the engine warms
its bucket grid (a progress bar on a terminal), then 200; every other path 503 with Retry-After until
the model has loaded. A model that does not load ends the tool with its error (exit code 1, or 2 for
a checkpoint that does not load). A flag the model cannot take ends it before it listens, with the reason
(exit code 2): a --speculative-config that is not valid JSON, names a key or method this server does not
have, or asks for "mtp" of a model without an MTP head; a --num-blocks that cannot hold one max context.
SIGTERM or Ctrl-C ends it gracefully: new requests are refused,
running ones get --shutdown-timeout seconds to finish and then end with an error, the port is freed,
and the tool prints what it served and one JSON line (exit code 0); before the model has loaded, it
ends at once with one line (exit code 128 + the signal's number: 130 for Ctrl-C). Output piped into a reader that
stops early (`| head -1`) ends it too, without a traceback (exit code 141, 128 + SIGPIPE). Under `torchrun
--nproc-per-node N ... --tp N` rank 0 serves HTTP and the other ranks follow its engine's steps
(Engine(broadcast_plans=True), engine.follow()), ignoring SIGINT / SIGTERM: they end when rank 0 does.
Stop such a server with SIGTERM to rank 0 (its pid is on the "listening" and "serving" lines): every
rank then exits 0, and so does torchrun (a signal to torchrun itself ends the server as well, but
torchrun reports the signal).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import torch

from metrale_graph import envs
from metrale_graph.tools.distributed import end_tensor_parallel, start_run
from metrale_graph.tools.flags import (add_engine_args, add_model_args, add_speculative_arg, non_negative_float,
                                       non_negative_int, positive_int)
from metrale_graph.tools.loading import (build_engine, check_engine_sizes, check_speculative_model, load_model,
                                        model_config)
from metrale_graph.tools.report import (bars_shown, closed_pipe_ends_quietly, print_json, print_table,
                                       speculative_figures, speculative_line)
from metrale_graph.tools.serve_output import ServeOutput

API_KEY_ENV = "METRALE_API_KEY"
TOOL_PARSERS = ("qwen3_xml", "qwen3_json")  # metrale_graph.server.tool_parsers.PARSERS (without the serve extra)
REASONING_PARSERS = ("qwen3",)  # metrale_graph.server.reply.REASONING_PARSERS
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}")
    return value


def api_key(text: str) -> str:
    """A key a request can send: not empty, no space at its ends (the server strips the key a request sends)."""
    if not text.strip() or text != text.strip():  # (the key itself is not echoed: a secret)
        got = "an empty key" if not text.strip() else "a key with spaces at an end, which no request's key can match"
        raise argparse.ArgumentTypeError(f"{got} (from the flag, or ${API_KEY_ENV}); leave both out for a server "
                                         "without a key")
    return text


def json_strings(text: str) -> list[str]:
    """A JSON list of strings (vLLM's CORS flags: '["https://a.example", "https://b.example"]')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m metrale_graph.tools.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seed_help="seed of random preset weights")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000; 0: any free one)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: --model as given); several, as "
                        "vLLM takes them: a request may name any, /v1/models lists all, answers report the first")
    p.add_argument("--api-key", type=api_key, default=envs.METRALE_API_KEY,
                   help=f"clients must send 'Authorization: Bearer KEY' on /v1 paths (default: ${API_KEY_ENV}; "
                        "none: open)")
    add_engine_args(p, num_slots=64)
    add_speculative_arg(p, "--speculative-config")
    p.add_argument("--max-waiting", type=non_negative_int, default=None,
                   help="requests waiting for a slot before new ones get 503 with Retry-After "
                        "(default max(256, 4 x slots); 0: none wait, a request needs a free slot)")
    p.add_argument("--max-request-bytes", type=positive_int, default=None,
                   help="request bodies larger than this get 413, counted as they are read (default 4 MiB, "
                        "4194304: a full context of token ids fits)")
    p.add_argument("--block-size", type=positive_int, default=64, help="tokens per KV block (default 64)")
    p.add_argument("--num-blocks", type=positive_int, default=None,
                   help="KV blocks (default: every slot can hold max context; at least one max context)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="prefix caching: a prompt starts from the KV blocks and GDN states of the longest prefix "
                        "seen before (README, Prefix caching; default: off, the Engine's)")
    p.add_argument("--tool-call-parser", choices=("auto", *TOOL_PARSERS, "none"), default="auto",
                   help="how chat replies write tool calls: qwen3_xml (Qwen3.5 / 3.6: <function=NAME> "
                        "<parameter=KEY>), qwen3_json (Qwen2.5 / Qwen3: JSON in <tool_call>); none: requests with "
                        "tools are refused (default auto: as the chat template shows a call)")
    p.add_argument("--reasoning-parser", choices=("auto", *REASONING_PARSERS, "none"), default="auto",
                   help="qwen3: a reply's <think> block goes to reasoning_content (default auto: when the chat "
                        "template has </think>)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="answer GET /tokenizer_info (vLLM's flag: it shows the tokenizer's configuration and chat "
                        "template)")
    p.add_argument("--responses-store-size", type=non_negative_int, default=None,
                   help="Responses API: the last N responses kept in memory for previous_response_id, GET and DELETE "
                        "/v1/responses/{id} (least recently used evicted first; default 1024; 0: none stored)")
    p.add_argument("--allowed-origins", type=json_strings, default=["*"],
                   help='CORS: origins whose pages may call the server, a JSON list (default ["*"]: any)')
    p.add_argument("--allowed-methods", type=json_strings, default=["*"],
                   help='CORS: methods allowed cross-origin, a JSON list (default ["*"])')
    p.add_argument("--allowed-headers", type=json_strings, default=["*"],
                   help='CORS: request headers allowed cross-origin, a JSON list (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow cross-origin requests with credentials (cookies, Authorization)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                   help="seconds running requests get to finish on SIGTERM / Ctrl-C (default 10)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level (default info)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    return p, p.parse_args(argv)


def _engine_kwargs(p, args) -> dict:
    """Engine arguments besides the sizes (--prefix-cache and --speculative-config under --tp too: rank 0's plans
    carry its cache journal, plan_journal.py, and its drafts and accept counts, speculative/following.py)."""
    kwargs = dict(max_waiting=args.max_waiting, block_size=args.block_size, num_blocks=args.num_blocks,
                  broadcast_plans=args.tp > 1)
    if args.prefix_cache is not None:
        kwargs["prefix_cache"] = args.prefix_cache
    if args.speculative is not None:
        kwargs["speculative"] = args.speculative
    return kwargs


def _listen_socket(p, host: str, port_: int) -> socket.socket:
    """The server's socket, bound now (before the model loads, so a port in use fails at once); uvicorn
    listens on it as soon as it starts. A port that cannot be taken ends the tool with that one line (exit
    code 2), not argparse's usage: the flags parsed, the address is the problem."""
    try:
        family = socket.getaddrinfo(host, port_, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port_))
    except OSError as e:
        p.exit(2, f"{p.prog}: error: --host {host} --port {port_}: cannot listen there ({e.strerror or e})\n")
    return sock


def _check_blocks(p, args) -> None:
    """--num-blocks x --block-size must hold one request at the full context (max context - 1 tokens: the last new
    token is never written), as vLLM refuses a KV cache smaller than max_model_len: the Engine takes fewer (a request
    that needs more is a ValueError), but /v1/models would then announce a context no request can use, and a chat
    without max_tokens, which runs to the context, would be a 400 whatever its prompt."""
    from metrale_graph.engine import DEFAULT_MAX_CONTEXT

    if args.num_blocks is None:
        return
    max_context = args.max_context or min(model_config(args).max_position_embeddings, DEFAULT_MAX_CONTEXT)
    held, need = args.num_blocks * args.block_size, max_context - 1
    if held < need:
        p.error(f"--num-blocks {args.num_blocks} x --block-size {args.block_size} hold {held} tokens, less than one "
                f"request at the full context needs ({need}: max context {max_context} - 1): raise --num-blocks to "
                f"at least {-(-need // args.block_size)} or lower --max-context to {held + 1}")


def _check_installed(p) -> None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        p.error(f"the server needs the serve extra (missing: {', '.join(missing)}): "
                "pip install 'metrale-graph[serve]'")


def main(argv=None) -> None:
    p, args = _parse_args(argv)
    _check_installed(p)
    check_engine_sizes(p, args)
    _check_blocks(p, args)
    check_speculative_model(p, args, "--speculative-config")
    kwargs = _engine_kwargs(p, args)
    run = start_run(args, p)
    if not run.reports:  # a follower rank: rank 0's SHUTDOWN ends it (its own signals would only kill it early)
        engine = build_engine(p, args, load_model(args, p, run), **kwargs)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        engine.follow()
        return
    _serve(p, args, run, kwargs, _listen_socket(p, args.host, args.port))


def _serve(p, args, run, engine_kwargs: dict, sock: socket.socket) -> None:
    """uvicorn on `sock` in this thread (it takes SIGINT / SIGTERM) from the start, answering through a Loading
    gate while a Startup thread loads the model and warms the engine; then the tool's end: the report (exit
    code 0), the startup's error (exit code 1, or 2 for a checkpoint that does not load), or, stopped before the
    model had loaded, one line and 128 + the signal's number."""
    import uvicorn

    from metrale_graph.server import Loading, with_cors

    gate, output = Loading(), ServeOutput()  # (output: standard output's reader gone ends the server, serve_output.py)
    cors = with_cors(gate, args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    config = uvicorn.Config(cors, log_level=args.log_level, access_log=args.access_log, lifespan="off",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, log_config=output.log_config())
    host, port_ = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port_}"
    startup = Startup(p, args, run, engine_kwargs, gate, url)
    output.drain = lambda: startup.stop(args.shutdown_timeout)
    server = startup.server = output.server = _server(config, output.drain)
    print(f"listening at {url} (pid {os.getpid()}); loading {args.model} (/health answers 503 until it is ready)",
          flush=True)
    threading.Thread(target=output.writing(startup.run), name="metrale-serve-startup", daemon=True).start()
    t0 = time.perf_counter()
    # uvicorn re-raises a signal it handled once it has shut down; these handlers take it then (the shutdown
    # is done: the tool ends as usual)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        startup.stop(0.0)
        sock.close()
    if output.gone:  # (the server was ended for it: the tool ends as the shell's tools do there)
        raise SystemExit(141)
    if startup.error is not None:
        what, error = startup.error
        if isinstance(error, SystemExit):  # load_model's / build_engine's parser.error: printed already
            raise error
        print(f"{what} failed: {type(error).__name__}: {error}", file=sys.stderr)
        raise SystemExit(1)
    if startup.engine is None:
        # the model still loads in its thread, which nothing can interrupt: the process ends here, at once
        sig = server.exit_signal
        why = f"stopped ({signal.Signals(sig).name})" if sig is not None else "the server ended"
        print(f"{why} before the model had loaded: nothing was served", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + sig if sig is not None else 1)
    _report(startup.engine, startup.state, startup.name, url, time.perf_counter() - t0, args.tp)


class Startup:
    """The model's load, the engine's build and its warmup, in a thread while uvicorn already answers: through
    `gate` (server.Loading) 503 until the app is built, then the app, /health 503 until warm. What main reads
    once the server has ended: `error` ((what failed, the exception): the server was ended for it), else
    `engine` and `state` (None: the server was stopped before the model had loaded)."""

    def __init__(self, p, args, run, engine_kwargs: dict, gate, url: str):
        self.p, self.args, self.run_, self.engine_kwargs, self.gate, self.url = p, args, run, engine_kwargs, gate, url
        self.names = args.served_model_name or [args.model]
        self.name = self.names[0]  # (the name answers report)
        self.server = None  # the uvicorn.Server, ended on a failure
        self.engine = self.state = None
        self.error: tuple[str, BaseException] | None = None
        self._lock, self._stopping = threading.Lock(), False

    def run(self) -> None:
        from metrale_graph.server import build_app

        args, run = self.args, self.run_
        t0 = time.perf_counter()
        try:
            if run.device.type == "cuda" and run.device.index is not None:
                # each thread has its current device (--tp: the main thread's is this rank's; a device without an
                # index is every thread's default, the first)
                torch.cuda.set_device(run.device)
            model = load_model(args, self.p, run)
            engine = build_engine(self.p, args, model, **self.engine_kwargs)
            kwargs = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
            if args.responses_store_size is not None:
                kwargs["responses_store_size"] = args.responses_store_size
            app = build_app(engine, self.names, api_key=args.api_key, ready=args.no_warmup,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                            enable_tokenizer_info=args.enable_tokenizer_info_endpoint, **kwargs)
        except BaseException as e:  # SystemExit too: parser.error for a checkpoint that does not load
            self._fail("loading the model", e)
            return
        with self._lock:
            stopped = self._stopping
            if not stopped:
                self.engine, self.state = engine, app.state.server
        if stopped:  # the server ended while the model loaded (the process is ending)
            engine.shutdown()
            return
        print(f"model: {args.model}  {model.extra_repr()}  (built in {time.perf_counter() - t0:.2f} s)\n{engine}",
              flush=True)
        replies = app.state.server.replies
        print(f"chat replies: tool calls {replies.tool_format or 'not parsed (requests with tools: 400)'}, "
              f"reasoning {'qwen3' if replies.reasoning else 'not parsed'}", flush=True)
        self.gate.serve(app)
        if args.no_warmup:
            print(f"serving {self.name!r} at {self.url} (pid {os.getpid()}; no warmup: buckets compile on first use)",
                  flush=True)
            return
        t = time.perf_counter()
        try:
            engine.warmup(progress=bars_shown(run))
        except Exception as e:  # the server cannot serve: end it (main exits 1 with the error)
            if not self.state.closing.is_set():
                self._fail("warmup", e)
            return
        what = "eager" if engine.runner is None else f"{len(engine.runner.grid)} buckets"
        self.state.ready.set()
        print(f"warmup ({what}): {time.perf_counter() - t:.1f} s\nserving {self.name!r} at {self.url} "
              f"(pid {os.getpid()})", flush=True)

    def _fail(self, what: str, e: BaseException) -> None:
        if not isinstance(e, SystemExit):
            logging.getLogger("metrale_graph.server").error("%s failed", what, exc_info=e)
        self.error = (what, e)
        self.server.should_exit = True

    def stop(self, wait_s: float) -> None:
        """Refuse new requests, give the running ones `wait_s` seconds, then end the engine (none yet: the
        model's load, once done, ends the engine it built). Idempotent, and safe from two threads at once: the
        exit hook's call may still wait when the server has ended (a second Ctrl-C forces the exit), and the
        call with wait_s=0 then ends the running requests at once."""
        with self._lock:
            self._stopping = True
            engine, state = self.engine, self.state
        if engine is not None:
            state.closing.set()
            engine.shutdown(wait_s=wait_s)


def _server(config, on_exit):
    """A uvicorn.Server whose exit signal also calls on_exit() (in a thread: it drains the engine while the
    event loop goes on streaming what the running requests produce); `exit_signal` is the first one."""
    import uvicorn

    class Server(uvicorn.Server):
        exit_signal = None

        def handle_exit(self, sig, frame):
            self.exit_signal = self.exit_signal or sig
            threading.Thread(target=on_exit, name="metrale-serve-drain", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server(config)


def _report(engine, state, name: str, url: str, served_s: float, tp: int = 1) -> None:
    from metrale_graph.server.metrics import FINISH_REASONS

    stats = engine.stats()
    totals, steps = state.metrics.totals, stats.steps
    finished = {reason: totals[reason] for reason in FINISH_REASONS}
    print_table(["requests", *FINISH_REASONS, "prompt tokens", "new tokens", "steps", "served s"],
                [[sum(finished.values()), *finished.values(), totals["prompt_tokens"], totals["generation_tokens"],
                  steps, f"{served_s:.1f}"]])
    speculative = speculative_figures(stats.speculative)
    if speculative is not None:
        print(speculative_line(speculative))
    print_json({"tool": "serve", "tp": tp, "model": name, "url": url, "requests": finished,
                "prompt_tokens": totals["prompt_tokens"], "generation_tokens": totals["generation_tokens"],
                "steps": steps, "served_s": round(served_s, 3), "speculative": speculative})


def cli() -> None:
    """The console script and `python -m`: main(), then the end of a --tp run (tools.distributed). A Ctrl-C
    before the server runs (a follower rank loading its shard; the flags' checks) ends the tool with one line
    and exit code 130; once it runs, Ctrl-C is its graceful shutdown (_serve)."""
    try:
        with closed_pipe_ends_quietly():  # (its main thread's lines; its threads': serve_output.py)
            main()
            sys.stdout.flush()  # (the report's lines, written before the process ends)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one while the interpreter exits
        print("interrupted (Ctrl-C) before the server started", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    end_tensor_parallel()


if __name__ == "__main__":
    cli()
