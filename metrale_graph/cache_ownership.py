"""One model, one caller, one holder: who may use a HybridCache (cache.py), and when.

A cache serves one model (the one whose `new_cache` made it, or the first that uses it) and one caller at a
time: `exclusive()` raises `CacheInUseError` instead of letting two threads interleave their bookkeeping. An
owner (an Engine) may `hold()` it: then only threads acting for that holder (`acting_for`) may use it. A cache
whose reset failed (`_broken`, set by HybridCache._reset: a dead CUDA context) refuses every later call.

`CacheOwnership` is HybridCache's base class: its state is its own (`_owner`, `_lock`, `_holder`,
`_holder_name`, `_broken`); what it guards (the tensors, the bookkeeping) is the subclass's. Its pickling and
deep copy copy the whole cache, all but that state: a pickled cache has no owner (the first model to use it
claims it), a deep copy keeps its owner; neither is held, each gets a lock of its own.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref


class CacheInUseError(ValueError, RuntimeError):
    """The cache is busy with another call (a cache serves one caller at a time), or held by an owner
    (an Engine) that alone may use it."""


# the holder each thread acts for (HybridCache.acting_for): a held cache serves only threads acting for its holder
_acting = threading.local()


class CacheOwnership:
    """The model a cache serves, the lock of its one caller, its holder (module docstring)."""

    def __init__(self, owner=None):
        self._owner = None if owner is None else weakref.ref(owner)
        self._lock = threading.Lock()
        self._holder: object | None = None  # hold(): the one owner whose threads may use the cache
        self._holder_name = ""
        self._broken: str | None = None  # set when a failed reset left device state unknown

    def bind(self, model, claim: bool = True) -> None:
        """Check that `model` is the model this cache serves (the first model to use a cache made
        without an owner becomes its owner; claim=False only checks). ValueError otherwise."""
        owner = None if self._owner is None else self._owner()
        if owner is None:
            if self._owner is not None:
                raise ValueError("the model that created this cache no longer exists; build a new cache "
                                 "with model.new_cache(...)")
            if claim:
                self._owner = weakref.ref(model)
        elif owner is not model:
            raise ValueError("the cache was created by another model (a cache holds the state of the model "
                             "that made it); build one with model.new_cache(...)")

    def hold(self, holder: object, name: str) -> None:
        """Reserve the cache for `holder` (e.g. an Engine's token) until release(holder): meanwhile every
        call (prefill, a runner's, reset, restore) raises CacheInUseError naming `name`, except from a thread
        inside `acting_for(holder)`. CacheInUseError if another holder has it."""
        with self._lock_for_holding():
            if self._holder is not None and self._holder is not holder:
                raise CacheInUseError(f"the cache is already held by {self._holder_name}")
            self._holder, self._holder_name = holder, name

    def release(self, holder: object) -> None:
        """End hold(holder); a no-op if `holder` does not hold the cache."""
        with self._lock_for_holding():
            if self._holder is holder:
                self._holder, self._holder_name = None, ""

    @property
    def holder_name(self) -> str | None:
        """Who holds the cache (hold()), or None."""
        return self._holder_name if self._holder is not None else None

    @contextlib.contextmanager
    def acting_for(self, holder: object):
        """Inside the block, this thread's calls on a cache held by `holder` are the holder's own."""
        previous = getattr(_acting, "holder", None)
        _acting.holder = holder
        try:
            yield
        finally:
            _acting.holder = previous

    @contextlib.contextmanager
    def _lock_for_holding(self):
        # hold / release must not race a call: take the call lock briefly (a running call keeps it: refuse)
        if not self._lock.acquire(blocking=False):
            raise CacheInUseError("the cache is in use by another call: it cannot change hands now")
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the cache for one call; CacheInUseError if another call (another thread) holds it, or if the
        cache is held (hold()) and this thread does not act for its holder."""
        if self._holder is not None and getattr(_acting, "holder", None) is not self._holder:
            raise CacheInUseError(f"the cache is held by {self._holder_name}: it alone may prefill, reset or "
                                  "restore it (build another cache for other work)")
        if not self._lock.acquire(blocking=False):
            raise CacheInUseError("the cache is in use by another call: a cache serves one caller at a time "
                                  "(prefill, reset and restore from one thread, or give each thread its own cache)")
        try:
            if self._broken:
                raise RuntimeError(f"this cache is unusable: {self._broken}")
            yield self
        finally:
            self._lock.release()

    def __getstate__(self):  # pickle (torch.save): a new lock, and no owner (a weak reference cannot be saved,
        # and the model may not exist where the cache is loaded): the first model to use the loaded cache claims it
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_owner"] = None
        state["_holder"], state["_holder_name"] = None, ""
        return state

    def __deepcopy__(self, memo):  # copy.deepcopy: a new lock, the same owner
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in ("_lock", "_owner", "_holder"):
                value = copy.deepcopy(value, memo)
            setattr(new, key, value)
        new._lock = threading.Lock()
        new._holder, new._holder_name = None, ""  # a copy is nobody's until held
        return new

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
