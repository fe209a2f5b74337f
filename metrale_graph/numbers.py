"""Numbers as users pass them: Python ints, numpy integers and 0-d integer tensors alike (`as_int`), or Python
and numpy integers only (`is_int`, the Engine's arguments); token ids in numpy arrays; host tensors to the device
without waiting for it."""

from __future__ import annotations

import operator
import sys
from array import array
from numbers import Integral

import torch

_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}
assert array("q").itemsize == 8 and array("i").itemsize == 4, "array.array's int sizes are not int64 / int32 here"


def as_int(value) -> int | None:
    """`value` as an int if it is an integer of any kind (int, numpy integer, 0-d integer tensor); None for
    anything else (bools of every kind, floats, strings, arrays of more than one element)."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    if getattr(value, "ndim", 0) != 0:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def int_tensor(values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Python ints (any iterable) as a 1-D CPU tensor of `dtype` (int64 or int32), built through an
    array.array's buffer: torch.tensor inspects a list element by element, several times slower, which
    shows in the host work of a step of many streams. OverflowError for an int that does not fit."""
    buffer = array(_ARRAY_CODES[dtype], values)
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)  # shares (and keeps alive) the array's memory


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A tensor in pageable host memory copied to `device` without waiting for the device. torch's blocking
    host-to-device copy (`.to(device)`, `torch.tensor(..., device=...)`, `copy_` from the host) synchronizes
    the stream after it: every kernel queued before it must finish first, which would stall the engine loop
    while the step before runs. CUDA stages a pageable source before cudaMemcpyAsync returns, so `host` may be
    freed or changed at once (not so a pinned one: this is for tensors the caller just built)."""
    return host.to(device, non_blocking=True)


def is_int(x) -> bool:
    """An integer as users pass them: a Python or numpy integer (not a bool; unlike as_int, not a 0-d tensor)."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def plain_int(x):
    """A numpy integer as a Python int; anything else as it is (token_tensor names what is not an int)."""
    return int(x) if is_int(x) and not isinstance(x, int) else x


def is_numpy_array(x) -> bool:
    """Whether `x` is a numpy array (without importing numpy: if it is not imported, nothing is one)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def numpy_ids(array, where: str) -> list[int]:
    """A 1-D integer numpy array as a list of Python ints; ValueError naming `where` otherwise."""
    if array.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be an integer array, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{where}: token ids must be 1-D, got shape {tuple(array.shape)}")
    return array.tolist()
