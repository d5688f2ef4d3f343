"""Redis access for the cache: one command per operation, every call bounded, a breaker in front.

Each request-path operation is a single command (a Lua script where several keys must change
together), sent through the process's ``RedisPipeline`` (the commands of concurrent requests share
one pipeline per event-loop turn) and bounded so that a slow or paused Redis costs at most
``timeout_s`` per call (``gateway.infra.deadlines``: ``asyncio.timeout``'s behaviour, with the store's
calls on one timer; the socket timeouts of the pooled client are the same value, and the outer bound
also covers connecting and the client library's own retries). Any failure is reported to the circuit breaker and
raised as ``RedisUnavailable``: the plugin then steps aside and the request goes to the engine.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from gateway.infra.deadlines import Deadlines
from gateway.infra.redis_api import RedisPipeline
from plugins.cache.breaker import CircuitBreaker
from plugins.cache.keys import CacheKey

T = TypeVar("T")

# An entry is: format byte, creation time (unix seconds, big-endian double), then for format 1 the
# response body bytes; for format 2 the body's length (big-endian u32), the body, and the stream events
# the answer first came as (their JSON, one per line; empty when it was not streamed or they did not fit);
# for format 3 (a streamed answer stored as its events only, not parsed when stored) the id prefix's
# length (big-endian u32), the prefix of the answer's id, and the events.
_ENTRY_FORMAT = b"\x02"
_EVENTS_FORMAT = b"\x03"
_HEADER = struct.Struct(">d")
_HEADER_SIZE = 1 + _HEADER.size
_LENGTH = struct.Struct(">I")


class Entry(NamedTuple):
    """A stored answer: when it was made, its body, and the events it first streamed as (b"" when
    none); an entry of events only has an empty body and the prefix of the answer's id."""

    created: float
    body: bytes
    chunks: bytes
    id_prefix: str = ""


# Hit: the value. Miss: take the single-flight lock when asked ("lock"), or report whether another
# request holds it ("peek"). One round trip either way.
_LOOKUP = """
local v = redis.call('GET', KEYS[1])
if v then return {1, v} end
if ARGV[3] == 'lock' then
  if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2} end
  return {3}
end
if redis.call('EXISTS', KEYS[2]) == 1 then return {3} end
return {0}
"""
# Store the entry and, if this request still holds the lock, release it.
_STORE = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""
# Give an entry its answer's body (an entry of events only, read by a hit that is not streamed): only
# while the key holds the entry that was read (its head: format, creation time, length field), with the
# expiry it has; an entry stored since, or gone, is left as it is.
_REPLACE = """
if redis.call('GETRANGE', KEYS[1], 0, string.len(ARGV[2]) - 1) ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_STATUS: dict[int, Literal["miss", "hit", "leader", "locked"]] = {0: "miss", 1: "hit", 2: "leader", 3: "locked"}


class RedisUnavailable(Exception):
    """Redis failed or timed out, or the breaker is open: the cache steps aside for this call."""


@dataclass(frozen=True, slots=True)
class Lookup:
    """``hit`` (with the raw entry), ``leader`` (this request holds the lock), ``locked`` (another
    request is computing the answer) or ``miss`` (nobody is)."""

    status: Literal["miss", "hit", "leader", "locked"]
    entry: bytes | None = None


def encode_entry(body: bytes, created: float, chunks: bytes = b"") -> bytes:
    """An entry for ``body`` (the response JSON) and, optionally, ``chunks``: its stream events (JSON,
    one per line), so a streaming hit replays them as they first came."""
    return _ENTRY_FORMAT + _HEADER.pack(created) + _LENGTH.pack(len(body)) + body + chunks


def encode_events_entry(id_prefix: str, created: float, chunks: bytes) -> bytes:
    """An entry for a streamed answer kept as its ``chunks`` only (JSON, one per line): the answer is
    assembled from them when a hit needs it as an object. ``id_prefix``: its id's (``chatcmpl-``)."""
    prefix = id_prefix.encode()
    return _EVENTS_FORMAT + _HEADER.pack(created) + _LENGTH.pack(len(prefix)) + prefix + chunks


def decode_entry(raw: bytes) -> Entry | None:
    """The entry, or None for a value this version does not understand (a miss)."""
    if len(raw) <= _HEADER_SIZE:
        return None
    created: float = _HEADER.unpack_from(raw, 1)[0]
    if raw[:1] == b"\x01":  # written before stream events were kept
        return Entry(created, raw[_HEADER_SIZE:], b"")
    if raw[:1] not in (_ENTRY_FORMAT, _EVENTS_FORMAT) or len(raw) < _HEADER_SIZE + _LENGTH.size:
        return None
    start = _HEADER_SIZE + _LENGTH.size
    end = start + _LENGTH.unpack_from(raw, _HEADER_SIZE)[0]
    if end > len(raw):
        return None
    if raw[:1] == _EVENTS_FORMAT:
        if end == len(raw):
            return None
        try:
            return Entry(created, b"", raw[end:], raw[start:end].decode())
        except UnicodeDecodeError:
            return None
    return Entry(created, raw[start:end], raw[end:])


def entry_head(raw: bytes) -> bytes:
    """What tells one stored entry from another of the same key: its format, its creation time (a
    float of the clock's resolution) and the length field after them."""
    return raw[: _HEADER_SIZE + _LENGTH.size]


class CacheStore:
    """The cache's Redis operations. ``on_error(op)`` is called for each failure (metrics)."""

    def __init__(
        self,
        client: aioredis.Redis,
        pipeline: RedisPipeline,
        admin_client: aioredis.Redis,
        breaker: CircuitBreaker,
        timeout_s: float,
        on_error: Callable[[str], None],
    ) -> None:
        self._client = client
        self._pipeline = pipeline  # the request path's commands, batched with other requests'
        self._admin = admin_client
        self.breaker = breaker
        self.timeout_s = timeout_s
        self._bounds = Deadlines(timeout_s)
        self._on_error = on_error
        self._lookup = client.register_script(_LOOKUP)
        self._store = client.register_script(_STORE)
        self._release = client.register_script(_RELEASE)
        self._replace = client.register_script(_REPLACE)

    @property
    def available(self) -> bool:
        """False while the breaker is open (a cheap check before doing any work for Redis)."""
        return self.breaker.state != "open"

    def _failed(self, op: str) -> None:
        self.breaker.failure()
        self._on_error(op)

    async def _call(self, op: str, make: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            raise RedisUnavailable(f"{op}: circuit breaker open")
        try:
            with self._bounds.bound():
                result = await make()
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(op)
            raise RedisUnavailable(f"{op}: {type(exc).__name__}") from exc
        self.breaker.success()
        return result

    async def warm_up(self) -> None:
        """Load the scripts and open a connection, so the first request does not pay for it."""
        sources = [script.script for script in (self._lookup, self._store, self._release, self._replace)]

        async def load() -> None:
            for source in sources:
                await self._client.script_load(source)

        await self._call("warm_up", load)

    async def lookup(self, key: CacheKey, *, lock_token: bytes | None, lock_ttl_ms: int) -> Lookup:
        mode = b"lock" if lock_token else b"peek"
        args: list[bytes | int] = [lock_token or b"", lock_ttl_ms, mode]
        keys = [key.entry, key.lock]
        reply: Any = await self._call("lookup", lambda: self._pipeline.evalsha(self._lookup, keys, args))
        status = _STATUS[int(reply[0])]
        return Lookup(status, reply[1] if status == "hit" else None)

    async def get(self, key: CacheKey) -> bytes | None:
        value = await self._call("lookup", lambda: self._pipeline.execute("GET", key.entry))
        return value if isinstance(value, bytes) else None

    async def poll(self, key: CacheKey) -> tuple[bytes | None, bool]:
        """(entry or None, whether the lock is still held): what a waiting request checks."""

        async def both() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(key.entry)
            pipe.exists(key.lock)
            return list(await pipe.execute())

        entry, locked = await self._call("poll", both)
        return entry, bool(locked)

    async def store(self, key: CacheKey, entry: bytes, ttl_ms: int, lock_token: bytes | None) -> None:
        args: list[bytes | int] = [entry, ttl_ms, lock_token or b""]
        await self._call("store", lambda: self._pipeline.evalsha(self._store, [key.entry, key.lock], args))

    def store_soon(
        self, key: CacheKey, entry: bytes, ttl_ms: int, lock_token: bytes | None, done: Callable[[bool | None], None]
    ) -> bool:
        """``store`` without a task, for the background write after a reply: queued in this turn's
        batch, and ``done(True)`` on success, ``done(False)`` on a failure (counted like any other),
        ``done(None)`` when Redis does not know the script (call ``store``, which loads it). False
        (and no callback) when the breaker is open. Bounded by the client's socket timeout."""
        keys = (key.entry, key.lock)
        return self._script_soon("store", self._store.sha, keys, (entry, ttl_ms, lock_token or b""), done)

    def replace_soon(self, key: CacheKey, entry: bytes, read: bytes, done: Callable[[bool | None], None]) -> bool:
        """Write ``entry`` in place of the one a lookup ``read``, keeping its expiry, unless the key
        holds another entry by now or none (``done(True)`` either way); the outcomes of ``store_soon``,
        ``replace`` being its fallback."""
        return self._script_soon("replace", self._replace.sha, (key.entry,), (entry, entry_head(read)), done)

    async def replace(self, key: CacheKey, entry: bytes, read: bytes) -> None:
        args = [entry, entry_head(read)]
        await self._call("replace", lambda: self._pipeline.evalsha(self._replace, [key.entry], args))

    def _script_soon(
        self,
        op: str,
        sha: str,
        keys: tuple[str, ...],
        args: tuple[bytes | int, ...],
        done: Callable[[bool | None], None],
    ) -> bool:
        if not self.breaker.allow():
            return False
        future = self._pipeline.submit("EVALSHA", sha, len(keys), *keys, *args)

        def settle(result: asyncio.Future[Any]) -> None:
            error: BaseException | None = asyncio.CancelledError() if result.cancelled() else result.exception()
            if error is None:
                self.breaker.success()
                done(True)
            elif isinstance(error, NoScriptError):
                done(None)
            else:
                self._failed(op)
                done(False)

        future.add_done_callback(settle)
        return True

    async def release(self, key: CacheKey, lock_token: bytes) -> None:
        await self._call("release", lambda: self._pipeline.evalsha(self._release, [key.lock], [lock_token]))

    async def purge(self, pattern: str, *, batch: int = 500) -> int:
        """UNLINK every key matching ``pattern`` (admin only: SCAN with the admin client's longer
        timeouts, not subject to the breaker). Raises RedisError on failure."""
        deleted = 0
        pending: list[bytes] = []
        async for name in self._admin.scan_iter(match=pattern, count=batch):
            pending.append(name)
            if len(pending) >= batch:
                deleted += int(await self._admin.unlink(*pending))
                pending.clear()
        if pending:
            deleted += int(await self._admin.unlink(*pending))
        return deleted
