"""One request's attempts on workers: ``Trip``.

The route plan (``ctx.plan``, from the routing plugin) names the workers; a trip takes a ``WorkerLease``
for each attempt, retries on another worker while nothing was sent (a refused connection, a timeout before
the headers, a 502/503), and, after a stream broke midway, opens its continuation on another worker
(``reopen``, called by ``gateway.proxy.resume.Resumer``). A worker that answers that it does not serve
the request's model (vLLM's 404) is asked once more when the plan held a stale belief that it did
(``RoutePlan.model_missing``: a LoRA adapter another gateway replica unloaded there). The lease of the
attempt that answered is ``trip.lease`` until the answer ends (``end``) or the request is over (``abandon``,
a finalizer).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from gateway.pipeline.context import RequestContext, RoutePlan
from gateway.pipeline.services import Services
from gateway.proxy.lease import WorkerLease
from gateway.proxy.resume import Resumer, resumable
from gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gateway.upstream.workers import Worker
from gateway.wire.errors import (
    GatewayError,
    ServiceUnavailable,
    endpoint_not_served,
    from_upstream,
    model_not_on_worker,
)

log = logging.getLogger("gateway.proxy")
_RETRYABLE_STATUS = frozenset({502, 503})

#: An attempt that got no answer to relay: the error the client would see, and what to do next: nothing
#: (``"none"``), try another worker (``"elsewhere"``), or this worker once more (``"again"``: it did not
#: hold the request's model, and the plan forgot that it did).
Retry = Literal["none", "elsewhere", "again"]
Refusal = tuple[GatewayError, Retry]


class Trip:
    """The attempts of one request (see the module docstring)."""

    __slots__ = ("_ctx", "_services", "lease")

    def __init__(self, ctx: RequestContext, services: Services) -> None:
        self._ctx = ctx
        self._services = services
        self.lease: WorkerLease | None = None

    async def open(
        self, *, failed: Worker | None = None, cause: GatewayError | None = None, continuation: bytes | None = None
    ) -> UpstreamResponse:
        """A worker's 200 response, from the plan's first worker or, on a failure that is safe to retry,
        the next one. After a stream from ``failed`` broke midway (``cause``), the same with the
        ``continuation`` body, on the request's own model only."""
        ctx = self._ctx
        plan = _plan_of(ctx)
        worker = plan.next_worker(failed, cause)
        if worker is None:
            other = "other " if failed is not None else ""
            raise ServiceUnavailable(
                f"No {other}healthy worker serves model '{ctx.model.name}' right now; try again shortly.",
                code="no_healthy_worker",
                headers={"retry-after": "1"},
            )
        # Once per request, never for a continuation (its body carries what the client was already sent).
        again = continuation is None
        while True:
            # Per attempt: a retry may go to a fallback model, which changes the body's "model".
            body = ctx.upstream_body() if continuation is None else continuation
            answer = await self._attempt(plan, worker, body, again)
            if isinstance(answer, UpstreamResponse):
                return answer
            error, retry = answer
            if retry == "again":
                again = False
                continue
            if retry == "none" or (continuation is not None and not plan.has_alternative()):
                raise error  # a continuation stays on the request's model
            nxt = plan.next_worker(worker, error)
            if nxt is None:
                raise error
            self._services.metrics.retries.labels(ctx.model.name).inc()
            log.info("request %s: retrying on %s after %s", ctx.request_id, nxt.url, error.message)
            worker = nxt

    async def _attempt(self, plan: RoutePlan, worker: Worker, body: bytes, again: bool) -> UpstreamResponse | Refusal:
        """One attempt on ``worker``: its 200 response (the lease kept as ``self.lease``), or why not
        (``again``: a 404 for a model the worker was believed to hold may be tried there once more)."""
        ctx = self._ctx
        lease = WorkerLease(worker, plan, self._services.workers, ctx.tenant)
        prepare = getattr(plan, "prepare", None)  # RoutePlan's optional step before each attempt
        try:
            if prepare is not None:  # e.g. load the request's LoRA adapter on this worker
                await prepare(worker)
            sent_at = time.perf_counter()  # after a load: a first byte's wait is the worker's alone
            ctx.reached_worker = True
            upstream = await self._connect(worker, body)
        except UpstreamFailure as failure:
            self._blame(worker, failure.kind)
            self._services.metrics.upstream_errors.labels(worker.url, failure.kind).inc()
            lease.failed(failure.error)
            return failure.error, "elsewhere" if failure.retryable else "none"
        except BaseException:  # cancelled (the client went away), or the plan's step refused
            lease.failed()
            raise
        if upstream.status != 200:
            return await self._refused(lease, upstream, again)
        lease.response = upstream
        self.lease = lease
        ctx.worker = worker
        if ctx.stream:  # a stream's first byte comes before its generation: comparable across requests
            self._first_byte(lease, time.perf_counter() - sent_at)
        return upstream

    async def _refused(self, lease: WorkerLease, upstream: UpstreamResponse, again: bool) -> Refusal:
        """A worker's error answer: its 5xx is the worker's failure (502/503 retried elsewhere); anything
        else is the client's own problem, raised as it is and held against nobody, except a 404 for a model
        the plan believed the worker held (``again``: tried there once more)."""
        ctx = self._ctx
        with lease:
            try:  # read for the gateway to parse, as its own calls' answers are: bounded
                raw = await upstream.read_at_most(self._services.upstream.config.max_small_answer_bytes)
            except UpstreamFailure as failure:
                raise failure.error from None
            unsupported = endpoint_not_served(upstream.status, raw, ctx.requested_model, ctx.endpoint)
            error = unsupported or from_upstream(upstream.status, raw)
            if again and self._stale(lease.worker, upstream.status, raw):
                lease.declined()
                return error, "again"
            if unsupported is not None or upstream.status < 500:
                lease.declined()
                raise error
            self._blame(lease.worker, f"http {upstream.status}")
            self._services.metrics.upstream_errors.labels(lease.worker.url, "status").inc()
            lease.failed(error)
            return error, "elsewhere" if upstream.status in _RETRYABLE_STATUS else "none"

    def _stale(self, worker: Worker, status: int, raw: bytes) -> bool:
        """The worker says it does not serve the request's model, and the plan, which believed it did, has
        forgotten that (``RoutePlan.model_missing``)."""
        ctx = self._ctx
        model = ctx.model.upstream_name
        missing = getattr(ctx.plan, "model_missing", None)  # RoutePlan's optional step
        if missing is None or not model_not_on_worker(status, raw, model) or not missing(worker):
            return False
        log.info("request %s: %s did not hold %s; trying it there once more", ctx.request_id, worker.url, model)
        return True

    async def _connect(self, worker: Worker, body: bytes) -> UpstreamResponse:
        """One POST; with tracing on, also a span (to response headers) and a ``traceparent``."""
        ctx, services = self._ctx, self._services
        tracing = services.tracing
        if tracing is None:
            return await services.upstream.open(worker.url, ctx.path, body)
        started = time.perf_counter()
        status = 0
        try:
            upstream = await services.upstream.open(worker.url, ctx.path, body, headers=tracing.inject())
            status = upstream.status
            return upstream
        finally:
            attributes = {"gateway.worker": worker.url, "http.response.status_code": status}
            tracing.record(f"upstream {ctx.path}", time.perf_counter() - started, attributes, error=status != 200)

    # -- mid-stream failover (gateway.proxy.resume) --------------------------------------------------

    def resumer(self) -> Resumer | None:
        """What a stream needs to be continued elsewhere if its worker fails, or None when it could not be
        (then the relays keep nothing extra)."""
        ctx, services = self._ctx, self._services
        limit = services.upstream.config.stream_resumptions
        plan = ctx.plan
        if limit <= 0 or plan is None or not resumable(ctx, limit, plan.has_alternative()):
            return None
        return Resumer(ctx, limit, self.reopen, services.upstream, services.metrics)

    async def reopen(self, reason: str, error: GatewayError, body: bytes) -> UpstreamResponse | None:
        """The stream's worker failed midway (its connection is closed): count it against that worker and
        open ``body`` on another one; None when no other worker takes it."""
        ctx, lease = self._ctx, self.lease
        if lease is None:
            return None
        self.lease = ctx.worker = None
        # As any failure a request's content could cause: one tenant's streams alone cannot eject a worker
        # (a worker that is really gone is ejected by the refused connections that follow).
        limits = ctx.snapshot.config.upstream
        self._services.workers.report_failure(lease.worker, f"stream {reason}", ctx.tenant, limits.eject_min_tenants)
        self._services.metrics.upstream_errors.labels(lease.worker.url, f"stream_{reason}").inc()
        lease.failed(error)
        plan = ctx.plan
        if plan is None or not plan.has_alternative():
            return None
        try:
            return await self.open(failed=lease.worker, cause=error, continuation=body)
        except GatewayError as refused:
            log.warning("request %s: the stream could not be continued: %s", ctx.request_id, refused.message)
            return None

    # -- the end -----------------------------------------------------------------------------------

    def end(self, ok: bool) -> None:
        """The answer is over: release the worker serving it (none when a failover found no other one)."""
        lease = self.lease
        if lease is not None:
            lease.ok() if ok else lease.failed()

    def abandon(self) -> None:
        """The request is over (a finalizer): a lease still held (a stream that never began to relay) is
        released as failed, its worker's connection closed."""
        lease = self.lease
        if lease is not None:
            lease.failed()

    # -- what counts against a worker ---------------------------------------------------------------

    def _blame(self, worker: Worker, kind: str) -> None:
        """Hold a failed attempt against its worker when it is the worker's failure: a refused connection
        always; a 5xx, a reset or a stream's first-byte timeout as one of the tenant's (one tenant alone
        cannot eject a worker others use: ``WorkerTable.report_failure``); never the first-byte timeout of
        a non-streamed request, whose first byte waits for its whole generation (the client's own long
        request, e.g. a big max_tokens)."""
        ctx, workers = self._ctx, self._services.workers
        if kind == "connect":
            workers.report_failure(worker, kind)
        elif kind != "timeout" or ctx.stream:
            workers.report_failure(worker, kind, ctx.tenant, ctx.snapshot.config.upstream.eject_min_tenants)

    def _first_byte(self, lease: WorkerLease, seconds: float) -> None:
        """A stream's first byte took ``seconds``: far slower than the model's usual counts as a failure."""
        ctx, workers = self._ctx, self._services.workers
        usual = workers.observe_first_byte(ctx.model.name, seconds)
        limits = ctx.snapshot.config.upstream
        if usual is not None and seconds > max(limits.slow_first_byte_min_s, limits.slow_first_byte_factor * usual):
            lease.slow_first_byte_s = ctx.log["slow_first_byte_s"] = round(seconds, 3)
            workers.report_failure(lease.worker, "slow first byte", ctx.tenant, limits.eject_min_tenants)


def _plan_of(ctx: RequestContext) -> RoutePlan:
    plan = ctx.plan
    if plan is None:
        raise ServiceUnavailable(
            f"No plugin chose a worker for model '{ctx.model.name}'; enable the routing plugin in config.yaml.",
            code="no_route",
        )
    return plan
