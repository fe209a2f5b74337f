"""Numbers as users pass them: Python ints, numpy integers and 0-d integer tensors alike."""

from __future__ import annotations

import operator


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
