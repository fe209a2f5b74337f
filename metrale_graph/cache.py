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
caught up on (speculative/mtp.py); 0 after a reset; after a prefix restore the prefix's length where the
head's entries that came with its blocks are the new tokens' (cache_prefixes.PrefixStore.restore), else 0.

The GDN state checkpoints, prefix caching's and speculative decoding's verify entries, share one pool per GDN
layer (checkpoint_conv_states / checkpoint_gdn_states) and one list of the step's targets (checkpoint_tokens /
checkpoint_entries), laid out in cache_prefixes.py.

Slot S (`scratch_slot`) and block NB (`null_block`) exist only for padding: no stream is
ever given them, so padding never reads or writes a real slot or block. Unused block-table
entries point at the null block.

HybridCache owns every tensor and each slot's context length, and composes the pieces that each do one job:
    CacheOwnership (cache_ownership.py, its base class): one model, one caller at a time (`exclusive()` raises
        `CacheInUseError` instead of letting two threads interleave their bookkeeping), one holder (`hold()`);
    slot_blocks, a SlotBlocks (cache_blocks.py): the KV blocks each slot holds and the tokens they hold, over the
        PrefixIndex (prefix_cache.py: ref counts, free lists, prefix caching's labels and checkpoint entries);
    prefixes, a PrefixStore (cache_prefixes.py): prefix caching's save, checkpoint plan and restore.
`prefill` checks a batch against the bookkeeping before touching anything. A prefill writes its slots inside
`transaction(slots)`: if anything fails there (an op error, out of memory, Ctrl-C) those slots are reset, so
a slot never holds half a step.
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import torch

from . import cache_snapshot
from .cache_blocks import SlotBlocks
from .cache_ownership import CacheInUseError, CacheOwnership
from .cache_prefixes import PrefixStore, checkpoint_buffers
from .cache_sizes import checked_sizes, pool_asks
from .cache_snapshot import CacheSnapshot
from .config import ModelConfig
from .numbers import int_tensor, to_device
from .placement import check_memory

__all__ = ["CacheInUseError", "CacheSnapshot", "HybridCache"]


class HybridCache(CacheOwnership):
    def __init__(self, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int = 64,
                 max_context: int | None = None, dtype: torch.dtype = torch.float32, device="cpu", owner=None,
                 prefix_checkpoints: int = 0, checkpoint_interval: int = 0, step_checkpoints: int | None = None,
                 verify_entries: int = 0):
        (num_slots, num_blocks, block_size, max_context, prefix_checkpoints, checkpoint_interval,
         verify_entries) = checked_sizes(cfg, num_slots, num_blocks, block_size, max_context, prefix_checkpoints,
                                         checkpoint_interval, verify_entries)
        check_memory(pool_asks(cfg, num_slots, num_blocks, block_size, max_context, dtype, prefix_checkpoints,
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
            # prefix caching (cache_prefixes.py): GDN state checkpoints 0 .. P - 1; speculative decoding's verify
            # entries (speculative/verify.py) P .. P + V - 1; the last entry the scratch one (what padding writes)
            P = prefix_checkpoints + verify_entries + 1 if prefix_checkpoints or verify_entries else 0
            # the checkpoints a step keeps inside the GDN ops (ops/checkpoints.py): NC targets, filled by the
            # prefill protocol before each step; the step reads them where they are (static for graphs)
            # (prefix caching's first, then the verify step's V: targets past `prefix_targets` are speculation's)
            NC = 0
            if checkpoint_interval:
                NC = num_slots + max_context // checkpoint_interval if step_checkpoints is None else step_checkpoints
            self.prefix_targets = NC
            (self.checkpoint_conv_states, self.checkpoint_gdn_states, self.checkpoint_tokens, self.checkpoint_entries,
             self.checkpoint_targets) = checkpoint_buffers(cfg, P, NC + verify_entries, dtype, self.device)
        self.prefix_checkpoints, self.checkpoint_interval = prefix_checkpoints, checkpoint_interval
        self.verify_entries = verify_entries
        # what the verify targets hold on the device (cache_prefixes.set_verify_targets): () none, None unknown
        self.verify_targets_held: tuple | None = ()
        self.context_lens = [0] * num_slots
        self.mtp_context_lens = [0] * num_slots  # the positions whose MTP KV entries are written
        self.slot_blocks = SlotBlocks(num_slots, num_blocks, block_size, prefix_checkpoints)
        self.prefixes = PrefixStore(self)
        super().__init__(owner)

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
        return self.slot_blocks.free_blocks

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

    def block_needs(self, growth) -> list[tuple[int, int]]:
        """(slot, blocks) of each slot of the (slot, new tokens) pairs of `growth` (distinct slots) that must
        still be given blocks to hold its new tokens, those above 0 (SlotBlocks.needs)."""
        return self.slot_blocks.needs(growth, self.context_lens)

    def block_needs_to(self, slots: list[int], ends: list[int]) -> list[tuple[int, int]]:
        """block_needs of distinct `slots` growing to `ends[i]` tokens each (their context plus new tokens)."""
        return self.slot_blocks.needs_to(slots, ends)

    def allocate(self, needs: list[tuple[int, int]]) -> None:
        """Give each (slot, blocks) of `needs` (block_needs) that many more blocks. The caller has checked
        capacity. The block table is written once for them all (one copy to the device, not one per slot)."""
        if not needs:
            return
        total = sum(n for _, n in needs)
        assert total <= self.free_blocks, "allocate() called without a capacity check"
        entries, taken = self.slot_blocks.take(needs, self.max_blocks_per_slot)
        # the block-table entries and their blocks, each made on the host in its dtype (no narrowing on the device)
        self.block_tables.view(-1).index_copy_(0, to_device(int_tensor(entries), self.device),
                                               to_device(int_tensor(taken, torch.int32), self.device))

    def commit(self, growth: dict[int, int], tokens: dict[int, list[int]] | None = None) -> None:
        """Advance each slot's context by its new tokens, once the step that wrote them has run. With prefix
        caching, `tokens` (slot -> its new token ids) labels the blocks they filled with their chain hashes."""
        context = self.context_lens
        for slot, n in growth.items():
            context[slot] += n
        if self.prefix_caching:
            for slot in growth:
                self.slot_blocks.record(slot, tokens[slot])

    # the host bookkeeping under the names tests read (tests/test_prefix_pools.py checks it after every call)
    _blocks = property(lambda self: self.slot_blocks.blocks)
    _tokens = property(lambda self: self.slot_blocks.tokens)
    _hashes = property(lambda self: self.slot_blocks.hashes)
    _index = property(lambda self: self.slot_blocks.index)

    # prefix caching (cache_prefixes.py): a slot's context kept for later prompts, the step's checkpoints ------
    def save_prefix(self, slot: int) -> bool:
        """Keep slot's whole context findable by later prompts (PrefixStore.save); False when there is nothing
        to keep (prefix caching off, an empty slot, an entry of this very prefix already there)."""
        self.check_slot(slot)
        with self.exclusive():
            return self.prefixes.save(slot)

    def plan_checkpoints(self, streams: list[tuple[int, int, list[int]]]) -> list[tuple[int, int, bytes]]:
        """The state checkpoints the next step keeps, written into its targets (PrefixStore.plan)."""
        return self.prefixes.plan(streams)

    def record_checkpoints(self, plan: list[tuple[int, int, bytes]], written: bool) -> None:
        """After the step of plan_checkpoints: its checkpoints become findable (written) or are given back."""
        self.prefixes.record(plan, written)

    def clear_prefixes(self) -> None:
        """Forget every prefix kept for later prompts (PrefixStore.clear); slots keep their contexts and blocks."""
        with self.exclusive():
            self.prefixes.clear()

    def prefix_stats(self) -> dict:
        """Prefix caching's counters (PrefixStore.stats)."""
        return self.prefixes.stats()

    def reset(self, slot: int) -> None:
        """Forget slot's stream: zero its states, return its KV blocks."""
        self.check_slot(slot)
        with self.exclusive():
            self._reset([slot])

    def _reset(self, slots: list[int]) -> None:
        # host bookkeeping first: it cannot fail, and a slot with context 0 and no blocks is empty
        for slot in slots:
            self.slot_blocks.release(slot)
            self.context_lens[slot] = self.mtp_context_lens[slot] = 0
        try:
            index = to_device(int_tensor(slots), self.device)
            for t in self.conv_states + self.gdn_states:
                t.index_fill_(0, index, 0)
            self.block_tables.index_fill_(0, index, self.null_block)
        except BaseException as e:  # e.g. a dead CUDA context: the states of `slots` are unknown
            self._broken = f"resetting slots {slots} failed ({type(e).__name__}: {e})"
            raise

    def snapshot(self) -> CacheSnapshot:
        """A copy of everything the cache holds: every device tensor and the host bookkeeping (cache_snapshot.py)."""
        return cache_snapshot.take(self)

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Put the cache back to a snapshot() of itself, in place (cache_snapshot.py). A snapshot of another cache
        is a ValueError before anything is copied; a copy that fails midway leaves every slot empty."""
        cache_snapshot.put_back(self, snapshot)

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
        targets = [self.checkpoint_targets] if self.checkpoint_targets is not None else []  # (tokens, entries: its rows)
        return (self.pools() + [self.block_tables] + self.checkpoint_conv_states + self.checkpoint_gdn_states + targets
                + self.mtp_k_caches + self.mtp_v_caches)

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
