"""One ``POST /v1/responses`` after it was translated: the chat request runs through the ``Proxy`` like any
other (every plugin, the chosen worker), and its answer comes back as a Response object or, for a stream,
as OpenAI's Responses events translated chunk by chunk (``gateway.wire.responses_output``). The finished
response is handed to a ``save`` callable (the route's store) before ``response.completed`` is sent.
Each turn records its own metrics and access log line, as the inference endpoints do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from gateway.ops.metrics import Metrics
from gateway.pipeline.context import RequestContext
from gateway.proxy.answer import cut_short
from gateway.proxy.forward import JSONReply, Proxy, StreamReply
from gateway.wire.errors import GatewayError
from gateway.wire.responses_chat import instructions_as_seen
from gateway.wire.responses_items import new_id
from gateway.wire.responses_output import EventStream, response_from_chat, response_object
from gateway.wire.responses_request import ResponsesRequest
from gateway.wire.streaming import SSEParser

log = logging.getLogger("gateway.access")


class _Events:
    """The translated stream as the sender sees it: ``aclose()`` releases the turn's resources even when
    the stream was never iterated (an async generator that never started skips its ``finally``)."""

    def __init__(self, events: AsyncIterator[bytes], release: Callable[[int], Awaitable[None]]) -> None:
        self._events = events
        self._release = release

    def __aiter__(self) -> _Events:
        return self

    def __anext__(self) -> Awaitable[bytes]:
        return self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined]
        finally:
            await self._release(499)


class ResponsesTurn:
    """One ``POST /v1/responses``: the proxied chat request and its translation back."""

    def __init__(
        self,
        proxy: Proxy,
        metrics: Metrics,
        req: ResponsesRequest,
        ctx: RequestContext,
        save: Callable[[dict[str, Any]], Awaitable[None]] | None,
    ) -> None:
        self.proxy, self.metrics, self.req, self.ctx = proxy, metrics, req, ctx
        self.save = save  # stores the finished Response (with the conversation it answered); None: store=false
        self.response_id = new_id("resp")
        self.created_at = int(time.time())

    async def start(self) -> JSONReply | StreamReply:
        """A whole JSON answer (or error), or the stream still to translate."""
        ctx = self.ctx
        in_flight = self.metrics.in_flight.labels(ctx.model.name)
        in_flight.inc()
        status = 500
        streaming = False
        try:
            reply = await self.proxy.serve(ctx)
            # the Response echoes the instructions the worker was given (a redaction shows), not the raw ones
            self.req.echo["instructions"] = instructions_as_seen(self.req, ctx.body)
            if isinstance(reply, StreamReply):
                streaming = True
                in_flight.dec()
                return reply
            status = reply.status
            return await self._json(reply)
        except GatewayError as error:
            status = error.status_code
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (the worker's connection was closed with it)
            raise
        finally:
            if not streaming:
                in_flight.dec()
                self._done(status)

    async def _json(self, reply: JSONReply) -> JSONReply:
        if reply.status != 200:  # already an OpenAI error (a refusal, the worker's 4xx, ...)
            return reply
        chat = orjson.loads(reply.body)
        response = response_from_chat(self.req, self.response_id, self.req.model, self.created_at, chat)
        if self.save is not None:
            await self.save(response)
        return JSONReply(200, orjson.dumps(response), reply.headers)

    def events(self, reply: StreamReply, pin: contextlib.ExitStack) -> _Events:
        """The Responses event sequence, translated from the chat stream as it arrives. Closing it
        releases the worker, the pinned snapshot and the context, even if it was never iterated."""
        chunks = reply.chunks
        if chunks is None:
            assert reply.passthrough is not None
            chunks = reply.passthrough.chunks()
        released = False

        async def release(status: int) -> None:
            nonlocal released
            if released:
                return
            released = True
            try:
                with contextlib.suppress(Exception):
                    await chunks.aclose()  # type: ignore[attr-defined]
                if reply.passthrough is not None:
                    reply.passthrough.close()
            finally:
                pin.close()
                self._done(status)

        return _Events(self._events(chunks, release), release)

    async def _events(
        self, chunks: AsyncIterator[bytes], release: Callable[[int], Awaitable[None]]
    ) -> AsyncIterator[bytes]:
        status = 200
        out = EventStream(
            response_object(self.req, self.response_id, self.req.model, self.created_at, "in_progress", [])
        )
        try:
            yield b"".join(out.start())
            parser = SSEParser()
            done = False
            async for raw in chunks:
                pieces: list[bytes] = []
                for payload in parser.feed(raw):
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = orjson.loads(payload)
                    if "error" in chunk and "choices" not in chunk:
                        status = 502
                        yield b"".join(pieces) + out.error(chunk["error"])
                        return
                    pieces += out.feed(chunk)
                if pieces:
                    yield b"".join(pieces)
                if done:
                    break
            if not done:
                status = 502
                yield out.error(cut_short().body()["error"])
                return
            tail = out.close()
            if self.save is not None:
                try:
                    await self.save(out.response)
                except GatewayError as error:
                    status = error.status_code
                    yield b"".join(tail) + out.error(error.body()["error"])
                    return
            yield b"".join(tail) + out.completed()
        except GatewayError as error:
            status = error.status_code
            yield out.error(error.body()["error"])
        except orjson.JSONDecodeError:
            status = 502
            yield out.error({"message": "The model worker sent an event that is not JSON.", "type": "server_error",
                             "param": None, "code": "upstream_error"})  # fmt: skip
        except BaseException:  # cancelled (the client went away) or closed early
            status = 499
            raise
        finally:
            await release(status)

    def _done(self, status: int) -> None:
        ctx = self.ctx
        ctx.finalize()
        elapsed = time.perf_counter() - ctx.started
        self.metrics.requests.labels(ctx.model.name, "responses", str(status)).inc()
        self.metrics.latency.labels(ctx.model.name, "responses").observe(elapsed)
        if log.isEnabledFor(logging.INFO):
            fields: dict[str, Any] = {
                "request_id": ctx.request_id,
                "route": "responses",
                "model": ctx.model.name,
                "status": status,
                "stream": ctx.stream,
                "duration_ms": round(elapsed * 1000, 3),
                "response_id": self.response_id,
            }
            if ctx.worker is not None:
                fields["worker"] = ctx.worker.url
            if ctx.tenant:
                fields["tenant"] = ctx.tenant
            fields.update(ctx.log)
            log.handle(
                log.makeRecord(log.name, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields})
            )
