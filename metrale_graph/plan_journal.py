"""The cache's bookkeeping under a plan broadcast (plan_sync.py): rank 0 journals it, the other ranks replay it.

Under tensor parallelism each rank's HybridCache holds its shard of one logical cache (its KV heads, its GDN heads),
so every rank must hold the same blocks and checkpoint entries for the same tokens: the same block ids in the
same slots, the same ref counts, labels and LRU orders, the same entries. A follower schedules nothing, so it
cannot decide any of that itself. Rank 0's engine loop writes every operation that changes the bookkeeping, in
the order it does them, into a `CacheJournal`; the next plan carries the journal, and the follower's
`JournalReplay` does the same operations, in that order, before it runs the plan's step. Everything else a step
does to the bookkeeping (its KV blocks taken, its checkpoints planned and recorded) follows from the step's
streams, which the plan carries, so the replayed cache is rank 0's when the step runs on every rank. Each plan
also carries rank 0's free blocks and available checkpoint entries, which the follower checks after its replay:
a difference is a RuntimeError (the ranks would go on writing other blocks), never a silent divergence.

The operations, each a run of int64s (the plan's `journal`):

    RESET slot                        the scheduler gave the slot back (cache.reset)
    SAVE slot ok                      prefix caching kept the slot's context (cache.save_prefix); ok 0: the copy
                                      failed (the entry it took was given back)
    COMMIT k ids[k]                   the last step launched was committed, its k decodes having read `ids`
                                      (prefix caching labels the blocks they fill with them)
    LOOKUP slot n entry m tokens[m]   a prefix restore looked the prompt up and found n tokens in `entry` (n 0,
                                      entry -1, m 0: nothing); tokens are the prompt's first n and the one after
                                      them where it has one (m = n + 1: the MTP head's entries of a restored prefix
                                      are the prompt's own only if the last one read it, SlotBlocks.head_follows),
                                      which the replay looks up again (at most n of them: the same index finds the
                                      same entry) and restores as rank 0 did
    CLEAR                             every kept prefix forgotten (reset_prefix_cache)

A restore that raises on rank 0 after its lookup (its copies failing) has its slot reset by its transaction and
then given back (RESET): the replay restores and resets the slot, which leaves the same bookkeeping. One that
raises before its lookup journals nothing but the RESET.

Without prefix caching the journal holds only RESETs and a follower commits its step at once (no ids needed).
"""

from __future__ import annotations

from typing import Callable

RESET, SAVE, COMMIT, LOOKUP, CLEAR = 1, 2, 3, 4, 5


def cache_state(cache) -> tuple[int, int]:
    """What a follower's replayed cache must match before each plan's step: (free KV blocks, available checkpoint
    entries; -1 without prefix caching)."""
    entries = cache.slot_blocks.index.available_entries if cache.prefix_caching else -1
    return cache.free_blocks, entries


class CacheJournal:
    """Rank 0: the bookkeeping operations since the last plan, in order, as the plan's int64s (module docstring)."""

    def __init__(self, prefix_caching: bool):
        self.prefix_caching = prefix_caching
        self.ops: list[int] = []

    def take(self) -> list[int]:
        ops, self.ops = self.ops, []
        return ops

    def reset(self, slot: int) -> None:
        self.ops += (RESET, slot)

    def save(self, slot: int, ok: bool) -> None:
        self.ops += (SAVE, slot, int(ok))

    def commit(self, ids: list[int]) -> None:
        """The last step launched was committed with its decodes' `ids` (only with prefix caching: without, the
        followers commit at once)."""
        if self.prefix_caching:
            self.ops += (COMMIT, len(ids), *ids)

    def lookup(self, slot: int, tokens: list[int], hit) -> None:
        """PrefixStore.restore's lookup (its on_lookup): `hit` a prefix_cache.Hit, or None."""
        if hit is None:
            self.ops += (LOOKUP, slot, 0, -1, 0)
        else:
            carried = tokens[:hit.length + 1]
            self.ops += (LOOKUP, slot, hit.length, hit.entry, len(carried), *carried)

    def clear(self) -> None:
        self.ops.append(CLEAR)


class JournalReplay:
    """A follower: rank 0's journal replayed on this rank's cache, and the commit of the step it last ran."""

    def __init__(self, cache, rank: int):
        self.cache, self.rank = cache, rank
        self._pending: tuple[Callable[[list[int]], None], int] | None = None  # (commit, decodes) of the last step

    def stepped(self, commit: Callable[[list[int]], None], decodes: int) -> None:
        """The step just run (its PrefillCall.launch commit and its decodes): committed now without prefix caching,
        else when rank 0's journal says with which ids."""
        if self.cache.prefix_caching:
            self._pending = (commit, decodes)
        else:
            commit([0] * decodes)

    def replay(self, ops: list[int], state: tuple[int, int]) -> None:
        """Do rank 0's operations `ops` in order, then check this cache against rank 0's `state` (cache_state).
        A step of this rank's that rank 0 never committed (it failed there) is dropped: the journal gives its
        slots back. RuntimeError if the cache is not rank 0's then."""
        cache, at = self.cache, 0
        while at < len(ops):
            op = ops[at]
            if op == RESET:
                cache.reset(ops[at + 1])
                at += 2
            elif op == SAVE:
                slot, ok = ops[at + 1:at + 3]
                with cache.exclusive():
                    cache.prefixes.save(slot, written=bool(ok))
                at += 3
            elif op == COMMIT:
                k = ops[at + 1]
                self._commit(ops[at + 2:at + 2 + k])
                at += 2 + k
            elif op == LOOKUP:
                slot, n, entry, m = ops[at + 1:at + 5]
                self._restore(slot, ops[at + 5:at + 5 + m], n, entry)
                at += 5 + m
            elif op == CLEAR:
                cache.clear_prefixes()
                at += 1
            else:
                raise RuntimeError(f"unknown cache journal operation {op} (rank 0 runs another metrale-graph?)")
        self._pending = None
        mine = cache_state(cache)
        if mine != tuple(state):
            self._diverged(f"(free KV blocks, available checkpoint entries) {mine} where rank 0 has {tuple(state)}")

    def _commit(self, ids: list[int]) -> None:
        if self._pending is None:  # this rank's step failed (its slots were reset) where rank 0's did not
            return
        commit, decodes = self._pending
        self._pending = None
        if len(ids) != decodes:
            self._diverged(f"rank 0 committed a step of {len(ids)} decodes, this rank's last step had {decodes}")
        commit(ids)

    def _restore(self, slot: int, tokens: list[int], n: int, entry: int) -> None:
        """Rank 0's restore into `slot`, whose lookup found the first `n` of `tokens` (0: nothing) in `entry`: the
        same lookup (its counters and LRU order) and the same restore here. A restore that raises here after its
        lookup has reset the slot (its transaction): where it raised on rank 0 too, the journal's RESET of the slot
        follows and finds it empty; where it did not, rank 0 holds blocks this rank gave back, which the state
        check names."""
        cache = self.cache
        index = cache.slot_blocks.index
        if not n:
            index.lookups += 1  # (a lookup that found nothing changes only the counter)
            return
        found = []
        cache.prefixes.on_lookup = lambda _slot, _tokens, hit: found.append(hit)
        try:
            with cache.exclusive():
                cache.prefixes.restore(slot, tokens, n)
        except Exception:
            pass
        finally:
            cache.prefixes.on_lookup = None
        hit = found[0] if found else None
        if hit is None or (hit.length, hit.entry) != (n, entry):
            got = "nothing" if hit is None else f"{hit.length} tokens in entry {hit.entry}"
            self._diverged(f"restoring slot {slot}, rank 0 found {n} tokens in entry {entry}, this rank {got}")

    def _diverged(self, what: str) -> None:
        raise RuntimeError(f"the prefix cache of tensor-parallel rank {self.rank} diverged from rank 0's: {what}")
