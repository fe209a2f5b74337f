"""The slot cache: per-slot GDN conv and recurrent states, and a paged KV cache.

Per GDN layer (in `config.linear_layers` order):
    conv_states[j]: [S+1, C, W-1] model dtype    gdn_states[j]: [S+1, HV, K, V] float32
Per attention layer (in `config.full_layers` order):
    k_caches[j], v_caches[j]: [NB+1, BS, HKV, HD] model dtype
and one block table for all layers: block_tables [S+1, MB] int32. A model with an MTP head
(config.mtp_num_hidden_layers > 0) has, per MTP layer, its attention's pools of the same shape:
    mtp_k_caches[i], mtp_v_caches[i]: [NB+1, BS, HKV, HD] model dtype
indexed by the same block table: the MTP's entry of position p sits where the main model's of p does, so
it needs no blocks of its own. `mtp_context_lens[slot]`: how many positions of the slot the MTP head has
caught up on (speculative/mtp.py); 0 after a reset or a prefix restore.

The GDN state checkpoints (prefix caching's, and speculative decoding's verify entries) share one pool per GDN
layer, checkpoint_conv_states / checkpoint_gdn_states [P + V + 1, ...]: entries 0 .. P - 1 prefix caching's
(prefix_checkpoints), P .. P + V - 1 the verify step's (verify_entries, speculative/verify.py), P + V the scratch
entry; and one target list checkpoint_tokens / checkpoint_entries, its first `prefix_targets` prefix caching's
(plan_checkpoints), the last V the verify step's (-1 outside a verify step).

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
import itertools
import sys
import threading
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .config import ModelConfig
from .numbers import as_int, int_tensor, to_device
from .placement import check_memory
from .prefix_cache import PrefixIndex, chain_hashes, prefix_key


@dataclass(frozen=True)
class CacheSnapshot:
    """HybridCache.snapshot(): the cache it is of (a weak reference), copies of its state_tensors() and of its
    host bookkeeping (contexts, blocks, prefix index, tokens, chain hashes)."""
    cache: weakref.ref
    tensors: list[torch.Tensor]
    host: tuple


class CacheInUseError(ValueError, RuntimeError):
    """The cache is busy with another call (a cache serves one caller at a time), or held by an owner
    (an Engine) that alone may use it."""


# the holder each thread acts for (HybridCache.acting_for): a held cache serves only threads acting for its holder
_acting = threading.local()


class HybridCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int = 64,
                 max_context: int | None = None, dtype: torch.dtype = torch.float32, device="cpu", owner=None,
                 prefix_checkpoints: int = 0, checkpoint_interval: int = 0, step_checkpoints: int | None = None,
                 verify_entries: int = 0):
        sizes = {}
        for name, value in (("num_slots", num_slots), ("num_blocks", num_blocks), ("block_size", block_size)):
            sizes[name] = as_int(value)
            if sizes[name] is None or sizes[name] < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        num_slots, num_blocks, block_size = sizes["num_slots"], sizes["num_blocks"], sizes["block_size"]
        prefix_checkpoints, checkpoint_interval = _prefix_options(prefix_checkpoints, checkpoint_interval, block_size)
        verify_entries = as_int(verify_entries)
        if verify_entries is None or verify_entries < 0:
            raise ValueError(f"verify_entries must be an integer >= 0, got {verify_entries!r}")
        if max_context is None:
            max_context = min(cfg.max_position_embeddings, num_blocks * block_size)
        max_context = as_int(max_context)
        if max_context is None or max_context < 1:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        if max_context > cfg.max_position_embeddings:
            raise ValueError(f"max_context ({max_context}) exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings}): no position past it exists")
        check_memory(_pool_asks(cfg, num_slots, num_blocks, block_size, max_context, dtype, prefix_checkpoints,
                                verify_entries), device, "the cache's pools")
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
            mtp_layers = range(cfg.mtp_num_hidden_layers)
            self.mtp_k_caches = [torch.zeros(kv_shape, dtype=dtype, device=self.device) for _ in mtp_layers]
            self.mtp_v_caches = [torch.zeros(kv_shape, dtype=dtype, device=self.device) for _ in mtp_layers]
            self.block_tables = torch.full((S, self.max_blocks_per_slot), self.null_block, dtype=torch.int32,
                                           device=self.device)
            # prefix caching (prefix_cache.py): GDN state checkpoints 0 .. P - 1; speculative decoding's verify
            # entries (speculative/verify.py) P .. P + V - 1; the last entry the scratch one (what padding writes)
            P = prefix_checkpoints + verify_entries + 1 if prefix_checkpoints or verify_entries else 0
            self.checkpoint_conv_states = [torch.zeros(P, cfg.conv_dim, W - 1, dtype=dtype, device=self.device)
                                           for _ in cfg.linear_layers] if P else []
            self.checkpoint_gdn_states = [torch.zeros(P, HV, K, V, dtype=torch.float32, device=self.device)
                                          for _ in cfg.linear_layers] if P else []
            # the checkpoints a step keeps inside the GDN ops (ops/checkpoints.py): NC targets, filled by the
            # prefill protocol before each step; the step reads them where they are (static for graphs)
            # (prefix caching's first, then the verify step's V: targets past `prefix_targets` are speculation's)
            NC = 0
            if checkpoint_interval:
                NC = num_slots + max_context // checkpoint_interval if step_checkpoints is None else step_checkpoints
            self.prefix_targets = NC
            NC += verify_entries
            scratch = prefix_checkpoints + verify_entries
            self.checkpoint_tokens = torch.full((NC,), -1, dtype=torch.int64, device=self.device) if NC else None
            self.checkpoint_entries = (torch.full((NC,), scratch, dtype=torch.int64, device=self.device)
                                       if NC else None)
        self.prefix_checkpoints, self.checkpoint_interval = prefix_checkpoints, checkpoint_interval
        self.verify_entries = verify_entries
        self.context_lens = [0] * num_slots
        self.mtp_context_lens = [0] * num_slots  # the positions whose MTP KV entries are written
        self._blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self._index = PrefixIndex(num_blocks, block_size, prefix_checkpoints)  # block refs and keys, checkpoints
        # with prefix caching, each slot's tokens and its full blocks' chain hashes (what its blocks hold)
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._hashes: list[list[bytes]] = [[] for _ in range(num_slots)]
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
        """Blocks a stream may still be given: free ones, and with prefix caching cached ones no slot holds."""
        return self._index.free_blocks

    @property
    def prefix_caching(self) -> bool:
        return self.prefix_checkpoints > 0

    @property
    def scratch_checkpoint(self) -> int:
        """The checkpoint entry that only padding writes (prefix caching, speculative decoding's verify)."""
        return self.prefix_checkpoints + self.verify_entries

    def check_slot(self, slot) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise ValueError(f"slot must be an int, got {type(slot).__name__} {slot!r}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"unknown slot {slot}: this cache has slots 0..{self.num_slots - 1}")

    def blocks_needed(self, slot: int, new_tokens: int) -> int:
        """Blocks slot must still be given to hold `new_tokens` more tokens."""
        return sum(n for _, n in self.block_needs([(slot, new_tokens)]))

    def block_needs(self, growth) -> list[tuple[int, int]]:
        """(slot, blocks) of each slot of the (slot, new tokens) pairs of `growth` (distinct slots) that must
        still be given blocks to hold its new tokens (blocks_needed of each), those above 0."""
        bs, context, blocks = self.block_size, self.context_lens, self._blocks
        needs = [(slot, -(-(context[slot] + n) // bs) - len(blocks[slot])) for slot, n in growth]
        return [sn for sn in needs if sn[1] > 0]

    def allocate(self, needs: list[tuple[int, int]]) -> None:
        """Give each (slot, blocks) of `needs` (block_needs) that many more blocks. The caller has checked
        capacity. The block table is written once for them all (one copy to the device, not one per slot)."""
        if not needs:
            return
        total = sum(n for _, n in needs)
        assert total <= self.free_blocks, "allocate() called without a capacity check"
        taken = self._index.take_many(total)
        width, blocks, entries, at = self.max_blocks_per_slot, self._blocks, [], 0
        if total == len(needs):  # a block each (decode streams crossing a block boundary)
            for (slot, _), b in zip(needs, taken):
                held = blocks[slot]
                entries.append(slot * width + len(held))
                held.append(b)
        else:
            for slot, n in needs:
                held = blocks[slot]
                first = slot * width + len(held)
                held.extend(taken[at:at + n])
                entries.extend(range(first, first + n))
                at += n
        host = to_device(int_tensor(itertools.chain(entries, taken)), self.device)  # block-table entries, their blocks
        self.block_tables.view(-1).index_copy_(0, host[:total], host[total:].to(torch.int32))

    def commit(self, growth: dict[int, int], tokens: dict[int, list[int]] | None = None) -> None:
        """Advance each slot's context by its new tokens, once the step that wrote them has run. With prefix
        caching, `tokens` (slot -> its new token ids) labels the blocks they filled with their chain hashes."""
        context = self.context_lens
        for slot, n in growth.items():
            context[slot] += n
        if self.prefix_caching:
            for slot in growth:
                self._record(slot, tokens[slot])

    def _record(self, slot: int, new: list[int]) -> None:
        """Append `new` to slot's tokens; label each block they fill by its chain hash."""
        toks, hashes, bs = self._tokens[slot], self._hashes[slot], self.block_size
        toks.extend(new)
        start = len(hashes) * bs
        if len(toks) < start + bs:  # no block filled (most decode steps)
            return
        fresh = chain_hashes(toks, bs, hashes[-1] if hashes else b"", start)
        for k, h in enumerate(fresh, len(hashes)):
            self._index.label(self._blocks[slot][k], h)
        hashes.extend(fresh)

    # prefix caching (prefix_cache.py): a slot's context kept for later prompts, a kept prefix restored ------
    def save_prefix(self, slot: int) -> bool:
        """Keep slot's whole context findable by later prompts: its GDN states copied into a checkpoint entry
        keyed by its tokens, its partial last block labelled with that key (full blocks are labelled as they
        fill). The slot is unchanged. False when there is nothing to keep: prefix caching off, an empty
        slot, or an entry of this very prefix already there."""
        self.check_slot(slot)
        with self.exclusive():
            return self._save_prefix(slot)

    def _save_prefix(self, slot: int) -> bool:
        n, bs = self.context_lens[slot], self.block_size
        if not self.prefix_caching or n == 0:
            return False
        k = n // bs
        full, tail = (self._hashes[slot][k - 1] if k else b""), self._tokens[slot][k * bs:n]
        if self._index.has_entry(full, tail):
            return False
        e = self._index.new_entry()
        try:
            for pool, entries in zip(self.conv_states + self.gdn_states,
                                     self.checkpoint_conv_states + self.checkpoint_gdn_states):
                entries[e].copy_(pool[slot])
        except BaseException:
            self._index.give_back(e)  # half written: never findable
            raise
        self._index.add_entry(e, n, full, tail)
        if tail:
            self._index.label(self._blocks[slot][k], prefix_key(full, tail))
        return True

    def plan_checkpoints(self, streams: list[tuple[int, int, list[int]]]) -> list[tuple[int, int, bytes]]:
        """The state checkpoints the next step keeps (prefix caching with a checkpoint_interval): for each
        (slot, packed offset, new tokens) stream, every multiple of the interval its new tokens reach, where
        the slot's context is a multiple of 64 away (ops/checkpoints.py: the CUDA path keeps states at
        chunk boundaries) and no checkpoint of that prefix exists or is planned (two streams reaching one
        prefix plan it once). At most what the pool can give (free entries and recorded ones, evicted least
        recently used first) and len(checkpoint_tokens): when fewer, each stream's deepest first, a round
        across the streams at a time (a deeper checkpoint restores more of every prompt that reaches it).
        Writes the targets into checkpoint_tokens / checkpoint_entries and returns (entry, length, chain
        hash) of each, to record once the step has run (record_checkpoints) or give back if it fails. A
        failure inside gives back the entries it took."""
        if not self.prefix_targets:
            return []
        every, bs = self.checkpoint_interval, self.block_size
        wanted, planned = [], set()  # per stream, its (stream, length, packed token, hash) targets deepest first
        for i, (slot, offset, new) in enumerate(streams):
            ctx = self.context_lens[slot]
            first = -(-(ctx + 1) // every) * every
            ends = [p for p in range(first, ctx + len(new) + 1, every) if (p - ctx) % 64 == 0]
            if not ends:  # no multiple of the interval reached (a decode's one token, mostly)
                continue
            held = self._hashes[slot]
            seq = self._tokens[slot] + list(new)
            chain = held + chain_hashes(seq[:ends[-1]], bs, held[-1] if held else b"", len(held) * bs)
            targets = []
            for p in reversed(ends):
                h = chain[p // bs - 1]
                if h not in planned and not self._index.has_entry(h, ()):
                    planned.add(h)
                    targets.append((i, p, offset + p - ctx - 1, h))
            wanted.append(targets)
        room = min(self.prefix_targets, self._index.available_entries)
        chosen = [t for round_ in itertools.zip_longest(*wanted) for t in round_ if t is not None][:room]
        chosen.sort()  # recorded stream by stream, shallow first: the deeper, the later evicted
        plan = []
        try:
            for _, p, _, h in chosen:
                plan.append((self._index.new_entry(), p, h))
            pad, NC = self.prefix_targets - len(plan), self.prefix_targets
            # (behind the step before on the device's stream, which may still read them: numbers.to_device)
            self.checkpoint_tokens[:NC].copy_(to_device(int_tensor([t for _, _, t, _ in chosen] + [-1] * pad),
                                                        self.device))
            self.checkpoint_entries[:NC].copy_(to_device(int_tensor([e for e, _, _ in plan]
                                                                    + [self.scratch_checkpoint] * pad), self.device))
        except BaseException:
            self.record_checkpoints(plan, written=False)
            raise
        return plan

    def record_checkpoints(self, plan: list[tuple[int, int, bytes]], written: bool) -> None:
        """After the step of plan_checkpoints: its checkpoints become findable (written) or are given back."""
        for e, p, h in plan:
            if written:
                self._index.add_entry(e, p, h, ())
            else:
                self._index.give_back(e)

    def _restore_prefix(self, slot: int, tokens: list[int], limit: int) -> int:
        """Start empty `slot` from the longest kept prefix of `tokens` of at most `limit` tokens: its full
        blocks shared, its partial last block copied into a fresh one (the stream appends to it), its GDN
        states copied from the checkpoint. Returns the tokens restored (0: none usable). The caller holds
        the cache (exclusive) and has validated the tokens; protocol.restore_prefix is the entry point."""
        assert self.context_lens[slot] == 0 and not self._blocks[slot], "restore into a slot that holds context"
        hit = self._index.lookup(tokens, limit) if self.prefix_caching and limit > 0 else None
        if hit is None:
            return 0
        bs, n = self.block_size, hit.length
        full, partial = list(hit.blocks[:n // bs]), hit.blocks[n // bs:]
        for b in full:
            self._index.share(b)
        if partial and self.free_blocks < 1:  # no block to copy the partial one into
            for b in full:
                self._index.drop(b)
            return 0
        with self.transaction([slot]):
            blocks = full + ([self._index.take()] if partial else [])
            self._blocks[slot] = blocks
            self.context_lens[slot] = n
            self._tokens[slot] = list(tokens[:n])
            self._hashes[slot] = chain_hashes(self._tokens[slot], bs)
            self.block_tables[slot, :len(blocks)] = to_device(int_tensor(blocks, torch.int32), self.device)
            if partial:
                rows = n % bs
                for pool in self.k_caches + self.v_caches:
                    pool[blocks[-1], :rows].copy_(pool[partial[0], :rows])
            for pool, entries in zip(self.conv_states + self.gdn_states,
                                     self.checkpoint_conv_states + self.checkpoint_gdn_states):
                pool[slot].copy_(entries[hit.entry])
        return n

    def clear_prefixes(self) -> None:
        """Forget every prefix kept for later prompts (prefix caching; else nothing to do): their cached
        blocks become free, their checkpoint entries unused. Slots keep their contexts and blocks (a prefix
        they reach later is kept again as it fills). The prefix counters are lifetime figures and stay."""
        with self.exclusive():
            if self.prefix_caching:
                self._index.clear()

    def prefix_stats(self) -> dict:
        """Prefix caching's counters: lookups, hits and the tokens they restored, cached blocks and
        checkpoints held, evictions, and the checkpoint pool's bytes."""
        nbytes = sum(t[0].numel() * t.element_size() * (self.prefix_checkpoints + 1)  # (not the verify entries)
                     for t in self.checkpoint_conv_states + self.checkpoint_gdn_states)
        return {**self._index.stats(), "checkpoint_bytes": nbytes, "checkpoint_entries": self.prefix_checkpoints}

    def reset(self, slot: int) -> None:
        """Forget slot's stream: zero its states, return its KV blocks."""
        self.check_slot(slot)
        with self.exclusive():
            self._reset([slot])

    def _reset(self, slots: list[int]) -> None:
        # host bookkeeping first: it cannot fail, and a slot with context 0 and no blocks is empty
        for slot in slots:
            for b in reversed(self._blocks[slot]):
                self._index.drop(b)
            self._blocks[slot] = []
            self.context_lens[slot] = self.mtp_context_lens[slot] = 0
            self._tokens[slot], self._hashes[slot] = [], []
        try:
            index = to_device(int_tensor(slots), self.device)
            for t in self.conv_states + self.gdn_states:
                t.index_fill_(0, index, 0)
            self.block_tables.index_fill_(0, index, self.null_block)
        except BaseException as e:  # e.g. a dead CUDA context: the states of `slots` are unknown
            self._broken = f"resetting slots {slots} failed ({type(e).__name__}: {e})"
            raise

    def snapshot(self) -> CacheSnapshot:
        """A copy of everything the cache holds: every device tensor (state_tensors(): the slot pools, KV
        pools, block tables and prefix caching's checkpoint pools) and the host bookkeeping (contexts, blocks,
        tokens and chain hashes, the prefix index: ref counts, labels, checkpoint entries)."""
        return CacheSnapshot(weakref.ref(self), [t.clone() for t in self.state_tensors()],
                             copy.deepcopy((self.context_lens, self.mtp_context_lens, self._blocks, self._index,
                                            self._tokens, self._hashes)))

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Put the cache back to a snapshot() of itself (in place: captured graphs stay valid). Anything else
        (a snapshot of another cache, even of the same geometry) raises ValueError before anything is
        copied. If a copy fails midway, every slot is reset and every kept prefix forgotten (the pools'
        contents are then unknown) and the error propagates."""
        if not isinstance(snapshot, CacheSnapshot) or snapshot.cache() is not self:
            got = "a snapshot of another cache" if isinstance(snapshot, CacheSnapshot) else type(snapshot).__name__
            raise ValueError(f"the snapshot is not of this cache (restore takes a snapshot() of this very cache, got "
                             f"{got}); nothing was restored")
        with self.exclusive():
            try:
                for t, s in zip(self.state_tensors(), snapshot.tensors):
                    t.copy_(s)
            except BaseException:
                self._index.clear()
                self._reset(list(range(self.num_slots)))
                raise
            ctx, mtp_ctx, self._blocks, self._index, self._tokens, self._hashes = copy.deepcopy(snapshot.host)
            self.context_lens[:], self.mtp_context_lens[:] = ctx, mtp_ctx

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
        """Every device tensor of the cache (for snapshots in tests and tools): pools(), the block tables, then
        with prefix caching the checkpoint pools and the step's checkpoint targets, then the MTP head's KV pools
        (which the step does not touch: not in pools())."""
        targets = [t for t in (self.checkpoint_tokens, self.checkpoint_entries) if t is not None]
        return (self.pools() + [self.block_tables] + self.checkpoint_conv_states + self.checkpoint_gdn_states + targets
                + self.mtp_k_caches + self.mtp_v_caches)

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


def _prefix_options(checkpoints, interval, block_size: int) -> tuple[int, int]:
    """Prefix caching's sizes, checked: the checkpoint entries (0: no prefix caching) and the interval of the
    checkpoints a prompt leaves (0: none; else a multiple of the block size and of the GDN chunk, 64)."""
    n, every = as_int(checkpoints), as_int(interval)
    if n is None or n < 0:
        raise ValueError(f"prefix_checkpoints must be an integer >= 0, got {checkpoints!r}")
    if every is None or every < 0:
        raise ValueError(f"checkpoint_interval must be an integer >= 0, got {interval!r}")
    if every and (every % block_size or every % 64):
        raise ValueError(f"checkpoint_interval ({every}) must be a multiple of the block size ({block_size}) and of "
                         "the GDN chunk (64)")
    if every and not n:
        raise ValueError("checkpoint_interval needs prefix_checkpoints > 0 (the pool the checkpoints go to)")
    return n, every


def _pool_asks(cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int, max_context: int,
               dtype: torch.dtype, prefix_checkpoints: int, verify_entries: int = 0) -> list[tuple[str, int]]:
    """The bytes of a cache's pools by the argument that sizes them (placement.check_memory's asks): each
    slot's states and block table, the KV blocks, the GDN state checkpoints (each pool with its padding row)."""
    states = len(cfg.linear_layers) * (cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
                                       + cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                       * cfg.linear_value_head_dim * 4)  # one slot's (or checkpoint's)
    kv_layers = len(cfg.full_layers) + cfg.mtp_num_hidden_layers  # the MTP head's attention layers have pools too
    kv_block = 2 * kv_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    table_row = -(-max_context // block_size) * 4
    asks = [(f"slot states (num_slots={num_slots})", (num_slots + 1) * (states + table_row)),
            (f"KV blocks (num_blocks={num_blocks} of block_size={block_size})", (num_blocks + 1) * kv_block)]
    if prefix_checkpoints:
        asks.append((f"GDN state checkpoints (prefix_checkpoints={prefix_checkpoints})",
                     (prefix_checkpoints + 1) * states))
    if verify_entries:
        asks.append((f"speculative verify states (num_slots x num_tokens = {verify_entries})", verify_entries * states))
    return asks


def _add_note(e: BaseException, note: str) -> None:
    """PEP 678 note (shown under the traceback; pytest's `match` reads it too)."""
    if sys.version_info >= (3, 11):
        e.add_note(note)
    else:  # pragma: no cover
        e.__notes__ = getattr(e, "__notes__", []) + [note]
