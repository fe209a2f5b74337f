"""The KV blocks each slot of a HybridCache (cache.py) holds, and what they hold: host bookkeeping only.

    blocks[slot]: the slot's blocks, in order (its block-table row on the device, cache.block_tables)
    tokens[slot], hashes[slot]: with prefix caching, the slot's tokens and its full blocks' chain hashes
    index: the PrefixIndex (prefix_cache.py) every block goes through: ref counts, the free lists, the
        labels (a full block's chain hash, a kept prefix's key) that let a later prompt find it; and
        prefix caching's checkpoint entries

    head[block]: the token each of the block's rows' MTP head entries read (speculative/drafting.py: the entry
        of position p reads token p + 1), rows 0 .. len - 1 written; what lets a restored prefix keep MTP drafts
        (cache_prefixes.PrefixStore.restore). Emptied when the block is taken afresh.

A block a slot holds is one ref; a slot's blocks go back when it is reset (`release`). Nothing here touches
the device: the cache writes the block table from what `take` returns.
"""

from __future__ import annotations

from .prefix_cache import PrefixIndex, chain_hashes


class SlotBlocks:
    """Each slot's KV blocks, tokens and chain hashes over one PrefixIndex (module docstring)."""

    def __init__(self, num_slots: int, num_blocks: int, block_size: int, prefix_checkpoints: int):
        self.block_size = block_size
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self.index = PrefixIndex(num_blocks, block_size, prefix_checkpoints)  # block refs and keys, checkpoints
        # with prefix caching, each slot's tokens and its full blocks' chain hashes (what its blocks hold)
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self.hashes: list[list[bytes]] = [[] for _ in range(num_slots)]
        self.head: dict[int, list[int]] = {}  # the MTP head's entries in each block (module docstring)

    @property
    def free_blocks(self) -> int:
        """Blocks a stream may still be given: free ones, and with prefix caching cached ones no slot holds."""
        return self.index.free_blocks

    def needs(self, growth, context_lens: list[int]) -> list[tuple[int, int]]:
        """(slot, blocks) of each slot of the (slot, new tokens) pairs of `growth` (distinct slots) that must
        still be given blocks to hold its new tokens past its context, those above 0."""
        bs, context, blocks = self.block_size, context_lens, self.blocks
        needs = [(slot, -(-(context[slot] + n) // bs) - len(blocks[slot])) for slot, n in growth]
        return [sn for sn in needs if sn[1] > 0]

    def needs_to(self, slots: list[int], ends: list[int]) -> list[tuple[int, int]]:
        """needs() of distinct `slots` growing to `ends[i]` tokens each (one pass; a tuple only for a slot whose blocks
        hold fewer rows than its end: a decode step's few)."""
        bs, blocks = self.block_size, self.blocks
        return [(slot, -(-end // bs) - len(blocks[slot])) for slot, end in zip(slots, ends) if end > len(blocks[slot]) * bs]

    def take(self, needs: list[tuple[int, int]], width: int) -> tuple[list[int], list[int]]:
        """Give each (slot, blocks) of `needs` that many more blocks (the caller has checked free_blocks).
        Returns (entries, taken): the flat block-table entries (slot * width + position, width the table's
        row length) and the block each one now holds."""
        total = sum(n for _, n in needs)
        taken = self.index.take_many(total)
        if self.head:  # (only with an MTP head's notes)
            for b in taken:
                self.head.pop(b, None)
        blocks, entries, at = self.blocks, [], 0
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
        return entries, taken

    def record(self, slot: int, new: list[int]) -> None:
        """Append `new` to slot's tokens; label each block they fill by its chain hash."""
        toks, hashes, bs = self.tokens[slot], self.hashes[slot], self.block_size
        toks.extend(new)
        start = len(hashes) * bs
        if len(toks) < start + bs:  # no block filled (most decode steps)
            return
        fresh = chain_hashes(toks, bs, hashes[-1] if hashes else b"", start)
        for k, h in enumerate(fresh, len(hashes)):
            self.index.label(self.blocks[slot][k], h)
        hashes.extend(fresh)

    def head_written(self, slot: int, start: int, tokens: list[int]) -> None:
        """The MTP head wrote slot's entries of positions start .. start + len(tokens) - 1, entry p reading
        tokens[p - start]; start is where the slot's entries end (its blocks from there on are its own)."""
        bs = self.block_size
        for p, t in enumerate(tokens, start):
            rows = self.head.setdefault(self.blocks[slot][p // bs], [])
            if len(rows) >= p % bs:  # (else a row before it is not written: the block's later rows do not count)
                del rows[p % bs:]
                rows.append(t)

    def head_follows(self, blocks: list[int], tokens: list[int], n: int) -> bool:
        """Whether `blocks` hold the MTP head's entries of positions 0 .. n - 1 as `tokens` (at least n + 1
        of them) would have them written: entry p read tokens[p + 1]."""
        bs = self.block_size
        return all(tokens[k * bs + 1:min(n, (k + 1) * bs) + 1] == self.head.get(b, [])[:min(n - k * bs, bs)]
                   for k, b in enumerate(blocks[:-(-n // bs)]))

    def adopt(self, slot: int, blocks: list[int], tokens: list[int]) -> None:
        """Empty `slot` now holds `blocks` (refs already taken), which hold `tokens` (a restored prefix)."""
        self.blocks[slot] = blocks
        self.tokens[slot] = list(tokens)
        self.hashes[slot] = chain_hashes(self.tokens[slot], self.block_size)

    def release(self, slot: int) -> None:
        """Drop slot's blocks (last first) and forget its tokens: the slot holds nothing."""
        for b in reversed(self.blocks[slot]):
            self.index.drop(b)
        self.blocks[slot] = []
        self.tokens[slot], self.hashes[slot] = [], []
