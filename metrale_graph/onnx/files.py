"""Writing exported graphs whole or not at all.

An ONNX file may come with a side file (`<name>.data`: the weights of a model past protobuf's 2 GB,
which `ONNXProgram.save` writes beside it). `staged(path)` has them written into a fresh hidden
folder beside `path` (same file system, so a rename moves them) and moves them into place only when
the block ends cleanly, the side files first and `path` itself last: a file at `path` is always
complete. Any exception, a Ctrl-C included, removes what was written and leaves `path` as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Callable, Iterator


@contextlib.contextmanager
def staged(path: str | os.PathLike) -> Iterator[str]:
    """Yields the path to write in place of `path` (same file name, in a hidden folder beside it). On a
    clean exit moves it, and whatever else was written into that folder (side files), to `path`'s
    folder, `path` last; on an exception removes it all (side files already moved are put back as they
    were) and re-raises. Raises RuntimeError if the block wrote no file at the yielded path."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; expected a file path to write")
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {path}: folder {folder} does not exist"
                         + (" (it is a file)" if os.path.exists(folder) else ""))
    scratch = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=folder)
    written, previous = os.path.join(scratch, name), os.path.join(scratch, ".previous")
    moved: list[tuple[str, str | None]] = []  # (side file's target, where the file it replaced waits)
    try:
        yield written
        if not os.path.isfile(written):
            raise RuntimeError(f"nothing was written for {path}")
        sides = sorted(set(os.listdir(scratch)) - {name})
        os.mkdir(previous)
        for side in sides:
            target, backup = os.path.join(folder, side), os.path.join(previous, side)
            moved.append((target, backup if os.path.lexists(target) else None))
            if moved[-1][1]:
                os.replace(target, backup)
            os.replace(os.path.join(scratch, side), target)
        os.replace(written, path)
    except BaseException:
        if os.path.exists(written):  # path was not replaced: the side files go back as they were
            for target, backup in reversed(moved):
                with contextlib.suppress(OSError):
                    if backup:
                        os.replace(backup, target)
                    else:
                        os.remove(target)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def save_onnx(program, path: str | os.PathLike, check: bool = True,
              progress: Callable[[str], None] | None = None) -> None:
    """Write an ONNXProgram (what export_prefill / export_onnx return) to `path` through `staged`:
    after `onnx.checker.check_model(full_check=True)` passes on the written file (check=True), or not at
    all. progress(step) is called with "save" and "check_model" as each starts.

    Raises ValueError, before anything is written, for a path that is a folder or whose folder does not
    exist; RuntimeError naming the checker's complaint (nothing written) when the graph fails it."""
    import onnx

    step = progress or (lambda _: None)
    with staged(path) as scratch:
        step("save")
        program.save(scratch)
        if check:
            step("check_model")
            try:  # by path: works past protobuf's 2 GB too
                onnx.checker.check_model(scratch, full_check=True)
            except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
                raise RuntimeError(f"the exported graph fails onnx.checker, so {os.fspath(path)} was not written: "
                                   f"{e}") from e
