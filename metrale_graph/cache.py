"""The slot cache: per-slot GDN conv and recurrent states, and a paged KV cache.

Per GDN layer (in `config.linear_layers` order):
    conv_states[j]: [S+1, C, W-1] model dtype    gdn_states[j]: [S+1, HV, K, V] float32
Per attention layer (in `config.full_layers` order):
    k_caches[j], v_caches[j]: [NB+1, BS, HKV, HD] model dtype
and one block table for all layers: block_tables [S+1, MB] int32.

Slot S (`scratch_slot`) and block NB (`null_block`) exist only for padding: no stream is
ever given them, so padding never reads or writes a real slot or block. Unused block-table
entries point at the null block.

Host-side bookkeeping (context length and blocks of each slot, the free-block list) lives
here too; `prefill` checks a batch against it before touching anything.

A cache serves one model (the one whose `new_cache` made it, or the first that uses it) and one
caller at a time: `exclusive()` raises `CacheInUseError` instead of letting two threads
interleave their bookkeeping. A prefill writes its slots inside `transaction(slots)`: if
anything fails there (an op error, out of memory, Ctrl-C) those slots are reset, so a slot
never holds half a step.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import weakref
from types import SimpleNamespace

import torch

from .config import ModelConfig
from .numbers import as_int


class CacheInUseError(ValueError, RuntimeError):
    """The cache is busy with another call (a cache serves one caller at a time), or held by an owner
    (an Engine) that alone may use it."""


# the holder each thread acts for (HybridCache.acting_for): a held cache serves only threads acting for its holder
_acting = threading.local()


class HybridCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int = 64,
                 max_context: int | None = None, dtype: torch.dtype = torch.float32, device="cpu", owner=None):
        sizes = {}
        for name, value in (("num_slots", num_slots), ("num_blocks", num_blocks), ("block_size", block_size)):
            sizes[name] = as_int(value)
            if sizes[name] is None or sizes[name] < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        num_slots, num_blocks, block_size = sizes["num_slots"], sizes["num_blocks"], sizes["block_size"]
        if max_context is None:
            max_context = min(cfg.max_position_embeddings, num_blocks * block_size)
        max_context = as_int(max_context)
        if max_context is None or max_context < 1:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        if max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context ({max_context}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}): no position past it exists")
        self.config = cfg
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        # exactly max_context tokens per slot (validate refuses a stream past it), in whole blocks
        self.max_context = max_context
        self.max_blocks_per_slot = -(-max_context // block_size)
        self.dtype, self.device = dtype, torch.device(device)
        S, W = num_slots + 1, cfg.linear_conv_kernel_dim
        HV, K, V = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kv_shape = (num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # normal tensors even when built under torch.inference_mode(): the steps update them in place, which
        # an inference tensor refuses outside inference mode
        with torch.inference_mode(False):
            self.conv_states = [torch.zeros(S, cfg.conv_dim, W - 1, dtype=dtype, device=self.device)
                                for _ in cfg.linear_layers]
            self.gdn_states = [torch.zeros(S, HV, K, V, dtype=torch.float32, device=self.device)
                               for _ in cfg.linear_layers]
            self.k_caches = [torch.zeros(kv_shape, dtype=dtype, device=self.device) for _ in cfg.full_layers]
            self.v_caches = [torch.zeros(kv_shape, dtype=dtype, device=self.device) for _ in cfg.full_layers]
            self.block_tables = torch.full((S, self.max_blocks_per_slot), self.null_block, dtype=torch.int32,
                                           device=self.device)
        self.context_lens = [0] * num_slots
        self._blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._owner = None if owner is None else weakref.ref(owner)
        self._lock = threading.Lock()
        self._holder: object | None = None  # hold(): the one owner whose threads may use the cache
        self._holder_name = ""
        self._broken: str | None = None  # set when a failed reset left device state unknown

    # one model, one caller ------------------------------------------------------------------------
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

    @contextlib.contextmanager
    def transaction(self, slots):
        """The caller writes `slots` (their states, blocks, context) inside this block. If the block
        raises anything (KeyboardInterrupt and out-of-memory included), every one of `slots` is reset
        (states zeroed, blocks returned, context 0) and the exception gets a note naming them, so a
        slot never holds half a step."""
        try:
            yield
        except BaseException as e:
            slots = sorted(set(slots))
            self._reset(slots)
            _add_note(e, f"metrale-graph: the step failed while writing the cache; slots {slots} were reset "
                         "(state zeroed, KV blocks returned, context 0)")
            try:
                e.reset_slots = slots
            except AttributeError:  # pragma: no cover (exceptions with __slots__)
                pass
            raise

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def check_slot(self, slot) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise ValueError(f"slot must be an int, got {type(slot).__name__} {slot!r}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"unknown slot {slot}: this cache has slots 0..{self.num_slots - 1}")

    def blocks_needed(self, slot: int, new_tokens: int) -> int:
        """Blocks slot must still be given to hold `new_tokens` more tokens."""
        need = -(-(self.context_lens[slot] + new_tokens) // self.block_size)
        return max(0, need - len(self._blocks[slot]))

    def allocate(self, growth: dict[int, int]) -> None:
        """Give each slot the blocks for its new tokens. The caller has checked capacity."""
        total = sum(self.blocks_needed(s, n) for s, n in growth.items())
        assert total <= len(self._free), "allocate() called without a capacity check"
        for slot, n in growth.items():
            need = self.blocks_needed(slot, n)
            if need == 0:
                continue
            first = len(self._blocks[slot])
            new = [self._free.pop() for _ in range(need)]
            self._blocks[slot].extend(new)
            self.block_tables[slot, first:first + need] = torch.tensor(new, dtype=torch.int32)

    def commit(self, growth: dict[int, int]) -> None:
        """Advance each slot's context by its new tokens, once the step that wrote them has run."""
        for slot, n in growth.items():
            self.context_lens[slot] += n

    def reset(self, slot: int) -> None:
        """Forget slot's stream: zero its states, return its KV blocks."""
        self.check_slot(slot)
        with self.exclusive():
            self._reset([slot])

    def _reset(self, slots: list[int]) -> None:
        # host bookkeeping first: it cannot fail, and a slot with context 0 and no blocks is empty
        for slot in slots:
            self._free.extend(reversed(self._blocks[slot]))
            self._blocks[slot] = []
            self.context_lens[slot] = 0
        try:
            index = torch.tensor(slots, dtype=torch.int64, device=self.device)
            for t in self.conv_states + self.gdn_states:
                t.index_fill_(0, index, 0)
            self.block_tables.index_fill_(0, index, self.null_block)
        except BaseException as e:  # e.g. a dead CUDA context: the states of `slots` are unknown
            self._broken = f"resetting slots {slots} failed ({type(e).__name__}: {e})"
            raise

    def snapshot(self) -> tuple:
        """A copy of everything the cache holds (device pools and host bookkeeping)."""
        return ([t.clone() for t in self.state_tensors()], list(self.context_lens),
                [list(b) for b in self._blocks], list(self._free))

    def restore(self, snapshot: tuple) -> None:
        """Put the cache back to a snapshot() of itself (in place: captured graphs stay valid). A snapshot
        of another cache geometry raises ValueError before anything is copied."""
        tensors, ctx, blocks, free = snapshot
        mine = self.state_tensors()
        if len(tensors) != len(mine) or len(ctx) != self.num_slots or len(blocks) != self.num_slots or any(
                t.shape != s.shape or t.dtype != s.dtype for t, s in zip(mine, tensors)) or not self._fits_geometry(
                tensors[-1], ctx, blocks, free):
            raise ValueError("the snapshot is not of this cache (other pools, slots or block tables); nothing "
                             "was restored")
        with self.exclusive():
            for t, s in zip(self.state_tensors(), tensors):
                t.copy_(s)
            self.context_lens[:] = ctx
            self._blocks = [list(b) for b in blocks]
            self._free = list(free)

    def _fits_geometry(self, block_tables: torch.Tensor, ctx, blocks, free) -> bool:
        """Whether a snapshot's bookkeeping describes this cache's blocks: each slot's context within
        max_context and held in ceil(context / block_size) blocks, its block-table row those blocks then
        the null block, and the held and free blocks together exactly 0..num_blocks-1. (The pool shapes
        alone do not pin the block geometry: a model without attention layers has no KV pools.)"""
        bs, held = self.block_size, []
        for n, b in zip(ctx, blocks):
            if not isinstance(n, int) or not 0 <= n <= self.max_context or len(b) != -(-n // bs):
                return False
            held.extend(b)
        if sorted(held + list(free)) != list(range(self.num_blocks)):
            return False
        rows = block_tables[:self.num_slots].tolist()
        return all(row == list(b) + [self.null_block] * (len(row) - len(b)) for row, b in zip(rows, blocks))

    # the pools in one order, which the ONNX export's inputs and outputs follow
    _POOL_KINDS = (("conv_states", "conv_state", "linear_layers"), ("gdn_states", "gdn_state", "linear_layers"),
                   ("k_caches", "k_cache", "full_layers"), ("v_caches", "v_cache", "full_layers"))

    def pools(self) -> list[torch.Tensor]:
        """The state pools the step mutates: conv states, GDN states, K caches, V caches (that order)."""
        return [t for kind, _, _ in self._POOL_KINDS for t in getattr(self, kind)]

    def pool_names(self) -> list[str]:
        """Names of pools() in order: conv_state_L{i}, gdn_state_L{i}, k_cache_L{i}, v_cache_L{i} (layer i)."""
        return [f"{name}_L{i}" for _, name, layers in self._POOL_KINDS for i in getattr(self.config, layers)]

    def pool_view(self, pools: list[torch.Tensor]) -> SimpleNamespace:
        """An object with this cache's pool attributes (conv_states, ...) holding `pools` (in pools()
        order) instead: what the step reads when it runs on other tensors, e.g. under torch.export."""
        view, start = SimpleNamespace(), 0
        for kind, _, _ in self._POOL_KINDS:
            n = len(getattr(self, kind))
            setattr(view, kind, list(pools[start:start + n]))
            start += n
        if start != len(pools):
            raise ValueError(f"expected {start} pools, got {len(pools)}")
        return view

    def state_tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the cache (for snapshots in tests and tools)."""
        return self.pools() + [self.block_tables]

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

    def __repr__(self) -> str:
        used = sum(c > 0 for c in self.context_lens)
        return (f"HybridCache(slots={self.num_slots} ({used} in use), blocks={self.num_blocks} "
                f"({self.free_blocks} free) x {self.block_size}, max_context={self.max_context}, "
                f"dtype={self.dtype}, device={self.device})")


def _add_note(e: BaseException, note: str) -> None:
    """PEP 678 note (shown under the traceback; pytest's `match` reads it too)."""
    if sys.version_info >= (3, 11):
        e.add_note(note)
    else:  # pragma: no cover
        e.__notes__ = getattr(e, "__notes__", []) + [note]
