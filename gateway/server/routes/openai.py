"""The inference endpoints (chat, completions, embeddings) served at the ASGI level.

These are the hot path, so they skip the web framework: read the body once (bounded), parse it once,
pin the config snapshot, build the RequestContext, hand it to the Proxy, and send the reply. A client
that disconnects cancels the work, which closes the upstream connection, which makes vLLM abort the
generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.infra.chunked_writer import ChunkedWriter
from gateway.pipeline.config import LimitsConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services
from gateway.proxy.forward import JSONReply, Proxy, Reply
from gateway.wire.allowlist import ParamAllowList
from gateway.wire.errors import GatewayError, PayloadTooLarge, ServerError, model_not_found
from gateway.wire.media_urls import check_request_media
from gateway.wire.protocol import ENDPOINTS, Endpoint, check_content_type, check_request, header_dict, parse_body
from gateway.wire.streaming import SSE_HEADERS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("gateway.access")
_JSON = (b"content-type", b"application/json")
_WATCH_AFTER_S = 0.05  # a non-streamed request starts watching for a client disconnect after this


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """A sane client-supplied x-request-id (short, printable, no spaces), else None."""
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= 128 and all(33 <= b < 127 for b in value):
                return value.decode("ascii")
            break
    return None


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """Keep a sane client-supplied x-request-id (short, printable, no spaces); otherwise make one."""
    return client_request_id(headers) or uuid.uuid4().hex


class RequestIds:
    """Request ids for the hot path: the client's when sane, else 32 hex digits unique to this process
    run (a random prefix and a counter; ``uuid4`` reads the OS random source on every request)."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:16]
        self._counter = itertools.count(1)

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> str:
        return client_request_id(headers) or f"{self._prefix}{next(self._counter):016x}"


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

    @staticmethod
    def handles(scope: Scope) -> Endpoint | None:
        return ENDPOINTS.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS[scope["path"]]
        started = time.perf_counter()
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = self.request_ids(raw_headers)
        state: dict[str, Any] = {"status": 0, "model": "-", "sent": False, "finished": False}
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.TimerHandle | None = None
        ctx: RequestContext | None = None
        tracing = self.services.tracing
        span = tracing.start_request(endpoint.name, raw_headers) if tracing is not None else None
        try:
            check_content_type(raw_headers)
            body = await self._read_body(raw_headers, receive)
            payload = parse_body(body)
            model_name, stream = check_request(endpoint, payload)
            # Watching for a disconnect takes a task per request. A plain request usually ends within
            # the delay, so it never needs one; a longer one still has its upstream closed when the
            # client leaves (receive() reports a disconnect that happened before the watch began).
            watcher = asyncio.get_running_loop().call_later(
                0.0 if stream else _WATCH_AFTER_S, self._start_watcher, receive, task, state
            )
            if not self.holder.loaded:
                raise ServerError("The gateway has no config loaded yet.", code="not_ready", status=503)
            with self.holder.pin() as snapshot:
                self._allow_list(snapshot.config.limits).check(endpoint.name, payload)
                check_request_media(endpoint.name, payload)
                model = snapshot.models.resolve(model_name)
                if model is None:
                    # Who is asking comes first (a plugin's on_models may refuse the caller, e.g. 401
                    # without a valid key), so an unknown model is no answer to someone without a key.
                    await snapshot.pipeline.run_models(header_dict(raw_headers), [])
                    raise model_not_found(model_name)
                state["model"] = model.name
                in_flight = self.metrics.in_flight.labels(model.name)
                in_flight.inc()
                try:
                    if model_name != model.upstream_name:
                        payload["model"] = model.upstream_name
                    ctx = RequestContext(
                        request_id=request_id,
                        endpoint=endpoint.name,
                        path=endpoint.path,
                        body=payload,
                        raw_body=body,
                        headers=header_dict(raw_headers),
                        model=model,
                        requested_model=model_name,
                        snapshot=snapshot,
                        stream=stream,
                        started=started,
                        body_changed=model_name != model.upstream_name,
                    )
                    reply = await self.proxy.serve(ctx)
                    await self._send_reply(reply, request_id, send, state)
                finally:
                    in_flight.dec()
        except BaseException as exc:  # _answer_failure raises again what it does not answer
            await self._answer_failure(exc, request_id, send, state)
        finally:
            self._stop_watching(watcher, state)
            if ctx is not None:
                ctx.finalize()
            self._record(endpoint, request_id, state, started, ctx)
            if span is not None:
                worker = ctx.worker.url if ctx is not None and ctx.worker is not None else None
                attributes = {"request_id": request_id, "model": state["model"], "worker": worker}
                span.end(attributes, state["status"])

    async def _answer_failure(self, exc: BaseException, request_id: str, send: Send, state: dict[str, Any]) -> None:
        """The answer to a request that raised ``exc``, for every handler built on this one: its
        OpenAI-shaped error, a 499 for a client that left (the upstream was closed with it), a logged 500
        for anything unexpected. A cancellation that is not the client leaving is raised again."""
        if isinstance(exc, GatewayError):
            await self._send_error(exc, request_id, send, state)
        elif isinstance(exc, _ClientGone):
            state["status"] = 499
        elif isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if not state.get("client_gone") or task is None:
                raise exc
            task.uncancel()
            state["status"] = 499
        elif isinstance(exc, Exception):
            log.error("request %s failed", request_id, exc_info=exc)
            failure = ServerError(
                "The gateway failed to process the request; it has been logged.", code="internal_error"
            )
            await self._send_error(failure, request_id, send, state)
        else:
            raise exc

    @staticmethod
    def _stop_watching(watcher: asyncio.TimerHandle | None, state: dict[str, Any]) -> None:
        """End the disconnect watch of a finished request (its timer, and its task if it started)."""
        state["finished"] = True
        if watcher is not None:
            watcher.cancel()
        # Popped, not just cancelled: the cancelled watcher keeps its CancelledError, whose traceback
        # holds the watcher's frame and so this dict; with the task still in it, every request would
        # leave a reference cycle for the garbage collector instead of being freed at once.
        watch_task = state.pop("watcher", None)
        if watch_task is not None:
            watch_task.cancel()

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

    def _start_watcher(self, receive: Receive, task: asyncio.Task[Any], state: dict[str, Any]) -> None:
        if not state["finished"]:
            state["watcher"] = asyncio.create_task(self._watch_disconnect(receive, task, state))

    @staticmethod
    async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], state: dict[str, Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not state["finished"]:
                    state["client_gone"] = True
                    task.cancel()
                return

    async def _send_reply(self, reply: Reply, request_id: str, send: Send, state: dict[str, Any]) -> None:
        if isinstance(reply, JSONReply):
            await _send_json(send, state, reply.status, reply.body, request_id, reply.headers)
            return
        extra = _encoded(reply.headers)
        rid = (b"x-request-id", request_id.encode("ascii"))
        state["status"] = 200
        state["sent"] = True
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
                async for chunk in chunks:
                    if writer is None:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    elif not writer.write(chunk):
                        await writer.drained()
        finally:
            if chunks is not None:
                with contextlib.suppress(Exception):
                    await chunks.aclose()  # type: ignore[attr-defined]
            if passthrough is not None:
                passthrough.close()  # releases the worker even if neither way of relaying began
        state["finished"] = True
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _send_error(error: GatewayError, request_id: str, send: Send, state: dict[str, Any]) -> None:
        # Its type and code, not the exception: its traceback holds the request's frame, which holds state.
        state["error"] = (error.type, error.code)
        if state["sent"]:
            # Headers are out: the error becomes one SSE event, then [DONE].
            state["finished"] = True
            await send({"type": "http.response.body", "body": error.to_sse(), "more_body": False})
            return
        await _send_json(send, state, error.status_code, error.to_json(), request_id, error.headers)

    def _record(
        self, endpoint: Endpoint, request_id: str, state: dict[str, Any], started: float, ctx: RequestContext | None
    ) -> None:
        elapsed = time.perf_counter() - started
        self.metrics.requests.labels(state["model"], endpoint.name, str(state["status"])).inc()
        self.metrics.latency.labels(state["model"], endpoint.name).observe(elapsed)
        if not log.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {
            "request_id": request_id,
            "route": endpoint.name,
            "model": state["model"],
            "status": state["status"],
            "duration_ms": round(elapsed * 1000, 3),
        }
        if ctx is not None:
            fields["stream"] = ctx.stream
            if ctx.worker is not None:
                fields["worker"] = ctx.worker.url
            if ctx.tenant:
                fields["tenant"] = ctx.tenant
            if ctx.snapshot.config.logging.log_content:  # opt-in only: prompts are the client's data
                fields["prompt"] = ctx.body.get("messages", ctx.body.get("prompt", ctx.body.get("input")))
            fields.update(ctx.log)
        error = state.get("error")
        if error is not None:
            fields["error_type"], fields["error_code"] = error
        # log.info() would also walk the stack to find the caller, which the JSON line never shows.
        log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields}))


async def _send_json(
    send: Send, state: dict[str, Any], status: int, body: bytes, request_id: str, headers: dict[str, str]
) -> None:
    """A whole JSON reply (an answer or an error), with its length: what clients and proxies expect of
    one, rather than chunked framing."""
    state["status"] = status
    state["sent"] = True
    length = (b"content-length", b"%d" % len(body))
    head = [_JSON, length, (b"x-request-id", request_id.encode("ascii")), *_encoded(headers)]
    await send({"type": "http.response.start", "status": status, "headers": head})
    state["finished"] = True
    await send({"type": "http.response.body", "body": body})


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The request body is larger than this gateway accepts ({limit} bytes).", code="request_too_large"
    )
