"""The request path after parsing: plugins on the way in, the upstream call (with retries before the
first byte), plugins on the way back, and the reply as JSON or SSE.

A ``Reply`` is produced before anything is sent; errors raised before then become an OpenAI error
body with its status. A ``StreamReply`` yields bytes after SSE headers are sent; an error after that
point becomes one ``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.services import Services
from gateway.proxy.passthrough import PassThrough, cut_short, observe_decoding, observe_first_token
from gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gateway.upstream.workers import Worker
from gateway.wire.errors import BadGateway, GatewayError, ServiceUnavailable, from_upstream
from gateway.wire.streaming import DONE, SSEParser, StreamAssembler, encode_event, replay

log = logging.getLogger("gateway.proxy")
_RETRYABLE_STATUS = frozenset({502, 503})


@dataclass(slots=True)
class JSONReply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class StreamReply:
    """SSE bytes to send after the headers: ``chunks``, or a pass-through stream, which the sender relays
    straight to the client's connection where it can (else as ``passthrough.chunks()``) and closes."""

    chunks: AsyncIterator[bytes] | None
    headers: dict[str, str] = field(default_factory=dict)
    passthrough: PassThrough | None = None


Reply = JSONReply | StreamReply


class Proxy:
    """Runs one request through the pipeline and the upstream; stateless between requests."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def serve(self, ctx: RequestContext) -> Reply:
        pipeline = ctx.snapshot.pipeline
        early = await pipeline.run_request(ctx)
        if early is not None:
            return await self._reply_early(ctx, early)
        upstream = await self._open(ctx)
        if not ctx.stream:
            return await self._reply_json(ctx, upstream)
        if pipeline.inspects_stream(ctx):
            return StreamReply(self._relay_inspected(ctx, upstream), ctx.response_headers)
        worker = ctx.worker
        assert worker is not None
        stream = PassThrough(ctx, upstream, self.services.metrics, lambda ok: self._finish(ctx, worker, ok=ok))
        return StreamReply(None, ctx.response_headers, passthrough=stream)

    # -- the way in -------------------------------------------------------------------------------

    async def _open(self, ctx: RequestContext) -> UpstreamResponse:
        """Call a worker chosen by the route plan, retrying elsewhere only while nothing was sent."""
        plan = ctx.plan
        if plan is None:
            raise ServiceUnavailable(
                f"No plugin chose a worker for model '{ctx.model.name}'; enable the routing plugin in config.yaml.",
                code="no_route",
            )
        worker = plan.next_worker(None, None)
        if worker is None:
            raise ServiceUnavailable(
                f"No healthy worker serves model '{ctx.model.name}' right now; try again shortly.",
                code="no_healthy_worker",
                headers={"retry-after": "1"},
            )
        workers = self.services.workers
        metrics = self.services.metrics
        while True:
            # Per attempt: a retry may go to a fallback model, which changes the body's "model".
            body = ctx.upstream_body()
            worker.in_flight += 1
            error: GatewayError
            try:
                upstream = await self._connect(ctx, worker, body)
            except BaseException as exc:
                if not isinstance(exc, UpstreamFailure):  # cancelled (client gone): keep counters exact
                    worker.in_flight -= 1
                    plan.finished(worker, ok=False)
                    raise
                failure = exc
                worker.in_flight -= 1
                workers.report_failure(worker, failure.kind)
                metrics.upstream_errors.labels(worker.url, failure.kind).inc()
                plan.finished(worker, ok=False, error=failure.error)
                error, retryable = failure.error, failure.retryable
            else:
                if upstream.status == 200:
                    ctx.worker = worker
                    return upstream
                try:
                    error = from_upstream(upstream.status, await upstream.read())
                except BaseException as exc:
                    worker.in_flight -= 1
                    plan.finished(worker, ok=False)
                    if isinstance(exc, UpstreamFailure):
                        raise exc.error from None
                    raise
                worker.in_flight -= 1
                retryable = upstream.status in _RETRYABLE_STATUS
                if upstream.status >= 500:
                    workers.report_failure(worker, f"http {upstream.status}")
                    metrics.upstream_errors.labels(worker.url, "status").inc()
                    plan.finished(worker, ok=False, error=error)
                else:  # the client's problem: neither retried nor held against the worker
                    plan.finished(worker, ok=True)
                    raise error
            if not retryable:
                raise error
            nxt = plan.next_worker(worker, error)
            if nxt is None:
                raise error
            metrics.retries.labels(ctx.model.name).inc()
            log.info("request %s: retrying on %s after %s", ctx.request_id, nxt.url, error.message)
            worker = nxt

    async def _connect(self, ctx: RequestContext, worker: Worker, body: bytes) -> UpstreamResponse:
        """One attempt; with tracing on, also a span (to response headers) and a ``traceparent``."""
        tracing = self.services.tracing
        if tracing is None:
            return await self.services.upstream.open(worker.url, ctx.path, body)
        started = time.perf_counter()
        status = 0
        try:
            upstream = await self.services.upstream.open(worker.url, ctx.path, body, headers=tracing.inject())
            status = upstream.status
            return upstream
        finally:
            attributes = {"gateway.worker": worker.url, "http.response.status_code": status}
            tracing.record(f"upstream {ctx.path}", time.perf_counter() - started, attributes, error=status != 200)

    def _finish(self, ctx: RequestContext, worker: Worker, *, ok: bool, error: GatewayError | None = None) -> None:
        worker.in_flight -= 1
        if ok:
            self.services.workers.report_success(worker)
        if ctx.plan is not None:
            ctx.plan.finished(worker, ok=ok, error=error)

    # -- the way back -----------------------------------------------------------------------------

    async def _reply_early(self, ctx: RequestContext, early: ModelResponse) -> Reply:
        response = await ctx.snapshot.pipeline.run_response(ctx, early)
        if ctx.stream and response.status == 200:
            options = ctx.body.get("stream_options") or {}
            events = replay(response.json, include_usage=bool(options.get("include_usage")))
            return StreamReply(_aiter(events), {**ctx.response_headers, **response.headers})
        return JSONReply(response.status, response.body, {**ctx.response_headers, **response.headers})

    async def _reply_json(self, ctx: RequestContext, upstream: UpstreamResponse) -> JSONReply:
        worker = ctx.worker
        assert worker is not None
        try:
            body = await upstream.read()
        except UpstreamFailure as failure:
            self._finish(ctx, worker, ok=False, error=failure.error)
            raise failure.error from None
        except BaseException:  # cancelled (client gone): keep counters exact
            self._finish(ctx, worker, ok=False)
            raise
        self._finish(ctx, worker, ok=True)
        response = ModelResponse(body=body)
        try:
            self._count_usage(ctx, response.json.get("usage"))
        except orjson.JSONDecodeError:
            raise BadGateway("The model worker sent a response that is not JSON.", code="upstream_error") from None
        response = await ctx.snapshot.pipeline.run_response(ctx, response)
        if ctx.snapshot.config.logging.log_content:  # opt-in only: completions are the client's data
            ctx.log["completion"] = [c.get("message", c.get("text")) for c in response.json.get("choices", ())]
        return JSONReply(response.status, response.body, {**ctx.response_headers, **response.headers})

    async def _relay_inspected(self, ctx: RequestContext, upstream: UpstreamResponse) -> AsyncIterator[bytes]:
        """Parse each event so plugins can see, change or hold chunks and check the assembled result."""
        worker = ctx.worker
        assert worker is not None
        pipeline = ctx.snapshot.pipeline
        has_chunk_hooks = bool(pipeline.chunk_plugins)
        parser = SSEParser()
        assembler = StreamAssembler()
        first = True
        done = False
        ok = False
        first_at = 0.0
        events = 0
        try:
            async for raw in upstream.iter_chunks():
                # What one read of the worker produced goes out as one piece: a gateway that fell behind
                # catches up with fewer, larger writes.
                out: list[bytes] = []
                for payload in parser.feed(raw):
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = orjson.loads(payload)
                    if "error" in chunk and "choices" not in chunk:
                        err = chunk["error"]
                        status = err.get("code") if isinstance(err, dict) else None
                        out.append(from_upstream(status if isinstance(status, int) else 500, payload).to_sse())
                        yield b"".join(out)
                        return
                    assembler.add(chunk)
                    if first:
                        first = False
                        first_at = time.perf_counter()
                        observe_first_token(self.services.metrics, ctx, first_at)
                    else:
                        events += 1
                    if has_chunk_hooks:
                        changed = await pipeline.run_chunk(ctx, chunk)
                        if changed is not None:
                            out.append(encode_event(changed))
                        if ctx.state.get("close_stream"):
                            done = True
                            break
                    else:
                        out.append(b"data: " + payload + b"\n\n")
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
                if done:
                    break
            if not done or not (assembler.complete or ctx.state.get("close_stream")):
                yield cut_short().to_sse()
                return
            ok = True
            observe_decoding(self.services.metrics, ctx, time.perf_counter() - first_at, events)
            result = assembler.result()
            self._count_usage(ctx, result.get("usage"))
            await pipeline.run_response(ctx, ModelResponse(json=result))
            yield DONE
        except UpstreamFailure as failure:
            yield failure.error.to_sse()
        except GatewayError as error:
            yield error.to_sse()
        except orjson.JSONDecodeError:
            yield BadGateway("The model worker sent an event that is not JSON.", code="upstream_error").to_sse()
        finally:
            upstream.close()
            self._finish(ctx, worker, ok=ok)

    def _count_usage(self, ctx: RequestContext, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        ctx.log["usage"] = usage
        tokens = self.services.metrics.tokens
        for kind in ("prompt", "completion"):
            value = usage.get(f"{kind}_tokens")
            if isinstance(value, int) and value > 0:
                tokens.labels(ctx.model.name, kind).inc(value)


async def _aiter(items: Any) -> AsyncIterator[bytes]:
    for item in items:
        yield item
