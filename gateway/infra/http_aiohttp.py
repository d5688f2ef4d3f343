"""``gateway.infra.http_api.HttpClient`` on aiohttp's client session: the well-kept library the hand-written
``http1`` client is measured and tested against (tests/infra/conformance), and a fallback an operator can
select with ``GATEWAY_UPSTREAM_CLIENT=aiohttp``.

Tuned for the hop to workers: no tracing, no cookie jar, no decompression, no auto ``User-Agent``, one
keep-alive connector with the pool's limits. aiohttp's exceptions are translated into the contract's
(``OSError``, ``ConnectTimeout``, ``ProtocolError``, ``TimeoutError``), and a POST written on a
kept-alive connection the worker had just closed is sent once more on a fresh one, as ``http1`` does
(aiohttp itself retries only idempotent methods).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import aiohttp
from aiohttp import client_exceptions as ce
from aiohttp import http_exceptions as he

from gateway.infra.http_api import ConnectTimeout, ProtocolError

#: Set by the connector when a request got a kept-alive connection from the pool (same task: visible to
#: the ``post`` that awaited the request).
_reused: ContextVar[bool] = ContextVar("gateway_aiohttp_reused", default=False)


class _Connector(aiohttp.TCPConnector):
    async def _get(self, key: Any, traces: Any) -> Any:
        conn = await super()._get(key, traces)
        if conn is not None:
            _reused.set(True)
        return conn


def _translate(exc: BaseException) -> BaseException:
    """aiohttp's exception as the contract's."""
    if isinstance(exc, ce.ConnectionTimeoutError):
        return ConnectTimeout(str(exc) or "no connection within the connect timeout")
    if isinstance(exc, ce.ClientConnectorError):
        return exc.os_error if isinstance(exc.os_error, OSError) else ConnectionError(str(exc))
    if isinstance(exc, ce.ServerTimeoutError):
        return TimeoutError(str(exc))
    if isinstance(exc, ce.ClientPayloadError):
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, he.ContentLengthError) or "not completed" in str(exc) or "closed" in str(exc):
            return ConnectionResetError(str(exc))
        return ProtocolError(str(exc))
    if isinstance(exc, ce.ServerDisconnectedError):
        return ConnectionResetError(str(exc) or "the worker closed the connection")
    if isinstance(exc, ce.ClientResponseError):  # the parser refused the response (aiohttp's "400")
        return ProtocolError(exc.message)
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, ce.ClientConnectionError):
        return ConnectionError(str(exc))
    return exc


_TRANSLATED = (ce.ClientError, OSError)


class AiohttpResponse:
    __slots__ = ("_done", "_resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._done = False
        self.status = resp.status

    def header(self, name: str) -> str | None:
        return self._resp.headers.get(name)

    async def _readany(self, idle_s: float | None) -> bytes:
        content = self._resp.content
        try:
            if idle_s is None:
                return await content.readany()
            async with asyncio.timeout(idle_s):
                return await content.readany()
        except _TRANSLATED as exc:
            raise _translate(exc) from None

    async def read(self, idle_s: float | None) -> bytes:
        parts: list[bytes] = []
        try:
            while data := await self._readany(idle_s):
                parts.append(data)
        finally:
            self.close()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def chunk(self, idle_s: float | None) -> bytes:
        return await self._readany(idle_s)

    async def relay(
        self, sink: Callable[[bytes], bool], drained: Callable[[], Awaitable[None]], idle_s: float | None
    ) -> None:
        try:
            while data := await self._readany(idle_s):
                if not sink(data):
                    await drained()
        finally:
            self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            if self._resp.content.at_eof():
                self._resp.release()  # read to its end: back to the pool (if the worker keeps it alive)
            else:
                self._resp.close()  # unread: the connection is closed (vLLM aborts the generation)


class AiohttpClient:
    """``gateway.infra.http_api.HttpClient`` on one tuned ``aiohttp.ClientSession``."""

    def __init__(self, *, base_headers: Mapping[str, str], limit: int, limit_per_host: int, keepalive_s: float) -> None:
        self._base_headers = dict(base_headers)
        self._limits = (limit, limit_per_host, keepalive_s)
        self._session: aiohttp.ClientSession | None = None
        self._connector: _Connector | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def _open_session(self) -> aiohttp.ClientSession:
        limit, per_host, keepalive_s = self._limits
        self._connector = _Connector(
            limit=limit, limit_per_host=per_host, keepalive_timeout=keepalive_s, family=socket.AF_UNSPEC
        )
        self._session = aiohttp.ClientSession(
            connector=self._connector,
            headers=self._base_headers,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self._session

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str] | None, *, connect_timeout_s: float
    ) -> AiohttpResponse:
        session = self._session or self._open_session()
        timeout = self._timeouts.get(connect_timeout_s)
        if timeout is None:
            timeout = self._timeouts[connect_timeout_s] = aiohttp.ClientTimeout(
                total=None, sock_connect=connect_timeout_s
            )
        for attempt in (1, 2):
            _reused.set(False)
            try:
                resp = await session.post(url, data=body, headers=headers, timeout=timeout)
            except (ce.ServerDisconnectedError, ce.ClientOSError) as exc:
                if attempt == 1 and _reused.get() and not isinstance(exc, ce.ClientConnectorError):
                    continue  # a kept-alive connection the worker closed as we wrote: once more, fresh
                raise _translate(exc) from None
            except _TRANSLATED as exc:
                raise _translate(exc) from None
            return AiohttpResponse(resp)
        raise AssertionError("unreachable")

    def set_limits(self, *, limit: int, limit_per_host: int, keepalive_s: float) -> None:
        self._limits = (limit, limit_per_host, keepalive_s)
        if self._connector is not None:  # aiohttp reads these on each acquire
            self._connector._limit = limit
            self._connector._limit_per_host = limit_per_host
            self._connector._keepalive_timeout = keepalive_s

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
