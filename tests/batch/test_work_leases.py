"""The shared work of a batch in the real Redis: a lease keeps a line from a second replica until it
lapses, a renewal by a replica that lost its lease changes nothing, and a result is written once per
custom_id however many replicas report one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.work import Work
from gateway.pipeline.batch_config import BatchesConfig, Caller
from tests.support.batches import chat_line, jsonl


def test_leases_and_exactly_once_results(batch_names: dict[str, Any]) -> None:
    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], lease_s=0.3)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key)
            batch = await jobs.create("shared", Caller(""), "file-x", "/v1/chat/completions", None)
            lines = [b'{"custom_id": "a"}', b'{"custom_id": "b"}']
            await work.load_lines(batch["id"], lines, [1, 0])  # run order: line 1 first
            first = await work.claim(batch["id"], "replica-1", 5)
            assert [index for index, _ in first] == [1, 0]
            assert await work.claim(batch["id"], "replica-2", 5) == []  # both leased
            await work.release(batch["id"], "replica-1", [0])
            assert [i for i, _ in await work.claim(batch["id"], "replica-2", 5)] == [0]  # given back: free
            await asyncio.sleep(0.4)  # replica-1's lease on line 1 lapses (it died)
            assert [i for i, _ in await work.claim(batch["id"], "replica-2", 5)] == [1, 0]
            assert await work.renew(batch["id"], "replica-1", [1]) == 0  # no longer its lease
            assert await work.renew(batch["id"], "replica-2", [1, 0]) == 2
            results = await asyncio.gather(
                *(work.record(batch["id"], 1, "b", {"by": who}, ok=True, tokens=(5, 3)) for who in ("r1", "r2"))
            )
            assert sorted(results) == [False, True]
            assert not await work.record(batch["id"], 1, "b", {"by": "late"}, ok=False, tokens=(1, 1))
            record = await jobs.load(batch["id"])
            assert record is not None
            assert (record["n_completed"], record["n_failed"], record["n_output_tokens"]) == (1, 0, 3)
            assert len(await work.results(batch["id"], "out")) == 1 and await work.results(batch["id"], "err") == []
            assert await work.pending(batch["id"]) == 1
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_validation_overtaken_by_a_cancellation_leaves_no_work_behind(batch_names: dict[str, Any]) -> None:
    """Another replica cancelled and finalized the batch while this one was about to validate it (its
    record read as ``validating``): the lines this one loads are not left in Redis for good."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"])
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            files = Files(client, DirectoryStore(config.files_dir), config)
            work = Work(client, config, jobs.key)
            lifecycle = Lifecycle(jobs, files, work, config, "replica-1")
            lines = [chat_line("a", "x"), {**chat_line("b", "y"), "method": "GET"}]  # one runs, one malformed
            source = await files.create("shared", "in.jsonl", "batch", _once(jsonl(lines)))
            batch = await jobs.create("shared", Caller(""), source["id"], "/v1/chat/completions", None)
            record = await jobs.load(batch["id"])
            assert record is not None and record["status"] == "validating"
            other = Lifecycle(jobs, files, work, config, "replica-2")
            await jobs.move(batch["id"], ("validating",), "cancelling")
            assert await other.finalize(batch["id"], {**record, "status": "cancelling"}, "cancelled")
            await lifecycle.validate(batch["id"], record)
            batch_keys = [k async for k in client.scan_iter(match=f"{batch_names['prefix']}:b:{batch['id']}:*")]
            assert {k: await client.ttl(k) for k in batch_keys if await client.ttl(k) < 0} == {}
            final = await jobs.load(batch["id"])
            assert final is not None and final["status"] == "cancelled"
        finally:
            await client.aclose()

    asyncio.run(scenario())


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_the_contents_of_expired_output_files_leave_the_file_store(batch_names: dict[str, Any]) -> None:
    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], output_ttl_s=60)
        client = aioredis.Redis()
        try:
            files = Files(client, DirectoryStore(config.files_dir), config)
            upload = await files.create("shared", "in.jsonl", "batch", _once(b"{}\n"))
            outputs = [await files.create("shared", "out.jsonl", "batch_output", _once(b"{}\n")) for _ in range(3)]
            later = time.time() + 61
            assert await files.sweep(later) == 0  # Redis has not expired any yet: nothing is deleted
            for gone in outputs[:2]:
                await client.delete(f"{batch_names['prefix']}:file:{gone['id']}")  # what the TTL does
            await files.delete("shared", outputs[2]["id"])
            assert await files.sweep(time.time()) == 0  # not due yet
            assert await files.sweep(later) == 2
            assert sorted(p.name for p in batch_names["dir"].iterdir()) == [upload["id"]]
            assert await client.zcard(f"{batch_names['prefix']}:files-expiring") == 0
        finally:
            await client.aclose()

    asyncio.run(scenario())
