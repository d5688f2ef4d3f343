"""The shared work of a batch in the real Redis: a lease keeps a line from a second replica until it
lapses, a renewal by a replica that lost its lease changes nothing, and a result is written once per
line however many replicas report one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.metrics import BatchMetrics
from gateway.batch.work import Work
from gateway.ops.metrics import Metrics
from gateway.pipeline.batch_config import BatchesConfig, Caller
from tests.support.batches import batch_in_progress, chat_line, jsonl


async def read_all(work: Work, batch_id: str, part: str) -> list[bytes]:
    """All of the batch's output (``out``) or error (``err``) lines, in the order ``Work.results`` gives."""
    return [line async for line in work.results(batch_id, part)]


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
            assert await work.claim(batch["id"], "replica-1", 5) == []  # not yet in progress: nothing to run
            assert await jobs.move(batch["id"], ("validating",), "in_progress")
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
                *(
                    work.record(batch["id"], 1, {"by": who}, ok=True, tokens=(5, 3), owner=who)
                    for who in ("replica-1", "replica-2")
                )
            )
            assert sorted(results) == [False, True]
            late = {"by": "late"}
            assert not await work.record(batch["id"], 1, late, ok=False, tokens=(1, 1), owner="replica-1")
            record = await jobs.load(batch["id"])
            assert record is not None
            assert (record["n_completed"], record["n_failed"], record["n_output_tokens"]) == (1, 0, 3)
            assert len(await read_all(work, batch["id"], "out")) == 1 and await read_all(work, batch["id"], "err") == []
            assert await work.pending(batch["id"]) == 1
            assert await work.running(batch["id"]) == 1  # line 0, still replica-2's
            await work.release(batch["id"], "replica-2", [0])
            assert await jobs.move(batch["id"], ("in_progress",), "cancelling")
            assert await work.claim(batch["id"], "replica-1", 5) == []  # cancelled since: line 0 is not run
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_success_replaces_an_error_while_the_batch_is_in_progress(batch_names: dict[str, Any]) -> None:
    """A line two runs answered (a lease taken over from a slow replica): the slow run's error, written
    first, gives way to the other run's success, with the counts and tokens of the success alone, and
    the batch is not done while that run holds its lease. Nothing else is replaced: not a success, not
    by an error, not once the batch is being finalized."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key)
            batch_id = await batch_in_progress(jobs, work, [b'{"custom_id": "a"}', b'{"custom_id": "b"}'])
            assert [i for i, _ in await work.claim(batch_id, "slow", 2)] == [0, 1]
            await client.zadd(work.key(batch_id, "leases"), {"0": 0})  # line 0's lease lapses
            assert [i for i, _ in await work.claim(batch_id, "taker", 2)] == [0]

            async def record(index: int, ok: bool, tokens: tuple[int, int], owner: str) -> bool:
                return await work.record(batch_id, index, {"by": owner}, ok=ok, tokens=tokens, owner=owner)

            async def counts() -> tuple[int, ...]:
                loaded = await jobs.load(batch_id)
                assert loaded is not None
                fields = ("n_completed", "n_failed", "n_input_tokens", "n_output_tokens")
                return tuple(loaded[f] for f in fields)

            assert await record(0, False, (4, 2), "slow")  # an error counts no tokens, whatever it was given
            assert (await work.pending(batch_id), await work.running(batch_id)) == (1, 2)  # the taker's lease stays
            assert await counts() == (0, 1, 0, 0)
            assert await record(0, True, (5, 3), "taker")
            assert await counts() == (1, 0, 5, 3)
            assert await read_all(work, batch_id, "err") == []
            assert await read_all(work, batch_id, "out") == [b'{"by":"taker"}']
            assert await work.running(batch_id) == 1  # line 1, the slow replica's
            assert not await record(0, True, (5, 3), "slow")  # a success stays the first one written
            assert not await record(0, False, (1, 1), "slow")
            assert await record(1, False, (0, 0), "slow")
            assert (await work.pending(batch_id), await work.running(batch_id)) == (0, 0)
            assert await jobs.move(batch_id, ("in_progress",), "finalizing")
            assert not await record(1, True, (1, 1), "late")  # the batch's files are being written
            assert await counts() == (1, 1, 5, 3)
            assert len(await read_all(work, batch_id, "err")) == 1
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
            lifecycle = Lifecycle(jobs, files, work, config, "replica-1", BatchMetrics(Metrics()))
            lines = [chat_line("a", "x"), {**chat_line("b", "y"), "method": "GET"}]  # one runs, one malformed
            source = await files.create("shared", "in.jsonl", "batch", _once(jsonl(lines)))
            batch = await jobs.create("shared", Caller(""), source["id"], "/v1/chat/completions", None)
            record = await jobs.load(batch["id"])
            assert record is not None and record["status"] == "validating"
            other = Lifecycle(jobs, files, work, config, "replica-2", BatchMetrics(Metrics()))
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


def test_a_batch_cancelled_while_it_was_validated_counts_the_lines_it_writes_off(
    batch_names: dict[str, Any],
) -> None:
    """The owner cancelled the batch while this replica was reading its input (a large file takes a while):
    the cancellation writes off the lines the validation loaded, and ``request_counts`` counts them in the
    total, never more lines failed than the batch has."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"])
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            files = Files(client, DirectoryStore(config.files_dir), config)
            work = Work(client, config, jobs.key)
            lifecycle = Lifecycle(jobs, files, work, config, "replica-1", BatchMetrics(Metrics()))
            lines = [chat_line("a", "x"), chat_line("b", "y"), {**chat_line("c", "z"), "method": "GET"}]
            source = await files.create("shared", "in.jsonl", "batch", _once(jsonl(lines)))
            batch = await jobs.create("shared", Caller(""), source["id"], "/v1/chat/completions", None)
            record = await jobs.load(batch["id"])
            assert record is not None and record["status"] == "validating"
            assert await jobs.move(batch["id"], ("validating",), "cancelling", _cancelled_by="owner")
            await lifecycle.validate(batch["id"], record)  # read as validating: the cancel came during it
            cancelling = await jobs.load(batch["id"])
            assert cancelling is not None and cancelling["status"] == "cancelling"
            assert await lifecycle.finalize(batch["id"], cancelling, "cancelled")
            final = await jobs.get("shared", batch["id"])
            assert final is not None and final["status"] == "cancelled"
            assert final["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
            content = b"".join([piece async for piece in files.content(final["error_file_id"])])
            codes = [line["error"]["code"] for line in map(orjson.loads, content.splitlines())]
            assert codes == ["batch_cancelled", "batch_cancelled", "invalid_method"]
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_run_ending_after_its_batch_is_final_records_nothing(batch_names: dict[str, Any]) -> None:
    """A slow replica's run (its lease was taken over) ends after the batch was finalized and its work
    dropped: its result is not written (so not charged), and no key of the batch's work comes back."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"])
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            files = Files(client, DirectoryStore(config.files_dir), config)
            work = Work(client, config, jobs.key)
            lifecycle = Lifecycle(jobs, files, work, config, "replica-1", BatchMetrics(Metrics()))
            batch_id = await batch_in_progress(jobs, work, [orjson.dumps(chat_line("a", "x"))])
            assert [i for i, _ in await work.claim(batch_id, "taker", 1)] == [0]
            line = {"custom_id": "a", "error": None}
            assert await work.record(batch_id, 0, line, ok=True, tokens=(5, 3), owner="taker")
            record = await jobs.load(batch_id)
            assert record is not None
            assert await lifecycle.finalize(batch_id, record, "completed")
            assert [k async for k in client.scan_iter(match=f"{batch_names['prefix']}:b:{batch_id}:*")] == []
            for ok in (True, False):
                assert not await work.record(batch_id, 0, line, ok=ok, tokens=(5, 3), owner="slow")
            assert [k async for k in client.scan_iter(match=f"{batch_names['prefix']}:b:{batch_id}:*")] == []
            final = await jobs.get("shared", batch_id)
            assert final is not None and final["status"] == "completed"
            assert final["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
            assert final["usage"]["total_tokens"] == 8
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_finalized_batch_whose_work_was_not_dropped_leaves_none_of_it_for_good(batch_names: dict[str, Any]) -> None:
    """The drop after a batch's move to its final status failed (Redis went away, the replica died): no
    round ever sees the batch again to drop its work, so its lines and results must expire by themselves."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"])
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            files = Files(client, DirectoryStore(config.files_dir), config)
            work = Work(client, config, jobs.key)
            lifecycle = Lifecycle(jobs, files, work, config, "replica-1", BatchMetrics(Metrics()))
            source = await files.create("shared", "in.jsonl", "batch", _once(jsonl([chat_line("a", "x")])))
            batch = await jobs.create("shared", Caller(""), source["id"], "/v1/chat/completions", None)
            record = await jobs.load(batch["id"])
            assert record is not None
            await lifecycle.validate(batch["id"], record)

            async def lost(batch_id: str) -> None:
                raise ConnectionError("Redis went away")

            work.drop = lost  # type: ignore[method-assign]
            moved = await jobs.move(batch["id"], ("in_progress",), "cancelling")
            assert moved
            with pytest.raises(ConnectionError):
                await lifecycle.finalize(batch["id"], {**record, "status": "cancelling"}, "cancelled")
            final = await jobs.load(batch["id"])
            assert final is not None and final["status"] == "cancelled"
            pattern = f"{batch_names['prefix']}:b:{batch['id']}:*"
            left = [k async for k in client.scan_iter(match=pattern)]
            assert left  # the lines and the written-off result: not dropped
            assert {k: await client.ttl(k) for k in left if await client.ttl(k) < 0} == {}
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


def test_a_success_written_first_does_not_wait_for_the_other_run(batch_names: dict[str, Any]) -> None:
    """The slow replica's run answers a line whose lease another replica took over and is still running:
    nothing can replace that answer, so the line holds no live lease and the batch is not kept from
    finalizing until the other run, whose answer is delivered to nobody, ends."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key)
            batch_id = await batch_in_progress(jobs, work, [b'{"custom_id": "a"}'])
            assert [i for i, _ in await work.claim(batch_id, "slow", 1)] == [0]
            await client.zadd(work.key(batch_id, "leases"), {"0": 0})  # its lease lapses
            assert [i for i, _ in await work.claim(batch_id, "taker", 1)] == [0]
            assert await work.record(batch_id, 0, {"by": "slow"}, ok=True, tokens=(5, 3), owner="slow")
            assert (await work.pending(batch_id), await work.running(batch_id)) == (0, 0)
            assert await work.renew(batch_id, "taker", [0]) == 0  # the taker's run goes on, holding nothing
            assert not await work.record(batch_id, 0, {"by": "taker"}, ok=True, tokens=(5, 3), owner="taker")
            assert await read_all(work, batch_id, "out") == [b'{"by":"slow"}']
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_run_ending_while_an_expiry_is_written_changes_no_result(batch_names: dict[str, Any]) -> None:
    """The window passed: a replica finalizes the batch as expired, its status still ``in_progress`` while
    it writes the lines left off and reads the results into the files. Runs of two lines end on another
    replica meanwhile, both with an answer: line "a", which was written off (it was still running), and
    line "b", whose first run's error was written (the answer is its second run's). Neither answer replaces
    the error: the files and the counts keep what the finalization read, and no answer is recorded (and
    so charged) that no file holds."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            files = Files(client, DirectoryStore(config.files_dir), config)
            work = Work(client, config, jobs.key)
            lifecycle = Lifecycle(jobs, files, work, config, "replica-1", BatchMetrics(Metrics()))
            batch_id = await batch_in_progress(jobs, work, [orjson.dumps(chat_line(c, c)) for c in "ab"])
            assert [i for i, _ in await work.claim(batch_id, "slow", 2)] == [0, 1]
            await client.zadd(work.key(batch_id, "leases"), {"1": 0})  # line 1's lease lapses
            assert [i for i, _ in await work.claim(batch_id, "taker", 2)] == [1]

            async def record(custom_id: str, ok: bool, owner: str) -> bool:
                line = {"custom_id": custom_id, "by": owner, "error": None}
                index = "ab".index(custom_id)
                return await work.record(batch_id, index, line, ok=ok, tokens=(5, 3), owner=owner)

            assert await record("b", False, "slow")  # the slow replica's worker refused line "b"
            answers: list[bool] = []
            read_results = work.results

            async def results_as_runs_end(batch: str, part: str, count: int = 0) -> AsyncIterator[bytes]:
                if part == "err":  # the output lines were read: the other replica's runs end now
                    answers.extend([await record("a", True, "slow"), await record("b", True, "taker")])
                async for line in read_results(batch, part, count):
                    yield line

            work.results = results_as_runs_end  # type: ignore[method-assign]
            record_read = await jobs.load(batch_id)
            assert record_read is not None
            assert await lifecycle.finalize(batch_id, record_read, "expired")
            assert answers == [False, False]
            final = await jobs.load(batch_id)
            assert final is not None and final["status"] == "expired"
            assert (final["n_completed"], final["n_failed"]) == (0, 2)
            assert final["output_file_id"] is None
            content = b"".join([piece async for piece in files.content(final["error_file_id"])])
            errors = [orjson.loads(line) for line in content.splitlines()]
            assert [(e["custom_id"], e["error"] and e["error"]["code"], e.get("by")) for e in errors] == [
                ("a", "batch_expired", None),
                ("b", None, "slow"),
            ]
        finally:
            await client.aclose()

    asyncio.run(scenario())
