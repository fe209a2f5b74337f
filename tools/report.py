"""What the tools print: aligned tables, markdown tables and the final JSON line."""

from __future__ import annotations

import json
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


def bars_shown(run=None) -> bool:
    """Whether progress bars are drawn: on a terminal only (standard error a TTY), and only by the reporting
    rank. In a log that standard output shares, a bar's text would be left in front of the next output line."""
    return sys.stderr.isatty() and (run is None or run.reports)


def progress_bar(iterable=None, run=None, **kwargs):
    """A tqdm bar (same arguments) drawn where bars_shown(run), cleared when it closes (leave=False), so the
    tool's output never follows a bar's text."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not bars_shown(run), leave=False, **kwargs)
