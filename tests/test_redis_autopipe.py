"""gateway/redis_autopipe.py against the real Redis: batching per loop turn, per-command errors,
scripts Redis does not know yet, callers that give up, and a Redis that is not there."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.redis_autopipe import AutoPipeline
from tests.fakes import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"


class CountingRedis(aioredis.Redis):
    """Counts the pipelines made, i.e. the batches sent."""

    pipelines = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.pipelines += 1
        return super().pipeline(*args, **kwargs)


@pytest.fixture
async def client() -> AsyncIterator[CountingRedis]:
    redis_client = CountingRedis.from_url(REDIS_URL, socket_timeout=2)
    yield redis_client
    await redis_client.aclose()


@pytest.fixture
async def prefix(client: CountingRedis) -> AsyncIterator[str]:
    """Keys of this test's own, deleted afterwards."""
    name = f"gwtest:autopipe:{uuid.uuid4().hex}"
    yield name
    keys = [k async for k in client.scan_iter(match=name + ":*")]
    if keys:
        await client.delete(*keys)


async def test_commands_of_one_loop_turn_go_as_one_pipeline(client: CountingRedis, prefix: str) -> None:
    pipe = AutoPipeline(client)
    await asyncio.gather(*(pipe.execute("SET", f"{prefix}:{i}", i) for i in range(20)))
    assert client.pipelines == 1
    values = await asyncio.gather(*(pipe.execute("GET", f"{prefix}:{i}") for i in range(20)))
    assert values == [str(i).encode() for i in range(20)]
    assert client.pipelines == 2
    await pipe.aclose()


async def test_sequential_commands_each_go_at_once(client: CountingRedis, prefix: str) -> None:
    pipe = AutoPipeline(client)
    for i in range(3):
        assert await pipe.execute("INCR", f"{prefix}:n") == i + 1
    assert client.pipelines == 3
    await pipe.aclose()


async def test_a_full_batch_is_sent_without_waiting_for_the_turn_to_end(client: CountingRedis, prefix: str) -> None:
    pipe = AutoPipeline(client, max_batch=4)
    results = await asyncio.gather(*(pipe.execute("SET", f"{prefix}:{i}", "v") for i in range(10)))
    assert results == [True] * 10
    assert client.pipelines == 3  # 4 + 4 + 2
    await pipe.aclose()


async def test_an_error_reaches_only_the_command_that_caused_it(client: CountingRedis, prefix: str) -> None:
    pipe = AutoPipeline(client)
    await client.lpush(f"{prefix}:list", "x")
    results = await asyncio.gather(
        pipe.execute("SET", f"{prefix}:a", "1"),
        pipe.execute("INCR", f"{prefix}:list"),  # WRONGTYPE
        pipe.execute("GET", f"{prefix}:a"),
        return_exceptions=True,
    )
    assert results[0] is True
    assert isinstance(results[1], ResponseError) and "WRONGTYPE" in str(results[1])
    assert results[2] == b"1"
    await pipe.aclose()


async def test_a_script_redis_does_not_know_is_loaded_and_run(client: CountingRedis, prefix: str) -> None:
    # A comment unique to this test gives a SHA that no Redis has loaded yet: the batch gets NOSCRIPT,
    # as it would from a Redis that restarted or flushed its scripts.
    script = client.register_script(f"-- {uuid.uuid4().hex}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1])")
    pipe = AutoPipeline(client)
    assert await pipe.evalsha(script, [f"{prefix}:s"], [5]) == 5
    assert await client.script_exists(script.sha) == [True]
    assert await pipe.evalsha(script, [f"{prefix}:s"], [2]) == 7  # now by SHA, in a batch
    await pipe.aclose()


async def test_a_caller_that_gives_up_leaves_the_batch_intact(client: CountingRedis, prefix: str) -> None:
    pipe = AutoPipeline(client)
    await client.set(f"{prefix}:k", "v")
    impatient = asyncio.ensure_future(pipe.execute("GET", f"{prefix}:k"))
    patient = asyncio.ensure_future(pipe.execute("GET", f"{prefix}:k"))
    await asyncio.sleep(0)
    impatient.cancel()
    assert await patient == b"v"
    with pytest.raises(asyncio.CancelledError):
        await impatient
    # The connection the batch used is still good for the next one.
    assert await pipe.execute("GET", f"{prefix}:k") == b"v"
    await pipe.aclose()


async def test_a_redis_that_is_not_there_fails_every_command_of_the_batch() -> None:
    absent = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    pipe = AutoPipeline(absent)
    results = await asyncio.gather(*(pipe.execute("GET", "k") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, (ConnectionError, OSError)) or "connect" in str(r).lower() for r in results), results
    assert all(isinstance(r, Exception) for r in results)
    await pipe.aclose()
    await absent.aclose()
