"""Numbers as users pass them: Python ints, numpy integers and 0-d integer tensors alike; host tensors to the
device without waiting for it."""

from __future__ import annotations

import operator
from array import array

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
