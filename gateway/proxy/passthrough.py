"""A stream relayed as the worker's SSE bytes, unparsed: what a stream that no plugin watches becomes.

Two ways to relay it, with the same bookkeeping (time to first token, time per output token, the
check that the worker ended with ``data: [DONE]``):

- ``relay(writer)``: from the upstream connection's reads straight to the client's connection
  (``gateway.infra.chunked_writer``), with backpressure; the request's task sleeps until the stream ends.
- ``chunks()``: an async iterator of byte pieces for ASGI ``send``, for any other server.

Exactly one of them runs. The end is checked on the last bytes only, so a stream the worker cut short
still ends with one error event (then the server's end of the body).

When the request's stream can be continued on another worker (a ``Resumer``, see ``gateway.proxy.resume``),
the relay also keeps the bytes it sent (whole events only: a torn event at a read boundary is held back
until it completes, so a cut never leaves half an event at the client) and, when the worker fails,
continues with the next worker's rewritten events instead of the error event. Without a resumer none of
that runs: the bytes go through as before.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import orjson

from gateway.infra.chunked_writer import ChunkedWriter
from gateway.ops.metrics import Metrics
from gateway.pipeline.context import Delivered, RequestContext
from gateway.proxy.resume import Resumer, reason_of
from gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gateway.wire.errors import BadGateway, GatewayError, from_upstream
from gateway.wire.streaming import DONE, SSEParser, encode_event

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
        "_held",
        "_last_at",
        "_metrics",
        "_on_end",
        "_resumer",
        "_sent",
        "_tail",
        "_upstream",
        "_writer",
        "ok",
    )

    def __init__(
        self,
        ctx: RequestContext,
        upstream: UpstreamResponse,
        metrics: Metrics,
        on_end: Callable[[bool], None],
        resumer: Resumer | None = None,
    ) -> None:
        self._ctx = ctx
        self._resumer = resumer
        self._held = b""  # resumable streams: the start of an event not yet complete
        self._sent: list[bytes] = []  # resumable streams: the whole events sent
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
        """Relay the whole stream through ``writer``, then its ending (an error event if it was cut, or
        the continuation from another worker)."""
        self._writer = writer
        try:
            kind: str | None = None
            failure: GatewayError | None = None
            try:
                await self._upstream.relay(self._write if self._resumer is None else self._write_whole, writer.drained)
                ending = self._ending()
            except UpstreamFailure as broke:  # kept as data: the kind and the client-facing error
                kind, failure = broke.kind, broke.error
                ending = failure.to_sse()
            if ending and self._resumer is not None:
                async for piece in self._resume(kind, failure or cut_short()):
                    if not writer.write(piece):
                        await writer.drained()
            elif ending:
                writer.write(ending)
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The stream as byte pieces (piled-up reads come as one piece), then its ending if it was cut."""
        try:
            kind: str | None = None
            failure: GatewayError | None = None
            try:
                async for chunk in self._upstream.iter_chunks():
                    if self._resumer is not None:
                        chunk = self._whole(chunk)
                        if not chunk:
                            continue
                    self._seen(chunk)
                    yield chunk
                ending = self._ending()
            except UpstreamFailure as broke:
                kind, failure = broke.kind, broke.error
                ending = failure.to_sse()
            if ending and self._resumer is not None:
                async for piece in self._resume(kind, failure or cut_short()):
                    yield piece
            elif ending:
                yield ending
        finally:
            self.close()

    def close(self) -> None:
        """Release the worker's connection (closing it unless it was read to the end, which makes vLLM
        abort the generation) and report the outcome; later calls do nothing."""
        if not self._ended:
            self._ended = True
            self._upstream.close()
            self._sent = []
            self._ctx.delivered = Delivered(complete=self.ok)  # not parsed: tokens uncounted
            self._on_end(self.ok)

    def _write(self, chunk: bytes) -> bool:
        self._seen(chunk)
        assert self._writer is not None
        return self._writer.write(chunk)

    def _write_whole(self, chunk: bytes) -> bool:
        chunk = self._whole(chunk)
        if not chunk:
            return True
        return self._write(chunk)

    def _whole(self, chunk: bytes) -> bytes:
        """Resumable streams: the complete events in ``held + chunk`` (kept for ``Progress``); the torn
        end waits for the next read."""
        if self._held:
            chunk = self._held + chunk
        cut = chunk.rfind(b"\n\n") + 2
        self._held = chunk[cut:]
        if cut < 2:
            self._held = chunk
            return b""
        whole = chunk[:cut] if self._held else chunk
        self._sent.append(whole)
        return whole

    async def _resume(self, kind: str | None, failure: GatewayError) -> AsyncIterator[bytes]:
        """After the worker failed: continue on other workers while the resumer allows, rewriting their
        events into this stream's; else end with ``failure`` as an error event."""
        resumer = self._resumer
        assert resumer is not None
        resumer.progress.add_events(b"".join(self._sent))
        self._sent = []
        self._held = b""
        while True:
            self._upstream.close()
            upstream, continuation = await resumer.resume(reason_of(kind), failure)
            if upstream is None:
                if continuation is None:
                    yield failure.to_sse()
                else:  # the token limit was reached exactly at the cut
                    self.ok = True
                    yield encode_event(continuation.length_end()) + DONE
                return
            self._upstream = upstream
            assert continuation is not None
            parser = SSEParser()
            kind = None
            try:
                async for raw in upstream.iter_chunks():
                    out: list[bytes] = []
                    for payload in parser.feed(raw):
                        if payload == b"[DONE]":
                            self.ok = True
                            out.append(DONE)
                            break
                        chunk = orjson.loads(payload)
                        if "error" in chunk and "choices" not in chunk:
                            err = chunk["error"]
                            status = err.get("code") if isinstance(err, dict) else None
                            out.append(from_upstream(status if isinstance(status, int) else 500, payload).to_sse())
                            yield b"".join(out)
                            return
                        rewritten = await continuation.rewrite(chunk)
                        if rewritten is not None:
                            out.append(encode_event(rewritten))
                    if out:
                        yield b"".join(out)
                    if self.ok:
                        return
                failure = cut_short()
            except UpstreamFailure as broke:
                kind, failure = broke.kind, broke.error
            except orjson.JSONDecodeError:
                yield BadGateway("The model worker sent an event that is not JSON.", code="upstream_error").to_sse()
                return

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
