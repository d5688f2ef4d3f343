"""A batch's output and error files, written from its results in the real Redis: every result, in input
order whatever order the lines ran in, read a chunk at a time (a batch of many long answers is never in
the replica's memory whole)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.metrics import BatchMetrics
from gateway.batch.work import READ_CHUNK, Work
from gateway.ops.metrics import Metrics
from gateway.pipeline.batch_config import BatchesConfig, Caller
from tests.support.batches import batch_in_progress, chat_line

LINES = 3 * READ_CHUNK + 5  # more than one chunk of each file
ANSWER = "x" * 4000


class MeasuredRedis(aioredis.Redis):
    """A client that keeps the size (bytes, all elements) of the largest reply it was sent."""

    largest = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = await super().execute_command(*args, **options)
        self.largest = max(self.largest, _size(reply))
        return reply


def _size(reply: Any) -> int:
    if isinstance(reply, list | tuple):
        return sum(_size(item) for item in reply)
    return len(reply) if isinstance(reply, bytes | str) else 8


async def _finished_batch(client: aioredis.Redis, config: BatchesConfig) -> tuple[Jobs, Files, str]:
    """A batch of ``LINES`` lines run in a shuffled order, every third one failed, finalized: its jobs,
    files and id."""
    jobs = Jobs(client, config)
    files = Files(client, DirectoryStore(config.files_dir), config)
    work = Work(client, config, jobs.key)
    batch = await jobs.create("shared", Caller(""), "file-x", "/v1/chat/completions", None)
    lines = [orjson.dumps(chat_line(f"c-{i}", f"q{i}")) for i in range(LINES)]
    order = list(range(LINES))
    random.Random(7).shuffle(order)
    await work.load_lines(batch["id"], lines, order)
    assert await jobs.move(batch["id"], ("validating",), "in_progress", n_total=LINES)
    while claimed := await work.claim(batch["id"], "replica-1", 100):
        for index, _ in claimed:
            ok = index % 3 != 0
            line = {"custom_id": f"c-{index}", "answer": ANSWER if ok else None}
            assert await work.record(batch["id"], index, line, ok=ok, tokens=(1, 1), owner="replica-1")
    record = await jobs.load(batch["id"])
    assert record is not None
    assert await Lifecycle(jobs, files, work, config, "replica-1", BatchMetrics(Metrics())).finalize(
        batch["id"], record, "completed"
    )
    return jobs, files, str(batch["id"])


async def _file_ids(jobs: Jobs, files: Files, batch_id: str) -> dict[str, list[str]]:
    final = await jobs.load(batch_id)
    assert final is not None and final["status"] == "completed"
    ids = {}
    for name in ("output", "error"):
        content = b"".join([piece async for piece in files.content(final[f"{name}_file_id"])])
        ids[name] = [orjson.loads(line)["custom_id"] for line in content.splitlines()]
    return ids


def test_every_result_is_written_in_input_order(batch_names: dict[str, Any]) -> None:
    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = aioredis.Redis()
        try:
            ids = await _file_ids(*await _finished_batch(client, config))
        finally:
            await client.aclose()
        assert ids["output"] == [f"c-{i}" for i in range(LINES) if i % 3 != 0]
        assert ids["error"] == [f"c-{i}" for i in range(LINES) if i % 3 == 0]

    asyncio.run(scenario())


def test_the_results_are_read_a_chunk_at_a_time(batch_names: dict[str, Any]) -> None:
    """No reply from Redis while the files are written holds more than one chunk of answers: the
    largest is bounded by ``READ_CHUNK`` lines, not by the batch's ``LINES``."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = MeasuredRedis()
        try:
            await _finished_batch(client, config)
        finally:
            await client.aclose()
        bound = READ_CHUNK * (len(ANSWER) + 100)
        assert bound < (LINES * 2 // 3) * len(ANSWER)  # the answers, read at once, would be over it
        assert 0 < client.largest <= bound

    asyncio.run(scenario())


class StallingRedis(aioredis.Redis):
    """A client that, before its ``at``-th command ``stall`` on a batch's answers, lets ``meanwhile`` run."""

    meanwhile: Any = None
    stall: tuple[str, int] = ("", 0)
    seen = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == self.stall[0] and str(args[1]).endswith(":out"):
            self.seen += 1
            if self.seen == self.stall[1]:
                await self.meanwhile()
        return await super().execute_command(*args, **options)


@pytest.mark.parametrize("stall", [("HKEYS", 1), ("HMGET", 2)], ids=["before-any-read", "after-one-chunk"])
def test_a_finalization_taken_over_midway_leaves_the_whole_file(
    batch_names: dict[str, Any], stall: tuple[str, int]
) -> None:
    """A replica's finalization outlasts its lock (a slow file store) and another replica's, taking the
    step over, writes the files and finalizes the batch, dropping its results, while the first still
    reads them: the first must not replace the whole output file with the part it had read (or none)."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client, slow = aioredis.Redis(), StallingRedis()
        try:
            jobs, files = Jobs(client, config), Files(client, DirectoryStore(config.files_dir), config)
            work = Work(client, config, jobs.key)
            batch_id = await batch_in_progress(jobs, work, [orjson.dumps(chat_line(f"c-{i}", "q")) for i in range(6)])
            for index, _ in await work.claim(batch_id, "replica-1", 6):
                line = {"custom_id": f"c-{index}", "answer": ANSWER}
                assert await work.record(batch_id, index, line, ok=True, tokens=(1, 1), owner="replica-1")
            record = await jobs.load(batch_id)
            assert record is not None

            def lifecycle(redis: aioredis.Redis, owner: str) -> Lifecycle:
                jobs_of = Jobs(redis, config)
                work_of = Work(redis, config, jobs_of.key, read_chunk=2)
                files_of = Files(redis, DirectoryStore(config.files_dir), config)
                return Lifecycle(jobs_of, files_of, work_of, config, owner, BatchMetrics(Metrics()))

            async def taken_over() -> None:
                await client.delete(work.key(batch_id, "finalize-lock"))  # the first one's lock lapsed
                current = await jobs.load(batch_id)
                assert current is not None
                assert await lifecycle(client, "replica-2").finalize(batch_id, current, "completed")

            slow.meanwhile, slow.stall = taken_over, stall
            assert not await lifecycle(slow, "replica-1").finalize(batch_id, record, "completed")
            final = await jobs.load(batch_id)
            assert final is not None and final["status"] == "completed"
            content = b"".join([piece async for piece in files.content(final["output_file_id"])])
            assert [orjson.loads(line)["custom_id"] for line in content.splitlines()] == [f"c-{i}" for i in range(6)]
        finally:
            await client.aclose()
            await slow.aclose()

    asyncio.run(scenario())


def test_lines_past_the_body_bound_are_not_parsed_when_a_cancel_writes_them_off(batch_names: dict[str, Any]) -> None:
    """Lines loaded within an earlier, larger bound (``limits.max_body_bytes`` lowered since): a cancel
    writes them off (``batch_cancelled``) without parsing them for their custom_id, named by their place."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key)
            files = Files(client, DirectoryStore(config.files_dir), config)
            huge = orjson.dumps(chat_line("huge", "x" * 8000))
            batch_id = await batch_in_progress(jobs, work, [huge, huge.replace(b"huge", b"other")])
            lifecycle = Lifecycle(jobs, files, work, config, "replica-1", BatchMetrics(Metrics()), lambda: 1024)
            record = await jobs.load(batch_id)
            assert record is not None
            assert await lifecycle.finalize(batch_id, record, "cancelled")
            final = await jobs.load(batch_id)
            assert final is not None and final["status"] == "cancelled"
            content = b"".join([piece async for piece in files.content(final["error_file_id"])])
            lines = [orjson.loads(line) for line in content.splitlines()]
        finally:
            await client.aclose()
        assert [(line["custom_id"], line["error"]["code"]) for line in lines] == [(None, "batch_cancelled")] * 2

    asyncio.run(scenario())
