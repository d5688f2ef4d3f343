"""The interface of the HTTP/1.1 client to workers, and the failures every implementation reports.

Two implementations: ``gateway.infra.http1`` (asyncio + httptools, the default) and
``gateway.infra.http_aiohttp`` (aiohttp's client session, tuned: no tracing, keep-alive pool), selected by
the ``GATEWAY_UPSTREAM_CLIENT`` setting. ``tests/infra/conformance/`` runs the same cases against both.

The contract (what a caller may rely on, whichever implementation):

- ``post`` resolves once the response headers have arrived. It does not bound that wait: the caller
  wraps it in ``asyncio.timeout`` (the first-byte bound); cancelling it closes the connection.
- Failures before the headers: ``OSError`` when no connection could be made or it broke
  (``ConnectionRefusedError``, ``ConnectionResetError``, ``ConnectTimeout`` after ``connect_timeout_s``),
  ``ProtocolError`` when the bytes were not HTTP. A request written on a kept-alive connection that the
  worker closed before any byte of an answer is sent once more on a fresh connection (once only);
  a fresh connection that fails is the caller's failure.
- Reading the body (``read``, ``chunk``, ``relay``): each wait for more bytes is bounded by ``idle_s``
  and raises ``TimeoutError`` past it; a body cut short (reset, closed before its length or its last
  chunk) raises ``OSError``; a malformed one ``ProtocolError``.
- ``close()`` gives the connection back: kept for reuse when the body was read to its end and the
  worker allows keep-alive, closed (aborted) otherwise. Closing an unread response is how vLLM learns
  to abort the generation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol


class ProtocolError(Exception):
    """The worker's bytes were not valid HTTP/1.1."""


class ConnectTimeout(ConnectionError):
    """No connection within the connect timeout (a connect failure, like a refused connection)."""


class HttpResponse(Protocol):
    """A response whose headers have arrived; the body is read on demand, once."""

    @property
    def status(self) -> int: ...

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (lower-case), or None."""
        ...

    async def read(self, idle_s: float | None) -> bytes:
        """The whole body; then the response is closed."""
        ...

    async def chunk(self, idle_s: float | None) -> bytes:
        """The body bytes that arrived since the last call (waiting for some if none did); ``b""`` at
        the end."""
        ...

    async def relay(
        self, sink: Callable[[bytes], bool], drained: Callable[[], Awaitable[None]], idle_s: float | None
    ) -> None:
        """Hand the rest of the body to ``sink`` as it arrives, until it ends. ``sink`` returns False
        when it cannot take more for now: reading then pauses until ``drained()`` returns."""
        ...

    def close(self) -> None:
        """Give the connection back (reused if the body was read to its end, closed otherwise)."""
        ...


class HttpClient(Protocol):
    """A keep-alive pool of HTTP/1.1 connections, limited in total and per (host, port, scheme)."""

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str] | None, *, connect_timeout_s: float
    ) -> HttpResponse:
        """POST ``body`` to ``url`` with the client's own headers plus ``headers``."""
        ...

    def set_limits(self, *, limit: int, limit_per_host: int, keepalive_s: float) -> None:
        """Pool limits for new connections from now on (connections above a lowered limit finish)."""
        ...

    async def aclose(self) -> None: ...
