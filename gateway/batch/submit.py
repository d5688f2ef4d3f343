"""The one place the batch lane meets the request path: a batch line becomes a ``RequestContext`` as the
inference routes build one and goes through ``Proxy.serve`` in-process (never HTTP to itself), so
tenancy, safety, cache, guided JSON and routing see it as any request. What comes back is the answer's
JSON body or the OpenAI error a live client would have been given.

Kept to this module so that a change to the proxy's or the routes' shapes is re-pointed here only.

A line stopped because its batch's owner cancelled the batch is, for the plugins, a client that hung up:
the runner says so through the line's ``LineRun`` (``abandon``) before it cancels the line, and the
context then carries ``client_gone`` to the finalizers (tenancy charges the prompt of a line that had
reached a worker, as it does a live client's). A line stopped for any other reason (the batch expired,
an operator cancelled it, the replica shuts down and the line runs again elsewhere) is not.

A line's answer is delivered when the runner writes it as the line's result (``keep``), which happens
once per line however many runs it had (a replica that took over the lapsed lease of a slow one runs it
again). So an answer is handed to ``keep`` before the line's request is over, as a live answer is sent
before its finalizers run; a run whose answer was not written (another run's was, first) delivered
nothing, and its context says so (``ctx.delivered`` None): the plugins bill it as a request whose client
got no answer (tenancy gives back what ``on_response`` charged), and the tenant pays for one answer per line.

A line refused for now (a 429 that says how long to wait: a rate limit, a budget until its period ends) is
not handed to ``keep``: ``submit`` raises ``RetryLater``, and the runner decides whether the line waits
(its batch's window lasts longer than the wait) or the refusal is its result.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.ops.metrics import Metrics
from gateway.pipeline.batch_config import LINE_PRIORITY, BatchLine
from gateway.pipeline.context import RequestContext
from gateway.pipeline.runtime import RuntimeHolder
from gateway.proxy.forward import JSONReply, Proxy
from gateway.proxy.responses_turn import ResponsesTurn
from gateway.wire.allowlist import ParamAllowList
from gateway.wire.errors import GatewayError, InvalidRequest, PayloadTooLarge, ServerError, model_not_found
from gateway.wire.media_urls import check_request_media
from gateway.wire.protocol import ENDPOINTS, check_request
from gateway.wire.responses_chat import chat_request
from gateway.wire.responses_request import ResponsesRequest, parse_request

_CHAT = ENDPOINTS["/v1/chat/completions"]
_PRIORITIZED = ("chat/completions", "completions", "embeddings")  # vLLM bodies with a "priority" field


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a line got: the HTTP status, the JSON body (an answer or ``{"error": ...}``), its usage."""

    status: int
    body: dict[str, Any]
    request_id: str

    @property
    def tokens(self) -> tuple[int, int]:
        usage = self.body.get("usage") if self.status == 200 else None
        if not isinstance(usage, dict):
            return 0, 0
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
        return (prompt if isinstance(prompt, int) else 0), (completion if isinstance(completion, int) else 0)


class RetryLater(Exception):
    """A line's run was refused for now: it may succeed after ``wait_s`` seconds (``outcome`` is the
    refusal, the line's result if it cannot wait that long)."""

    def __init__(self, wait_s: float, outcome: Outcome) -> None:
        super().__init__(f"retry in {wait_s:.3f} s")
        self.wait_s, self.outcome = wait_s, outcome


def retry_wait(error: GatewayError) -> float | None:
    """The seconds a 429 says to wait before the same request can succeed (``retry-after-ms``, else
    ``retry-after``); None for any other refusal, and for a 429 without a wait (a request larger than a
    limit, which waiting does not help)."""
    if error.status_code != 429:
        return None
    try:
        if "retry-after-ms" in error.headers:
            return max(0.0, int(error.headers["retry-after-ms"]) / 1000)
        if "retry-after" in error.headers:
            return max(0.0, float(error.headers["retry-after"]))
    except ValueError:
        return None
    return None


#: Writes what a run of a line got as the line's result, unless a result was written already (by another
#: run of the line): whether this call wrote it.
Keep = Callable[[Outcome], Awaitable[bool]]


@dataclass(slots=True)
class LineRun:
    """One run of a line, shared by the runner and the submitter: the line's request context once it is
    built (None before, and for a line refused before it had one), and whether what it got was handed to
    ``keep`` (None: not yet; then whether it was written as the line's result)."""

    ctx: RequestContext | None = None
    kept: bool | None = None

    def abandon(self) -> None:
        """The batch's owner stopped this line (it cancelled the batch): mark the line's request as one
        whose client went away. Called before the line's task is cancelled, as the live routes' disconnect
        watch marks a request before cancelling it."""
        if self.ctx is not None:
            self.ctx.client_gone = True


class Submitter:
    """Runs batch lines through the live pipeline of the pinned config."""

    def __init__(self, holder: RuntimeHolder, proxy: Proxy, metrics: Metrics, engine_priority: int | None) -> None:
        self.holder, self.proxy, self.metrics = holder, proxy, metrics
        self.engine_priority = engine_priority

    async def submit(self, url: str, body: dict[str, Any], line: BatchLine, run: LineRun, keep: Keep) -> None:
        """Run one line and hand what it got (its answer or its refusal) to ``keep``, once: an answer before
        the line's request is over. ``run`` is given the line's request context as soon as it exists.
        Raises ``RetryLater`` instead for a refusal that says when the line could succeed."""
        request_id = "batch-" + uuid.uuid4().hex
        try:
            self._ready()
            limit = self.holder.current.config.limits.max_body_bytes
            if len(orjson.dumps(body)) > limit:  # refused as the live routes refuse a larger body
                raise PayloadTooLarge(f"The request body is larger than this gateway accepts ({limit} bytes).",
                                      code="request_too_large")  # fmt: skip
            if url == "/v1/responses":
                await self._responses(body, line, request_id, run, keep)
            else:
                await self._inference(url, body, line, request_id, run, keep)
        except GatewayError as error:
            if run.kept is None:
                outcome = Outcome(error.status_code, error.body(), request_id)
                wait_s = retry_wait(error)
                if wait_s is not None:
                    raise RetryLater(wait_s, outcome) from None
                await hand_over(run, keep, outcome)

    def _context(self, endpoint_name: str, path: str, body: dict[str, Any], requested: str, line: BatchLine,
                 request_id: str, snapshot: Any, model: Any, run: LineRun) -> RequestContext:  # fmt: skip
        if self.engine_priority is not None and endpoint_name in _PRIORITIZED:
            body["priority"] = self.engine_priority  # after the allow-list: the client may not set it
        ctx = RequestContext(
            request_id=request_id,
            endpoint=endpoint_name,
            path=path,
            body=body,
            raw_body=orjson.dumps(body),
            headers={},
            model=model,
            requested_model=requested,
            snapshot=snapshot,
            stream=False,
            started=time.perf_counter(),
        )
        ctx.batch_line = line
        ctx.priority = LINE_PRIORITY
        ctx.log["batch_id"] = line.batch_id
        ctx.log["custom_id"] = line.custom_id
        run.ctx = ctx
        return ctx

    async def _inference(
        self, url: str, body: dict[str, Any], line: BatchLine, request_id: str, run: LineRun, keep: Keep
    ) -> None:
        endpoint = ENDPOINTS[url]
        self._ready()
        with self.holder.pin() as snapshot:
            limits = snapshot.config.limits
            ParamAllowList(limits.extra_params, max_n=limits.max_n).check(endpoint.name, body)
            check_request_media(endpoint.name, body)
            requested, _ = check_request(endpoint, body)
            model = snapshot.models.resolve(requested)
            if model is None:
                raise model_not_found(requested)
            body["model"] = model.upstream_name
            ctx = self._context(endpoint.name, endpoint.path, body, requested, line, request_id, snapshot, model, run)
            in_flight = self.metrics.in_flight.labels(model.name)
            in_flight.inc()
            try:
                reply = await self.proxy.serve(ctx)
                if not isinstance(reply, JSONReply):  # never: a line's body cannot ask to stream
                    raise ServerError("The batch line was answered as a stream.", code="internal_error")
                await hand_over(run, keep, Outcome(reply.status, orjson.loads(reply.body), request_id))
            finally:
                in_flight.dec()
                ctx.finalize()

    async def _responses(
        self, body: dict[str, Any], line: BatchLine, request_id: str, run: LineRun, keep: Keep
    ) -> None:
        # A line's Response is not stored (no tenant's conversation to continue it in): its answer says
        # store false, and a line asking to store is refused rather than answered as if it were stored.
        if body.get("store") is True:
            raise InvalidRequest(
                "Batch lines are not stored: leave 'store' out or set it to false.",
                param="store",
                code="unsupported_parameter",
            )
        req = parse_request({**body, "store": False})
        if req.previous_response_id is not None:
            raise InvalidRequest("Batch lines cannot continue a stored response.", param="previous_response_id")
        self._ready()
        with self.holder.pin() as snapshot:
            model = snapshot.models.resolve(req.model)
            if model is None:
                raise model_not_found(req.model)
            chat = chat_request(req, model.upstream_name, [])
            limits = snapshot.config.limits
            ParamAllowList(limits.extra_params, max_n=limits.max_n).check(_CHAT.name, chat)
            check_request(_CHAT, chat)
            ctx = self._context(_CHAT.name, _CHAT.path, chat, req.model, line, request_id, snapshot, model, run)
            ctx.log["api"] = "responses"
            reply = await LineTurn(self.proxy, self.metrics, req, ctx, run, keep).start()
        if not isinstance(reply, JSONReply):  # never: a line's body cannot ask to stream
            raise ServerError("The batch line was answered as a stream.", code="internal_error")

    def _ready(self) -> None:
        if not self.holder.loaded:
            raise ServerError("The gateway has no config loaded yet.", code="not_ready", status=503)


async def hand_over(run: LineRun, keep: Keep, outcome: Outcome) -> None:
    """Hand what the run got to ``keep``. An answer that was not written (another run's was, or the write
    failed and the line runs again) reached nobody: the run's context says nothing was delivered."""
    run.kept = False  # once, whatever ``keep`` raises
    try:
        run.kept = await keep(outcome)
    finally:
        if not run.kept and run.ctx is not None:
            run.ctx.delivered = None


class LineTurn(ResponsesTurn):
    """A ``/v1/responses`` line's turn: not stored, and its Response handed to ``keep`` once translated,
    before the turn's request is over."""

    def __init__(
        self, proxy: Proxy, metrics: Metrics, req: ResponsesRequest, ctx: RequestContext, run: LineRun, keep: Keep
    ) -> None:
        super().__init__(proxy, metrics, req, ctx, None)
        self.run, self.keep = run, keep

    async def translate_json(self, reply: JSONReply) -> JSONReply:
        translated = await super().translate_json(reply)
        outcome = Outcome(translated.status, orjson.loads(translated.body), self.ctx.request_id)
        await hand_over(self.run, self.keep, outcome)
        return translated
