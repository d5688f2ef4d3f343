"""One answer's SSE bytes across workers: ``AnswerStream``, the only place that knows a stream may come
from more than one worker.

Both relays consume it (``gateway.proxy.passthrough`` as bytes, ``gateway.proxy.inspected`` parsed): it
yields the first worker's bytes as they arrive and, when that worker fails midway and the request allows
it (a ``Resumer``, ``gateway.proxy.resume``), the continuing worker's events rewritten into the first
stream's. When the answer cannot be finished it raises one ``AnswerFailed`` carrying the client-facing
error as data (a consumer renders it as the stream's last event); it never raises ``UpstreamFailure``.

When the stream can be continued, only whole events go out (a torn event at a read boundary is held back
until it completes, so a cut never leaves half an event at the client), and the events sent are kept to
tell the continuation what the client already has. Without a resumer none of that runs: the bytes go
through as the worker sent them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from gateway.pipeline.context import RequestContext, StreamError
from gateway.proxy.resume import Continuation, Resumer, reason_of
from gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gateway.wire.errors import BadGateway, GatewayError, from_upstream
from gateway.wire.streaming import DONE, SSEParser, done_event_at, encode_event

_TAIL = 64  # bytes kept from the end of the stream to find the marker across read boundaries

Sink = Callable[[bytes], bool]


class AnswerFailed(Exception):
    """The answer could not be finished; ``error`` is what the client is told. The error travels as data
    (never raised itself, so it holds no frames: a stream that failed leaves no reference cycle)."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class AnswerStream:
    """The SSE bytes of one answer, from one worker or, after failovers, several. ``ok`` is True once the
    answer ended with ``[DONE]`` (a consumer that stops reading at ``[DONE]`` itself knows that first)."""

    __slots__ = ("_held", "_resumer", "_sent", "_tail", "_upstream", "ok")

    def __init__(self, upstream: UpstreamResponse, resumer: Resumer | None) -> None:
        self._upstream = upstream
        self._resumer = resumer
        self._held = b""  # resumable: the start of an event not yet complete
        self._sent: list[bytes] = []  # resumable: the whole events that went out
        self._tail = b"\n"  # the stream's start counts as a line's start
        self.ok = False

    async def pieces(self) -> AsyncIterator[bytes]:
        """The answer as byte pieces (reads that piled up come as one piece), until its end."""
        kind: str | None = None
        try:
            async for chunk in self._upstream.iter_chunks():
                chunk = self._keep(chunk)
                if chunk:
                    yield chunk
            if self._ended_well():
                return
            failure = cut_short()
        except UpstreamFailure as broke:  # kept as data: the kind and the client-facing error
            kind, failure = broke.kind, broke.error
        async for piece in self._continue(kind, failure):
            yield piece

    async def relay(self, sink: Sink, drained: Callable[[], Awaitable[None]]) -> None:
        """The same, pushed into ``sink``: the first worker's bytes straight from its connection's reads
        (``sink`` returns False when it cannot take more; reading then waits for ``drained()``)."""
        kind: str | None = None
        try:
            await self._upstream.relay(self._kept_into(sink), drained)
            if self._ended_well():
                return
            failure = cut_short()
        except UpstreamFailure as broke:
            kind, failure = broke.kind, broke.error
        async for piece in self._continue(kind, failure):
            if not sink(piece):
                await drained()

    def close(self) -> None:
        """Release the current worker's connection (closing it unless read to the end, which makes vLLM
        abort the generation)."""
        self._upstream.close()
        self._sent = []

    # -- the first worker's bytes --------------------------------------------------------------------

    def _keep(self, chunk: bytes) -> bytes:
        """What of a read goes out now (all of it, or the whole events of a resumable stream); the last
        bytes are kept to see ``[DONE]`` across read boundaries."""
        self._tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (self._tail + chunk)[-_TAIL:]
        return chunk if self._resumer is None else self._whole(chunk)

    def _kept_into(self, sink: Sink) -> Sink:
        def push(chunk: bytes) -> bool:
            chunk = self._keep(chunk)
            return sink(chunk) if chunk else True

        return push

    def _whole(self, chunk: bytes) -> bytes:
        """The complete events in ``held + chunk`` (kept for the continuation); the torn end waits."""
        if self._held:
            chunk = self._held + chunk
        cut = chunk.rfind(b"\n\n") + 2
        if cut < 2:
            self._held = chunk
            return b""
        self._held = chunk[cut:]
        whole = chunk[:cut] if self._held else chunk
        self._sent.append(whole)
        return whole

    def _ended_well(self) -> bool:
        """Whether the stream ended with the ``[DONE]`` event, not the same words inside an event's text.
        Looked for past the tail's first byte, whose line may have begun before the tail (a line feed
        stands for the stream's start)."""
        if done_event_at(self._tail, 1) >= 0:
            self.ok = True
        return self.ok

    # -- the continuation ------------------------------------------------------------------------------

    async def _continue(self, kind: str | None, failure: GatewayError) -> AsyncIterator[bytes]:
        """After the worker failed: the answer continued on other workers while the resumer allows;
        raises the last failure when no worker (or no more) continues it."""
        resumer = self._resumer
        if resumer is None:
            raise AnswerFailed(failure)
        resumer.progress.add_events(b"".join(self._sent))
        self._sent, self._held = [], b""
        while True:
            self._upstream.close()
            upstream, continuation = await resumer.resume(reason_of(kind), failure)
            if upstream is None:
                if continuation is None:
                    raise AnswerFailed(failure)
                self.ok = True  # the token limit was reached exactly at the cut
                yield encode_event(continuation.length_end()) + DONE
                return
            self._upstream = upstream
            assert continuation is not None  # resume() pairs a worker with its rewriter
            kind, failure = None, cut_short()
            try:
                async for piece in self._rewritten(upstream, continuation):
                    yield piece
            except UpstreamFailure as broke:
                kind, failure = broke.kind, broke.error
            except orjson.JSONDecodeError:
                raise AnswerFailed(not_json()) from None
            if self.ok:
                return

    async def _rewritten(self, upstream: UpstreamResponse, continuation: Continuation) -> AsyncIterator[bytes]:
        parser = SSEParser()
        async for raw in upstream.iter_chunks():
            out: list[bytes] = []
            for payload in parser.feed(raw):
                if payload == b"[DONE]":
                    self.ok = True
                    out.append(DONE)
                    break
                chunk = orjson.loads(payload)
                if is_error_event(chunk):
                    if out:
                        yield b"".join(out)
                    raise AnswerFailed(error_event(payload, chunk))
                rewritten = await continuation.rewrite(chunk)
                if rewritten is not None:
                    out.append(encode_event(rewritten))
            if out:
                yield b"".join(out)
            if self.ok:
                return


def is_error_event(chunk: dict[str, Any]) -> bool:
    """vLLM's way of failing a stream after its headers: an event with ``error`` and no ``choices``."""
    return "error" in chunk and "choices" not in chunk


def error_event(payload: bytes, chunk: dict[str, Any]) -> GatewayError:
    """A worker's error event as the gateway's error (its status from the event's ``code``, else 500)."""
    err = chunk["error"]
    status = err.get("code") if isinstance(err, dict) else None
    return from_upstream(status if isinstance(status, int) else 500, payload)


def ending_event(ctx: RequestContext, error: GatewayError) -> bytes:
    """The gateway's own ``error`` as the stream's last event (then ``[DONE]``), kept as
    ``ctx.stream_error``: a reader of the stream that renders it in another API's shape (a translated
    turn) must not take it for a worker's error event, which it would read as the worker's failure."""
    ctx.stream_error = StreamError(error.status_code, error.body()["error"])
    return error.to_sse()


def cut_short() -> GatewayError:
    return BadGateway("The model worker ended the stream before it was complete.", code="stream_incomplete")


def not_json() -> GatewayError:
    return BadGateway("The model worker sent an event that is not JSON.", code="upstream_error")
