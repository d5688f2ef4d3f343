"""The batch runner stops when cancelled (at shutdown) even when the Redis call it was in turns the
cancellation into an error of its own: its loop catches Redis errors to go on with the next round, and
without ``stop_if_cancelled`` it went on waiting for that round with the cancellation swallowed, so the
app's shutdown (``cancel_and_wait``) waited for ever."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.batch.runner import Runner
from gateway.ops.tasks import stop_if_cancelled


class _CutJobs:
    """``Jobs.active`` whose Redis read, cancelled, raises the client's own error instead."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()

    async def active(self) -> list[str]:
        self.reading.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None
        return []


def _runner(jobs: _CutJobs) -> Runner:
    """A runner whose parts other than ``jobs`` hold only what a round that ends in an error reads."""
    config = SimpleNamespace(batches=SimpleNamespace(poll_interval_s=0.05, max_in_flight=1))
    parts: dict[str, Any] = {
        "holder": SimpleNamespace(current=SimpleNamespace(config=config)),
        "services": None,
        "jobs": jobs,
        "work": None,
        "lifecycle": SimpleNamespace(owner="replica-1", config=SimpleNamespace(lease_s=30)),
        "submitter": None,
        "metrics": SimpleNamespace(batches=SimpleNamespace(set=lambda n: None)),
    }
    return Runner(**parts)


async def test_a_runner_cancelled_inside_a_redis_call_stops() -> None:
    jobs = _CutJobs()
    runner = _runner(jobs)
    runner.start()
    await asyncio.wait_for(jobs.reading.wait(), 5)
    rounds = runner._tasks[0]
    rounds.cancel()  # what aclose does first, at shutdown
    done, _ = await asyncio.wait({rounds}, timeout=5)
    assert done, "the runner went on with its rounds after it was cancelled"
    await runner.aclose()


async def test_stop_if_cancelled_raises_only_in_a_task_asked_to_stop() -> None:
    stop_if_cancelled()  # this task was not asked: nothing happens

    async def swallows() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # as a library that raises its own error instead
            await asyncio.sleep(30)
        stop_if_cancelled()
        return "went on"

    task = asyncio.ensure_future(swallows())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
