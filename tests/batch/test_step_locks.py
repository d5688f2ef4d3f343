"""The locks of a batch's validation and finalization in the real Redis, with two ``Lifecycle`` objects as
two replicas: a lock is renewed while its step runs (a slow validation is not run a second time), is
deleted only by the replica holding it, and a step that lost its lock writes nothing; lines loaded again
(a validation run twice all the same) do not put back a line already loaded or done."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.metrics import BatchMetrics
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
