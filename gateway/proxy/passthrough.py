"""A stream relayed as the worker's SSE bytes, unparsed: what a stream that no plugin watches becomes.

Two ways to relay it, with the same bookkeeping (time to first token, time per output token, the
check that the worker ended with ``data: [DONE]``):

- ``relay(writer)``: from the upstream connection's reads straight to the client's connection
  (``gateway.infra.chunked_writer``), with backpressure; the request's task sleeps until the stream ends.
- ``chunks()``: an async iterator of byte pieces for ASGI ``send``, for any other server.

Exactly one of them runs. The end is checked on the last bytes only, so a stream the worker cut short
still ends with one error event (then the server's end of the body).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from gateway.infra.chunked_writer import ChunkedWriter
from gateway.ops.metrics import Metrics
from gateway.pipeline.context import RequestContext
from gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gateway.wire.errors import BadGateway, GatewayError

_DONE_MARK = b"data: [DONE]"
_TAIL = 64  # bytes kept from the end of the stream to find the marker across read boundaries


class PassThrough:
    """One pass-through stream. ``on_end(ok)`` runs exactly once, when the worker's side is over
    (``ok``: the stream ended with ``[DONE]``), whichever way it was relayed, or when ``close`` is called
    before either ran."""

    __slots__ = (
        "_ctx",
        "_ended",
        "_events",
        "_first_at",
        "_last_at",
        "_metrics",
        "_on_end",
        "_tail",
        "_upstream",
        "_writer",
        "ok",
    )

    def __init__(
        self, ctx: RequestContext, upstream: UpstreamResponse, metrics: Metrics, on_end: Callable[[bool], None]
    ) -> None:
        self._ctx = ctx
        self._upstream = upstream
        self._metrics = metrics
        self._on_end = on_end
        self._writer: ChunkedWriter | None = None
        self._tail = b""
        self._first_at = self._last_at = 0.0
        self._events = 0  # after the first chunk; each SSE event is about one decoding step
        self._ended = False
        self.ok = False

    async def relay(self, writer: ChunkedWriter) -> None:
        """Relay the whole stream through ``writer``, then its ending (an error event if it was cut)."""
        self._writer = writer
        try:
            try:
                await self._upstream.relay(self._write, writer.drained)
                ending = self._ending()
            except UpstreamFailure as failure:
                ending = failure.error.to_sse()
            if ending:
                writer.write(ending)
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The stream as byte pieces (piled-up reads come as one piece), then its ending if it was cut."""
        try:
            async for chunk in self._upstream.iter_chunks():
                self._seen(chunk)
                yield chunk
            ending = self._ending()
            if ending:
                yield ending
        except UpstreamFailure as failure:
            yield failure.error.to_sse()
        finally:
            self.close()

    def close(self) -> None:
        """Release the worker's connection (closing it unless it was read to the end, which makes vLLM
        abort the generation) and report the outcome; later calls do nothing."""
        if not self._ended:
            self._ended = True
            self._upstream.close()
            self._on_end(self.ok)

    def _write(self, chunk: bytes) -> bool:
        self._seen(chunk)
        assert self._writer is not None
        return self._writer.write(chunk)

    def _seen(self, chunk: bytes) -> None:
        now = time.perf_counter()
        if not self._first_at:
            self._first_at = now
            observe_first_token(self._metrics, self._ctx, now)
        else:
            self._events += chunk.count(b"data:")
        self._last_at = now
        self._tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (self._tail + chunk)[-_TAIL:]

    def _ending(self) -> bytes:
        """After the worker's last byte: nothing more when it sent ``[DONE]`` (and the time per output
        token is observed), else one error event."""
        if _DONE_MARK not in self._tail:
            return cut_short().to_sse()
        self.ok = True
        # The [DONE] event is not a decoding step.
        observe_decoding(self._metrics, self._ctx, self._last_at - self._first_at, self._events - 1)
        return b""


def cut_short() -> GatewayError:
    return BadGateway("The model worker ended the stream before it was complete.", code="stream_incomplete")


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
