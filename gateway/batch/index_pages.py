"""A page of a scope's index: a Redis sorted set of ids whose records may have expired since.

The Files and Batch APIs keep each scope's ids in a sorted set by creation time, beside records that
expire on their own (a batch's output files, the batch itself). A listing reads the index a chunk at a
time from where its page starts, never the whole index: it holds everything the scope made in its last
``output_ttl_s``, and a whole read per page would cost the event loop in proportion to a tenant's history.
Each chunk's records are read in one round trip; ids whose records are gone are dropped from the index as
they are met, so later pages (and later listings) do not meet them again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import redis.asyncio as aioredis

from gateway.batch.redis_errors import guarded, text

T = TypeVar("T")

#: ids read per round trip while a page is filled
CHUNK = 100


class Skip:
    """A record that exists and is not on this listing (it stays in the index)."""


SKIP = Skip()


async def page(
    redis: aioredis.Redis,
    index: str,
    start: int,
    *,
    desc: bool,
    limit: int,
    fetch: Callable[[list[str]], Awaitable[Sequence[T | Skip | None]]],
    doing: str,
) -> tuple[list[T], bool]:
    """Up to ``limit`` items from rank ``start`` of ``index`` (newest first with ``desc``), and whether more
    follow. ``fetch`` reads a chunk's records, in the chunk's order: the item a listing shows, ``SKIP`` for
    a record that exists and is not listed (another purpose, say), None for one that is gone. ``doing``
    names the action for the 503 when Redis is unavailable."""
    items: list[T] = []
    while len(items) <= limit:
        async with guarded(doing):
            chunk = [text(i) for i in await redis.zrange(index, start, start + CHUNK - 1, desc=desc)]
            records = await fetch(chunk) if chunk else []
        stale = [item_id for item_id, record in zip(chunk, records, strict=True) if record is None]
        items += [record for record in records if record is not None and not isinstance(record, Skip)]
        if stale:
            async with guarded(doing):
                await redis.zrem(index, *stale)
        if len(chunk) < CHUNK:
            break
        start += CHUNK - len(stale)  # the stale ones are gone from the index: the next ones moved up
    return items[:limit], len(items) > limit
