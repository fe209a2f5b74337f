"""Prefix caching's bookkeeping (host side): which KV blocks and GDN state checkpoints hold a prefix.

A hit for a hybrid model needs two things at the same token: the attention layers' KV blocks and
every GDN layer's conv and recurrent state. So:

- KV blocks are ref-counted (the slots holding them) and carry content keys: a full block the chain
  hash of its tokens and its parent's (`chain_hashes`), a block holding a prefix's partial last block
  also that prefix's key. A block whose last holder lets go stays findable by its keys until the pool
  needs it (LRU), and any number of slots share it without copies; a block without keys is plain free.
- State checkpoints are entries of a bounded pool (the device tensors are the cache's): each holds
  the GDN states after some prefix, keyed by that prefix. They are taken least recently used first.

A prefix of L tokens is usable when its checkpoint entry exists and every block it spans still holds
its content: the full blocks by their chain hashes, the partial last one (L not a multiple of the
block size) by the prefix's key; the partial block is copied into a fresh one (copy on write), since
the new stream appends to it. Nothing here touches device memory: cache_prefixes.PrefixStore does the copies.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from array import array

Key = bytes


def _digest(*parts: bytes) -> Key:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


def _tokens_bytes(tokens) -> bytes:
    return array("q", tokens).tobytes()


def chain_hashes(tokens, block_size: int, parent: Key = b"", start: int = 0) -> list[Key]:
    """The chain hash of every full block of `tokens[start:]` (start a multiple of block_size, `parent`
    the hash of the block before it, b"" at the start): hash_k = H(hash_{k-1}, tokens of block k)."""
    out, h = [], parent
    for a in range(start, len(tokens) - block_size + 1, block_size):
        h = _digest(b"B", h, _tokens_bytes(tokens[a:a + block_size]))
        out.append(h)
    return out


def prefix_key(full_hash: Key, tail) -> Key:
    """The key of a prefix: its full blocks' chain hash and the tokens of its partial last block."""
    return _digest(b"P", full_hash, _tokens_bytes(tail))


@dataclass(frozen=True)
class Hit:
    """A usable cached prefix: `length` tokens, the blocks holding them (the last one partial when
    length is not a multiple of the block size) and the checkpoint entry with their GDN states."""
    length: int
    blocks: tuple[int, ...]
    entry: int


@dataclass
class _Entry:
    length: int
    full: Key  # chain hash of the prefix's full blocks
    tail: tuple[int, ...]  # the tokens of its partial last block


class PrefixIndex:
    """KV blocks (ref counts, content keys, LRU) and checkpoint entries (keys, LRU) of one cache."""

    def __init__(self, num_blocks: int, block_size: int, num_entries: int):
        self.block_size, self.num_entries = block_size, num_entries
        self.refs = [0] * num_blocks
        self._keys: list[set[Key]] = [set() for _ in range(num_blocks)]
        self._by_key: dict[Key, int] = {}
        self._plain = list(range(num_blocks - 1, -1, -1))  # free blocks without keys; pop() gives low ids first
        self._cached: OrderedDict[int, None] = OrderedDict()  # free blocks with keys, least recently freed first
        # checkpoint entries
        self._entries: dict[int, _Entry] = {}
        self._entry_lru: OrderedDict[int, None] = OrderedDict()
        self._by_prefix: dict[Key, dict[tuple[int, ...], int]] = {}  # full-blocks hash -> tail -> entry
        self._free_entries = list(range(num_entries - 1, -1, -1))
        self.hits = self.lookups = self.hit_tokens = self.evicted_blocks = self.evicted_entries = 0

    # KV blocks ------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks a caller may take: plain free ones and cached ones no slot holds."""
        return len(self._plain) + len(self._cached)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def take(self) -> int:
        """A block for new content (ref 1): a plain free one, else the least recently freed cached one,
        whose keys it loses. The caller has checked free_blocks."""
        if self._plain:
            b = self._plain.pop()
        else:
            b, _ = self._cached.popitem(last=False)
            self._forget(b)
            self.evicted_blocks += 1
        self.refs[b] = 1
        return b

    def take_many(self, n: int) -> list[int]:
        """n blocks, as n calls of take() give them (the plain free ones first, lowest id first)."""
        plain = self._plain
        if n > len(plain):
            return [self.take() for _ in range(n)]
        taken = plain[len(plain) - n:][::-1]  # pop() order
        del plain[len(plain) - n:]
        refs = self.refs
        for b in taken:
            refs[b] = 1
        return taken

    def share(self, b: int) -> None:
        """One more holder of block b (a cached block leaves the free LRU)."""
        if self.refs[b] == 0:
            del self._cached[b]
        self.refs[b] += 1

    def drop(self, b: int) -> None:
        """One holder fewer; a block nobody holds becomes free (cached if it has keys)."""
        assert self.refs[b] > 0, f"block {b} dropped more often than held"
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if self._keys[b]:
                self._cached[b] = None
            else:
                self._plain.append(b)

    def label(self, b: int, key: Key) -> None:
        """Record that held block b holds the content of `key` (a chain hash, or a prefix key for a
        partial block). A key another block already holds stays with that block."""
        if key not in self._by_key:
            self._by_key[key] = b
            self._keys[b].add(key)

    def block_of(self, key: Key) -> int | None:
        return self._by_key.get(key)

    def _forget(self, b: int) -> None:
        for key in self._keys[b]:
            del self._by_key[key]
        self._keys[b] = set()

    # checkpoint entries ---------------------------------------------------------------------------
    @property
    def available_entries(self) -> int:
        """Entries new_entry can still give: free ones and recorded ones (evicted least recently used first).
        Entries taken and neither recorded nor given back yet are not among them."""
        return len(self._free_entries) + len(self._entry_lru)

    def new_entry(self) -> int:
        """An entry to write a checkpoint into: a free one, else the least recently used one (forgotten
        now). The caller has checked available_entries, and records the entry with add_entry once the
        state is written, or gives it back."""
        assert self.available_entries, "new_entry() called without an available entry"
        if self._free_entries:
            return self._free_entries.pop()
        e, _ = self._entry_lru.popitem(last=False)
        self._unlink(e)
        self.evicted_entries += 1
        return e

    def add_entry(self, e: int, length: int, full: Key, tail) -> None:
        """Entry e now holds the states after the prefix (full, tail) of `length` tokens; an entry of the
        same prefix already there wins (e is given back)."""
        tail = tuple(tail)
        at = self._by_prefix.setdefault(full, {})
        if tail in at:
            self.give_back(e)
            return
        at[tail] = e
        self._entries[e] = _Entry(length, full, tail)
        self._entry_lru[e] = None

    def give_back(self, e: int) -> None:
        """An entry taken with new_entry and not recorded (its step failed, or a duplicate)."""
        self._free_entries.append(e)

    def has_entry(self, full: Key, tail) -> bool:
        return tuple(tail) in self._by_prefix.get(full, {})

    def _unlink(self, e: int) -> None:
        meta = self._entries.pop(e)
        at = self._by_prefix[meta.full]
        del at[meta.tail]
        if not at:
            del self._by_prefix[meta.full]

    def clear(self) -> None:
        """Forget every kept prefix: no block keeps a key (cached free blocks become plain free ones; blocks
        slots hold stay theirs, no longer findable) and no checkpoint entry is recorded. The counters are
        kept (lifetime figures)."""
        self._keys = [set() for _ in self.refs]
        self._by_key.clear()
        self._plain = sorted(set(self._plain) | set(self._cached), reverse=True)
        self._cached.clear()
        self._entries.clear()
        self._entry_lru.clear()
        self._by_prefix.clear()
        self._free_entries = list(range(self.num_entries - 1, -1, -1))

    # lookup ---------------------------------------------------------------------------------------
    def lookup(self, tokens, limit: int) -> Hit | None:
        """The longest usable cached prefix of `tokens` of at most `limit` tokens (module docstring)."""
        self.lookups += 1
        bs = self.block_size
        full = chain_hashes(tokens[:limit - limit % bs], bs)
        for k in range(len(full), -1, -1):  # prefixes whose full blocks are the first k
            h = full[k - 1] if k else b""
            at = self._by_prefix.get(h)
            if not at:
                continue
            blocks = [self._by_key.get(x) for x in full[:k]]
            if any(b is None for b in blocks):
                continue  # a full block was evicted: no prefix through it
            best = None
            for tail, e in at.items():
                n = k * bs + len(tail)
                if n <= limit and (best is None or n > best[0]) and list(tokens[k * bs:n]) == list(tail):
                    b = self._by_key.get(prefix_key(h, tail)) if tail else None
                    if not tail or b is not None:
                        best = (n, e, b)
            if best is not None:
                n, e, b = best
                self._entry_lru.move_to_end(e)
                self.hits += 1
                self.hit_tokens += n
                return Hit(n, tuple(blocks) + ((b,) if b is not None else ()), e)
        return None

    def stats(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "hit_tokens": self.hit_tokens,
                "cached_blocks": len(self._cached), "checkpoints": len(self._entries),
                "evicted_blocks": self.evicted_blocks, "evicted_checkpoints": self.evicted_entries}
