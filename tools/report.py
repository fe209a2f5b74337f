"""What the tools print: aligned tables, markdown tables and the final JSON line."""

from __future__ import annotations

import contextlib
import json
import os
import sys


def format_table(headers: list[str], rows: list[list]) -> str:
    """Columns right-aligned to their widest cell, a rule under the headers."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(headers: list[str], rows: list[list]) -> None:
    print(format_table(headers, rows))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    return ("| " + " | ".join(map(str, headers)) + " |\n|" + "---|" * len(headers) + "\n"
            + "".join("| " + " | ".join(map(str, r)) + " |\n" for r in rows))


def print_json(record: dict) -> None:
    print(json.dumps(record, sort_keys=True))


def speculative_figures(stats: dict | None, before: dict | None = None) -> dict | None:
    """engine.stats().speculative (its counts less those of `before`, an earlier one) with two ratios: acceptance
    (drafts accepted / proposed) and tokens_per_step (what a speculating stream gains per verify step, its
    accepted drafts and the one token more: (accepted + drafts) / drafts, vLLM's mean acceptance length); None
    when speculation is off, a ratio None when nothing was proposed."""
    if stats is None:
        return None
    counts = {k: stats[k] - (before[k] if before else 0) for k in ("proposed", "accepted", "drafts", "steps")}
    proposed, accepted, drafts = counts["proposed"], counts["accepted"], counts["drafts"]
    return {"method": stats["method"], "num_tokens": stats["num_tokens"], **counts,
            "acceptance": round(accepted / proposed, 4) if proposed else None,
            "tokens_per_step": round((accepted + drafts) / drafts, 3) if drafts else None}


def speculative_line(figures: dict) -> str:
    """speculative_figures as one line for a person."""
    f = figures
    if not f["proposed"]:
        return f"speculative ({f['method']}, k = {f['num_tokens']}): no drafts proposed"
    return (f"speculative ({f['method']}, k = {f['num_tokens']}): {f['proposed']} drafts proposed, {f['accepted']} "
            f"accepted ({100 * f['acceptance']:.1f} %), {f['tokens_per_step']:.2f} tokens per stream and verify step "
            f"({f['steps']} verify steps verifying {f['drafts']} drafts)")


@contextlib.contextmanager
def ends_quietly():
    """Around a tool's main (its console script), the ends a user causes, without a traceback: Ctrl-C is one line
    on standard error and exit code 130 (128 + SIGINT; a second Ctrl-C while the process exits is ignored: it would
    interrupt the interpreter's finalization); standard output's reader gone (`metrale-generate ... | head`) ends
    the tool as the shell's own tools end there, exit code 141 (128 + SIGPIPE; closed_pipe_ends_quietly). Python's
    default for both was a traceback (a BrokenPipeError one, and another message at exit, when it flushes standard
    output)."""
    import signal

    try:
        with closed_pipe_ends_quietly():
            yield
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


@contextlib.contextmanager
def closed_pipe_ends_quietly():
    """ends_quietly's second half alone (serve has its own Ctrl-C): standard output's reader gone ends the tool with
    exit code 141, no traceback. A BrokenPipeError of anything else (a socket) is raised as it is."""
    try:
        yield
    except BrokenPipeError:
        if not stdout_closed():
            raise
        silence_stdout()
        raise SystemExit(141) from None


def silence_stdout() -> None:
    """Standard output pointed at /dev/null, its reader gone: later writes, and the exit's flush, write nowhere."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def stdout_closed() -> bool:
    """Whether standard output's reader has gone: its pipe reports an error (POLLERR: no reader), or a flush fails."""
    import select

    with contextlib.suppress(OSError, ValueError, AttributeError):
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        if any(events & select.POLLERR for _, events in poll.poll(0)):
            return True
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    return False


def bars_shown(run=None) -> bool:
    """Whether progress bars are drawn: on a terminal only (standard error a TTY), and only by the reporting
    rank. In a log that standard output shares, a bar's text would be left in front of the next output line."""
    return sys.stderr.isatty() and (run is None or run.reports)


def progress_bar(iterable=None, run=None, **kwargs):
    """A tqdm bar (same arguments) drawn where bars_shown(run), cleared when it closes (leave=False), so the
    tool's output never follows a bar's text."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not bars_shown(run), leave=False, **kwargs)
