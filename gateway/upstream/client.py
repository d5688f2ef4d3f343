"""The pooled HTTP client to workers.

One keep-alive pool per process (``gateway.infra.http1``: asyncio + httptools), chosen by measurement: on
one core a minimal hop reached ~8,700 req/s with aiohttp's client against ~1,400 with
``httpx.AsyncClient``, whose pool also stalled streams under concurrency, and the lean pool took the
client's share of the gateway's profile down again (bench/README.md). It is used through the
``gateway.infra.http_api.HttpClient`` interface; ``GATEWAY_UPSTREAM_CLIENT=aiohttp`` puts a tuned aiohttp
session behind it instead (same behaviour, tests/infra/conformance; ~50% more CPU per request,
bench/bench_clients.py).

Every wait is bounded: connect, first byte (response headers), and the idle gap between two body reads.
Failures before the headers are raised as ``UpstreamFailure`` with ``retryable`` set when no byte can
have been processed by the worker's client-facing side in a way that matters (connect refused, timeout
before headers, 502/503). The answers the gateway reads for itself (health, listings, metrics, adapter
loads) are bounded in size too (``max_small_answer_bytes``): a longer one is ``AnswerTooLarge``, unread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field

from gateway.infra.deadlines import Deadlines
from gateway.infra.http1 import Http1Client
from gateway.infra.http_api import HttpClient, HttpResponse, ProtocolError
from gateway.wire.errors import BadGateway, GatewayError, GatewayTimeout, ServiceUnavailable

log = logging.getLogger("gateway.upstream")

_BASE_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}

#: Default bound on a worker's answer to the gateway's own calls (``UpstreamConfig.max_small_answer_bytes``).
#: The largest legitimate one is the /metrics page of a busy vLLM worker, a few hundred KB (histograms per
#: model and adapter); 8 MiB leaves room for that and for a /v1/models listing thousands of adapters, while a
#: worker that answers more is broken or hostile and is not read into memory and parsed on the event loop.
SMALL_ANSWER_MAX_BYTES = 8 << 20


class UpstreamConfig(BaseModel):
    """Bounds on every wait for a worker. A worker that breaks one is answered with 504/502."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_timeout_s: float = Field(3.0, gt=0, description="longest wait for a connection to a worker")
    first_byte_timeout_s: float = Field(
        120.0,
        gt=0,
        description="longest wait for a worker's response headers; for a non-streamed request this includes the "
        "whole generation",
    )
    idle_timeout_s: float = Field(60.0, gt=0, description="longest gap between two body reads")
    max_connections: int = Field(2048, ge=1, description="connections to all workers at once, per gateway process")
    max_connections_per_worker: int = Field(512, ge=1, description="connections to one worker at once")
    keepalive_s: float = Field(
        30.0, gt=0, description="an idle connection to a worker is closed after this (keep it below the worker's own)"
    )
    health_interval_s: float = Field(5.0, gt=0, description="how often each worker's /health is checked")
    health_timeouts_before_unhealthy: int = Field(
        3,
        ge=1,
        le=100,
        description="consecutive /health checks that time out (2 s) before a worker counts as unhealthy: a"
        " worker busy with a long prefill can answer late; a refused connection or another status counts at once",
    )
    stream_resumptions: int = Field(
        1,
        ge=0,
        le=8,
        description="times a stream cut by a failing worker is continued on another healthy worker of the model "
        "(within routing's retry budget); 0: a cut stream ends with one error event",
    )
    slow_first_byte_factor: float = Field(
        10.0,
        gt=1,
        description="a stream whose first byte takes this many times the model's usual first byte (and at "
        "least slow_first_byte_min_s) counts as a failure of its worker",
    )
    slow_first_byte_min_s: float = Field(
        2.0, gt=0, description="a first byte faster than this never counts as slow, whatever the factor"
    )
    max_small_answer_bytes: int = Field(
        SMALL_ANSWER_MAX_BYTES,
        ge=64 << 10,
        description="largest answer read from a worker for the gateway's own calls (/health, /v1/models, /metrics, "
        "/version, /kv_event_sources, adapter loads and unloads); a larger one fails that call, unread",
    )
    eject_min_tenants: int = Field(
        2,
        ge=1,
        description="failures a request's content could cause (5xx, resets, slow first bytes) eject a worker "
        "only when they come from this many tenants (or from all of its recent tenants, if fewer)",
    )


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


class AnswerTooLarge(UpstreamFailure):
    """A worker's answer to one of the gateway's own calls was longer than ``max_small_answer_bytes``: the
    call failed (a broken or hostile worker, not retried), and the rest of the answer was not read."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            BadGateway(
                f"The model worker's answer was longer than {max_bytes:,} bytes.", code="upstream_answer_too_large"
            ),
            retryable=False,
            kind="protocol",
        )


class UpstreamResponse:
    """A worker's response whose headers have arrived; the body is read on demand. Transport failures
    while reading are raised as ``UpstreamFailure``."""

    __slots__ = ("_http", "_idle_s", "status")

    def __init__(self, http: HttpResponse, idle_s: float) -> None:
        self._http = http
        self._idle_s = idle_s
        self.status = http.status

    @property
    def content_type(self) -> str:
        return self._http.header("content-type") or ""

    async def read(self) -> bytes:
        """The whole body (the idle timeout bounds the wait for the rest of it)."""
        try:
            return await self._http.read(self._idle_s)
        except (TimeoutError, OSError, ProtocolError) as exc:
            raise _failure(exc, "The model worker stopped sending its response.") from None
        finally:
            self._http.close()

    async def read_at_most(self, max_bytes: int) -> bytes:
        """The whole body, if it is no longer than ``max_bytes``; ``AnswerTooLarge`` otherwise, raised
        before the rest is read (the connection is then closed, not reused). For the small answers the
        gateway parses itself; each wait is bounded by the idle timeout, and transport failures are raised
        as for ``read``."""
        http, idle_s = self._http, self._idle_s
        try:
            length = http.header("content-length")
            if length is not None and length.strip().isdigit() and int(length) > max_bytes:
                raise AnswerTooLarge(max_bytes)
            body = bytearray()
            while True:
                try:
                    chunk = await http.chunk(idle_s)
                except (TimeoutError, OSError, ProtocolError) as exc:
                    raise _failure(exc, "The model worker stopped sending its response.") from None
                if not chunk:
                    return bytes(body)
                body += chunk
                if len(body) > max_bytes:
                    raise AnswerTooLarge(max_bytes)
        finally:
            http.close()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; each wait bounded by the idle timeout."""
        http, idle_s = self._http, self._idle_s
        try:
            while True:
                try:
                    chunk = await http.chunk(idle_s)
                except (TimeoutError, OSError, ProtocolError) as exc:
                    raise _failure(exc, f"The model worker sent nothing for {idle_s:g} s.") from None
                if not chunk:
                    return
                yield chunk
        finally:
            http.close()

    async def relay(self, sink: Callable[[bytes], bool], drained: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to ``sink`` as it arrives, until it ends. ``sink`` returns False when it cannot
        take more for now; reading from the worker then pauses until ``drained()`` returns. Each gap
        between two reads is bounded by the idle timeout; failures are raised as ``UpstreamFailure``
        like ``iter_chunks``."""
        try:
            await self._http.relay(sink, drained, self._idle_s)
        except (TimeoutError, OSError, ProtocolError) as exc:
            raise _failure(exc, f"The model worker sent nothing for {self._idle_s:g} s.") from None
        finally:
            self._http.close()

    def close(self) -> None:
        """Keep the connection for reuse if the body was read to the end; otherwise close it (an
        unread body cannot be reused, and closing it is what tells vLLM to abort the generation)."""
        self._http.close()


def make_http_client(kind: str, config: UpstreamConfig) -> HttpClient:
    """The HTTP client to workers: ``http1`` (asyncio + httptools, the default) or ``aiohttp`` (a tuned
    aiohttp session; same contract, proven by tests/infra/conformance, slower: see the docs)."""
    limit, per_host, keepalive_s = config.max_connections, config.max_connections_per_worker, config.keepalive_s
    if kind == "aiohttp":
        from gateway.infra.http_aiohttp import AiohttpClient

        return AiohttpClient(base_headers=_BASE_HEADERS, limit=limit, limit_per_host=per_host, keepalive_s=keepalive_s)
    if kind != "http1":
        raise ValueError(f"unknown upstream client {kind!r} (http1 or aiohttp)")
    return Http1Client(base_headers=_BASE_HEADERS, limit=limit, limit_per_host=per_host, keepalive_s=keepalive_s)


class UpstreamClient:
    """The process-wide connection pool to workers.

    Requests on the hot path go over ``transport``, an ``HttpClient`` (``gateway.infra.http_api``):
    ``make_http_client(settings.upstream_client, config)`` in the app, ``http1`` when none is given, or an
    in-process fake in tests (``tests/support/transport.py``), as httpx takes a ``MockTransport``. The
    occasional GET (health checks, metrics scrapes) goes over an aiohttp session.
    """

    def __init__(self, config: UpstreamConfig, transport: HttpClient | None = None) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._http = transport if transport is not None else make_http_client("http1", config)
        self._urls: dict[tuple[str, str], str] = {}
        # Every request's wait for its first byte, on one timer: asyncio.timeout's timer per request cost
        # about 27,000 instructions under uvloop, 4-5% of the whole request. Remade when a reload changes it.
        self._first_byte = Deadlines(config.first_byte_timeout_s)

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
        if self._first_byte.seconds != config.first_byte_timeout_s:
            self._first_byte = Deadlines(config.first_byte_timeout_s)  # the old one keeps its waiting bounds
        self._http.set_limits(
            limit=config.max_connections,
            limit_per_host=config.max_connections_per_worker,
            keepalive_s=config.keepalive_s,
        )

    async def open(
        self, base_url: str, path: str, body: bytes, *, headers: dict[str, str] | None = None
    ) -> UpstreamResponse:
        """POST ``body`` and wait (bounded) for response headers."""
        cfg = self.config
        url = self._urls.get((base_url, path))
        if url is None:
            url = self._urls[(base_url, path)] = base_url.rstrip("/") + path
        try:
            with self._first_byte.bound():
                http = await self._http.post(url, body, headers, connect_timeout_s=cfg.connect_timeout_s)
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
        return UpstreamResponse(http, cfg.idle_timeout_s)

    async def count_tokens(self, base_url: str, body: bytes, timeout_s: float) -> int | None:
        """The token count vLLM's ``/tokenize`` gives for ``body`` on the worker at ``base_url``, within
        ``timeout_s``; None on any failure (no such route, an error, no answer in time, an answer longer
        than ``max_small_answer_bytes``)."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.open(base_url, "/tokenize", body)
                raw = await response.read_at_most(self.config.max_small_answer_bytes)
            count = orjson.loads(raw).get("count") if response.status == 200 else None
        except (TimeoutError, UpstreamFailure, orjson.JSONDecodeError, AttributeError) as exc:
            log.info("no token count from %s: %s", base_url, exc)
            return None
        return count if isinstance(count, int) and count >= 0 else None

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """A small GET of the gateway's own (health checks, model listings, metrics scrapes, versions): the
        status and body, within ``timeout_s`` for the whole exchange and ``max_small_answer_bytes`` for the
        body. A longer body raises ``AnswerTooLarge`` before the rest is read (callers already treat any
        exception as a failed call); a timeout raises ``TimeoutError``, a transport failure aiohttp's or
        the OS's error."""
        max_bytes = self.config.max_small_answer_bytes
        async with asyncio.timeout(timeout_s), self.session.get(url) as resp:
            length = resp.content_length
            if length is not None and length > max_bytes:
                resp.close()  # not read: the connection is not reused
                raise AnswerTooLarge(max_bytes)
            body = bytearray()
            async for chunk in resp.content.iter_any():
                body += chunk
                if len(body) > max_bytes:
                    resp.close()
                    raise AnswerTooLarge(max_bytes)
            return resp.status, bytes(body)

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None
