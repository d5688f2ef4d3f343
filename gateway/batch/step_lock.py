"""The lock a replica holds while it runs one of a batch's one-off steps (``Lifecycle``: validate, finalize).

A redis-py ``Lock`` (``SET NX PX`` with a token of its own; deleted and extended only by its holder, each
in one Lua script), taken for ``lease_s`` and renewed every third of it while the step runs, as the line
leases are (``Runner``): a step that outlasts ``lease_s`` (a large input on a busy replica) keeps it, and no
other replica runs the step meanwhile. A holder that stalls past its lease (an event loop held up) can
still lose it to another replica: the step asks ``held`` before each write and stops when it is no longer
its lock, and letting go never deletes the lock of the replica that took it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from gateway.batch.redis_errors import REDIS_ERRORS

log = logging.getLogger(__name__)


class StepLock:
    """One replica's hold on a step's lock, from ``hold`` until its step ends."""

    def __init__(self, lock: Lock) -> None:
        self._lock = lock
        self._lost = False
        self._ended = False  # the step is over: renew no more

    async def held(self) -> bool:
        """Whether the lock is still this holder's: asked before the step writes."""
        if self._lost:
            return False
        try:
            self._lost = not await self._lock.owned()
        except REDIS_ERRORS:  # unknown is not held: the step is safe to run again, a write twice is not
            return False
        return not self._lost

    async def renew(self) -> None:
        """Extend the lock to ``lease_s`` from now every third of it, until it is lost or the step ends."""
        timeout = float(self._lock.timeout or 0)
        while not (self._lost or self._ended):
            await asyncio.sleep(timeout / 3)
            if self._ended:
                return
            try:
                await self._lock.reacquire()
            except LockError:  # lapsed (and maybe taken over): the step stops at its next write
                self._lost = True
            except REDIS_ERRORS as exc:  # tried again; the lock may lapse meanwhile, ``held`` tells
                log.warning("lock %s not renewed (%s)", self._lock.name, exc)

    def end(self) -> None:
        """The step is over: the renewal stops at its next turn. Cancelling it is not enough: redis-py can
        swallow a cancellation that lands inside a command (it did in about one in twenty here), and the
        loop then renewed the lock for ever, with its step's ``hold`` waiting on it."""
        self._ended = True

    async def release(self) -> None:
        """Let go, deleting the lock only while it is this holder's."""
        with contextlib.suppress(LockError):
            await self._lock.release()


@contextlib.asynccontextmanager
async def hold(redis: aioredis.Redis, key: str, lease_s: float, owner: str) -> AsyncIterator[StepLock | None]:
    """The lock at ``key``, held and renewed until the block ends; None when another replica holds it."""
    lock = Lock(redis, key, timeout=lease_s, blocking=False, thread_local=False)
    if not await lock.acquire(token=f"{owner}:{uuid.uuid4().hex}"):
        yield None
        return
    step = StepLock(lock)
    renewal = asyncio.create_task(step.renew())
    try:
        yield step
    finally:
        step.end()
        renewal.cancel()
        # Ended before letting go, but never waited on for longer than a lease: a renewal stuck in a
        # Redis call ends with the client's socket timeout, and the flag then ends its loop. A
        # cancellation of this task still goes through.
        await asyncio.wait([renewal], timeout=lease_s)
        await step.release()
