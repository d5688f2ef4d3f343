"""Stored bytes per caller scope: what the Responses store holds for each tenant, kept exact in Redis.

Each scope has a ledger beside its records: a hash ``<prefix>:<scope>:@bytes`` (response id -> bytes of
its record, and ``@total``) and a sorted set ``<prefix>:<scope>:@expiry`` (response id -> when its record
expires, ms). Records expire on their own (TTL); each script first takes the entries whose time has come
off the ledger, so the total never counts what Redis already dropped. Writing a record, refreshing its
ancestors' expiry and counting it are one script: concurrent turns on any number of replicas can never
store past the bound together. Ids are checked against their format before any call, so an id can never
name a ledger key (``@`` is not in the format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.infra.redis_api import RedisPipeline

# Takes expired entries off the ledger (KEYS[1] the hash, KEYS[2] the sorted set). Shared by every script.
_PURGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(gone) do
  local n = tonumber(redis.call('HGET', KEYS[1], id)) or 0
  redis.call('HDEL', KEYS[1], id)
  if n > 0 then redis.call('HINCRBY', KEYS[1], '@total', -n) end
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
local total = tonumber(redis.call('HGET', KEYS[1], '@total')) or 0
"""

# -> {total bytes, responses}
_USAGE = _PURGE + "return {total, redis.call('ZCARD', KEYS[2])}"

# KEYS[3] the record, KEYS[4..] its ancestors' records; ARGV: value, ttl ms, bound, id, ancestor ids.
# -> {1, new total} stored, {0, total} refused (over the bound: nothing written).
_SAVE = (
    _PURGE
    + """
local size = string.len(ARGV[1])
if total + size > tonumber(ARGV[3]) then return {0, total} end
local ttl = tonumber(ARGV[2])
local previous = tonumber(redis.call('HGET', KEYS[1], ARGV[4])) or 0
redis.call('SET', KEYS[3], ARGV[1], 'PX', ttl)
redis.call('HSET', KEYS[1], ARGV[4], size)
redis.call('HINCRBY', KEYS[1], '@total', size - previous)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
for i = 5, #ARGV do
  if redis.call('PEXPIRE', KEYS[i - 1], ttl) == 1 then redis.call('ZADD', KEYS[2], 'XX', now + ttl, ARGV[i]) end
end
for k = 1, 2 do  -- the ledger outlives every record it counts, also those stored with a longer TTL
  if redis.call('PTTL', KEYS[k]) < ttl then redis.call('PEXPIRE', KEYS[k], ttl) end
end
return {1, total + size - previous}
"""
)

# KEYS[3] the record; ARGV[1] its id. -> 1 deleted, 0 there was none.
_DELETE = (
    _PURGE
    + """
local existed = redis.call('DEL', KEYS[3])
local n = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) or 0
redis.call('HDEL', KEYS[1], ARGV[1])
if n > 0 then redis.call('HINCRBY', KEYS[1], '@total', -n) end
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('HLEN', KEYS[1]) == 1 and (tonumber(redis.call('HGET', KEYS[1], '@total')) or 0) == 0 then
  redis.call('DEL', KEYS[1])  -- the scope's last response: no empty ledger left behind
end
return existed
"""
)


@dataclass(frozen=True, slots=True)
class Usage:
    bytes: int
    responses: int


class Ledger:
    """The scripts on one Redis client, run through the store's bounded pipeline; keys under ``prefix``."""

    def __init__(self, redis: aioredis.Redis, pipeline: RedisPipeline) -> None:
        self._usage = redis.register_script(_USAGE)
        self._save = redis.register_script(_SAVE)
        self._delete = redis.register_script(_DELETE)
        self._pipeline = pipeline

    @staticmethod
    def _ledger_keys(prefix: str, scope: str) -> list[str]:
        return [f"{prefix}:{scope}:@bytes", f"{prefix}:{scope}:@expiry"]

    async def usage(self, prefix: str, scope: str) -> Usage:
        total, count = await self._pipeline.evalsha(self._usage, self._ledger_keys(prefix, scope), [])
        return Usage(int(total), int(count))

    async def save(
        self, prefix: str, scope: str, response_id: str, value: bytes, ttl_s: int, bound: int, ancestors: list[str]
    ) -> tuple[bool, int]:
        """Write the record and refresh its ancestors' expiry (a chain lives as long as its newest turn),
        unless the scope would then hold more than ``bound`` bytes: (stored?, the scope's total)."""
        records = [f"{prefix}:{scope}:{rid}" for rid in (response_id, *ancestors)]
        args: list[Any] = [value, ttl_s * 1000, bound, response_id, *ancestors]
        stored, total = await self._pipeline.evalsha(self._save, [*self._ledger_keys(prefix, scope), *records], args)
        return bool(stored), int(total)

    async def delete(self, prefix: str, scope: str, response_id: str) -> bool:
        keys = [*self._ledger_keys(prefix, scope), f"{prefix}:{scope}:{response_id}"]
        return bool(await self._pipeline.evalsha(self._delete, keys, [response_id]))


async def scopes(redis: aioredis.Redis, prefix: str, limit: int = 10_000) -> list[str]:
    """The scopes that hold a ledger under ``prefix`` (an admin listing: SCAN, never KEYS), at most ``limit``."""
    found: list[str] = []
    head, tail = f"{prefix}:", ":@bytes"
    async for raw in redis.scan_iter(match=f"{head}*{tail}", count=1000):
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        found.append(name[len(head) : -len(tail)])
        if len(found) >= limit:
            break
    return sorted(found)
