"""A stream relayed as the worker's SSE bytes, unparsed: what a stream that no plugin must read becomes.

Two ways to relay it, with the same bookkeeping (time to first token, time per output token):

- ``relay(writer)``: from the upstream connection's reads straight to the client's connection
  (``gateway.infra.chunked_writer``), with backpressure; the request's task sleeps until the stream ends.
- ``chunks()``: an async iterator of byte pieces for ASGI ``send``, for any other server.

Exactly one of them runs. The bytes come from an ``AnswerStream`` (``gateway.proxy.answer``), which
hides a failover to another worker; when it raises its final error, the stream ends with that error as
one event. When a plugin needs the stream's usage (``Plugin.reads_stream_text = False``: billing), a
``StreamTap`` (``gateway.proxy.stream_tap``) reads the bytes: it finds the usage (then ``settle(usage)``
runs before ``[DONE]`` goes out), counts the tokens sent, and ends the stream at the request's limit should
the worker run past it (the worker's connection is closed, which makes vLLM stop).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.infra.chunked_writer import ChunkedWriter
from gateway.ops.metrics import Metrics
from gateway.pipeline.context import Delivered, ModelResponse, RequestContext
from gateway.proxy.answer import AnswerFailed, AnswerStream, ending_event
from gateway.proxy.stream_tap import StreamTap
from gateway.wire.errors import GatewayError

#: Runs the plugins that need a stream's usage (or its recording) with what the tap found
#: (``StreamTap.settlement``).
Settle = Callable[[ModelResponse], Awaitable[None]]


class PassThrough:
    """One pass-through stream. ``on_end(ok)`` runs exactly once, when the worker's side is over
    (``ok``: the stream ended with ``[DONE]``), whichever way it was relayed, or when ``close`` is called
    before either ran."""

    __slots__ = (
        "_answer",
        "_ctx",
        "_done",
        "_ended",
        "_events",
        "_first_at",
        "_last_at",
        "_metrics",
        "_on_end",
        "_settle",
        "_tap",
        "_writer",
    )

    def __init__(
        self,
        ctx: RequestContext,
        answer: AnswerStream,
        metrics: Metrics,
        on_end: Callable[[bool], None],
        tap: StreamTap | None = None,
        settle: Settle | None = None,
    ) -> None:
        self._ctx = ctx
        self._tap = tap
        self._settle = settle
        self._done = b""  # the [DONE] part, held until the usage was settled
        self._answer = answer
        self._metrics = metrics
        self._on_end = on_end
        self._writer: ChunkedWriter | None = None
        self._first_at = self._last_at = 0.0
        self._events = 0  # after the first chunk; each SSE event is about one decoding step
        self._ended = False

    @property
    def ok(self) -> bool:
        """The stream ended with ``[DONE]``: the worker's, or the gateway's at the request's limit."""
        return self._answer.ok or (self._tap is not None and self._tap.limited)

    async def relay(self, writer: ChunkedWriter) -> None:
        """Relay the whole stream through ``writer``, then its ending (an error event if it was cut and not
        continued)."""
        self._writer = writer
        try:
            try:
                with contextlib.suppress(_AtLimit):
                    await self._answer.relay(self._write, writer.drained)
                self._observe_end()
                ending = await self._ending()
            except AnswerFailed as failed:
                ending = self._flushed() + ending_event(self._ctx, failed.error)
            if ending:
                writer.write(ending)
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The stream as byte pieces (piled-up reads come as one piece), then its ending if it was cut."""
        try:
            try:
                async for piece in self._answer.pieces():
                    self._seen(piece)
                    if self._tap is not None:
                        piece = self._tapped(piece)
                    if piece:
                        yield piece
                    if self._tap is not None and self._tap.limited:
                        break  # at the request's limit: the worker's connection is closed with the stream
                self._observe_end()
                ending = await self._ending()
            except AnswerFailed as failed:
                ending = self._flushed() + ending_event(self._ctx, failed.error)
            if ending:
                yield ending
        finally:
            self.close()

    def close(self) -> None:
        """Release the worker's connection (closing it unless it was read to the end, which makes vLLM
        abort the generation) and report the outcome; later calls do nothing."""
        if not self._ended:
            self._ended = True
            self._answer.close()
            ok, tap = self.ok, self._tap
            if tap is None:
                self._ctx.delivered = Delivered(complete=ok)  # not parsed: tokens uncounted
            else:
                self._ctx.delivered = Delivered(stream_tokens=tap.completion_tokens(), usage=tap.usage, complete=ok)
            self._on_end(ok)

    def _write(self, chunk: bytes) -> bool:
        self._seen(chunk)
        tap = self._tap
        if tap is not None:
            chunk, done = tap.feed(chunk)  # _tapped, written out: once per read of every billed stream
            if done:
                self._done = done
            if tap.limited:  # at the request's limit: stop reading the worker (its connection is closed)
                assert self._writer is not None
                self._writer.write(chunk)
                raise _AtLimit
            if not chunk:
                return True
        assert self._writer is not None
        return self._writer.write(chunk)

    def _tapped(self, piece: bytes) -> bytes:
        assert self._tap is not None
        piece, done = self._tap.feed(piece)
        if done:
            self._done = done
        return piece

    async def _ending(self) -> bytes:
        """After the worker's last byte (or the limit), a tapped stream's end: the plugins that need its
        usage run (a refusal becomes the stream's last event instead of ``[DONE]``), then the ``[DONE]``
        held back."""
        tap, settle = self._tap, self._settle
        if tap is None:
            return b""
        held = b"" if tap.limited else tap.flush()
        if settle is None:  # a tap without plugins to settle (tests of the tap alone)
            return held + self._done
        self._ctx.delivered = Delivered(stream_tokens=tap.completion_tokens(), usage=tap.usage, complete=False)
        try:
            await settle(tap.settlement(completed=bool(self._done)))
        except GatewayError as refused:
            return held + ending_event(self._ctx, refused)
        return held + self._done

    def _flushed(self) -> bytes:
        return self._tap.flush() if self._tap is not None else b""

    def _seen(self, chunk: bytes) -> None:
        now = time.perf_counter()
        if not self._first_at:
            self._first_at = now
            observe_first_token(self._metrics, self._ctx, now)
        else:
            self._events += chunk.count(b"data:")
        self._last_at = now

    def _observe_end(self) -> None:
        # The [DONE] event is not a decoding step.
        observe_decoding(self._metrics, self._ctx, self._last_at - self._first_at, self._events - 1)


class _AtLimit(Exception):
    """Raised from the relay's sink when the stream reached the request's limit: reading stops."""


def observe_first_token(metrics: Metrics, ctx: RequestContext, at: float) -> None:
    """A stream's first event arrived at ``at`` (perf_counter): time to first token, in the access line
    and the histogram."""
    ctx.log["ttft_ms"] = round((at - ctx.started) * 1000, 3)
    metrics.ttft.labels(ctx.model.name).observe(at - ctx.started)


def observe_decoding(metrics: Metrics, ctx: RequestContext, seconds: float, steps: int) -> None:
    """Time per output token of a completed stream: the decode time after the first event over the
    events that followed (ignores prefill, which TTFT measures). Not observed for one-event streams."""
    if steps > 0:
        metrics.tpot.labels(ctx.model.name).observe(seconds / steps)
