"""The Files API's objects: OpenAI file objects whose metadata lives in Redis and whose bytes live in a
``BlobStore``, each owned by one caller scope.

- ``<prefix>:file:<id>``: ``{"scope": ..., "file": <OpenAI file object>}`` as JSON. A file of another
  scope reads exactly like an unknown one (None: the routes answer 404), so an id is no oracle.
- ``<prefix>:files:<scope>``: the scope's file ids, scored by creation time (listing, newest first).
- Files a batch writes (``batch_output``) expire ``output_ttl_s`` after they were written; uploads stay
  until deleted.
- ``<prefix>:files-expiring``: the ids of files that expire, scored by when: ``sweep`` deletes their
  contents from the file store once their metadata expired (Redis forgets the key; the store must be told).
- What each scope stores is counted and bounded (``gateway.batch.usage``): an upload reserves room as its
  bytes arrive and is refused (nothing kept) past the scope's bound; deleting and sweeping give it back.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.batch.blobs import BlobStore
from gateway.batch.index_pages import SKIP, Skip, page
from gateway.batch.redis_errors import guarded, text
from gateway.batch.usage import FileKeys, Hold, StorageFull, Usage
from gateway.pipeline.batch_config import BatchesConfig
from gateway.wire.errors import PayloadTooLarge

UPLOAD_PURPOSES = ("batch",)
PURPOSES = ("batch", "batch_output")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileTooLarge(PayloadTooLarge):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"The file is larger than this gateway accepts ({limit} bytes); split it into several batches.",
            param="file",
            code="file_too_large",
        )


@dataclass(frozen=True, slots=True)
class Stored:
    """A file written to the store and not registered yet; an upload's ``hold`` on its scope's storage."""

    file_id: str
    size: int
    hold: Hold | None = None


class Files:
    """Create, look up, read and delete files, per scope."""

    def __init__(self, redis: aioredis.Redis, blobs: BlobStore, config: BatchesConfig) -> None:
        self.redis, self.blobs, self.config = redis, blobs, config
        self.usage = Usage(redis, config)

    def _key(self, file_id: str) -> str:
        return f"{self.config.redis_prefix}:file:{file_id}"

    def _index(self, scope: str) -> str:
        return f"{self.config.redis_prefix}:files:{scope}"

    @property
    def _expiring(self) -> str:
        return f"{self.config.redis_prefix}:files-expiring"

    def _gone(self, scope: str) -> str:
        return f"{self.config.redis_prefix}:files-gone:{scope}"

    def _keys(self, scope: str, file_id: str) -> FileKeys:
        return FileKeys(self._key(file_id), self._index(scope), self._expiring, self._gone(scope))

    async def create(
        self, scope: str, filename: str, purpose: str, pieces: AsyncIterator[bytes], *, file_id: str | None = None
    ) -> dict[str, Any]:
        """Store ``pieces`` as a file the gateway writes and return its file object. ``file_id`` is given
        for the files a batch writes, so writing them again (a finalization taken over) replaces them.
        Bounded neither by ``max_file_bytes`` (a batch's answers may be far larger than its input) nor by
        the scope's storage (counted, never refused: see ``gateway.batch.usage``)."""
        stored = await self.store(pieces, file_id)
        return await self.register(scope, stored, filename, purpose)

    async def store(
        self,
        pieces: AsyncIterator[bytes],
        file_id: str | None = None,
        *,
        scope: str | None = None,
        declared: int | None = None,
    ) -> Stored:
        """Write ``pieces``; not visible to anyone before ``register``. With ``scope``, an upload of that
        scope (``declared``: the length its request announced): at most ``max_file_bytes``
        (``FileTooLarge`` beyond) and within the scope's storage, reserved before each piece is written
        (``StorageFull`` beyond); refused, nothing is kept."""
        file_id = file_id or new_file_id()
        hold = None if scope is None else Hold(self.usage, scope, declared, self.config.max_file_bytes)
        writer = await self.blobs.open_writer(file_id)
        size = 0
        try:
            if hold is not None:
                await hold.cover(0)  # the file itself, and what the request announced when there is room
            async for piece in pieces:
                size += len(piece)
                if hold is not None:
                    if size > self.config.max_file_bytes:
                        raise FileTooLarge(self.config.max_file_bytes)
                    await hold.cover(size)
                await writer.write(piece)
        except BaseException:
            await writer.abort()
            if hold is not None:
                await hold.release()
            raise
        await writer.commit()
        return Stored(file_id, size, hold)

    async def discard(self, stored: Stored) -> None:
        """Drop a stored file that will not be registered, and what its upload held."""
        if stored.hold is not None:
            await stored.hold.release()
        await self.blobs.delete(stored.file_id)

    async def register(self, scope: str, stored: Stored, filename: str, purpose: str) -> dict[str, Any]:
        """Make a stored file ``scope``'s, with its OpenAI file object, and count it for the scope. An
        upload whose hold lapsed and that no longer fits is ``StorageFull`` (and discarded)."""
        now = int(time.time())
        ttl = self.config.output_ttl_s if purpose == "batch_output" else None
        obj = {
            "id": stored.file_id,
            "object": "file",
            "bytes": stored.size,
            "created_at": now,
            "expires_at": now + ttl if ttl else None,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
        }
        record = orjson.dumps({"scope": scope, "file": obj})
        token = stored.hold.token if stored.hold is not None else None
        try:
            await self.usage.commit(scope, token, stored.file_id, stored.size, self._keys(scope, stored.file_id),
                                    record, ttl)  # fmt: skip
        except StorageFull:
            await self.blobs.delete(stored.file_id)
            raise
        return obj

    async def get(self, scope: str, file_id: str) -> dict[str, Any] | None:
        """The file object, or None when it is unknown, expired, deleted or another scope's."""
        if not file_id.startswith("file-") or len(file_id) > 64:
            return None
        async with guarded("read the file"):
            raw = await self.redis.get(self._key(file_id))
        if raw is None:
            return None
        record = orjson.loads(raw)
        return record["file"] if record.get("scope") == scope else None

    def content(self, file_id: str) -> AsyncIterator[bytes]:
        """The bytes of a file ``get`` returned (the caller checked its scope)."""
        return self.blobs.read(file_id)

    async def delete(self, scope: str, file_id: str) -> bool:
        if await self.get(scope, file_id) is None:
            return False
        await self.usage.forget(scope, file_id, self._keys(scope, file_id))
        await self.blobs.delete(file_id)
        return True

    async def sweep(self, now: float, most: int = 100) -> int:
        """Delete the contents of up to ``most`` files whose expiry passed by ``now``; how many. A replica
        takes a file by removing it from the expiring set, so replicas sweeping at once share the work; one
        whose metadata is still there (written again later, or not yet expired by Redis) waits again. A
        swept file is taken off its scope's storage."""
        due = [text(i) for i in await self.redis.zrangebyscore(self._expiring, "-inf", now, start=0, num=most)]
        swept = 0
        for file_id in due:
            if not await self.redis.zrem(self._expiring, file_id):
                continue  # another replica's
            left_ms = int(await self.redis.pttl(self._key(file_id)))
            if left_ms > 0:
                await self.redis.zadd(self._expiring, {file_id: time.time() + left_ms / 1000})
            elif left_ms == -2:  # the metadata is gone
                scope = await self.usage.counted_scope(file_id)
                if scope is not None and not await self.usage.forget(
                    scope, file_id, self._keys(scope, file_id), swept=True
                ):
                    continue  # written again since its metadata was read as gone: it stays
                await self.blobs.delete(file_id)
                swept += 1
        return swept

    async def listing(
        self, scope: str, *, purpose: str | None, limit: int, after: str | None, order: str
    ) -> tuple[list[dict[str, Any]], bool]:
        """A page of the scope's files (``order`` by creation, "desc" first by default), after the file
        ``after``; and whether more follow. ``after`` may be a file deleted or expired since (its place is
        kept a while): a client deleting the files it pages through goes on where it was. Read a chunk at a
        time from where the page starts, never the whole index. Expired files are dropped from the index
        as they are met."""
        index, desc = self._index(scope), order == "desc"
        start = await self._start(scope, after, desc)
        if start is None:
            return [], False

        async def fetch(chunk: list[str]) -> list[dict[str, Any] | Skip | None]:
            raws = await self.redis.mget([self._key(i) for i in chunk])
            objs = [orjson.loads(raw)["file"] if raw is not None else None for raw in raws]
            return [SKIP if obj is not None and purpose not in (None, obj["purpose"]) else obj for obj in objs]

        return await page(self.redis, index, start, desc=desc, limit=limit, fetch=fetch, doing="list the files")

    async def _start(self, scope: str, after: str | None, desc: bool) -> int | None:
        """Where in the index (in ``desc`` order or not) a page after the file ``after`` starts: past it,
        or past its place if it was deleted or expired lately; None for an id the scope never had."""
        if after is None:
            return 0
        index = self._index(scope)
        async with guarded("list the files"):
            rank: Any = await (self.redis.zrevrank if desc else self.redis.zrank)(index, after)
            if rank is not None:
                return int(rank) + 1
            place = await self.redis.zscore(self._gone(scope), after)
            if place is None:
                return None
            # the files listed before it: created before it (after it, when the newest come first)
            low, high = (f"({place}", "+inf") if desc else ("-inf", f"({place}")
            before: Any = await self.redis.zcount(index, low, high)
        return int(before)
