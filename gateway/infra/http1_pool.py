"""The keep-alive pool of ``gateway.infra.http1``'s connections: per (host, port, tls), with a total and
a per-host limit, idle connections kept for ``keepalive_s`` and reused newest first."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque

from gateway.infra.http1_connection import Connection
from gateway.infra.http_api import ConnectTimeout


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
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled before it ran: the next waiter takes its turn
                raise
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
