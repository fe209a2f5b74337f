"""What produced a benchmark record."""

from __future__ import annotations

import os
import subprocess
import sys

from metrale_graph import envs


def provenance(argv=None) -> dict:
    """The command line, the commit of this checkout ("-dirty" with uncommitted changes; None outside a git
    checkout) and the torch / triton versions. METRALE_COMMIT, when set, is the commit instead: for a copy of
    a working tree whose .git is not that tree's (a device machine's copy keeps the .git it was first given).
    argv: the tool's arguments when main(argv) was called with them (default: the command line's)."""
    import torch
    import triton

    here = os.path.dirname(os.path.abspath(__file__))

    def git(*cmd):
        try:
            return subprocess.run(["git", "-C", here, *cmd], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = envs.METRALE_COMMIT or git("rev-parse", "--short", "HEAD") or None
    if commit and envs.METRALE_COMMIT is None and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return {"command": " ".join([program] + args), "commit": commit, "torch": torch.__version__,
            "triton": triton.__version__}
