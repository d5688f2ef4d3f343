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
from functools import partial
from typing import Any

import orjson

from gateway.pipeline.context import Delivered, ModelResponse, RequestContext
from gateway.pipeline.services import Services
from gateway.proxy.passthrough import PassThrough, cut_short, observe_decoding, observe_first_token
from gateway.proxy.resume import Continuation, Resumer, reason_of, resumable
from gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gateway.upstream.workers import Worker, WorkerTable
from gateway.wire.errors import BadGateway, GatewayError, ServiceUnavailable, endpoint_not_served, from_upstream
from gateway.wire.streaming import (
    DONE,
    SSEParser,
    StreamAssembler,
    delta_tokens,
    encode_event,
    replay,
    replay_chunks,
    wants_usage,
)

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
        stream = PassThrough(
            ctx, upstream, self.services.metrics, lambda ok: self._finish_current(ctx, ok), self._resumer(ctx)
        )
        return StreamReply(None, ctx.response_headers, passthrough=stream)

    # -- the way in -------------------------------------------------------------------------------

    async def _open(
        self,
        ctx: RequestContext,
        *,
        failed: Worker | None = None,
        cause: GatewayError | None = None,
        continuation: bytes | None = None,
    ) -> UpstreamResponse:
        """Call a worker chosen by the route plan, retrying elsewhere only while nothing was sent.

        After a stream from ``failed`` broke midway (``cause``), the same on another healthy worker of
        the model with the ``continuation`` body (``gateway.proxy.resume``); ``ServiceUnavailable`` when
        there is none (the plan's retry budget and attempts bound this too)."""
        plan = ctx.plan
        if plan is None:
            raise ServiceUnavailable(
                f"No plugin chose a worker for model '{ctx.model.name}'; enable the routing plugin in config.yaml.",
                code="no_route",
            )
        worker = plan.next_worker(failed, cause)
        if worker is None:
            other = "other " if failed is not None else ""
            raise ServiceUnavailable(
                f"No {other}healthy worker serves model '{ctx.model.name}' right now; try again shortly.",
                code="no_healthy_worker",
                headers={"retry-after": "1"},
            )
        workers = self.services.workers
        metrics = self.services.metrics
        prepare = getattr(plan, "prepare", None)  # an optional async step of a plan before each attempt
        while True:
            # Per attempt: a retry may go to a fallback model, which changes the body's "model".
            body = ctx.upstream_body() if continuation is None else continuation
            worker.in_flight += 1
            error: GatewayError
            try:
                if prepare is not None:  # e.g. load the request's LoRA adapter on this worker
                    await prepare(worker)
                sent_at = time.perf_counter()  # after a load: a first byte's wait is the worker's alone
                upstream = await self._connect(ctx, worker, body)
            except BaseException as exc:
                if not isinstance(exc, UpstreamFailure):  # cancelled (client gone): keep counters exact
                    worker.in_flight -= 1
                    plan.finished(worker, ok=False)
                    raise
                failure = exc
                worker.in_flight -= 1
                _blame(ctx, workers, worker, failure.kind)
                metrics.upstream_errors.labels(worker.url, failure.kind).inc()
                plan.finished(worker, ok=False, error=failure.error)
                error, retryable = failure.error, failure.retryable
            else:
                if upstream.status == 200:
                    ctx.worker = worker
                    if ctx.stream:  # a stream's first byte comes before its generation: comparable
                        _first_byte(ctx, workers, worker, time.perf_counter() - sent_at)
                    return upstream
                try:
                    raw = await upstream.read()
                except BaseException as exc:
                    worker.in_flight -= 1
                    plan.finished(worker, ok=False)
                    if isinstance(exc, UpstreamFailure):
                        raise exc.error from None
                    raise
                worker.in_flight -= 1
                unsupported = endpoint_not_served(upstream.status, raw, ctx.requested_model, ctx.endpoint)
                if unsupported is not None:  # the client's problem: neither retried nor held against the worker
                    plan.finished(worker, ok=True)
                    raise unsupported
                error = from_upstream(upstream.status, raw)
                retryable = upstream.status in _RETRYABLE_STATUS
                if upstream.status >= 500:
                    _blame(ctx, workers, worker, f"http {upstream.status}")
                    metrics.upstream_errors.labels(worker.url, "status").inc()
                    plan.finished(worker, ok=False, error=error)
                else:  # the client's problem: neither retried nor held against the worker
                    plan.finished(worker, ok=True)
                    raise error
            if not retryable or (continuation is not None and not plan.has_alternative()):
                raise error  # a continuation stays on the request's model
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

    # -- mid-stream failover (gateway.proxy.resume) --------------------------------------------

    def _resumer(self, ctx: RequestContext) -> Resumer | None:
        """What a stream needs to be continued elsewhere if its worker fails, or None when it could not be
        (then the relays keep nothing extra)."""
        limit = self.services.upstream.config.stream_resumptions
        plan = ctx.plan
        if limit <= 0 or plan is None or not resumable(ctx, limit, plan.has_alternative()):
            return None
        return Resumer(ctx, limit, partial(self._reopen, ctx), self.services.upstream, self.services.metrics)

    async def _reopen(
        self, ctx: RequestContext, reason: str, error: GatewayError, body: bytes
    ) -> UpstreamResponse | None:
        """The stream's worker failed midway (its connection is closed): count it against that worker and
        open ``body`` on another one; None when no other worker takes it."""
        failed = ctx.worker
        if failed is None:
            return None
        ctx.worker = None
        # As any failure a request's content could cause: one tenant's streams alone cannot eject a worker
        # (a worker that is really gone is ejected by the refused connections that follow).
        limits = ctx.snapshot.config.upstream
        self.services.workers.report_failure(failed, f"stream {reason}", ctx.tenant, limits.eject_min_tenants)
        self.services.metrics.upstream_errors.labels(failed.url, f"stream_{reason}").inc()
        self._finish(ctx, failed, ok=False, error=error)
        plan = ctx.plan
        if plan is None or not plan.has_alternative():
            return None
        try:
            return await self._open(ctx, failed=failed, cause=error, continuation=body)
        except GatewayError as refused:
            log.warning("request %s: the stream could not be continued: %s", ctx.request_id, refused.message)
            return None

    def _finish_current(self, ctx: RequestContext, ok: bool) -> None:
        """The stream is over: release the worker serving it (none when a failover found no other one)."""
        worker = ctx.worker
        if worker is not None:
            self._finish(ctx, worker, ok=ok)

    def _finish(self, ctx: RequestContext, worker: Worker, *, ok: bool, error: GatewayError | None = None) -> None:
        worker.in_flight -= 1
        if ok and "slow_first_byte_s" not in ctx.log:  # a slow first byte stays counted
            self.services.workers.report_success(worker, ctx.tenant)
        if ctx.plan is not None:
            ctx.plan.finished(worker, ok=ok, error=error)

    # -- the way back -----------------------------------------------------------------------------

    async def _reply_early(self, ctx: RequestContext, early: ModelResponse) -> Reply:
        response = await ctx.snapshot.pipeline.run_response(ctx, early)
        ctx.delivered = Delivered(response.status)
        if ctx.stream and response.status == 200:
            include_usage = wants_usage(ctx.body)
            if response.chunks is not None:  # the events the answer first streamed as, kept by the plugin
                events = replay_chunks(response.chunks, include_usage=include_usage)
            else:
                events = replay(response.json, include_usage=include_usage)
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
        ctx.delivered = Delivered(response.status)
        if ctx.snapshot.config.logging.log_content:  # opt-in only: completions are the client's data
            ctx.log["completion"] = [c.get("message", c.get("text")) for c in response.json.get("choices", ())]
        return JSONReply(response.status, response.body, {**ctx.response_headers, **response.headers})

    async def _relay_inspected(self, ctx: RequestContext, upstream: UpstreamResponse) -> AsyncIterator[bytes]:
        """Parse each event so plugins can see, change or hold chunks and check the assembled result.

        A worker that fails midway (reset, idle, ended without ``[DONE]``) is replaced by another one
        continuing the answer when the request allows it (``gateway.proxy.resume``): its chunks are
        rewritten into this stream's and go through the same hooks and assembler."""
        pipeline = ctx.snapshot.pipeline
        has_chunk_hooks = bool(pipeline.chunk_plugins)
        resumer = self._resumer(ctx)
        progress = resumer.progress if resumer is not None else None
        continuation: Continuation | None = None
        parser = SSEParser()
        assembler = StreamAssembler()
        first = True
        done = False
        ok = False
        first_at = 0.0
        events = 0
        # The billing hook: what went out so far, kept current however the stream ends.
        sent = ctx.delivered = Delivered(stream_tokens=0, complete=False)
        tokens = 0
        try:
            while True:
                kind: str | None = None
                failure: GatewayError | None = None
                try:
                    async for raw in upstream.iter_chunks():
                        # What one read of the worker produced goes out as one piece: a gateway that fell
                        # behind catches up with fewer, larger writes.
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
                                sent.stream_tokens = tokens
                                return
                            if continuation is not None:
                                chunk = await continuation.rewrite(chunk)
                                if chunk is None:
                                    continue
                                payload = orjson.dumps(chunk)
                            elif progress is not None:
                                progress.add(chunk)
                            assembler.add(chunk)
                            if first:
                                first = False
                                first_at = time.perf_counter()
                                observe_first_token(self.services.metrics, ctx, first_at)
                            else:
                                events += 1
                            # The worker's tokens, counted as sent with the next piece that goes out (a chunk
                            # hook may hold text back and release it merged into a later chunk).
                            tokens += delta_tokens(chunk)
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
                            sent.stream_tokens, sent.usage = tokens, assembler.usage
                        if done:
                            break
                except UpstreamFailure as broke:  # kept as data: the kind and the client-facing error
                    kind, failure = broke.kind, broke.error
                if done:
                    break
                if failure is None:
                    failure = cut_short()
                if resumer is None:
                    yield failure.to_sse()
                    return
                upstream.close()
                nxt, continuation = await resumer.resume(reason_of(kind), failure)
                if nxt is None:
                    if continuation is None:
                        yield failure.to_sse()
                        return
                    # The token limit was reached exactly at the cut: end the answer here.
                    end = continuation.length_end()
                    assembler.add(end)
                    changed = await pipeline.run_chunk(ctx, end) if has_chunk_hooks else end
                    if changed is not None:
                        yield encode_event(changed)
                    break
                upstream, parser = nxt, SSEParser()
            if not (assembler.complete or ctx.state.get("close_stream")):
                yield cut_short().to_sse()
                return
            ok = sent.complete = True
            observe_decoding(self.services.metrics, ctx, time.perf_counter() - first_at, events)
            result = assembler.result()
            self._count_usage(ctx, result.get("usage"))
            await pipeline.run_response(ctx, ModelResponse(json=result))
            yield DONE
        except UpstreamFailure as failure_:
            yield failure_.error.to_sse()
        except GatewayError as error:
            yield error.to_sse()
        except orjson.JSONDecodeError:
            yield BadGateway("The model worker sent an event that is not JSON.", code="upstream_error").to_sse()
        finally:
            upstream.close()
            self._finish_current(ctx, ok)

    def _count_usage(self, ctx: RequestContext, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        ctx.log["usage"] = usage
        tokens = self.services.metrics.tokens
        for kind in ("prompt", "completion"):
            value = usage.get(f"{kind}_tokens")
            if isinstance(value, int) and value > 0:
                tokens.labels(ctx.model.name, kind).inc(value)


def _blame(ctx: RequestContext, workers: WorkerTable, worker: Worker, kind: str) -> None:
    """Hold a failed attempt against its worker when it is the worker's failure: a refused connection
    always; a 5xx, a reset or a stream's first-byte timeout as one of the tenant's (one tenant alone
    cannot eject a worker others use: ``WorkerTable.report_failure``); never the first-byte timeout of a
    non-streamed request, whose first byte waits for its whole generation (the client's own long
    request, e.g. a big max_tokens)."""
    if kind == "connect":
        workers.report_failure(worker, kind)
    elif kind != "timeout" or ctx.stream:
        limits = ctx.snapshot.config.upstream
        workers.report_failure(worker, kind, ctx.tenant, limits.eject_min_tenants)


def _first_byte(ctx: RequestContext, workers: WorkerTable, worker: Worker, seconds: float) -> None:
    """A stream's first byte took ``seconds``: far slower than the model's usual counts as a failure."""
    usual = workers.observe_first_byte(ctx.model.name, seconds)
    limits = ctx.snapshot.config.upstream
    if usual is not None and seconds > max(limits.slow_first_byte_min_s, limits.slow_first_byte_factor * usual):
        ctx.log["slow_first_byte_s"] = round(seconds, 3)
        workers.report_failure(worker, "slow first byte", ctx.tenant, limits.eject_min_tenants)


async def _aiter(items: Any) -> AsyncIterator[bytes]:
    for item in items:
        yield item
