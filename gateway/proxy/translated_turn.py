"""One request of another API's shape (Responses, Anthropic Messages) after it was translated into a chat
completions request: it runs through the ``Proxy`` like any other (every plugin, the chosen worker, failover
inside), and its answer comes back translated, as a whole JSON object or, for a stream, event by event as
the chat chunks arrive. ``TranslatedTurn`` is what every such API shares: the in-flight gauge, releasing the
worker and the pinned snapshot when the translated stream closes (iterated or not), the loop that parses
the chat stream and hands each chunk to the API's translator, the end of a stream cut short, and the turn's
own metrics and access log line. A subclass says how a whole answer and the stream's events look.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from gateway.ops.metrics import STATUS_LABELS, Metrics
from gateway.pipeline.config import ModelConfig
from gateway.pipeline.context import PinnedSnapshot, RequestContext
from gateway.proxy.answer import cut_short, error_event, is_error_event
from gateway.proxy.forward import JSONReply, Proxy, Reply, StreamReply
from gateway.wire.errors import BadGateway, GatewayError, ServerError
from gateway.wire.streaming import SSEParser

log = logging.getLogger("gateway.access")
failures = logging.getLogger("gateway.proxy")
_NOT_JSON = {"message": "The model worker sent an event that is not JSON.", "type": "server_error",
             "param": None, "code": "upstream_error"}  # fmt: skip


def chat_context(
    *,
    api: str,
    request_id: str,
    chat: dict[str, Any],
    headers: dict[str, str],
    model: ModelConfig,
    requested_model: str,
    snapshot: PinnedSnapshot,
    started: float,
) -> RequestContext:
    """The context of a translated request: a chat completions request like any other, its API logged."""
    ctx = RequestContext(
        request_id=request_id,
        endpoint="chat/completions",
        path="/v1/chat/completions",
        body=chat,
        raw_body=orjson.dumps(chat),
        headers=headers,
        model=model,
        requested_model=requested_model,
        snapshot=snapshot,
        stream=chat.get("stream") is True,
        started=started,
    )
    ctx.log["api"] = api
    return ctx


class Translator(Protocol):
    """Chat completion chunks in, another API's events out (SSE bytes)."""

    def start(self) -> list[bytes]: ...

    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def error(self, error: dict[str, Any]) -> bytes:
        """The event for an error (given in OpenAI's shape) that ends the stream."""
        ...

    def close(self) -> list[bytes]:
        """The events that close what is open, after the chat stream's last chunk."""
        ...


class TranslatedEvents:
    """The translated stream as the sender sees it: ``aclose()`` releases the turn's resources even when
    the stream was never iterated (an async generator that never started skips its ``finally``)."""

    def __init__(self, events: AsyncIterator[bytes], release: Callable[[int], Awaitable[None]]) -> None:
        self._events = events
        self._release = release

    def __aiter__(self) -> TranslatedEvents:
        return self

    def __anext__(self) -> Awaitable[bytes]:
        return self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined]
        finally:
            await self._release(499)


class _EndedByGateway(Exception):
    """The chat stream's error event is the one the gateway ended it with (``ctx.stream_error``)."""


def chat_chunk(payload: bytes, ended_by_gateway: bool = False) -> dict[str, Any]:
    """One event of the chat stream as the translators read it, a JSON object. An error event is the
    gateway's own when it ended the stream with one (``ended_by_gateway``: a plugin's refusal, say, whose
    status and code the translation keeps), else the worker's error, raised as the chat route reads it (any
    shape; its status from its ``code``)."""
    chunk = orjson.loads(payload)
    if not isinstance(chunk, dict):  # JSON, but no chunk: the translators read objects
        raise BadGateway("The model worker sent an event that is not a JSON object.", code="upstream_error")
    if is_error_event(chunk):
        if ended_by_gateway:
            raise _EndedByGateway
        raise error_event(payload, chunk)
    return chunk


class TranslatedTurn(abc.ABC):
    """One translated request: the proxied chat request and its translation back. ``route`` labels its
    metrics and access log line."""

    route = "translated"

    def __init__(self, proxy: Proxy, metrics: Metrics, ctx: RequestContext) -> None:
        self.proxy, self.metrics, self.ctx = proxy, metrics, ctx

    # -- what a subclass says ----------------------------------------------------------------------

    @abc.abstractmethod
    async def translate_json(self, reply: JSONReply) -> JSONReply:
        """The whole answer (``reply`` is the chat answer or an OpenAI-shaped error) in the API's shape."""

    @abc.abstractmethod
    def translator(self) -> Translator:
        """A fresh translator of this turn's chat stream into the API's events."""

    @abc.abstractmethod
    async def finish(self, out: Any) -> bytes:
        """The stream's last event, once ``out`` closed (may raise a GatewayError: sent as an error event)."""

    def log_fields(self) -> dict[str, Any]:
        return {}

    # -- the trip ----------------------------------------------------------------------------------

    async def start(self) -> JSONReply | StreamReply:
        """A whole JSON answer (or error), or the stream still to translate."""
        ctx = self.ctx
        in_flight = self.metrics.in_flight.labels(ctx.model.name)
        in_flight.inc()
        status = 500
        streaming = False
        try:
            reply = await self.proxy.serve(ctx)
            if isinstance(reply, StreamReply):
                streaming = True  # in flight until the translated stream is released (``events``)
                return reply
            status = reply.status
            return await self.translate_json(reply)
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

    async def reply(self, pin: contextlib.ExitStack) -> Reply:
        """The turn's answer: a whole JSON reply, or the translated stream, which then owns the pinned
        snapshot (``pin``'s callbacks move to it) until its last byte."""
        reply = await self.start()
        if isinstance(reply, JSONReply):
            return reply
        return StreamReply(self.events(reply, pin.pop_all()), reply.headers)

    def events(self, reply: StreamReply, pin: contextlib.ExitStack) -> TranslatedEvents:
        """The API's event sequence, translated from the chat stream as it arrives. Closing it
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
                self.metrics.in_flight.labels(self.ctx.model.name).dec()
                self._done(status)

        return TranslatedEvents(self._events(chunks, release), release)

    async def _events(
        self, chunks: AsyncIterator[bytes], release: Callable[[int], Awaitable[None]]
    ) -> AsyncIterator[bytes]:
        status = 200
        out = self.translator()
        pieces: list[bytes] = []  # the events of this read's chunks, not sent yet: an error ending it follows them
        try:
            yield b"".join(out.start())
            parser = SSEParser()
            done = False
            async for raw in chunks:
                for payload in parser.feed(raw):
                    if payload == b"[DONE]":
                        done = True
                        break
                    pieces += out.feed(chat_chunk(payload, self.ctx.stream_error is not None))
                if pieces:
                    yield b"".join(pieces)
                    pieces = []
                if done:
                    break
            if not done:
                status = 502
                yield out.error(cut_short().body()["error"])
                return
            tail = out.close()
            try:
                last = await self.finish(out)
            except GatewayError as error:
                status = error.status_code
                yield b"".join(tail) + out.error(error.body()["error"])
                return
            yield b"".join(tail) + last
        except GatewayError as error:
            status = error.status_code
            yield b"".join(pieces) + out.error(error.body()["error"])
        except _EndedByGateway:
            ended = self.ctx.stream_error
            assert ended is not None
            status = ended.status
            yield b"".join(pieces) + out.error(ended.error)
        except orjson.JSONDecodeError:
            status = 502
            yield b"".join(pieces) + out.error(_NOT_JSON)
        except Exception:  # the gateway's own failure: logged, and the stream still ends in the API's shape
            status = 500
            failures.exception("request %s failed while its stream was translated", self.ctx.request_id)
            message = "The gateway failed to process the request; it has been logged."
            yield b"".join(pieces) + out.error(ServerError(message, code="internal_error").body()["error"])
        except BaseException:  # cancelled (the client went away) or closed early
            status = 499
            raise
        finally:
            await release(status)

    def _done(self, status: int) -> None:
        ctx = self.ctx
        ctx.finalize()
        elapsed = time.perf_counter() - ctx.started
        self.metrics.requests.labels(ctx.model.name, self.route, STATUS_LABELS[status]).inc()
        self.metrics.latency.labels(ctx.model.name, self.route).observe(elapsed)
        if log.isEnabledFor(logging.INFO):
            fields: dict[str, Any] = {
                "request_id": ctx.request_id,
                "route": self.route,
                "model": ctx.model.name,
                "status": status,
                "stream": ctx.stream,
                "duration_ms": round(elapsed * 1000, 3),
                **self.log_fields(),
            }
            if ctx.worker is not None:
                fields["worker"] = ctx.worker.url
            if ctx.tenant:
                fields["tenant"] = ctx.tenant
            fields.update(ctx.log)
            log.handle(
                log.makeRecord(log.name, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields})
            )
