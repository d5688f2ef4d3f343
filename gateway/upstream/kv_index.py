"""Which KV cache blocks each worker holds, learned from its KV cache events: a pure data structure.

A block is named by its hash as vLLM publishes it (the last 8 bytes of the block's digest, an int).
Each worker's blocks are a multiset: vLLM does not de-duplicate physical copies of a block (two
``BlockStored`` for one hash, later two ``BlockRemoved``), so a block is held while its count is
above zero, and dropping one copy must not forget the other.

Memory is bounded by ``max_entries`` (one entry per worker and block hash, whatever its count): when a
store would go past it, the least recently stored entries are forgotten first (an index that forgets
a block predicts a miss where the worker may still hit, the safe direction). ``BYTES_PER_ENTRY`` is the
measured cost of one entry (``tests/upstream/test_kv_index.py`` checks it with ``tracemalloc``), so the
bound in bytes is ``max_entries * BYTES_PER_ENTRY``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

#: Measured bytes per (worker, block) entry on CPython 3.11, 64-bit: the LRU's node and key tuple, the
#: worker's count dict slot and the hash int. The tracemalloc check keeps this number honest.
BYTES_PER_ENTRY = 320


class BlockIndex:
    """Per worker, the multiset of block hashes it holds, with one LRU bound over all workers."""

    __slots__ = ("_lru", "_workers", "evicted", "max_entries")

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._workers: dict[str, dict[int, int]] = {}  # worker -> block hash -> copies held
        self._lru: OrderedDict[tuple[str, int], None] = OrderedDict()  # oldest store first
        self.evicted = 0  # entries forgotten for the bound (a gauge of whether it is too small)

    def __len__(self) -> int:
        return len(self._lru)

    def blocks(self, worker: str) -> int:
        """How many distinct blocks ``worker`` holds."""
        held = self._workers.get(worker)
        return len(held) if held is not None else 0

    def workers(self) -> list[str]:
        return list(self._workers)

    def store(self, worker: str, hashes: Iterable[int]) -> None:
        """``worker`` stored one copy of each block; the entries become the most recently stored."""
        held = self._workers.setdefault(worker, {})
        lru = self._lru
        for block in hashes:
            held[block] = held.get(block, 0) + 1
            key = (worker, block)
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
        while len(lru) > self.max_entries:
            (old_worker, old_block), _ = lru.popitem(last=False)
            self._forget(old_worker, old_block)
            self.evicted += 1

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        """``worker`` evicted one copy of each block (unknown blocks are ignored: the index may have
        forgotten them, or the event may belong to a store from before the index started)."""
        held = self._workers.get(worker)
        if held is None:
            return
        for block in hashes:
            count = held.get(block)
            if count is None:
                continue
            if count > 1:
                held[block] = count - 1
            else:
                del held[block]
                del self._lru[(worker, block)]
        if not held:
            del self._workers[worker]

    def clear(self, worker: str) -> int:
        """Forget everything ``worker`` holds (a restart, ``AllBlocksCleared``, a resync); returns how
        many blocks were dropped."""
        held = self._workers.pop(worker, None)
        if not held:
            return 0
        lru = self._lru
        for block in held:
            del lru[(worker, block)]
        return len(held)

    def prefix_blocks(self, worker: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a prompt's chained block hashes, in order) ``worker`` holds from the
        start: vLLM reuses a cached prefix only up to the first block it lacks."""
        held = self._workers.get(worker)
        if held is None:
            return 0
        n = 0
        for block in hashes:
            if block not in held:
                break
            n += 1
        return n

    def copies(self, worker: str, block: int) -> int:
        held = self._workers.get(worker)
        return held.get(block, 0) if held is not None else 0

    def _forget(self, worker: str, block: int) -> None:
        held = self._workers[worker]
        del held[block]
        if not held:
            del self._workers[worker]
