"""``GET /v1/batches`` pages read the scope's index a chunk at a time from where the page starts, never the
whole index: the index holds every batch of the scope's last ``output_ttl_s`` (a tenant creating a batch a
second has millions), and a whole read per page cost the event loop in proportion to that history, for
every tenant on the replica. Paging stays exact across chunks and past batches that expired meanwhile."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from gateway.batch.jobs import Jobs
from gateway.pipeline.batch_config import BatchesConfig, Caller


class _Counting(aioredis.Redis):
    """A client that records the index ranges read."""

    ranges: list[tuple[int, int]]

    async def zrange(self, name: Any, start: int, end: int, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.ranges.append((start, end))
        return await super().zrange(name, start, end, *args, **kwargs)


async def test_pages_read_the_index_a_chunk_at_a_time_and_stay_exact(batch_names: dict[str, Any]) -> None:
    config = BatchesConfig(redis_prefix=batch_names["prefix"])
    client = _Counting()
    client.ranges = []
    try:
        jobs = Jobs(client, config)
        ids = [
            (await jobs.create("acme", Caller("acme"), "file-x", "/v1/chat/completions", None))["id"]
            for _ in range(230)
        ]
        newest_first = ids[::-1]
        gone = set(newest_first[95:110]) | set(newest_first[198:201])  # expired around the chunks' edges
        await client.delete(*(jobs.key(batch_id) for batch_id in gone))
        live = [batch_id for batch_id in newest_first if batch_id not in gone]

        client.ranges.clear()
        page, more = await jobs.listing("acme", after=None, limit=2)
        assert [b["id"] for b in page] == live[:2] and more
        assert client.ranges == [(0, 99)]  # the top of the index only, not all 230

        seen: list[str] = []
        after: str | None = None
        while True:
            page, more = await jobs.listing("acme", after=after, limit=7)
            seen += [b["id"] for b in page]
            if not more:
                break
            after = page[-1]["id"]
        assert seen == live
        assert all(end - start + 1 <= 100 for start, end in client.ranges)
        index = await client.zrange(f"{batch_names['prefix']}:batches:acme", 0, -1)
        assert len(index) == len(live)  # the expired ones met on the way were dropped
        assert await jobs.listing("acme", after="batch_unknown", limit=5) == ([], False)
    finally:
        await client.aclose()
