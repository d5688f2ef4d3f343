"""The cache's writes after a reply: storing an answer, rewriting an entry with its body, and releasing a
single-flight lock. None delays a reply: each is a callback on the batched Redis command (no task per
miss), or a task when Redis must first load the script or a release must retry; together they are
bounded by ``max_pending_writes`` (past it an answer is not stored), and ``drain`` waits for them at
shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any

from gateway.ops.tasks import stop_if_cancelled
from plugins.cache.config import CacheConfig
from plugins.cache.keys import CacheKey
from plugins.cache.shared import CacheShared
from plugins.cache.store import CacheStore, RedisUnavailable, encode_entry


class CacheWrites:
    """The background writes of one cache plugin instance (its config, its store)."""

    def __init__(self, config: CacheConfig, store: CacheStore, shared: CacheShared) -> None:
        self.config = config
        self.store = store
        self._shared = shared
        self.metrics = shared.metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self._sent = 0  # writes sent as callbacks, not yet answered

    @property
    def full(self) -> bool:
        """Whether ``max_pending_writes`` are under way: a new store is then dropped, not queued."""
        return len(self._tasks) + self._sent >= self.config.max_pending_writes

    def store_answer(self, key: CacheKey, lock_token: bytes | None, model: str, entry: bytes) -> None:
        """Store ``entry`` under ``key`` (for ``model``'s TTL) and release the lock this request holds,
        if any: on success the waiting requests read the entry; on a failure the lock is released."""
        ttl_ms = self.config.ttl_for(model) * 1000

        def done(ok: bool | None) -> None:
            self._sent -= 1
            if ok is None:
                self._spawn(self._store(key, lock_token, model, entry, ttl_ms))
                return
            if ok:
                if lock_token is not None:
                    self._shared.leaders.done(key.digest)
                self._stored(model, entry)
            elif lock_token is not None:  # the lock outlives this failure in Redis; see release
                self.release_soon(key, lock_token)

        if self.store.store_soon(key, entry, ttl_ms, lock_token, done):
            self._sent += 1
        elif lock_token is not None:  # the breaker is open: nothing was sent
            self.release_soon(key, lock_token)

    async def _store(self, key: CacheKey, lock_token: bytes | None, model: str, entry: bytes, ttl_ms: int) -> None:
        try:
            await self.store.store(key, entry, ttl_ms, lock_token)
        except RedisUnavailable:
            # Counted by the store. The lock (if any) outlives this failure in Redis; see release.
            if lock_token is not None:
                await self.release(key, lock_token)
            return
        finally:
            if lock_token is not None:
                self._shared.leaders.done(key.digest)
        self._stored(model, entry)

    def _stored(self, model: str, entry: bytes) -> None:
        self.metrics.stores.labels(model).inc()
        self.metrics.bytes.labels("stored").inc(len(entry))

    def keep_body(self, key: CacheKey, read: bytes, body: bytes, created: float, chunks: bytes) -> None:
        """Write the entry ``read`` (created at ``created``, of the events ``chunks``) back with the answer's
        ``body`` added, if the key still holds it; dropped when it is larger than an entry may be, the
        writes are full, or this process is already writing that key's body (hits that read the entry
        before that write landed all would: one rewrite of up to ``max_value_bytes`` each)."""
        replacing, name = self._shared.replacing, key.entry
        if name in replacing or self.full:
            return
        entry = encode_entry(body, created, chunks)
        if len(entry) > self.config.max_value_bytes:
            return

        def done(ok: bool | None) -> None:
            self._sent -= 1
            if ok is None:
                self._spawn(self._replace(key, entry, read))
                return
            replacing.discard(name)
            if ok:
                self.metrics.bytes.labels("stored").inc(len(entry))

        replacing.add(name)
        if self.store.replace_soon(key, entry, read, done):
            self._sent += 1
        else:  # the breaker is open: nothing was sent
            replacing.discard(name)

    async def _replace(self, key: CacheKey, entry: bytes, read: bytes) -> None:
        try:
            with contextlib.suppress(RedisUnavailable):  # counted by the store; the entry stays as it was
                await self.store.replace(key, entry, read)
                self.metrics.bytes.labels("stored").inc(len(entry))
        finally:
            self._shared.replacing.discard(key.entry)

    def release_soon(self, key: CacheKey, token: bytes, *, local_leader: bool = True) -> None:
        self._spawn(self.release(key, token, local_leader=local_leader))

    async def release(self, key: CacheKey, token: bytes, *, local_leader: bool = True) -> None:
        """Release this request's single-flight lock, retrying while Redis is unreachable: a lock left
        behind would make every identical request wait out ``coalesce_wait_s`` for an answer that never
        comes, until the lock expires (``lock_ttl_s``). Bounded by that expiry; the release is
        token-checked, so a lock someone else took since is never touched."""
        if local_leader:
            self._shared.leaders.done(key.digest)
        deadline = time.monotonic() + self.config.lock_ttl_s
        delay = 0.05
        while True:
            try:
                await self.store.release(key, token)
                return
            except RedisUnavailable:
                stop_if_cancelled()  # drain cancelled it: a Redis read cut by that comes out as this error
                if time.monotonic() + delay >= deadline:
                    return  # it expires by itself now
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.breaker_cooldown_s)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait (bounded) for the writes under way; releases still waiting for Redis are cancelled, their
        locks expire by themselves."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=max(1.0, self.config.timeout_ms / 1000 * 4))
            for task in pending:
                task.cancel()
