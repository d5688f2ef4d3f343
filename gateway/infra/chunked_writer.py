"""Body chunks of a streamed response written straight to the client's connection.

ASGI's ``send`` is a coroutine per message, awaited by the request's task: relaying a stream through it
costs a task wake-up, a coroutine and a message dict per chunk, which at hundreds of concurrent streams
was a third of the gateway's CPU beyond the socket calls themselves (bench/README.md). When the server
is uvicorn's httptools protocol (what ``gateway serve`` runs), a ``ChunkedWriter`` writes each chunk to
the same transport, framed the way uvicorn frames it, from whatever callback has the bytes.

Only the body between the response start and the response end goes this way: both of those still go
through ``send``, so the server's own state (headers sent, keep-alive, completion) stays its own. With
any other server ``ChunkedWriter.of`` returns None and the caller keeps using ``send``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


class ChunkedWriter:
    """Writes chunked-encoded body pieces of a response whose start was sent with ASGI ``send``."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow

    @classmethod
    def of(cls, send: Callable[[Any], Awaitable[None]]) -> ChunkedWriter | None:
        """A writer for the response ``send`` belongs to, once its start has been sent; None unless
        ``send`` is uvicorn's httptools cycle in the middle of a chunked response."""
        cycle = getattr(send, "__self__", None)
        if (
            cycle is None
            or getattr(cycle, "chunked_encoding", None) is not True
            or getattr(cycle, "response_started", None) is not True
            or getattr(cycle, "response_complete", True) is not False
            or not hasattr(cycle, "transport")
            or not hasattr(getattr(cycle, "flow", None), "write_paused")
        ):
            return None
        return cls(cycle)

    def write(self, data: bytes) -> bool:
        """Send ``data`` as one chunk. False when the client's buffer is full: wait for ``drained``
        before writing more. A client that is gone takes nothing (its request is being cancelled)."""
        if self._cycle.disconnected or self._transport.is_closing():
            return True
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return not self._flow.write_paused

    async def drained(self) -> None:
        """Return once the client's connection can take more (or is gone)."""
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()
