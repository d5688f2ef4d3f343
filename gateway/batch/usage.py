"""What each scope stores in the file store, counted exactly in Redis and bounded per scope
(``batches.max_tenant_bytes`` and ``max_tenant_files``), so one tenant cannot fill the store every
tenant's uploads and batch results share.

- ``<prefix>:usage:<scope>``: a hash, ``bytes`` and ``files``: what the scope's registered files hold.
- ``<prefix>:file-bytes``: file id -> ``"<bytes> <scope>"`` for every counted file, so a file whose record
  Redis already expired (a batch's output) is still taken off its scope's usage when it is swept, and a
  file is taken off once however many replicas delete or sweep it.
- ``<prefix>:held:<scope>`` (upload token -> bytes) and ``<prefix>:held-until:<scope>`` (token -> when the
  hold lapses, ms): what uploads in flight have reserved. An upload reserves room before it writes a piece
  (and one file), so two uploads at once cannot both pass when only one fits; each check and reservation
  is one script. A hold is renewed while its upload runs and lapses ``HOLD_S`` after the last renewal, so a
  replica killed mid-upload holds nothing for good.

Counting a file and writing its record are one script (``commit``), and so are deleting a record and
taking its file off (``forget``): the usage never counts a file nobody can see or misses one anybody can.
The files a batch writes are counted but never refused (``forced``): they are the answers the batch's
lines were already run (and charged) for, and losing them would fail the batch for a bound that is about
uploads. A scope their writing took to or past the bound has its uploads and its new batches refused
(``BatchService.create_batch``) until deletions or expiry bring it back under. Files stored before the
count existed are not counted (nor taken off when deleted).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.batch.redis_errors import REDIS_ERRORS, guarded, text
from gateway.pipeline.batch_config import BatchesConfig
from gateway.wire.errors import GatewayError, InvalidRequest

HOLD_S = 120.0  # how long a hold outlives its last renewal (an upload renews it every third of that)
GRANT = 1 << 20  # an upload of unknown length reserves this much more each time it needs more
#: A deleted or expired file's place in its scope's listing is kept (the newest this many, this long), so a
#: client paging past it (``after`` = its id: deleting while iterating) goes on from there.
GONE_KEPT = 1000
GONE_TTL_S = 86400

# KEYS[1] usage, KEYS[2] held, KEYS[3] held-until. Drops lapsed holds; sets now, held, uploads, stored, files.
_PURGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, token in ipairs(lapsed) do redis.call('HDEL', KEYS[2], token) end
if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now) end
local held = 0
for _, n in ipairs(redis.call('HVALS', KEYS[2])) do held = held + tonumber(n) end
local uploads = redis.call('HLEN', KEYS[2])
local stored = tonumber(redis.call('HGET', KEYS[1], 'bytes')) or 0
local files = tonumber(redis.call('HGET', KEYS[1], 'files')) or 0
"""

# ARGV: token, bytes it must hold, bytes it would like to hold, max bytes, max files, hold ms.
# -> {held} (at least the bytes it must hold), {-1, stored, files} no file more, {-2, stored, files} no room.
_RESERVE = (
    _PURGE
    + """
local mine = tonumber(redis.call('HGET', KEYS[2], ARGV[1]))
if not mine then
  if files + uploads + 1 > tonumber(ARGV[5]) then return {-1, stored, files} end
  mine = 0
end
local room = tonumber(ARGV[4]) - stored - held
local more = tonumber(ARGV[2]) - mine
if more > 0 and more > room then return {-2, stored, files} end
-- what it would like when that fits, else just what it must hold: near the bound, one upload's wish
-- never takes the room another upload at once needs
local grant = math.max(mine, tonumber(ARGV[2]))
if tonumber(ARGV[3]) - mine <= room then grant = math.max(mine, tonumber(ARGV[3])) end
local hold = tonumber(ARGV[6])
redis.call('HSET', KEYS[2], ARGV[1], grant)
redis.call('ZADD', KEYS[3], now + hold, ARGV[1])
redis.call('PEXPIRE', KEYS[2], hold)
redis.call('PEXPIRE', KEYS[3], hold)
return {grant}
"""
)

# KEYS[1] held, KEYS[2] held-until; ARGV[1] token.
_RELEASE = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS[4] file-bytes, KEYS[5] the record, KEYS[6] the scope's index, KEYS[7] the expiring set.
# ARGV: token ('' when forced), file id, size, scope, max bytes, max files, record, ttl s (0: none),
# index score, expires at. -> {1} written and counted, or the refusal _RESERVE gives (nothing written).
_COMMIT = (
    _PURGE
    + """
local size = tonumber(ARGV[3])
if ARGV[1] ~= '' then
  local mine = tonumber(redis.call('HGET', KEYS[2], ARGV[1]))
  if mine then
    redis.call('HDEL', KEYS[2], ARGV[1])
    redis.call('ZREM', KEYS[3], ARGV[1])
  else  -- the hold lapsed (the upload stalled past HOLD_S): checked as a new upload now
    if files + uploads + 1 > tonumber(ARGV[6]) then return {-1, stored, files} end
    if stored + held + size > tonumber(ARGV[5]) then return {-2, stored, files} end
  end
end
local previous = redis.call('HGET', KEYS[4], ARGV[2])
if previous then  -- written again (a batch's finalization taken over): counted once, at its new size
  redis.call('HINCRBY', KEYS[1], 'bytes', size - tonumber(string.match(previous, '^%d+')))
else
  redis.call('HINCRBY', KEYS[1], 'bytes', size)
  redis.call('HINCRBY', KEYS[1], 'files', 1)
end
redis.call('HSET', KEYS[4], ARGV[2], ARGV[3] .. ' ' .. ARGV[4])
local ttl = tonumber(ARGV[8])
if ttl > 0 then
  redis.call('SET', KEYS[5], ARGV[7], 'EX', ttl)
  redis.call('ZADD', KEYS[7], ARGV[10], ARGV[2])
else
  redis.call('SET', KEYS[5], ARGV[7])
end
redis.call('ZADD', KEYS[6], ARGV[9], ARGV[2])
return {1}
"""
)

# KEYS[1] usage, KEYS[2] file-bytes, KEYS[3] the record, KEYS[4] the scope's index, KEYS[5] the expiring set,
# KEYS[6] the scope's gone files (id -> its place in the index, the newest GONE_KEPT, for GONE_TTL_S); ARGV[1]
# file id, ARGV[2] "sweep" (the record expired: leave a record written again since alone) or "delete",
# ARGV[3] GONE_KEPT, ARGV[4] GONE_TTL_S.
# -> 1 the file is gone and no longer counted, 0 nothing done (swept, but its record is there again).
_FORGET = """
if ARGV[2] == 'sweep' then
  if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
else
  redis.call('DEL', KEYS[3])
  redis.call('ZREM', KEYS[5], ARGV[1])
end
local place = redis.call('ZSCORE', KEYS[4], ARGV[1])
if place then  -- its place in the listing, for a client paging past it
  redis.call('ZADD', KEYS[6], place, ARGV[1])
  redis.call('ZREMRANGEBYRANK', KEYS[6], 0, -1 - tonumber(ARGV[3]))
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[4]))
end
redis.call('ZREM', KEYS[4], ARGV[1])
local counted = redis.call('HGET', KEYS[2], ARGV[1])
if counted then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'bytes', -tonumber(string.match(counted, '^%d+')))
  if redis.call('HINCRBY', KEYS[1], 'files', -1) <= 0 then redis.call('DEL', KEYS[1]) end  -- nothing left
end
return 1
"""


@dataclass(frozen=True, slots=True)
class FileKeys:
    """The keys of one file's record: where ``commit`` writes it and ``forget`` removes it."""

    record: str
    index: str
    expiring: str
    gone: str  # the scope's files deleted or expired lately, by their place in ``index``


class StorageFull(InvalidRequest):
    """An upload the scope has no room for: a 400 ``invalid_request_error``, as OpenAI answers one past an
    organization's file storage (a 429 would have SDKs send the same upload again, to the same answer)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, param="file", code=code)


def _refusal(reply: list[Any], config: BatchesConfig) -> GatewayError:
    stored, files = int(reply[1]), int(reply[2])
    if int(reply[0]) == -1:
        return StorageFull(
            f"This tenant stores {files} files; with its uploads in flight, that is the most it may "
            f"(batches.max_tenant_files: {config.max_tenant_files}). Delete files it no longer needs.",
            code="stored_files_exceeded",
        )
    return StorageFull(
        f"This upload does not fit in this tenant's file storage: its files hold {stored} bytes of the "
        f"{config.max_tenant_bytes} it may store (batches.max_tenant_bytes), uploads in flight included; "
        "delete files it no longer needs (batch output files also expire on their own).",
        code="stored_bytes_exceeded",
    )


class Usage:
    """The scripts that count, bound and reserve a scope's stored files."""

    def __init__(self, redis: aioredis.Redis, config: BatchesConfig) -> None:
        self.redis, self.config = redis, config
        self._reserve = redis.register_script(_RESERVE)
        self._release = redis.register_script(_RELEASE)
        self._commit = redis.register_script(_COMMIT)
        self._forget = redis.register_script(_FORGET)

    def key(self, scope: str) -> str:
        return f"{self.config.redis_prefix}:usage:{scope}"

    def _held(self, scope: str) -> list[str]:
        prefix = self.config.redis_prefix
        return [self.key(scope), f"{prefix}:held:{scope}", f"{prefix}:held-until:{scope}"]

    @property
    def _counted(self) -> str:
        return f"{self.config.redis_prefix}:file-bytes"

    async def stored(self, scope: str) -> tuple[int, int]:
        """The bytes and files the scope's registered files hold."""
        async with guarded("read the file storage"):
            stored, files = await self.redis.hmget(self.key(scope), ["bytes", "files"])
        return int(stored or 0), int(files or 0)

    async def reserve(self, scope: str, token: str, need: int, want: int) -> int:
        """Hold at least ``need`` bytes (``want`` when there is room for it) for the upload ``token``, and
        one file the first time; renews the hold. The bytes now held; ``StorageFull`` when they do not fit."""
        config = self.config
        most = (config.max_tenant_bytes, config.max_tenant_files)
        args: list[Any] = [token, need, max(need, want), *most, int(HOLD_S * 1000)]
        async with guarded("reserve file storage"):
            reply = await self._reserve(keys=self._held(scope), args=args)
        if int(reply[0]) < 0:
            raise _refusal(reply, config)
        return int(reply[0])

    async def release(self, scope: str, token: str) -> None:
        """Give back what the upload ``token`` holds (it failed, or was refused). Best effort: a hold
        that cannot be released now lapses on its own."""
        with contextlib.suppress(*REDIS_ERRORS):
            await self._release(keys=self._held(scope)[1:], args=[token])

    async def commit(
        self, scope: str, token: str | None, file_id: str, size: int, keys: FileKeys, record: bytes, ttl_s: int | None
    ) -> None:
        """Write the file's record (its index entry, and its expiry when ``ttl_s``) and count it for the
        scope, in one step; an upload's hold is given back. ``token`` None: forced (a file the gateway
        writes), else ``StorageFull`` when the upload's hold lapsed and it no longer fits (nothing written)."""
        now = time.time()
        args: list[Any] = [
            token or "",
            file_id,
            size,
            scope,
            self.config.max_tenant_bytes,
            self.config.max_tenant_files,
            record,
            ttl_s or 0,
            time.time_ns() // 1000,  # ordered within a second too
            int(now) + (ttl_s or 0),
        ]
        async with guarded("store the file"):
            reply = await self._commit(
                keys=[*self._held(scope), self._counted, keys.record, keys.index, keys.expiring], args=args
            )
        if int(reply[0]) < 0:
            raise _refusal(reply, self.config)

    async def counted_scope(self, file_id: str) -> str | None:
        """The scope a counted file is counted for; None when it is not counted (stored before the count
        existed, or taken off already)."""
        counted = await self.redis.hget(self._counted, file_id)
        return None if counted is None else text(counted).split(" ", 1)[1]

    async def forget(self, scope: str, file_id: str, keys: FileKeys, *, swept: bool = False) -> bool:
        """Delete the file's record and take it off the scope's usage (once, whoever else deletes it).
        ``swept``: its record expired; False (nothing done) when the record is there again (written anew
        meanwhile: its contents must stay)."""
        all_keys = [self.key(scope), self._counted, keys.record, keys.index, keys.expiring, keys.gone]
        args = [file_id, "sweep" if swept else "delete", GONE_KEPT, GONE_TTL_S]
        async with guarded("delete the file"):
            return bool(await self._forget(keys=all_keys, args=args))


class Hold:
    """One upload's reservation, grown as its bytes arrive: ``cover`` before each piece is written, then
    the file is committed with ``token`` (which gives it back) or ``release``d."""

    def __init__(self, usage: Usage, scope: str, declared: int | None, most: int) -> None:
        self.usage, self.scope, self.most = usage, scope, most
        self.token = secrets.token_hex(8)
        self.declared = declared
        self.held = -1  # nothing reserved yet (not even the file)
        self._renew_at = 0.0

    async def cover(self, size: int) -> None:
        """Make sure ``size`` bytes are held (renewing the hold when it is due); ``StorageFull`` beyond."""
        if size <= self.held and time.monotonic() < self._renew_at:
            return
        want = min(max(size + GRANT, self.declared or 0), self.most)
        self.held = await self.usage.reserve(self.scope, self.token, size, want)
        self._renew_at = time.monotonic() + HOLD_S / 3

    async def release(self) -> None:
        await self.usage.release(self.scope, self.token)
