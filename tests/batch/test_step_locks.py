"""The locks of a batch's validation and finalization in the real Redis, with two ``Lifecycle`` objects as
two replicas: a lock is renewed while its step runs (a slow validation is not run a second time), is
deleted only by the replica holding it, and a step that lost its lock writes nothing; lines loaded again
(a validation run twice all the same) do not put back a line already loaded or done."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from redis.asyncio.lock import Lock

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.metrics import BatchMetrics
from gateway.batch.step_lock import hold
from gateway.batch.work import Work
from gateway.ops.metrics import Metrics
from gateway.pipeline.batch_config import BatchesConfig, Caller
from tests.support.batches import chat_line, jsonl

LINES = [chat_line("a", "x"), chat_line("b", "y")]


class Replicas:
    """Two replicas' lifecycles on one Redis, and a batch to validate whose input file the test holds up."""

    def __init__(self, client: aioredis.Redis, config: BatchesConfig) -> None:
        self.config = config
        self.jobs = Jobs(client, config)
        self.files = Files(client, DirectoryStore(config.files_dir), config)
        self.work = Work(client, config, self.jobs.key)
        self.gate = asyncio.Event()  # the held-up read goes on once set
        self.reading = asyncio.Event()  # set once the held-up read started
        slow = Files(client, DirectoryStore(config.files_dir), config)
        slow.content = self._held_up(slow.content)  # type: ignore[method-assign]
        self.first = Lifecycle(self.jobs, slow, self.work, config, "replica-1", BatchMetrics(Metrics()))
        self.second = Lifecycle(self.jobs, self.files, self.work, config, "replica-2", BatchMetrics(Metrics()))

    def _held_up(self, read: Callable[[str], AsyncIterator[bytes]]) -> Callable[[str], AsyncIterator[bytes]]:
        async def content(file_id: str) -> AsyncIterator[bytes]:
            self.reading.set()
            await self.gate.wait()
            async for piece in read(file_id):
                yield piece

        return content

    async def batch(self) -> tuple[str, dict[str, Any]]:
        source = await self.files.create("shared", "in.jsonl", "batch", _once(jsonl(LINES)))
        batch = await self.jobs.create("shared", Caller(""), source["id"], "/v1/chat/completions", None)
        record = await self.jobs.load(batch["id"])
        assert record is not None and record["status"] == "validating"
        return str(batch["id"]), record


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def run(batch_names: dict[str, Any], scenario: Callable[[Replicas, aioredis.Redis], Awaitable[None]]) -> None:
    async def main() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=0.3)
        client = aioredis.Redis()
        try:
            await scenario(Replicas(client, config), client)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_slow_validation_keeps_its_lock_and_is_not_run_twice(batch_names: dict[str, Any]) -> None:
    """The first replica's validation outlasts ``lease_s`` (a large input on a busy replica): its lock is
    renewed, so the second replica's round does not validate the batch again meanwhile."""

    async def scenario(replicas: Replicas, client: aioredis.Redis) -> None:
        batch_id, record = await replicas.batch()
        slow = asyncio.create_task(replicas.first.validate(batch_id, record))
        await replicas.reading.wait()
        await asyncio.sleep(replicas.config.lease_s * 2)  # past the lease the lock was taken for
        await replicas.second.validate(batch_id, record)
        assert await replicas.work.pending(batch_id) == 0  # the second replica loaded nothing
        still = await replicas.jobs.load(batch_id)
        assert still is not None and still["status"] == "validating"
        replicas.gate.set()
        await slow
        done = await replicas.jobs.load(batch_id)
        assert done is not None and done["status"] == "in_progress"
        assert await replicas.work.pending(batch_id) == len(LINES)
        assert await client.exists(replicas.work.key(batch_id, "validate-lock")) == 0  # let go once done

    run(batch_names, scenario)


def test_a_validation_that_lost_its_lock_neither_writes_nor_deletes_the_new_holders(
    batch_names: dict[str, Any],
) -> None:
    """The first replica's lock was taken over while it read the input (it stalled past its lease): it
    loads no line, does not move the batch, and leaves the lock of the replica that holds it now."""

    async def scenario(replicas: Replicas, client: aioredis.Redis) -> None:
        batch_id, record = await replicas.batch()
        key = replicas.work.key(batch_id, "validate-lock")
        slow = asyncio.create_task(replicas.first.validate(batch_id, record))
        await replicas.reading.wait()
        await client.set(key, "replica-2-token", px=60_000)  # lapsed, and taken by another replica
        replicas.gate.set()
        await slow
        assert await client.get(key) == b"replica-2-token"
        assert await replicas.work.pending(batch_id) == 0
        still = await replicas.jobs.load(batch_id)
        assert still is not None and still["status"] == "validating"

    run(batch_names, scenario)


def test_a_finalization_that_lost_its_lock_writes_nothing(batch_names: dict[str, Any]) -> None:
    """The first replica's finalization lost its lock while it counted the results: it writes no file and
    does not move the batch on; the replica holding the lock now finalizes it."""

    async def scenario(replicas: Replicas, client: aioredis.Redis) -> None:
        batch_id, record = await replicas.batch()
        await replicas.second.validate(batch_id, record)
        for index, line in await replicas.work.claim(batch_id, "runner", 5):
            result = {"custom_id": orjson.loads(line)["custom_id"], "response": {"status_code": 200}}
            await replicas.work.record(batch_id, index, result, ok=True, tokens=(1, 1), owner="runner")
        key = replicas.work.key(batch_id, "finalize-lock")
        count = replicas.work.count

        async def held_up_count(batch: str, part: str) -> int:
            replicas.reading.set()
            await replicas.gate.wait()
            return await count(batch, part)

        replicas.work.count = held_up_count  # type: ignore[method-assign]
        current = await replicas.jobs.load(batch_id)
        assert current is not None
        slow = asyncio.create_task(replicas.first.finalize(batch_id, current, "completed"))
        await replicas.reading.wait()
        await client.set(key, "replica-2-token", px=60_000)
        replicas.gate.set()
        assert not await slow
        assert await client.get(key) == b"replica-2-token"
        final = await replicas.jobs.load(batch_id)
        assert final is not None and final["status"] == "finalizing" and final["output_file_id"] is None
        assert await replicas.work.count(batch_id, "out") == len(LINES)  # the results are still there

    run(batch_names, scenario)


def test_lines_loaded_again_do_not_put_back_lines_loaded_or_done(batch_names: dict[str, Any]) -> None:
    """A second validation's ``load_lines`` (two ran all the same) leaves the work as the first left it: a
    line with a result is not run again, one leased stays leased."""

    async def scenario(replicas: Replicas, client: aioredis.Redis) -> None:
        batch_id, _ = await replicas.batch()
        await replicas.work.load_lines(batch_id, [orjson.dumps(line) for line in LINES], [0, 1])
        assert await replicas.jobs.move(batch_id, ("validating",), "in_progress", n_total=len(LINES))
        [(index, line)] = await replicas.work.claim(batch_id, "runner", 1)
        result = {"custom_id": orjson.loads(line)["custom_id"], "response": {"status_code": 200}}
        assert await replicas.work.record(batch_id, index, result, ok=True, tokens=(1, 1), owner="runner")
        await replicas.work.load_lines(batch_id, [orjson.dumps(line) for line in LINES], [1, 0])
        assert await replicas.work.pending(batch_id) == 1  # only the line not done
        assert [i for i, _ in await replicas.work.claim(batch_id, "runner", 5)] == [1]

    run(batch_names, scenario)


def test_a_renewal_whose_cancellation_is_swallowed_does_not_hold_its_step(
    batch_names: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py can swallow a cancellation that lands inside a command (seen here in about one in twenty
    renewals cut at a random point): the renewal then ran on, renewing the lock for ever, and the step's
    ``hold`` waited on it for ever (a full run of the suite hung in the test above for its 600 s)."""
    renewing = asyncio.Event()

    async def reacquire(self: Lock) -> bool:
        renewing.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return True  # the cancellation is lost, as inside redis-py
        return True

    monkeypatch.setattr(Lock, "reacquire", reacquire)

    async def main() -> None:
        client = aioredis.Redis()
        key = f"{batch_names['prefix']}:swallowed-lock"
        try:

            async def step() -> None:
                async with hold(client, key, 0.3, "replica-1"):
                    await renewing.wait()  # the renewal is inside its Redis call when the step ends

            await asyncio.wait_for(step(), 5)
            assert await client.exists(key) == 0  # let go
        finally:
            await client.aclose()

    asyncio.run(main())
