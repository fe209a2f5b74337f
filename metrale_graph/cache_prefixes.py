"""Prefix caching on a HybridCache (cache.py): a slot's context kept for later prompts, the state checkpoints a
step keeps planned, a kept prefix restored into a slot. The host side (which blocks and checkpoint entries hold
which prefix) is the PrefixIndex (prefix_cache.py, `cache.slot_blocks.index`); here are the device copies and
the targets the step reads, in the cache's tensors:

    checkpoint_conv_states[j] / checkpoint_gdn_states[j]: [P + V + 1, ...] per GDN layer; entries 0 .. P - 1
        prefix caching's (prefix_checkpoints), then the verify entries (speculative/verify.py), then the scratch
    checkpoint_tokens / checkpoint_entries: [NC] the step's targets (ops/checkpoints.py), the first
        `prefix_targets` planned here, the rest the verify step's

Every failure inside gives back the checkpoint entries it took, so the index's accounting stays exact
(tests/test_prefix_pools.py).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from .config import ModelConfig
from .numbers import int_tensor, to_device
from .prefix_cache import Hit, chain_hashes, prefix_key


class PrefixStore:
    """Prefix caching's work on one cache (module docstring). The cache calls it with the cache held
    (exclusive), its arguments checked; `cache.prefixes` is the one of a cache."""

    def __init__(self, cache):
        self.cache = cache
        # on_lookup(slot, tokens, hit): called by restore after its lookup (hit a prefix_cache.Hit or None); a plan
        # broadcast's rank 0 journals it for the other ranks (plan_journal.py)
        self.on_lookup: Callable[[int, list[int], Hit | None], None] | None = None

    def save(self, slot: int, written: bool = True) -> bool:
        """Keep slot's whole context findable by later prompts: its GDN states copied into a checkpoint entry
        keyed by its tokens, its partial last block labelled with that key (full blocks are labelled as they
        fill). The slot is unchanged. False when there is nothing to keep: prefix caching off, an empty
        slot, or an entry of this very prefix already there. written=False does the bookkeeping of a save whose
        copy failed (the entry taken, the least recently used one evicted if none was free, then given back):
        what a follower of a plan broadcast replays of rank 0's failed save (plan_journal.py)."""
        c = self.cache
        n, bs, held, index = c.context_lens[slot], c.block_size, c.slot_blocks, c.slot_blocks.index
        if not c.prefix_caching or n == 0:
            return False
        k = n // bs
        full, tail = (held.hashes[slot][k - 1] if k else b""), held.tokens[slot][k * bs:n]
        if index.has_entry(full, tail):
            return False
        e = index.new_entry()
        if not written:
            index.give_back(e)
            return False
        try:
            for pool, entries in zip(c.conv_states + c.gdn_states, c.checkpoint_conv_states + c.checkpoint_gdn_states):
                entries[e].copy_(pool[slot])
            index.add_entry(e, n, full, tail)  # (findable only once its states are written)
        except BaseException:
            index.give_back(e)  # half written, or not recorded: never findable
            raise
        if tail:
            index.label(held.blocks[slot][k], prefix_key(full, tail))
        return True

    def plan(self, streams: list[tuple[int, int, list[int]]]) -> list[tuple[int, int, bytes]]:
        """The state checkpoints the next step keeps (prefix caching with a checkpoint_interval): for each
        (slot, packed offset, new tokens) stream, every multiple of the interval its new tokens reach, where
        the slot's context is a multiple of 64 away or at the last of its new tokens when it has several (a
        prompt chunk; ops/checkpoints.py: the CUDA path keeps states at chunk boundaries and at each stream's
        last token) and no checkpoint of that prefix exists or is planned (two streams reaching one
        prefix plan it once). At most what the pool can give (free entries and recorded ones, evicted least
        recently used first) and len(checkpoint_tokens): when fewer, each stream's deepest first, a round
        across the streams at a time (a deeper checkpoint restores more of every prompt that reaches it).
        Writes the targets into checkpoint_tokens / checkpoint_entries and returns (entry, length, chain
        hash) of each, to record once the step has run (record) or give back if it fails. A failure inside
        gives back the entries it took."""
        c = self.cache
        if not c.prefix_targets:
            return []
        every, bs, held, index = c.checkpoint_interval, c.block_size, c.slot_blocks, c.slot_blocks.index
        wanted, planned = [], set()  # per stream, its (stream, length, packed token, hash) targets deepest first
        for i, (slot, offset, new) in enumerate(streams):
            ctx, end = c.context_lens[slot], c.context_lens[slot] + len(new)
            first = -(-(ctx + 1) // every) * every
            # (a prompt chunk's last token: the ops keep any stream's, ops/checkpoints.py; not a decode's one token)
            ends = [p for p in range(first, end + 1, every) if (p - ctx) % 64 == 0 or (p == end and len(new) > 1)]
            if not ends:  # no multiple of the interval reached (a decode's one token, mostly)
                continue
            hashes = held.hashes[slot]
            seq = held.tokens[slot] + list(new)
            chain = hashes + chain_hashes(seq[:ends[-1]], bs, hashes[-1] if hashes else b"", len(hashes) * bs)
            targets = []
            for p in reversed(ends):
                h = chain[p // bs - 1]
                if h not in planned and not index.has_entry(h, ()):
                    planned.add(h)
                    targets.append((i, p, offset + p - ctx - 1, h))
            wanted.append(targets)
        room = min(c.prefix_targets, index.available_entries)
        chosen = [t for round_ in itertools.zip_longest(*wanted) for t in round_ if t is not None][:room]
        chosen.sort()  # recorded stream by stream, shallow first: the deeper, the later evicted
        plan = []
        try:
            for _, p, _, h in chosen:
                plan.append((index.new_entry(), p, h))
            write_targets(c, 0, [t for _, _, t, _ in chosen], [e for e, _, _ in plan], c.prefix_targets)
        except BaseException:
            self.record(plan, written=False)
            raise
        return plan

    def record(self, plan: list[tuple[int, int, bytes]], written: bool) -> None:
        """After the step of plan(): its checkpoints become findable (written) or are given back."""
        index = self.cache.slot_blocks.index
        for k, (e, p, h) in enumerate(plan):
            if not written:
                index.give_back(e)
                continue
            try:
                index.add_entry(e, p, h, ())
            except BaseException:  # the entries not recorded go back (the one that raised taken as not recorded)
                self.record(plan[k:], written=False)
                raise

    def restore(self, slot: int, tokens: list[int], limit: int) -> int:
        """Start empty `slot` from the longest kept prefix of `tokens` of at most `limit` tokens: its full
        blocks shared, its partial last block copied into a fresh one (the stream appends to it), its GDN
        states copied from the checkpoint. Returns the tokens restored (0: none usable). The caller holds
        the cache (exclusive) and has validated the tokens; protocol.restore_prefix is the entry point.
        The MTP head's entries come with the blocks (its pools share the block table; a partial block's rows
        are copied too): where they are those of `tokens`, entry p having read tokens[p + 1] up to the last
        restored position (SlotBlocks.head_follows), the head has caught up on the prefix (mtp_context_lens
        = the tokens restored), else it has not (0: the request gets no MTP drafts)."""
        c = self.cache
        held, index = c.slot_blocks, c.slot_blocks.index
        assert c.context_lens[slot] == 0 and not held.blocks[slot], "restore into a slot that holds context"
        if not (c.prefix_caching and limit > 0):
            return 0
        hit = index.lookup(tokens, limit)
        if self.on_lookup is not None:
            self.on_lookup(slot, tokens, hit)
        if hit is None:
            return 0
        bs, n = c.block_size, hit.length
        full, partial = list(hit.blocks[:n // bs]), hit.blocks[n // bs:]
        for b in full:
            index.share(b)
        if partial and c.free_blocks < 1:  # no block to copy the partial one into
            for b in full:
                index.drop(b)
            return 0
        with c.transaction([slot]):
            held.blocks[slot] = blocks = full  # the slot's from here: a failure below drops them (the slot's reset)
            if partial:
                blocks.append(index.take())
            held.adopt(slot, blocks, tokens[:n])
            c.context_lens[slot] = n
            c.block_tables[slot, :len(blocks)] = to_device(int_tensor(blocks, torch.int32), c.device)
            if partial:
                rows = n % bs
                for pool in c.k_caches + c.v_caches + c.mtp_k_caches + c.mtp_v_caches:
                    pool[blocks[-1], :rows].copy_(pool[partial[0], :rows])
                held.head[blocks[-1]] = held.head.get(partial[0], [])[:rows]
            if c.mtp_k_caches and held.head_follows(blocks, tokens, n):
                c.mtp_context_lens[slot] = n
            for pool, entries in zip(c.conv_states + c.gdn_states, c.checkpoint_conv_states + c.checkpoint_gdn_states):
                pool[slot].copy_(entries[hit.entry])
        return n

    def clear(self) -> None:
        """Forget every prefix kept for later prompts (prefix caching; else nothing to do): their cached
        blocks become free, their checkpoint entries unused. Slots keep their contexts and blocks (a prefix
        they reach later is kept again as it fills). The prefix counters are lifetime figures and stay."""
        if self.cache.prefix_caching:
            self.cache.slot_blocks.index.clear()

    def stats(self) -> dict:
        """Prefix caching's counters: lookups, hits and the tokens they restored, cached blocks and
        checkpoints held, evictions, and the checkpoint pool's bytes."""
        c = self.cache
        nbytes = sum(t[0].numel() * t.element_size() * (c.prefix_checkpoints + 1)  # (not the verify entries)
                     for t in c.checkpoint_conv_states + c.checkpoint_gdn_states)
        return {**c.slot_blocks.index.stats(), "checkpoint_bytes": nbytes, "checkpoint_entries": c.prefix_checkpoints}


def checkpoint_buffers(cfg: ModelConfig, entries: int, targets: int, dtype: torch.dtype, device: torch.device):
    """A cache's checkpoint pools and the step's targets (module docstring): per GDN layer a conv pool
    [entries, C, W-1] (model dtype) and a GDN-state pool [entries, HV, K, V] (float32), none when entries is 0;
    checkpoint_tokens [targets] (-1: no target) and checkpoint_entries [targets] (the scratch entry, the last),
    the two rows of checkpoint_targets [2, targets]; None when targets is 0."""
    W, HV, K, V = cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    P, NC, scratch = entries, targets, entries - 1
    conv = [torch.zeros(P, cfg.conv_dim, W - 1, dtype=dtype, device=device) for _ in cfg.linear_layers] if P else []
    gdn = [torch.zeros(P, HV, K, V, dtype=torch.float32, device=device) for _ in cfg.linear_layers] if P else []
    if not NC:
        return conv, gdn, None, None, None
    both = torch.tensor([[-1], [scratch]], dtype=torch.int64, device=device).repeat(1, NC)  # (write_targets: one copy)
    return conv, gdn, both[0], both[1], both


def write_targets(cache, start: int, tokens: list[int], entries: list[int], width: int) -> None:
    """checkpoint_tokens / checkpoint_entries [start, start + width) := tokens / entries, the rest of the width none
    (-1 / the scratch entry): one host-to-device copy into the [2, NC] tensor both are rows of (ordered behind
    the step before on the device's stream, which may still read them: numbers.to_device)."""
    pad = width - len(tokens)
    host = int_tensor(tokens + [-1] * pad + entries + [cache.scratch_checkpoint] * pad).view(2, width)
    cache.checkpoint_targets[:, start:start + width].copy_(to_device(host, cache.device))


def set_verify_targets(cache, tokens: list[int], entries: list[int]) -> None:
    """The verify step's checkpoint targets (past prefix_targets; speculative/verify.py): written only when they
    differ from what the device holds (`cache.verify_targets_held`): a run of verify steps of the same streams and
    draft count keeps one set, with no copy a step. They stay after the step; clear_verify_targets drops them
    before any other step."""
    held = (tuple(tokens), tuple(entries))
    if cache.verify_targets_held == held:
        return
    cache.verify_targets_held = None  # (unknown if the copy fails)
    write_targets(cache, cache.prefix_targets, tokens, entries, cache.verify_entries)
    cache.verify_targets_held = held


def clear_verify_targets(cache) -> None:
    """No verify targets (every token -1) before a step that is not a verify step (the prefill protocol's run and
    launch), so it keeps no verify states; nothing to do when none are held."""
    if cache.verify_entries and cache.verify_targets_held != ():
        cache.verify_targets_held = None
        cache.checkpoint_tokens[cache.prefix_targets:].fill_(-1)
        cache.verify_targets_held = ()
