"""``gateway.infra.redis_api.RedisPipeline`` on redis-py's own pipeline: the well-kept library the
hand-written ``redis_autopipe`` is measured and tested against (tests/infra/conformance), and a fallback
an operator can select with ``GATEWAY_REDIS_CLIENT=redis-py``.

The commands of one event-loop turn go out as one ``pipeline(transaction=False).execute()`` on a
dedicated connection (a pool of one, with the settings of the client it was made for). While a batch is
in flight, new commands wait for the next one (a redis-py connection serves one pipeline at a time),
so under load the batches grow instead of queueing connections. Replies are raw (no response
callbacks, RESP2), errors per command (``raise_on_error=False``), and nothing is retried after a connection
failure (redis-py's retry would send commands Redis may already have run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.infra.redis_script import ScriptCall

_Pending = tuple[tuple[Any, ...], "asyncio.Future[Any]"]


class RedisPyPipeline:
    def __init__(self, client: aioredis.Redis, *, max_batch: int = 256) -> None:
        pool = client.connection_pool
        # RESP2 as AutoPipeline speaks it (redis-py 8 defaults to RESP3, where HGETALL answers a map).
        kwargs = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0), "retry_on_timeout": False, "protocol": 2}
        for resp3_only in ("maint_notifications_pool_handler", "maint_notifications_config"):
            kwargs.pop(resp3_only, None)
        self._client = aioredis.Redis(
            connection_pool=aioredis.ConnectionPool(connection_class=pool.connection_class, max_connections=1, **kwargs)
        )
        self._client.response_callbacks.clear()  # Redis's own replies, as the contract says
        self._max_batch = max_batch
        self._queue: list[_Pending] = []
        self._running: asyncio.Task[None] | None = None
        self._closed = False
        #: Pipelines executed so far (a statistic; tests read it).
        self.batches_sent = 0

    async def execute(self, *args: Any) -> Any:
        return await self.submit(*args)

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self._closed:
            future.set_exception(RedisConnectionError("the Redis pipeline is closed"))
            return future
        self._queue.append((args, future))
        if self._running is None:
            self._running = loop.create_task(self._run())
        return future

    async def evalsha(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await script(keys=keys, args=args)

    async def run_script(self, call: ScriptCall, varying: Sequence[Any]) -> Any:
        return await self.evalsha(call.script, call.keys, call.args(varying))

    def submit_script(self, call: ScriptCall, varying: Sequence[Any]) -> asyncio.Future[Any]:
        return self.submit("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args(varying))

    async def _run(self) -> None:
        """Send the queue as pipelines, one at a time, until it is empty."""
        try:
            await asyncio.sleep(0)  # the rest of this loop turn's commands join the first batch
            while self._queue:
                batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
                await self._send(batch)
        finally:
            self._running = None

    async def _send(self, batch: list[_Pending]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for args, _ in batch:
            pipe.execute_command(*args)
        self.batches_sent += 1
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:
            error = exc if isinstance(exc, RedisError) else RedisConnectionError(f"Redis pipeline failed: {exc}")
            if isinstance(exc, TimeoutError) and not isinstance(exc, RedisError):
                error = RedisTimeoutError(str(exc) or "timed out waiting for Redis")
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue  # its caller gave up waiting
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def aclose(self) -> None:
        if self._running is not None:
            await asyncio.gather(self._running, return_exceptions=True)
        self._closed = True
        await self._client.aclose()
        await self._client.connection_pool.disconnect()
