"""Automatic pipelining of Redis commands issued by concurrent requests.

Every command that hot-path code issues through ``AutoPipeline.execute`` during one turn of the event
loop goes to Redis as one pipeline: one connection checkout, one write and one read burst for all of
them, instead of a round trip (and a pool checkout, a socket write, a connection health check) per
command. On loopback the socket calls dominate what a Redis command costs the gateway, so under
concurrency this cuts the CPU each request spends on Redis; a lone request pays nothing extra (its
batch is sent on the loop's next turn, before any I/O wait).

A caller that stops waiting (its own timeout, a client that went away) leaves the batch intact: the
pipeline is read to its end on its own task, so a connection is never torn down mid-reply and the
other commands of the batch still get their answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

_Pending = tuple[tuple[Any, ...], "asyncio.Future[Any]"]


class AutoPipeline:
    """Batches ``execute(*args)`` calls made in the same loop turn into one non-transactional pipeline.

    Errors are per command where Redis gives them per command (e.g. ``NOSCRIPT``: raised to that
    caller only); a connection failure or timeout fails every command of the batch. The client's own
    socket timeout bounds each batch.
    """

    def __init__(self, client: aioredis.Redis, *, max_batch: int = 256) -> None:
        self._client = client
        self._max_batch = max_batch
        self._queue: list[_Pending] = []
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()

    async def execute(self, *args: Any) -> Any:
        return await self.submit(*args)

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        """Queue a command for this turn's batch; its future gets the reply (or the error). For work
        nobody waits on (a background write), a callback on the future spares a task."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((args, future))
        if len(self._queue) >= self._max_batch:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return future

    async def evalsha(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """Run a registered ``redis.commands.core.AsyncScript`` by its SHA in the next batch; if Redis
        does not know the script (restarted, flushed), load it and run it once outside the batch."""
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await script(keys=keys, args=args)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._queue:
            return
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Pending]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for args, _ in batch:
            pipe.execute_command(*args)
        try:
            results = await pipe.execute(raise_on_error=False)
        except BaseException as exc:  # connection lost, timed out, or the loop is shutting down
            error = exc if isinstance(exc, Exception) else ConnectionError("the Redis batch was cancelled")
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # the caller gave up waiting
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def aclose(self) -> None:
        """Wait for the batches already sent (each is bounded by the client's socket timeout)."""
        self._flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
