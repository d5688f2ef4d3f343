"""``GET /v1/batches`` pages read the scope's index a chunk at a time from where the page starts, never the
whole index: the index holds every batch of the scope's last ``output_ttl_s`` (a tenant creating a batch a
second has millions), and a whole read per page cost the event loop in proportion to that history, for
every tenant on the replica. Paging stays exact across chunks and past batches that expired meanwhile."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.batch.jobs import Jobs
from gateway.pipeline.batch_config import BatchesConfig, Caller


class _Counting(aioredis.Redis):
    """A client that records the index ranges read."""

    ranges: list[tuple[int, int]]
    reads = 0  # single-record reads (HGETALL sent alone)

    async def hgetall(self, name: Any) -> Any:  # type: ignore[override]
        self.reads += 1
        return await super().hgetall(name)

    async def zrange(self, name: Any, start: int, end: int, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.ranges.append((start, end))
        return await super().zrange(name, start, end, *args, **kwargs)


@pytest.fixture
async def counted(batch_names: dict[str, Any]) -> AsyncIterator[tuple[_Counting, Jobs]]:
    """Scope ``acme``'s batches on a client that counts its reads."""
    client = _Counting()
    client.ranges = []
    try:
        yield client, Jobs(client, BatchesConfig(redis_prefix=batch_names["prefix"]))
    finally:
        await client.aclose()


async def _created(jobs: Jobs, count: int) -> list[str]:
    """The ids of ``count`` new batches of scope ``acme``, oldest first."""
    return [
        (await jobs.create("acme", Caller("acme"), "file-x", "/v1/chat/completions", None))["id"] for _ in range(count)
    ]


async def test_pages_read_the_index_a_chunk_at_a_time_and_stay_exact(
    batch_names: dict[str, Any], counted: tuple[_Counting, Jobs]
) -> None:
    client, jobs = counted
    ids = await _created(jobs, 230)
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


async def test_a_page_reads_its_chunk_of_records_in_one_round_trip(batch_names: dict[str, Any]) -> None:
    """A page's records are read together (one pipelined round trip a chunk), not one ``HGETALL`` each."""
    config = BatchesConfig(redis_prefix=batch_names["prefix"])
    client = _Counting()
    client.ranges = []
    try:
        jobs = Jobs(client, config)
        ids = [
            (await jobs.create("acme", Caller("acme"), "file-x", "/v1/chat/completions", None))["id"] for _ in range(12)
        ]
        await client.delete(jobs.key(ids[5]))
        client.reads = 0
        page, more = await jobs.listing("acme", after=None, limit=20)
        assert [b["id"] for b in page] == [i for i in ids[::-1] if i != ids[5]] and not more
        assert client.reads == 0
        assert await jobs.get("acme", ids[0]) is not None and client.reads == 1  # one batch: one read
    finally:
        await client.aclose()


async def test_a_create_drops_expired_batches_from_the_indexes(
    batch_names: dict[str, Any], counted: tuple[_Counting, Jobs]
) -> None:
    """Listings drop only the expired ids they meet; each create also drops the expired ones among a sample
    of the scope's index and of every batch's (all of them, in an index this small), so ids of batches long
    gone do not pile up past the pages anyone reads."""
    client, jobs = counted
    old = await _created(jobs, 5)
    await client.delete(*(jobs.key(batch_id) for batch_id in old[1:]))  # expired with their output files
    new = await _created(jobs, 1)
    for index in (f"{batch_names['prefix']}:batches:acme", f"{batch_names['prefix']}:all"):
        assert {i.decode() for i in await client.zrange(index, 0, -1)} == {old[0], *new}
