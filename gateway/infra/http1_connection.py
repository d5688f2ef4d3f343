"""One keep-alive HTTP/1.1 connection of ``gateway.infra.http1``: an asyncio protocol around
``httptools``' response parser, one request at a time. A body is read chunk by chunk (``chunk_nowait``,
``wait_data``) or relayed from the protocol callback to a sink (``relay_to``); reading pauses when
1 MiB is buffered and the consumer has not caught up."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools

from gateway.infra.http_api import ProtocolError

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
