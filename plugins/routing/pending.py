"""Blocks on their way: what a request was just placed to store on a worker, before the worker's KV events
say it holds them.

A prompt's repeat that arrives while the first request is still queued or prefilling finds nothing in
the index. Placed as cold, it often goes to the other worker, which then caches the same prefix as well:
the pair holds one prefix fewer, and the repeat misses. Counting the blocks already placed makes the
repeat follow the first request, as approximate affinity's key or SGLang's router tree (which inserts a
prompt when it routes it) would. An entry lives ``lifetime_s``, the time within which the KV feed expects
the worker's events (``kv_events.expire_s``); once the event has come the index answers first, so an
entry only matters while it is pending. At most ``max_entries`` (worker, block) entries, the oldest
dropped first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence


class PendingBlocks:
    """(worker, block hash) -> when it was placed, oldest first."""

    __slots__ = ("_clock", "_placed", "lifetime_s", "max_entries")

    def __init__(self, lifetime_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.lifetime_s = lifetime_s
        self.max_entries = max_entries
        self._clock = clock
        self._placed: OrderedDict[tuple[str, int], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._placed)

    def add(self, worker: str, hashes: Sequence[int]) -> None:
        """``worker`` was sent a request that will store ``hashes``."""
        now = self._clock()
        placed = self._placed
        for block in hashes:
            key = (worker, block)
            placed[key] = now
            placed.move_to_end(key)
        oldest = now - self.lifetime_s
        while placed and (len(placed) > self.max_entries or next(iter(placed.values())) < oldest):
            placed.popitem(last=False)

    def extend(self, worker: str, hashes: Sequence[int], held: int) -> int:
        """``held`` (the blocks the index says ``worker`` holds from the prompt's start) plus the blocks
        right after them that are on their way there."""
        oldest = self._clock() - self.lifetime_s
        placed = self._placed
        while held < len(hashes):
            at = placed.get((worker, hashes[held]))
            if at is None or at < oldest:
                break
            held += 1
        return held
