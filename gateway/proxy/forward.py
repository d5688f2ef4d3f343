"""The request path after parsing: plugins on the way in, the upstream call (``gateway.proxy.trip``:
leases, retries before the first byte, failover), plugins on the way back, and the reply as JSON or SSE
(a stream through ``passthrough`` when no plugin must read it, else ``inspected``).

A ``Reply`` is produced before anything is sent; errors raised before then become an OpenAI error
body with its status. A ``StreamReply`` yields bytes after SSE headers are sent; an error after that
point becomes one ``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from gateway.pipeline.context import Delivered, ModelResponse, RequestContext
from gateway.pipeline.services import Services
from gateway.proxy.answer import AnswerStream
from gateway.proxy.inspected import InspectedRelay
from gateway.proxy.passthrough import PassThrough
from gateway.proxy.stream_tap import StreamTap
from gateway.proxy.token_limit import cap_answer, completion_limit
from gateway.proxy.trip import Trip
from gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gateway.wire.errors import BadGateway
from gateway.wire.protocol import requested_choices, requested_prompts
from gateway.wire.streaming import replay, replay_chunks, wants_usage


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
    """Runs one request through the pipeline and the upstream; stateless between requests (a request's
    attempts on workers are its ``Trip``)."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def serve(self, ctx: RequestContext) -> Reply:
        pipeline = ctx.snapshot.pipeline
        early = await pipeline.run_request(ctx)
        if early is not None:
            return await self._reply_early(ctx, early)
        inspected = ctx.stream and pipeline.inspects_stream(ctx)
        tap = self._stream_tap(ctx) if ctx.stream and not inspected else None
        trip = Trip(ctx, self.services)
        ctx.add_finalizer(trip.abandon)  # a lease no relay released (the client left first) is given back
        upstream = await trip.open()
        if not ctx.stream:
            return await self._reply_json(ctx, trip, upstream)
        answer = AnswerStream(upstream, trip.resumer())
        if inspected:
            relay = InspectedRelay(ctx, self.services.metrics, self._count_usage, trip.end)
            return StreamReply(relay.relay(answer), ctx.response_headers)
        settle = partial(self._settle_usage, ctx) if tap is not None else None
        stream = PassThrough(ctx, answer, self.services.metrics, trip.end, tap, settle)
        return StreamReply(None, ctx.response_headers, passthrough=stream)

    def _stream_tap(self, ctx: RequestContext) -> StreamTap | None:
        """A pass-through stream whose usage a plugin needs (billing) or that a plugin asked to have
        recorded (the cache): the worker is asked for the usage (before the trip), and a tap reads the
        bytes, keeping the request's completion limit too (and the recording). A stream no plugin bills
        or records passes through untapped: the limit is kept where someone pays for what passes it (the
        parsed relay keeps it always)."""
        recording = ctx.record_max_bytes
        if not (recording or ctx.snapshot.pipeline.settles_from_usage(ctx)):
            return None
        strip = not ctx.ask_for_usage()
        choices = requested_choices(ctx.body) * requested_prompts(ctx.endpoint, ctx.body)  # vLLM's choice indices
        return StreamTap(
            strip=strip,
            limit=completion_limit(ctx),
            choices=choices,
            record=recording,
            recordings=self.services.recordings,
        )

    async def _settle_usage(self, ctx: RequestContext, settlement: ModelResponse) -> None:
        # The tap's usage (``ctx.delivered``, set before the settlement): reading the settlement's would
        # parse a recorded stream that no plugin may read.
        sent = ctx.delivered
        self._count_usage(ctx, sent.usage if sent is not None else settlement.json.get("usage"))
        await ctx.snapshot.pipeline.run_response(ctx, settlement)

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

    async def _reply_json(self, ctx: RequestContext, trip: Trip, upstream: UpstreamResponse) -> JSONReply:
        lease = trip.lease
        assert lease is not None
        with lease:
            try:
                body = await upstream.read()
            except UpstreamFailure as failure:
                lease.failed(failure.error)
                raise failure.error from None
            lease.ok()
        response = ModelResponse(body=body)
        try:
            usage = response.json.get("usage")
        except orjson.JSONDecodeError:
            raise BadGateway("The model worker sent a response that is not JSON.", code="upstream_error") from None
        limit = completion_limit(ctx)
        if limit is not None and cap_answer(response.json, limit):  # a worker that ran past max_tokens
            response.replace_json(response.json)
            ctx.log["cut_at_max_tokens"] = limit
        self._count_usage(ctx, usage)
        response = await ctx.snapshot.pipeline.run_response(ctx, response)
        ctx.delivered = Delivered(response.status)
        if ctx.snapshot.config.logging.log_content:  # opt-in only: completions are the client's data
            ctx.log["completion"] = [c.get("message", c.get("text")) for c in response.json.get("choices", ())]
        return JSONReply(response.status, response.body, {**ctx.response_headers, **response.headers})

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
