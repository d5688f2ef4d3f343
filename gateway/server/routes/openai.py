"""The inference endpoints (chat, completions, embeddings) served at the ASGI level.

These are the hot path, so they skip the web framework: read the body once (bounded), parse it once,
pin the config snapshot, build the RequestContext, hand it to the Proxy, and send the reply. A client
that disconnects cancels the work, which closes the upstream connection, which makes vLLM abort the
generation. One request's state lives in its ``RequestCycle`` (``gateway.server.cycle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.infra.chunked_writer import ChunkedWriter
from gateway.ops.metrics import STATUS_LABELS
from gateway.pipeline.config import LimitsConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services
from gateway.proxy.forward import JSONReply, Proxy, Reply
from gateway.server.cycle import Receive, RequestCycle, RequestIds, Scope, Send, encoded, send_json
from gateway.wire.allowlist import ParamAllowList
from gateway.wire.errors import GatewayError, PayloadTooLarge, ServerError, model_not_found
from gateway.wire.media_urls import check_request_media
from gateway.wire.protocol import ENDPOINTS, Endpoint, check_content_type, check_request, header_dict, parse_body
from gateway.wire.streaming import SSE_HEADERS

log = logging.getLogger("gateway.access")
_WATCH_AFTER_S = 0.05  # a non-streamed request starts watching for a client disconnect after this


class _ClientGone(Exception):
    pass


class InferenceEndpoints:
    """ASGI app for POST /v1/chat/completions, /v1/completions and /v1/embeddings."""

    def __init__(self, holder: RuntimeHolder, services: Services) -> None:
        self.holder = holder
        self.services = services
        self.proxy = Proxy(services)
        self.request_ids = RequestIds()
        self.metrics = services.metrics
        self._allow: tuple[LimitsConfig, ParamAllowList] | None = None

    def _allow_list(self, limits: LimitsConfig) -> ParamAllowList:
        """The allow-list of the live config, rebuilt only when a reload brought new limits."""
        cached = self._allow
        if cached is None or cached[0] is not limits:
            cached = self._allow = (limits, ParamAllowList(limits.extra_params, max_n=limits.max_n))
        return cached[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS[scope["path"]]
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        cycle = RequestCycle(self.request_ids(raw_headers), time.perf_counter(), task=asyncio.current_task())
        tracing = self.services.tracing
        span = tracing.start_request(endpoint.name, raw_headers) if tracing is not None else None
        try:
            await self._serve(endpoint, raw_headers, receive, send, cycle)
        except BaseException as exc:  # _answer_failure raises again what it does not answer
            await self._answer_failure(exc, send, cycle)
        finally:
            self._stop_watching(cycle)
            ctx = cycle.ctx
            if ctx is not None:
                ctx.finalize()
            self._record(endpoint, cycle)
            if span is not None:
                worker = ctx.worker.url if ctx is not None and ctx.worker is not None else None
                span.end({"request_id": cycle.request_id, "model": cycle.model, "worker": worker}, cycle.status)

    async def _serve(
        self,
        endpoint: Endpoint,
        raw_headers: list[tuple[bytes, bytes]],
        receive: Receive,
        send: Send,
        cycle: RequestCycle,
    ) -> None:
        check_content_type(raw_headers)
        body = await self._read_body(raw_headers, receive)
        payload = parse_body(body)
        model_name, stream = check_request(endpoint, payload)
        # Watching for a disconnect takes a task per request. A plain request usually ends within the
        # delay, so it never needs one; a longer one still has its upstream closed when the client leaves
        # (receive() reports a disconnect that happened before the watch began).
        self._watch(receive, cycle, 0.0 if stream else _WATCH_AFTER_S)
        if not self.holder.loaded:
            raise ServerError("The gateway has no config loaded yet.", code="not_ready", status=503)
        with self.holder.pin() as snapshot:
            self._allow_list(snapshot.config.limits).check(endpoint.name, payload)
            check_request_media(endpoint.name, payload)
            model = snapshot.models.resolve(model_name)
            if model is None:
                # Who is asking comes first (a plugin's on_models may refuse the caller, e.g. 401 without a
                # valid key), so an unknown model is no answer to someone without a key.
                await snapshot.pipeline.run_models(header_dict(raw_headers), [])
                raise model_not_found(model_name)
            cycle.model = model.name
            in_flight = self.metrics.in_flight.labels(model.name)
            in_flight.inc()
            try:
                if model_name != model.upstream_name:
                    payload["model"] = model.upstream_name
                cycle.ctx = ctx = RequestContext(
                    request_id=cycle.request_id,
                    endpoint=endpoint.name,
                    path=endpoint.path,
                    body=payload,
                    raw_body=body,
                    headers=header_dict(raw_headers),
                    model=model,
                    requested_model=model_name,
                    snapshot=snapshot,
                    stream=stream,
                    started=cycle.started,
                    body_changed=model_name != model.upstream_name,
                )
                reply = await self.proxy.serve(ctx)
                await self._send_reply(reply, send, cycle)
            finally:
                in_flight.dec()

    async def _answer_failure(self, exc: BaseException, send: Send, cycle: RequestCycle) -> None:
        """The answer to a request that raised ``exc``, for every handler built on this one: its
        OpenAI-shaped error, a 499 for a client that left (the upstream was closed with it), a logged 500
        for anything unexpected. A cancellation that is not the client leaving is raised again."""
        if isinstance(exc, GatewayError):
            await self._send_error(exc, send, cycle)
        elif isinstance(exc, _ClientGone):
            cycle.status = 499
        elif isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if not cycle.client_gone or task is None:
                raise exc
            task.uncancel()
            cycle.status = 499
        elif isinstance(exc, Exception):
            log.error("request %s failed", cycle.request_id, exc_info=exc)
            failure = ServerError(
                "The gateway failed to process the request; it has been logged.", code="internal_error"
            )
            await self._send_error(failure, send, cycle)
        else:
            raise exc

    # -- the disconnect watch ------------------------------------------------------------------------

    def _watch(self, receive: Receive, cycle: RequestCycle, after_s: float) -> None:
        cycle.watch_timer = asyncio.get_running_loop().call_later(after_s, self._start_watcher, receive, cycle)

    def _start_watcher(self, receive: Receive, cycle: RequestCycle) -> None:
        if not cycle.finished:
            cycle.watcher = asyncio.create_task(self._watch_disconnect(receive, cycle))

    @staticmethod
    async def _watch_disconnect(receive: Receive, cycle: RequestCycle) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not cycle.finished and cycle.task is not None:
                    cycle.client_gone = True
                    if cycle.ctx is not None:  # for the finalizers (billing: a client gone still pays)
                        cycle.ctx.client_gone = True
                    cycle.task.cancel()
                return

    @staticmethod
    def _stop_watching(cycle: RequestCycle) -> None:
        """End the disconnect watch of a finished request (its timer, and its task if it started)."""
        cycle.finished = True
        if cycle.watch_timer is not None:
            cycle.watch_timer.cancel()
        # Dropped, not just cancelled: the cancelled watcher keeps its CancelledError, whose traceback
        # holds the watcher's frame and so the cycle; with the task still in it, every request would
        # leave a reference cycle for the garbage collector instead of being freed at once.
        watcher, cycle.watcher, cycle.task = cycle.watcher, None, None
        if watcher is not None:
            watcher.cancel()

    async def _read_body(self, headers: list[tuple[bytes, bytes]], receive: Receive) -> bytes:
        limit = self.holder.current.config.limits.max_body_bytes if self.holder.loaded else 4 * 1024 * 1024
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _send_reply(self, reply: Reply, send: Send, cycle: RequestCycle) -> None:
        if isinstance(reply, JSONReply):
            await send_json(send, cycle, reply.status, reply.body, reply.headers)
            return
        extra = encoded(reply.headers)
        rid = (b"x-request-id", cycle.request_id.encode("ascii"))
        cycle.status = 200
        cycle.sent = True
        chunks, passthrough = reply.chunks, reply.passthrough
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, rid, *extra]})
            writer = ChunkedWriter.of(send)  # None unless the server lets chunks go straight to the client
            if writer is not None and passthrough is not None:
                await passthrough.relay(writer)
            else:
                if chunks is None:
                    assert passthrough is not None
                    chunks = passthrough.chunks()
                await _send_chunks(chunks, send, writer)
        finally:
            if chunks is not None:
                with contextlib.suppress(Exception):
                    await chunks.aclose()  # type: ignore[attr-defined]
            if passthrough is not None:
                passthrough.close()  # releases the worker even if neither way of relaying began
        cycle.finished = True
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _send_error(error: GatewayError, send: Send, cycle: RequestCycle) -> None:
        # Its type and code, not the exception: its traceback holds the request's frame, which holds the cycle.
        cycle.error = (error.type, error.code)
        if cycle.sent:
            # Headers are out: the error becomes one SSE event, then [DONE].
            cycle.finished = True
            await send({"type": "http.response.body", "body": error.to_sse(), "more_body": False})
            return
        await send_json(send, cycle, error.status_code, error.to_json(), error.headers)

    def _record(self, endpoint: Endpoint, cycle: RequestCycle) -> None:
        elapsed = time.perf_counter() - cycle.started
        self.metrics.requests.labels(cycle.model, endpoint.name, STATUS_LABELS[cycle.status]).inc()
        self.metrics.latency.labels(cycle.model, endpoint.name).observe(elapsed)
        if not log.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": cycle.request_id,
            "route": endpoint.name,
            "model": cycle.model,
            "status": cycle.status,
            "duration_ms": round(elapsed * 1000, 3),
        }
        ctx = cycle.ctx
        if ctx is not None:
            fields["stream"] = ctx.stream
            if ctx.worker is not None:
                fields["worker"] = ctx.worker.url
            if ctx.tenant:
                fields["tenant"] = ctx.tenant
            if ctx.snapshot.config.logging.log_content:  # opt-in only: prompts are the client's data
                fields["prompt"] = ctx.body.get("messages", ctx.body.get("prompt", ctx.body.get("input")))
            fields.update(ctx.log)
        error = cycle.error
        if error is not None:
            fields["error_type"], fields["error_code"] = error
        # log.info() would also walk the stack to find the caller, which the JSON line never shows.
        log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields}))


async def _send_chunks(chunks: AsyncIterator[bytes], send: Send, writer: ChunkedWriter | None) -> None:
    """A stream's pieces, straight to the client's connection where the server allows (with backpressure),
    else as ASGI messages."""
    async for chunk in chunks:
        if writer is None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        elif not writer.write(chunk):
            await writer.drained()


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The request body is larger than this gateway accepts ({limit} bytes).", code="request_too_large"
    )
