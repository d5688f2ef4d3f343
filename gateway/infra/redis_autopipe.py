"""Automatic pipelining of Redis commands issued by concurrent requests.

Every command that hot-path code issues through ``AutoPipeline.execute`` during one turn of the event
loop goes to Redis in one write on one connection that the pipeline keeps open, and the replies are
matched to their commands in order as they arrive (Redis answers a connection's commands in the order
they were sent). A lone request pays nothing extra: its write goes out on the loop's next turn, before
any I/O wait.

The connection is a bare asyncio protocol around hiredis's packer and reader, not a redis-py
connection: per command that is one C call to pack it, a share of one socket write and one C call to
parse its reply. redis-py's pipeline object, its pool checkout, its retry wrapper and its stream
reader cost the full default plugin set about a fifth of its CPU on a cache miss (two scripts per
request). Everything else stays on redis-py: the connection settings (host or socket path, TLS,
credentials, database, timeouts) are read from the client the pipeline was made for, and loading a
script Redis does not know goes through that client.

Replies are Redis's own (bytes, integers, lists), without redis-py's per-command conversions: ``SET``
answers ``b"OK"``, not ``True``.

Failure semantics:
- an error reply (e.g. ``NOSCRIPT``) is raised to that command's caller only, as redis-py's exception;
- a connection that cannot be opened within the client's connect timeout fails the commands waiting
  for it with ``redis.exceptions.ConnectionError`` (or ``TimeoutError``);
- a connection that gives no reply for the client's socket timeout while commands wait is closed and
  fails every command sent on it with ``redis.exceptions.TimeoutError``; a lost connection fails them
  with ``ConnectionError``. The next command opens a new connection.
A caller that stops waiting (its own timeout, a client that went away) leaves the connection intact:
its reply is read and dropped, so the other commands still get theirs.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.credentials import UsernamePasswordCredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.infra.redis_script import ScriptCall

#: A queued command: its arguments, or the command already packed (``ScriptCall.command``), and its future.
_Pending = tuple[tuple[Any, ...] | bytes, "asyncio.Future[Any]"]


class AutoPipeline:
    """Batches ``execute(*args)`` calls made in the same loop turn into one write on its own connection.

    Errors are per command where Redis gives them per command; a connection failure or timeout fails
    every command waiting on that connection. The client's socket timeout bounds how long a connection
    may stay silent while commands wait; its connect timeout bounds opening one.
    """

    def __init__(self, client: aioredis.Redis, *, max_batch: int = 256) -> None:
        self._client = client
        self._max_batch = max_batch
        self._queue: list[_Pending] = []
        self._flush_scheduled = False
        self._conn: _RedisProtocol | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False
        #: Writes made so far, each carrying one turn's commands (a statistic; tests read it).
        self.batches_sent = 0

    async def execute(self, *args: Any) -> Any:
        return await self.submit(*args)

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        """Queue a command for this turn's batch; its future gets the reply (or the error). For work
        nobody waits on (a background write), a callback on the future spares a task."""
        return self._enqueue(args)

    def _enqueue(self, command: tuple[Any, ...] | bytes) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self._closed:
            future.set_exception(RedisConnectionError("the Redis pipeline is closed"))
            return future
        self._queue.append((command, future))
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
            return await self.submit("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await script(keys=keys, args=args)

    async def run_script(self, call: ScriptCall, varying: Sequence[Any]) -> Any:
        """``evalsha`` of ``call``'s script with ``varying`` before its fixed arguments, the command
        packed by ``call`` (its fixed part was packed once)."""
        try:
            return await self._enqueue(call.command(varying))
        except NoScriptError:
            return await call.script(keys=call.keys, args=call.args(varying))

    def submit_script(self, call: ScriptCall, varying: Sequence[Any]) -> asyncio.Future[Any]:
        """``run_script`` queued for this turn's batch, for a caller that does not wait (``RedisPipeline``)."""
        return self._enqueue(call.command(varying))

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._queue:
            return
        conn = self._conn
        if conn is None or not conn.open:
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return  # sent once connected
        queue, self._queue = self._queue, []
        step = self._max_batch
        for start in range(0, len(queue), step):  # more than one batch only after a connect
            conn.send(queue[start : start + step])
            self.batches_sent += 1

    async def _connect(self) -> None:
        try:
            self._conn = await _open(self._client)
        except Exception as exc:
            error = _as_redis_error(exc, "connecting to Redis")
            batch, self._queue = self._queue, []
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
        finally:
            self._connecting = None
        self._flush()

    async def aclose(self) -> None:
        """Send what is queued, wait for the replies still due (bounded by the socket timeout), close."""
        self._flush()
        if self._connecting is not None:
            await asyncio.gather(self._connecting, return_exceptions=True)
        self._closed = True
        if self._conn is not None:
            await self._conn.drain_and_close()
            self._conn = None


class _RedisProtocol(asyncio.Protocol):
    """One Redis connection: writes packed commands, matches replies to them in order."""

    def __init__(self, socket_timeout_s: float | None) -> None:
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self._timeout_s = socket_timeout_s
        self._last_progress = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._closed: asyncio.Future[None] | None = None
        self.open = False

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it: no isinstance check.
        self._transport = cast(asyncio.Transport, transport)
        self._closed = asyncio.get_running_loop().create_future()
        self.open = True

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        self._last_progress = time.monotonic()
        waiting = self._waiting
        while True:
            try:
                reply = self._reader.gets()
            except Exception as exc:  # a protocol error: the stream can no longer be trusted
                self._fail(RedisConnectionError(f"unreadable reply from Redis: {exc}"))
                return
            if reply is False:
                return
            if not waiting:
                self._fail(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            future = waiting.popleft()
            if future.done():
                continue  # its caller gave up waiting
            if isinstance(reply, ResponseError):
                future.set_exception(BaseParser.parse_error(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail(RedisConnectionError(f"connection to Redis lost: {exc}" if exc else "Redis closed the connection"))
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    # -- sending ----------------------------------------------------------------------------------

    def send(self, batch: list[_Pending]) -> None:
        assert self._transport is not None
        if not self._waiting:
            self._last_progress = time.monotonic()
        packed = [command if isinstance(command, bytes) else hiredis.pack_command(command) for command, _ in batch]
        self._transport.write(b"".join(packed))
        self._waiting.extend(future for _, future in batch)
        self._arm_timer()

    def send_one(self, *args: Any) -> asyncio.Future[Any]:
        """One command outside any batch (the connection handshake)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.send([(args, future)])
        return future

    def _arm_timer(self) -> None:
        if self._timer is None and self._timeout_s is not None:
            self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._check_silence)

    def _check_silence(self) -> None:
        self._timer = None
        if not self._waiting or self._timeout_s is None:
            return
        silent_for = time.monotonic() - self._last_progress
        if silent_for >= self._timeout_s:
            self._fail(RedisTimeoutError(f"no reply from Redis for {silent_for:.3f} s"))
            return
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s - silent_for, self._check_silence)

    def _fail(self, error: Exception) -> None:
        """Fail every command waiting on this connection and close it (it is out of step)."""
        self.open = False
        waiting, self._waiting = self._waiting, collections.deque()
        for future in waiting:
            if not future.done():
                future.set_exception(error)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.abort()

    async def drain_and_close(self) -> None:
        if self._waiting:
            await asyncio.gather(*self._waiting, return_exceptions=True)
        self.open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()
            if self._closed is not None:
                await asyncio.shield(self._closed)


async def _open(client: aioredis.Redis) -> _RedisProtocol:
    """A connection with the settings of ``client``'s pool, authenticated and on its database."""
    pool = client.connection_pool
    settings: Any = pool.connection_class(**pool.connection_kwargs)  # read its settings; never connected
    loop = asyncio.get_running_loop()
    protocol = _RedisProtocol(settings.socket_timeout)
    async with asyncio.timeout(settings.socket_connect_timeout):
        if isinstance(settings, UnixDomainSocketConnection):
            await loop.create_unix_connection(lambda: protocol, settings.path)
        else:
            ssl = settings.ssl_context.get() if isinstance(settings, SSLConnection) else None
            await loop.create_connection(lambda: protocol, settings.host, settings.port, ssl=ssl)
        handshake = []
        provider = settings.credential_provider
        if provider is None and (settings.username or settings.password):
            provider = UsernamePasswordCredentialProvider(settings.username, settings.password)
        if provider is not None:
            handshake.append(protocol.send_one("AUTH", *await provider.get_credentials_async()))
        if settings.db:
            handshake.append(protocol.send_one("SELECT", settings.db))
        try:
            for reply in handshake:
                await reply
        except BaseException:
            protocol._fail(RedisConnectionError("the Redis handshake failed"))
            raise
    return protocol


def _as_redis_error(exc: Exception, what: str) -> Exception:
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, ResponseError)):
        return exc
    if isinstance(exc, TimeoutError):
        return RedisTimeoutError(f"timed out {what}")
    return RedisConnectionError(f"{what}: {exc}")
