"""Single-flight across replicas: while one request computes an answer, identical requests wait.

The leader is whoever takes the Redis lock (``SET NX PX``, inside the lookup script) for a key; the
lock expires by itself after ``lock_ttl_s`` if its holder dies. Everyone else polls Redis for the entry
with a growing interval (capped at ``poll_interval_s``) until it appears, the lock disappears without
an entry (the leader failed or its answer was not storable: go to the engine), or ``wait_s`` runs out
(go to the engine). Polling needs no extra connection per waiter, unlike a pub/sub subscription.

Within one process a waiter also listens on an ``asyncio.Event`` that the local leader sets when it is
done, so local followers do not wait for their next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal

from plugins.cache.keys import CacheKey
from plugins.cache.store import CacheStore, RedisUnavailable

_FIRST_POLL_S = 0.002

Outcome = Literal["hit", "leader_gone", "timeout", "redis_error"]


@dataclass
class LocalLeaders:
    """Events of the leaders running in this process, by key digest (shared across reloads)."""

    events: dict[str, asyncio.Event] = field(default_factory=dict)

    def lead(self, digest: str) -> None:
        self.events.setdefault(digest, asyncio.Event())

    def done(self, digest: str) -> None:
        event = self.events.pop(digest, None)
        if event is not None:
            event.set()


async def wait_for_leader(
    store: CacheStore, leaders: LocalLeaders, key: CacheKey, *, wait_s: float, poll_interval_s: float
) -> tuple[Outcome, bytes | None]:
    """Wait, bounded by ``wait_s``, for the answer another request is computing."""
    deadline = time.monotonic() + wait_s
    delay = min(_FIRST_POLL_S, poll_interval_s)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timeout", None
        pause = min(delay, remaining)
        event = leaders.events.get(key.digest)
        if event is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await event.wait()
        else:
            await asyncio.sleep(pause)
        try:
            entry, locked = await store.poll(key)
        except RedisUnavailable:
            return "redis_error", None
        if entry is not None:
            return "hit", entry
        if not locked:
            return "leader_gone", None
        delay = min(delay * 2, poll_interval_s)
