"""A batch's move to a final status is one step in Redis: the status, leaving the runners' and the
tenant's active sets, and the record's expiry all apply together or not at all. When they were separate
calls after the status change, a replica that lost Redis (or died) right after the change left a final
batch that never expired and still counted among its tenant's running batches."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.batch.jobs import Jobs, TooManyActive
from gateway.pipeline.batch_config import BatchesConfig, Caller
from gateway.wire.errors import ServiceUnavailable


class _LostAfterScript:
    """A Redis client that becomes unreachable as soon as a script it runs has been applied."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self.lost = False

    def _check(self) -> None:
        if self.lost:
            raise RedisConnectionError("Connection closed by server.")

    def register_script(self, source: str) -> Callable[..., Awaitable[Any]]:
        script = self._client.register_script(source)

        async def run(**kwargs: Any) -> Any:
            self._check()
            try:
                return await script(**kwargs)
            finally:
                self.lost = True

        return run

    def __getattr__(self, name: str) -> Any:
        command = getattr(self._client, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self._check()
            return await command(*args, **kwargs)

        return call


async def test_a_final_batch_expires_and_leaves_the_active_sets_even_if_redis_is_lost_right_after(
    batch_names: dict[str, Any],
) -> None:
    config = BatchesConfig(redis_prefix=batch_names["prefix"])
    client = aioredis.Redis()
    try:
        jobs = Jobs(client, config)
        batch = await jobs.create("acme", Caller("acme"), "file-x", "/v1/chat/completions", None)
        assert await jobs.move(batch["id"], ("validating",), "in_progress", in_progress_at=1)
        cut = Jobs(cast(aioredis.Redis, _LostAfterScript(client)), config)
        with contextlib.suppress(ServiceUnavailable):
            await cut.move(batch["id"], ("in_progress",), "expired", expired_at=2)

        record = await jobs.load(batch["id"])
        assert record is not None and record["status"] == "expired"
        assert 0 < await client.ttl(jobs.key(batch["id"])) <= config.output_ttl_s
        assert await jobs.active() == []
        assert await client.scard(f"{batch_names['prefix']}:active:acme") == 0
    finally:
        await client.aclose()


async def test_only_an_applied_final_status_ends_a_batch(batch_names: dict[str, Any]) -> None:
    """A move to a status that is not final, or one from a status it does not name, keeps the batch
    running and its record unexpiring."""
    config = BatchesConfig(redis_prefix=batch_names["prefix"])
    client = aioredis.Redis()
    try:
        jobs = Jobs(client, config)
        batch = await jobs.create("acme:team", Caller("acme"), "file-x", "/v1/chat/completions", None)
        assert await jobs.move(batch["id"], ("validating",), "in_progress", in_progress_at=1)
        assert not await jobs.move(batch["id"], ("finalizing",), "completed", completed_at=2)
        record = await jobs.load(batch["id"])
        assert record is not None and (record["status"], record["in_progress_at"]) == ("in_progress", 1)
        assert await client.ttl(jobs.key(batch["id"])) == -1
        assert await jobs.active() == [batch["id"]] and await jobs.active_count("acme:team") == 1

        assert await jobs.move(batch["id"], ("in_progress",), "finalizing", finalizing_at=3)
        assert await jobs.move(batch["id"], ("finalizing",), "completed", completed_at=4, output_file_id="file-o")
        record = await jobs.load(batch["id"])
        assert record is not None and (record["status"], record["output_file_id"]) == ("completed", "file-o")
        assert await client.ttl(jobs.key(batch["id"])) > 0
        assert await jobs.active() == [] and await jobs.active_count("acme:team") == 0
    finally:
        await client.aclose()


async def test_batches_gone_or_final_without_leaving_the_active_set_free_their_place(
    batch_names: dict[str, Any],
) -> None:
    """A batch that vanished (a Redis flush of its record, an expiry) or turned final by a path that did not
    take it off its tenant's active set never holds a place among the ``max_active_batches`` for good: the
    create at the bound drops them, in the same script that counts and adds, and creates. A batch still
    running keeps its place."""
    config = BatchesConfig(redis_prefix=batch_names["prefix"])
    client = aioredis.Redis()
    try:
        jobs = Jobs(client, config)

        async def create() -> dict[str, Any]:
            return await jobs.create("acme:team", Caller("acme"), "file-x", "/v1/chat/completions", None, most=3)

        running, vanished, finished = [(await create())["id"] for _ in range(3)]
        await client.delete(jobs.key(vanished))
        await client.hset(jobs.key(finished), "status", b'"completed"')  # final, still in the active set
        assert await jobs.active_count("acme:team") == 3

        created = await create()
        assert await client.smembers(f"{batch_names['prefix']}:active:acme:team") == {
            running.encode(),
            created["id"].encode(),
        }
        await create()  # the third place, freed
        with pytest.raises(TooManyActive):
            await create()  # three running: the bound holds
        assert await jobs.active_count("acme:team") == 3
    finally:
        await client.aclose()
