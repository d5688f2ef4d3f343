"""``gateway_batch_lines_total`` counts each line once, with its final outcome, summed over replicas as a
dashboard sums them: a line two replicas ran (a lease taken over from a slow one) is not counted by both,
and a line whose first run failed and whose second succeeded is one completed line, as the batch's
``request_counts`` show it. The runs' results go through each replica's runner (``Runner._keep``, what the
submitter calls with a run's outcome) into the real Redis."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.metrics import BatchMetrics
from gateway.batch.runner import Runner
from gateway.batch.submit import Outcome
from gateway.batch.work import Work
from gateway.ops.metrics import Metrics
from gateway.pipeline.batch_config import BatchesConfig
from tests.support.batches import batch_in_progress, chat_line

ANSWER = Outcome(200, {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}, "req-ok")
REFUSAL = Outcome(500, {"error": {"message": "The worker gave up.", "type": "server_error"}}, "req-err")


def replica(owner: str, jobs: Jobs, work: Work, config: BatchesConfig) -> Runner:
    """A replica's runner, with its own metrics registry and the parts recording a result reads."""
    metrics = BatchMetrics(Metrics())
    lifecycle = Lifecycle(
        jobs, Files(jobs.redis, DirectoryStore(config.files_dir), config), work, config, owner, metrics
    )
    parts: dict[str, Any] = {"holder": SimpleNamespace(), "services": None, "submitter": None}
    return Runner(**parts, jobs=jobs, work=work, lifecycle=lifecycle, metrics=metrics)


def counted(replicas: list[Runner]) -> dict[str, int]:
    """``sum by (outcome) (gateway_batch_lines_total)`` over the replicas."""
    totals = {"completed": 0, "failed": 0}
    for runner in replicas:
        for family in runner.metrics.lines.collect():
            for sample in family.samples:
                if sample.name == "gateway_batch_lines_total":
                    totals[sample.labels["outcome"]] += int(sample.value)
    return totals


def test_each_line_is_counted_once_with_its_final_outcome(batch_names: dict[str, Any]) -> None:
    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key)
            slow, taker = replica("slow", jobs, work, config), replica("taker", jobs, work, config)
            ids = [f"c-{i}" for i in range(5)]
            batch_id = await batch_in_progress(jobs, work, [orjson.dumps(chat_line(c, c)) for c in ids])
            assert [i for i, _ in await work.claim(batch_id, "slow", 5)] == [0, 1, 2, 3, 4]
            await client.zadd(work.key(batch_id, "leases"), {"0": 0, "1": 0, "2": 0})  # the slow one stalls
            assert [i for i, _ in await work.claim(batch_id, "taker", 5)] == [0, 1, 2]

            async def keep(runner: Runner, index: int, outcome: Outcome) -> bool:
                return await runner._keep(batch_id, index, ids[index], outcome)

            # lines 0-2: the slow replica's worker gave up; the taker still holds them
            assert [await keep(slow, i, REFUSAL) for i in (0, 1, 2)] == [True, True, True]
            assert counted([slow, taker]) == {"completed": 0, "failed": 0}  # a success may still replace them
            assert await keep(taker, 0, ANSWER)  # line 0: the second run answered, replacing the error
            assert not await keep(taker, 1, REFUSAL)  # line 1: it failed too; the first error stays
            assert counted([slow, taker]) == {"completed": 1, "failed": 1}
            assert [await keep(slow, 3, ANSWER), await keep(slow, 4, REFUSAL)] == [True, True]  # one run each
            assert counted([slow, taker]) == {"completed": 2, "failed": 2}
            # line 2: the taker's replica died; once its lease lapses the batch is finalized, line 2 failed
            await client.zadd(work.key(batch_id, "leases"), {"2": 0})
            assert await work.running(batch_id) == 0
            record = await jobs.load(batch_id)
            assert record is not None
            assert await slow.lifecycle.finalize(batch_id, record, "completed")
            final = await jobs.load(batch_id)
            assert final is not None and final["status"] == "completed"
            assert counted([slow, taker]) == {"completed": 2, "failed": 3}
            assert (final["n_completed"], final["n_failed"]) == (2, 3)  # as request_counts say
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_line_is_counted_once_whichever_of_its_runs_records_first(batch_names: dict[str, Any]) -> None:
    """The run holding the line may record an error while a run whose lease it took over still runs (a
    stalled replica), and a line may be taken over twice: whichever run answers last, the line is one
    line, counted with the outcome the batch ends with."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key)
            names = ("slow", "taker", "third")
            slow, taker, third = (replica(name, jobs, work, config) for name in names)
            ids = ["c-0", "c-1"]
            batch_id = await batch_in_progress(jobs, work, [orjson.dumps(chat_line(c, c)) for c in ids])
            for runner in (slow, taker, third):  # each run's lease lapses before the next run claims
                assert await work.claim(batch_id, runner.owner, 2)
                await client.zadd(work.key(batch_id, "leases"), {"0": 0, "1": 0})
            await client.zadd(work.key(batch_id, "leases"), {"1": 2**50})  # the third run holds line 1
            lease = {"0": 2**50}

            async def keep(runner: Runner, index: int, outcome: Outcome) -> bool:
                return await runner._keep(batch_id, index, ids[index], outcome)

            # line 0: the third run held it; its worker gave up, then the stalled slow run answered
            await client.zadd(work.key(batch_id, "leases"), lease)
            assert await keep(third, 0, REFUSAL)
            assert await keep(slow, 0, ANSWER)  # the answer replaces the error
            # line 1: the slow and the taker runs failed, then the third run, holding it, answered
            assert await keep(slow, 1, REFUSAL)
            assert not await keep(taker, 1, REFUSAL)
            assert await keep(third, 1, ANSWER)
            final = await jobs.load(batch_id)
            assert final is not None and (final["n_completed"], final["n_failed"]) == (2, 0)
            assert counted([slow, taker, third]) == {"completed": 2, "failed": 0}
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_line_given_back_unrun_leaves_no_run_to_wait_for(batch_names: dict[str, Any]) -> None:
    """A line claimed and given back before it was sent (no room on its model now) never ran: the next
    run's failure is final at once, not held for a run that will never record."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key)
            first, second = replica("first", jobs, work, config), replica("second", jobs, work, config)
            batch_id = await batch_in_progress(jobs, work, [orjson.dumps(chat_line("c-0", "c-0"))])
            assert await work.claim(batch_id, "first", 1)
            await work.release(batch_id, "first", [0])
            assert await work.claim(batch_id, "second", 1)
            assert await second._keep(batch_id, 0, "c-0", REFUSAL)
            assert counted([first, second]) == {"completed": 0, "failed": 1}
        finally:
            await client.aclose()

    asyncio.run(scenario())
