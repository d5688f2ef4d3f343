"""Client API keys: held only as peppered digests, in config.yaml and in Redis.

A key is ``sk-gw-`` followed by 43 url-safe random characters; only ``hmac_sha256(pepper, key)`` is
ever stored. Keys created through the admin API live in Redis (``{prefix}:key:{digest}`` -> JSON
record, ``{prefix}:key-ids`` id -> digest) and every replica sees a new or revoked key within
``key_cache_ttl_s`` (<= 1 s): a lookup result, found or not, is trusted locally for that long and then
read again. Nothing here logs a key or a digest.

An id names one key for good: what is kept under it (usage counters and history, the batches it made,
whose lines run as their key, looked up by id) must never pass to another key. Revoking a key deletes
its record and leaves ``REVOKED`` as its id's entry in ``{prefix}:key-ids`` (a tombstone, never
removed), so ``create`` refuses that id as it refuses one in use (in the same ``HSETNX``), and every
look-up by id finds no key. A config.yaml's ids are written there too, as ``CONFIG`` (``claim_config_ids``,
when the config loads), so no key created later takes one, even once config.yaml no longer declares it:
the removed key's usage and history stay its own. A config.yaml declaring an id the admin API created (in
use or revoked) is refused when it loads; a created key whose id the running config declares anyway (it
was created on another replica meanwhile, or Redis was away when the config loaded) does not
authenticate: two keys under one id would share its counters and limits.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import orjson
import redis.asyncio as aioredis

from plugins.tenancy.config import ConfigKey, Limits

log = logging.getLogger("gateway.tenancy")
KEY_PREFIX = "sk-gw-"
#: The entry ``{prefix}:key-ids`` keeps for a revoked id in place of its digest (a digest is 64 hex digits).
REVOKED = "revoked"
#: The entry for an id a config.yaml declared (now or before): no key is created under it.
CONFIG = "config"
_NOT_DIGESTS = frozenset({REVOKED, CONFIG})


def hash_key(key: str, pepper: bytes) -> str:
    """The digest a key is stored and looked up by."""
    return hmac.digest(pepper, key.encode("utf-8", "surrogatepass"), "sha256").hex()


class KeyHasher:
    """``hash_key`` for one pepper, for every request: HMAC-SHA256 (RFC 2104) from the inner and outer
    hash states keyed once. ``hmac.digest`` sets up the key's pads and looks the digest up by name on
    each call, which costs about twice the two hashes of a 49-character key themselves."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, pepper: bytes) -> None:
        block = hashlib.sha256().block_size
        if len(pepper) > block:
            pepper = hashlib.sha256(pepper).digest()
        pepper = pepper.ljust(block, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in pepper))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in pepper))

    def __call__(self, key: str) -> str:
        inner = self._inner.copy()
        inner.update(key.encode("utf-8", "surrogatepass"))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What a valid key grants. Never holds the key itself."""

    id: str
    tenant: str
    models: tuple[str, ...]
    limits: Limits
    source: str  # "config" | "redis"
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.id, self.tenant, self.models, self.limits, self.source)))

    def __hash__(self) -> int:
        # Computed once: the plan cache looks a key's plan up by it on every request, and hashing the
        # fields each time hashes ``limits``, a pydantic model.
        return self._hash

    def allows(self, *names: str) -> bool:
        if "*" in self.models:  # the default: every model (what fnmatch would say, without a match per call)
            return True
        return any(fnmatchcase(name, pattern) for pattern in self.models for name in names)

    def record(self) -> bytes:
        return orjson.dumps(
            {"id": self.id, "tenant": self.tenant, "models": list(self.models), "limits": self.limits.model_dump()}
        )

    @classmethod
    def from_record(cls, raw: bytes | str) -> KeyInfo:
        data = orjson.loads(raw)
        return cls(data["id"], data["tenant"], tuple(data["models"]), Limits(**data["limits"]), "redis")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class KeyExists(Exception):
    pass


class KeyStore:
    """Looks keys up by digest (config first, then Redis through a short-lived local cache).

    Redis errors propagate to the caller, which applies the deployment's ``redis_down`` policy;
    ``stale(digest)`` offers the last answer seen for a key for that purpose.

    ``on_gone(key_id)`` is told when this store learns that a created key is gone for good: revoked
    through it, or found revoked (on another replica) when a lookup reads again a key it had found.
    A key revoked elsewhere and never presented here again is not noticed.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        pepper: bytes,
        config_keys: list[ConfigKey],
        *,
        ttl_s: float,
        max_entries: int,
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        self._redis = redis
        self._on_gone = on_gone
        self._prefix = prefix
        self._hash = KeyHasher(pepper)
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._config = {k.hash: KeyInfo(k.id, k.tenant, tuple(k.models), k.limits, "config") for k in config_keys}
        self._config_ids = {info.id: info for info in self._config.values()}
        self._cache: dict[str, tuple[KeyInfo | None, float]] = {}

    def digest(self, key: str) -> str:
        return self._hash(key)

    def _record_key(self, digest: str) -> str:
        return f"{self._prefix}:key:{digest}"

    @property
    def _ids_key(self) -> str:
        return f"{self._prefix}:key-ids"

    async def lookup(self, digest: str) -> KeyInfo | None:
        info = self._config.get(digest)
        if info is not None:
            return info
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        raw = await self._redis.get(self._record_key(digest))
        found = KeyInfo.from_record(raw) if raw is not None else None
        if found is not None and found.id in self._config_ids:
            log.warning(
                "tenancy: a key created through the admin API has id '%s', which config.yaml declares too: "
                "it is refused (revoke it with revoke_key)",
                found.id,
            )
            found = None
        if found is None and cached is not None and cached[0] is not None:
            self._gone(cached[0].id)  # found before, gone now: revoked (ids are never reused)
        if len(self._cache) >= self._max_entries:
            self._cache.clear()  # bounded memory; a flood of bad keys only costs re-reads
        self._cache[digest] = (found, now + self._ttl_s)
        return found

    def stale(self, digest: str) -> KeyInfo | None:
        """The last lookup result for ``digest``, however old (used while Redis is unreachable)."""
        cached = self._cache.get(digest)
        return cached[0] if cached is not None else None

    async def create(self, key_id: str, tenant: str, models: list[str], limits: Limits) -> tuple[str, KeyInfo]:
        """Store a new key; returns (the key, shown this once; its info). KeyExists if the id is taken:
        by config.yaml (now or before), by a key created here, or by one revoked (ids are never reused)."""
        if key_id in self._config_ids:
            raise KeyExists(key_id)
        key = new_key()
        digest = self.digest(key)
        info = KeyInfo(key_id, tenant, tuple(models), limits, "redis")
        if not await self._redis.hsetnx(self._ids_key, key_id, digest):
            raise KeyExists(key_id)
        await self._redis.set(self._record_key(digest), info.record())
        return key, info

    async def _digest_of(self, key_id: str) -> str | None:
        """The digest a created key's id maps to; None for an id never created here, revoked, or config's."""
        digest = await self._redis.hget(self._ids_key, key_id)
        if digest is None or _text(digest) in _NOT_DIGESTS:
            return None
        return _text(digest)

    async def revoke(self, key_id: str) -> bool:
        """Delete a Redis key by id, leaving its id's tombstone. False when no such key exists there (never
        created, or already revoked)."""
        digest_str = await self._digest_of(key_id)
        if digest_str is None:
            return False
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._record_key(digest_str))
            pipe.hset(self._ids_key, key_id, REVOKED)
            await pipe.execute()
        self._cache.pop(digest_str, None)
        if key_id not in self._config_ids:  # else the id's requests are the config key's, which stays
            self._gone(key_id)
        return True

    def _gone(self, key_id: str) -> None:
        if self._on_gone is not None:
            self._on_gone(key_id)

    def config_key(self, key_id: str) -> KeyInfo | None:
        return self._config_ids.get(key_id)

    async def by_id(self, key_id: str) -> KeyInfo | None:
        info = self._config_ids.get(key_id)
        if info is not None:
            return info
        digest = await self._digest_of(key_id)
        if digest is None:
            return None
        raw = await self._redis.get(self._record_key(digest))
        return KeyInfo.from_record(raw) if raw is not None else None

    async def claim_config_ids(self) -> list[str]:
        """The ids config.yaml declares that the admin API created too, in use or revoked, sorted: such a
        config must not load, since the config's key would inherit what is kept under the other's id. When
        there are none, the ids not yet written are written as ``CONFIG`` (``HSETNX``: a key created on
        another replica meanwhile keeps its entry, and is then refused at lookup), so that no key created
        later takes one, even once config.yaml no longer declares it."""
        ids = sorted(self._config_ids)
        if not ids:
            return []
        found = [None if d is None else _text(d) for d in await self._redis.hmget(self._ids_key, ids)]
        clashing = [key_id for key_id, entry in zip(ids, found, strict=True) if entry not in (None, CONFIG)]
        unclaimed = [key_id for key_id, entry in zip(ids, found, strict=True) if entry is None]
        if not clashing and unclaimed:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key_id in unclaimed:
                    pipe.hsetnx(self._ids_key, key_id, CONFIG)
                await pipe.execute()
        return clashing

    async def list(self) -> list[dict[str, Any]]:
        """Ids, tenants and sources of every key: never digests."""
        out = [{"id": i.id, "tenant": i.tenant, "source": "config"} for i in self._config.values()]
        ids = [_text(d) for d in (await self._redis.hgetall(self._ids_key)).values()]
        digests = [d for d in ids if d not in _NOT_DIGESTS]
        records = await self._redis.mget([self._record_key(d) for d in digests]) if digests else []
        for raw in records:
            if raw is not None:
                info = KeyInfo.from_record(raw)
                out.append({"id": info.id, "tenant": info.tenant, "source": "redis"})
        return sorted(out, key=lambda k: k["id"])
