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

from collections.abc import Awaitable, Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

from gateway.infra.http1_connection import Connection
from gateway.infra.http1_pool import ConnectionPool
from gateway.infra.http_api import ConnectTimeout, ProtocolError

__all__ = ["ConnectTimeout", "Connection", "ConnectionPool", "Http1Client", "Http1Response", "ProtocolError"]


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
