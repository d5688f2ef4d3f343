"""The pooled HTTP client to workers.

One keep-alive pool per process (``gateway.infra.http1``: asyncio + httptools), chosen by measurement: on
one core a minimal hop reached ~8,700 req/s with aiohttp's client against ~1,400 with
``httpx.AsyncClient``, whose pool also stalled streams under concurrency, and the lean pool took the
client's share of the gateway's profile down again (bench/README.md).

Every wait is bounded: connect, first byte (response headers), and the idle gap between two body reads.
Failures before the headers are raised as ``UpstreamFailure`` with ``retryable`` set when no byte can
have been processed by the worker's client-facing side in a way that matters (connect refused, timeout
before headers, 502/503).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast
from urllib.parse import urlsplit

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from gateway.infra.http1 import Connection, ConnectionPool, ProtocolError
from gateway.wire.errors import BadGateway, GatewayError, GatewayTimeout, ServiceUnavailable

_ACCEPT = b"Accept: application/json, text/event-stream\r\n"


class UpstreamConfig(BaseModel):
    """Bounds on every wait for a worker. A worker that breaks one is answered with 504/502."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_timeout_s: float = Field(3.0, gt=0)
    first_byte_timeout_s: float = Field(120.0, gt=0, description="until response headers arrive")
    idle_timeout_s: float = Field(60.0, gt=0, description="longest gap between two body reads")
    max_connections: int = Field(2048, ge=1)
    max_connections_per_worker: int = Field(512, ge=1)
    keepalive_s: float = Field(30.0, gt=0)
    health_interval_s: float = Field(5.0, gt=0)


def _failure(exc: BaseException, idle_message: str) -> UpstreamFailure:
    """A transport failure while the body was read, as the error a client can be told: the idle bound
    ran out (``TimeoutError``), or the connection broke."""
    if isinstance(exc, TimeoutError):
        return UpstreamFailure(GatewayTimeout(idle_message, code="upstream_timeout"), retryable=False, kind="timeout")
    return UpstreamFailure(
        BadGateway(f"The connection to the model worker broke ({type(exc).__name__}).", code="upstream_error"),
        retryable=False,
        kind="protocol",
    )


class UpstreamFailure(Exception):
    """A failure talking to a worker; ``error`` is what the client sees if nothing else is tried."""

    def __init__(self, error: GatewayError, *, retryable: bool, kind: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable
        self.kind = kind  # "connect" | "timeout" | "status" | "protocol"


class UpstreamResponse:
    """A worker's response whose headers have arrived; the body is read on demand."""

    __slots__ = ("_conn", "_done", "_idle_s", "_pool", "status")

    def __init__(self, conn: Connection, pool: ConnectionPool, idle_s: float) -> None:
        self._conn = conn
        self._pool = pool
        self._idle_s = idle_s
        self._done = False
        self.status = conn.status

    @property
    def content_type(self) -> str:
        for name, value in self._conn.headers:
            if name == b"content-type":
                return value.decode("latin-1")
        return ""

    async def read(self) -> bytes:
        """The whole body (the idle timeout bounds the wait for the rest of it)."""
        conn = self._conn
        parts: list[bytes] = []
        try:
            while not conn.complete:
                if conn.lost is not None:
                    raise conn.lost
                await conn.wait_data(self._idle_s)
            while chunk := conn.chunk_nowait():
                parts.append(chunk)
        except (TimeoutError, OSError, ProtocolError) as exc:
            raise _failure(exc, "The model worker stopped sending its response.") from None
        finally:
            self.close()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; each wait bounded by the idle timeout."""
        conn = self._conn
        try:
            while True:
                try:
                    chunk = conn.chunk_nowait()
                    while chunk is None:
                        await conn.wait_data(self._idle_s)
                        chunk = conn.chunk_nowait()
                except (TimeoutError, OSError, ProtocolError) as exc:
                    raise _failure(exc, f"The model worker sent nothing for {self._idle_s:g} s.") from None
                if not chunk:
                    return
                if conn.chunks:
                    # More arrived while the last one was relayed (the gateway is behind): pass them on
                    # in one write, so a busy gateway makes fewer, larger writes instead of falling
                    # further behind.
                    pieces = [chunk]
                    while conn.chunks:
                        pieces.append(cast(bytes, conn.chunk_nowait()))
                    chunk = b"".join(pieces)
                yield chunk
        finally:
            self.close()

    async def relay(self, sink: Callable[[bytes], bool], drained: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to ``sink`` as it arrives, from the connection's reads (no task wake-up per
        chunk), until it ends. ``sink`` returns False when it cannot take more for now; reading from the
        worker then pauses until ``drained()`` returns. Each gap between two reads is bounded by the idle
        timeout; failures are raised as ``UpstreamFailure`` like ``iter_chunks``."""
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
                    await conn.wait_data(self._idle_s)
        except (TimeoutError, OSError, ProtocolError) as exc:
            raise _failure(exc, f"The model worker sent nothing for {self._idle_s:g} s.") from None
        finally:
            conn.end_relay()
            self.close()

    def close(self) -> None:
        """Keep the connection for reuse if the body was read to the end; otherwise close it (an
        unread body cannot be reused, and closing it is what tells vLLM to abort the generation)."""
        if not self._done:
            self._done = True
            self._pool.release(self._conn)


class UpstreamClient:
    """The process-wide connection pool to workers.

    Requests on the hot path go over ``gateway.infra.http1`` connections; the occasional GET (health checks,
    metrics scrapes) over an aiohttp session.
    """

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._pool = ConnectionPool(
            limit=config.max_connections,
            limit_per_host=config.max_connections_per_worker,
            keepalive_s=config.keepalive_s,
        )
        self._targets: dict[tuple[str, str], tuple[tuple[str, int, bool], bytes]] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=64, keepalive_timeout=self.config.keepalive_s, ttl_dns_cache=10, family=socket.AF_UNSPEC
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    def reconfigure(self, config: UpstreamConfig) -> None:
        """Timeouts, keep-alive and pool limits apply to new requests at once (a lowered limit lets the
        connections above it finish and close)."""
        self.config = config
        self._pool.keepalive_s = config.keepalive_s
        self._pool.limit = config.max_connections
        self._pool.limit_per_host = config.max_connections_per_worker

    def _target(self, base_url: str, path: str) -> tuple[tuple[str, int, bool], bytes]:
        """(host, port, tls) and the request head up to the headers that vary, cached per URL."""
        cached = self._targets.get((base_url, path))
        if cached is None:
            parts = urlsplit(base_url)
            tls = parts.scheme == "https"
            host = parts.hostname or "127.0.0.1"
            port = parts.port or (443 if tls else 80)
            target = (parts.path.rstrip("/") + path) or "/"
            head = f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            cached = self._targets[(base_url, path)] = ((host, port, tls), head.encode("latin-1") + _ACCEPT)
        return cached

    async def open(
        self, base_url: str, path: str, body: bytes, *, headers: dict[str, str] | None = None
    ) -> UpstreamResponse:
        """POST ``body`` and wait (bounded) for response headers."""
        cfg = self.config
        key, head = self._target(base_url, path)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1") if headers else b""
        request = b"%sContent-Length: %d\r\n%s\r\n%s" % (head, len(body), extra, body)
        try:
            async with asyncio.timeout(cfg.first_byte_timeout_s):
                for attempt in (1, 2):
                    conn, reused = await self._pool.acquire(key, cfg.connect_timeout_s)
                    try:
                        await conn.send(request)
                    except (OSError, ProtocolError) as exc:
                        self._pool.discard(conn)
                        # A kept-alive connection the worker closed as we wrote: nothing was processed,
                        # so one fresh connection is tried before the failure counts.
                        if attempt == 1 and reused and not conn.received and isinstance(exc, OSError):
                            continue
                        raise
                    except BaseException:
                        self._pool.discard(conn)  # timed out or cancelled: close it, vLLM aborts
                        raise
                    return UpstreamResponse(conn, self._pool, cfg.idle_timeout_s)
        except TimeoutError:
            raise UpstreamFailure(
                GatewayTimeout(
                    f"The model worker did not answer within {cfg.first_byte_timeout_s:g} s.", code="upstream_timeout"
                ),
                retryable=True,
                kind="timeout",
            ) from None
        except OSError as exc:
            raise UpstreamFailure(
                ServiceUnavailable(
                    f"The model worker could not be reached ({type(exc).__name__}).", code="upstream_unavailable"
                ),
                retryable=True,
                kind="connect",
            ) from None
        except ProtocolError as exc:
            raise UpstreamFailure(
                BadGateway(
                    f"The model worker's answer was not valid HTTP ({type(exc).__name__}).", code="upstream_error"
                ),
                retryable=False,
                kind="protocol",
            ) from None
        raise AssertionError("unreachable")

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """A small bounded GET (health checks, model listings)."""
        async with asyncio.timeout(timeout_s), self.session.get(url) as resp:
            return resp.status, await resp.read()

    async def aclose(self) -> None:
        self._pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
