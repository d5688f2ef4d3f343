"""A lean HTTP/1.1 client connection and keep-alive pool for the request path to workers.

Only what the gateway sends and workers answer: a POST with a complete body, a response framed by
``content-length`` or chunked encoding, keep-alive. Built on asyncio protocols and ``httptools`` (the
parser uvicorn uses), so one request costs one ``write`` and a parse, with no per-request objects
beyond the response. Chosen by measurement over aiohttp's client session, whose request machinery
(headers multidicts, payload registry, tracing hooks, timers) was the largest item in the gateway's
profile (bench/README.md). Backpressure: a connection stops reading when 1 MiB is buffered and the
consumer has not caught up.

A streamed body can also be relayed (``relay_to``): each read from the worker goes straight to a sink
from the protocol callback, with no buffering and no task woken per chunk; the sink pushes back by
returning False, which pauses reading until ``resume_relay``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools

_HIGH_WATER = 1 << 20
_LOW_WATER = 1 << 18


class ProtocolError(Exception):
    """The worker's bytes were not valid HTTP/1.1."""


class ConnectTimeout(ConnectionError):
    """No connection within the connect timeout (a connect failure, like a refused connection)."""


class Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[None] | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the current response
        self.lost: BaseException | None = None
        self.idle_since = 0.0
        # The body's idle timeout, without a timer per read: one timer per wait that outlives the
        # data, re-armed from the time of the last byte (a stream relays thousands of chunks).
        self.last_data = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None
        # Relay mode: body bytes of one read, handed to the sink once the read is parsed.
        self.sink: Callable[[bytes], bool] | None = None
        self.relayed: list[bytes] = []
        self.sink_full = False

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        self.last_data = self.loop.time()
        if self.parser is None:
            return  # detached: nothing more is read for anyone
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(str(exc)))
            if self.transport is not None:
                self.transport.close()
        if self.relayed:
            self._flush_relayed()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.complete:
            self._fail(exc or ConnectionResetError("the worker closed the connection"))

    # -- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.relayed.append(body)  # one sink call per read, after the parser is done with it
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- used by the client -----------------------------------------------------------------------

    def send(self, data: bytes) -> asyncio.Future[None]:
        """Write one request; the future resolves when the response headers have arrived."""
        assert self.transport is not None
        self.status, self.headers, self.complete, self.received = 0, [], False, False
        self.chunks.clear()
        self.buffered = 0
        self._cancel_idle_timer()
        self.head = self.loop.create_future()
        self.transport.write(data)
        return self.head

    def chunk_nowait(self) -> bytes | None:
        """The next buffered body bytes, b"" at the end, None when the caller must wait."""
        if self.chunks:
            chunk = self.chunks.popleft()
            self.buffered -= len(chunk)
            if self.paused and self.buffered < _LOW_WATER and self.transport is not None:
                self.paused = False
                self.transport.resume_reading()
            return chunk
        if self.complete:
            return b""
        if self.lost is not None:
            raise self.lost
        return None

    def relay_to(self, sink: Callable[[bytes], bool]) -> None:
        """Hand the rest of the body to ``sink``, one call per read from the worker, instead of buffering
        it for ``chunk_nowait`` (what is buffered already goes first). ``wait_data`` then wakes only at
        the end, on a failure, or when ``sink`` returned False (it cannot take more for now): reading is
        paused until ``resume_relay``."""
        self.sink = sink
        if self.chunks:
            self.relayed.extend(self.chunks)
            self.chunks.clear()
            self.buffered = 0
            self._flush_relayed()
        if not self.sink_full:
            self.resume_relay()  # buffered mode may have paused reading at its high-water mark

    def end_relay(self) -> None:
        """Stop handing bytes to the sink and let go of it (it usually holds the response that holds
        this connection; a pooled connection must not keep its last consumer alive)."""
        self.sink, self.sink_full = None, False
        self.relayed.clear()

    def resume_relay(self) -> None:
        """The sink has room again: read from the worker again."""
        self.sink_full = False
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _flush_relayed(self) -> None:
        relayed = self.relayed
        data = relayed[0] if len(relayed) == 1 else b"".join(relayed)
        relayed.clear()
        assert self.sink is not None
        try:
            room = self.sink(data)
        except Exception as exc:  # the consumer's failure ends this response, not the event loop's callback
            self._fail(exc)
            self.abort()
            return
        if not room and not self.sink_full:
            self.sink_full = True
            if not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            self._wake()

    async def wait_data(self, idle_s: float | None = None) -> None:
        """Wait until more body bytes (or the end, or a failure) arrive; with ``idle_s``, raise
        ``TimeoutError`` once neither a byte nor a new wait has come for that long."""
        self.waiter = self.loop.create_future()
        # The window starts at the later of the last byte and this wait (a consumer that was slow to
        # drain the buffer does not count against the worker).
        self.last_data = self.loop.time()
        if idle_s is not None and self.idle_timer is None:
            self.idle_timer = self.loop.call_at(self.last_data + idle_s, self._idle_check, idle_s)
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _idle_check(self, idle_s: float) -> None:
        self.idle_timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting now; the next wait arms the timer again
        due = self.last_data + idle_s
        if self.loop.time() >= due:
            waiter.set_exception(TimeoutError())
        else:
            self.idle_timer = self.loop.call_at(due, self._idle_check, idle_s)

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.chunks and not self.paused and self.usable

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.lost is None

    def detach(self) -> None:
        """The pool lets go of this connection for good: drop what ties it to the requests it served
        (the parser holds this protocol's callbacks; a stored failure's traceback holds the frames that
        read it; futures hold that failure; the relay's sink holds the response), so the connection and
        those requests are freed by reference counting, not left as cycles for the garbage collector."""
        self.parser = None
        self.head = self.waiter = None
        self.lost = None
        self.end_relay()
        self.chunks.clear()
        self._cancel_idle_timer()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # closing an unfinished response is what makes vLLM abort it

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class ConnectionPool:
    """Keep-alive connections per (host, port, tls), with a total and a per-host limit.

    ``acquire`` waits for a free slot when a limit is reached (the caller bounds the wait);
    ``release`` keeps a finished connection for reuse or closes it.
    """

    def __init__(self, *, limit: int, limit_per_host: int, keepalive_s: float) -> None:
        self.limit = limit
        self.limit_per_host = limit_per_host
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int, bool], deque[Connection]] = {}
        self._open: dict[tuple[str, int, bool], int] = {}
        self._total = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tls: ssl.SSLContext | None = None

    async def acquire(self, key: tuple[str, int, bool], connect_timeout_s: float) -> tuple[Connection, bool]:
        """A connection to ``key`` and whether it was reused (a reused one may have been closed by the
        worker a moment ago; the caller may retry once on a fresh one)."""
        while True:
            idle = self._idle.get(key)
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.usable and now - conn.idle_since < self.keepalive_s:
                    return conn, True
                self._discard(conn)
            if self._total >= self.limit:
                self._evict_idle()
            if self._total < self.limit and self._open.get(key, 0) < self.limit_per_host:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._total += 1
        self._open[key] = self._open.get(key, 0) + 1
        host, port, tls = key
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: Connection(key), host, port, ssl=self._ssl() if tls else None
                )
        except TimeoutError:
            self._forget(key)
            raise ConnectTimeout(f"no connection to {host}:{port} within {connect_timeout_s:g} s") from None
        except BaseException:
            self._forget(key)
            raise
        return conn, False

    def release(self, conn: Connection) -> None:
        conn._cancel_idle_timer()
        if not conn.reusable:
            conn.abort()
            self._discard(conn)
            return
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(conn.key, deque())
        idle.append(conn)
        while idle and (not idle[0].usable or conn.idle_since - idle[0].idle_since > self.keepalive_s):
            stale = idle.popleft()
            stale.abort()
            self._discard(stale)
        self._wake_one()

    def _evict_idle(self) -> None:
        """At the total limit, an idle connection to another worker gives way to a new one."""
        for idle in self._idle.values():
            if idle:
                self._discard(idle.popleft())
                return

    def discard(self, conn: Connection) -> None:
        conn.abort()
        self._discard(conn)

    def _discard(self, conn: Connection) -> None:
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.close()
        conn.detach()
        self._forget(conn.key)

    def _forget(self, key: tuple[str, int, bool]) -> None:
        self._total -= 1
        self._open[key] -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _ssl(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
