"""Writing result files whole: a reader (or the next run) sees the previous file or the new one,
never a torn one."""

from __future__ import annotations

import os
import tempfile


def write_whole(path: str, data: str | bytes) -> None:
    """Write `data` (text, or bytes) to `path` so that the file holds all of it or stays as it was: the data
    goes to a temporary file in the same folder, which is renamed over `path` once written and flushed to
    disk (a rename within one file system is atomic). A Ctrl-C, a full disk or an error mid-write leaves the
    previous file (bench rewrites its --json after every workload; warmup's ranks and runs share a folder)
    and no temporary file."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def unwritable(folder: str) -> str | None:
    """Why no file can be written into the existing `folder` (the OS's reason), or None. Checked by writing
    one: os.access says yes to root on read-only file systems."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return str(e.strerror or e)
    return None
