"""A lean HTTP/1.1 client connection and keep-alive pool for the request path to workers: the default
implementation of ``gateway.infra.http_api.HttpClient`` (``Http1Client``).

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
from collections.abc import Awaitable, Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.infra.http_api import ConnectTimeout, ProtocolError

__all__ = ["ConnectTimeout", "Connection", "ConnectionPool", "Http1Client", "Http1Response", "ProtocolError"]

_HIGH_WATER = 1 << 20
_LOW_WATER = 1 << 18


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


class Http1Response:
    """``gateway.infra.http_api.HttpResponse`` on one pooled ``Connection``."""

    __slots__ = ("_conn", "_done", "_pool", "status")

    def __init__(self, conn: Connection, pool: ConnectionPool) -> None:
        self._conn = conn
        self._pool = pool
        self._done = False
        self.status = conn.status

    def header(self, name: str) -> str | None:
        wanted = name.encode("latin-1")
        for key, value in self._conn.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    async def read(self, idle_s: float | None) -> bytes:
        conn = self._conn
        parts: list[bytes] = []
        try:
            # Taken as it arrives, not after the end: a body over the high-water mark pauses reading
            # until the buffer is drained, so waiting for the end first would wait for the idle bound.
            while True:
                chunk = conn.chunk_nowait()
                if chunk is None:
                    await conn.wait_data(idle_s)
                elif chunk:
                    parts.append(chunk)
                else:
                    break
        finally:
            self.close()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunk(self, idle_s: float | None) -> bytes:
        conn = self._conn
        chunk = conn.chunk_nowait()
        while chunk is None:
            await conn.wait_data(idle_s)
            chunk = conn.chunk_nowait()
        if chunk and conn.chunks:
            # More arrived while the last one was relayed (the gateway is behind): pass them on in one
            # piece, so a busy gateway makes fewer, larger writes instead of falling further behind.
            pieces = [chunk]
            while conn.chunks:
                pieces.append(cast(bytes, conn.chunk_nowait()))
            chunk = b"".join(pieces)
        return chunk

    async def relay(
        self, sink: Callable[[bytes], bool], drained: Callable[[], Awaitable[None]], idle_s: float | None
    ) -> None:
        conn = self._conn
        try:
            conn.relay_to(sink)
            while not conn.complete:
                if conn.lost is not None:
                    raise conn.lost
                if conn.sink_full:
                    await drained()
                    conn.resume_relay()
                else:
                    await conn.wait_data(idle_s)
        finally:
            conn.end_relay()
            self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._pool.release(self._conn)


class Http1Client:
    """``gateway.infra.http_api.HttpClient`` on a ``ConnectionPool``: one request is one ``write`` of a
    head cached per URL (with ``base_headers``), the extra headers and the body."""

    def __init__(self, *, base_headers: Mapping[str, str], limit: int, limit_per_host: int, keepalive_s: float) -> None:
        self._base = "".join(f"{k}: {v}\r\n" for k, v in base_headers.items())
        # A request that names its own content type (a multipart upload) sends it instead of the default.
        self._base_type = "".join(f"{k}: {v}\r\n" for k, v in base_headers.items() if k.lower() == "content-type")
        self._pool = ConnectionPool(limit=limit, limit_per_host=limit_per_host, keepalive_s=keepalive_s)
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes]] = {}

    def _target(self, url: str) -> tuple[tuple[str, int, bool], bytes]:
        """(host, port, tls) and the request head up to the headers that vary, cached per URL."""
        cached = self._targets.get(url)
        if cached is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            host = parts.hostname or "127.0.0.1"
            port = parts.port or (443 if tls else 80)
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            head = f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n{self._base}"
            if len(self._targets) > 4096:  # URLs come from config; bound the cache all the same
                self._targets.clear()
            cached = self._targets[url] = ((host, port, tls), head.encode("latin-1"))
        return cached

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str] | None, *, connect_timeout_s: float
    ) -> Http1Response:
        key, head = self._target(url)
        extra = b""
        if headers:
            extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
            if self._base_type and any(k.lower() == "content-type" for k in headers):
                head = head.replace(self._base_type.encode("latin-1"), b"", 1)
        request = b"%sContent-Length: %d\r\n%s\r\n%s" % (head, len(body), extra, body)
        pool = self._pool
        for attempt in (1, 2):
            conn, reused = await pool.acquire(key, connect_timeout_s)
            try:
                await conn.send(request)
            except (OSError, ProtocolError) as exc:
                pool.discard(conn)
                # A kept-alive connection the worker closed as we wrote: nothing was processed, so one
                # fresh connection is tried before the failure counts.
                if attempt == 1 and reused and not conn.received and isinstance(exc, OSError):
                    continue
                raise
            except BaseException:
                pool.discard(conn)  # timed out or cancelled: close it, vLLM aborts
                raise
            return Http1Response(conn, pool)
        raise AssertionError("unreachable")

    def set_limits(self, *, limit: int, limit_per_host: int, keepalive_s: float) -> None:
        self._pool.limit = limit
        self._pool.limit_per_host = limit_per_host
        self._pool.keepalive_s = keepalive_s

    async def aclose(self) -> None:
        self._pool.close()
