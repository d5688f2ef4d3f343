"""The RoutePlan the core follows for one request: the first worker, the next one after a failure that
is safe to retry, and the bookkeeping when each attempt finishes.

Retries go to a worker this request has not tried, then to the model's fallbacks in order (switching
``ctx.model`` and the body's ``model`` field). Each retry spends from a per-model ``RetryBudget`` so
that, when many workers fail at once, retries add a bounded fraction of load instead of multiplying it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from gateway.pipeline.context import RequestContext
from gateway.upstream.workers import Worker
from gateway.wire.errors import GatewayError
from plugins.routing.admission import ModelGate
from plugins.routing.canary import retarget
from plugins.routing.config import RetryBudgetConfig

if TYPE_CHECKING:
    from gateway.pipeline.config import ModelConfig


class RetryBudget:
    """Retries allowed = ``ratio`` x requests seen in the last ``window_s`` + ``min_per_s`` x window,
    minus retries already made (counted in one-second buckets)."""

    __slots__ = ("_buckets", "_clock", "config")

    def __init__(self, config: RetryBudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._buckets: dict[int, list[int]] = {}  # second -> [requests, retries]

    def _bucket(self) -> list[int]:
        second = int(self._clock())
        bucket = self._buckets.get(second)
        if bucket is None:
            horizon = second - int(self.config.window_s)
            for old in [s for s in self._buckets if s <= horizon]:
                del self._buckets[old]
            bucket = self._buckets[second] = [0, 0]
        return bucket

    def record_request(self) -> None:
        self._bucket()[0] += 1

    def try_spend(self) -> bool:
        current = self._bucket()
        requests = sum(b[0] for b in self._buckets.values())
        retries = sum(b[1] for b in self._buckets.values())
        allowed = self.config.ratio * requests + self.config.min_per_s * self.config.window_s
        if retries + 1 > allowed:
            return False
        current[1] += 1
        return True


class Route(Protocol):
    """One model a request may be served by, and how to pick among its workers."""

    @property
    def model(self) -> ModelConfig: ...

    def choose(self, tried: list[Worker], now: float) -> Worker | None: ...

    def has_untried(self, tried: list[Worker], now: float) -> bool: ...


class Plan:
    """Implements the core's ``RoutePlan`` protocol for one request: up to ``max_attempts`` tries on
    distinct workers of each model, the request's model first, then its fallbacks."""

    __slots__ = (
        "_attempts",
        "_budget",
        "_ctx",
        "_gate",
        "_max_attempts",
        "_on_budget_refused",
        "_on_fallback",
        "_routes",
        "_tried",
    )

    def __init__(
        self,
        ctx: RequestContext,
        routes: Sequence[Route],
        *,
        gate: ModelGate | None,
        budget: RetryBudget,
        max_attempts: int,
        on_fallback: Callable[[str, str], None] | None = None,
        on_budget_refused: Callable[[str], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._routes = list(routes)  # routes[0] is the model in ctx; the rest are fallbacks in order
        self._gate = gate
        self._budget = budget
        self._max_attempts = max_attempts
        self._on_fallback = on_fallback
        self._on_budget_refused = on_budget_refused
        self._tried: list[Worker] = []
        self._attempts = 0

    @property
    def tried(self) -> list[Worker]:
        return self._tried

    def next_worker(self, failed: Worker | None, error: GatewayError | None) -> Worker | None:
        if failed is None:
            self._budget.record_request()
            worker = self._pick()
            if worker is None:
                self._release()  # the core answers 503 and will not call finished()
            return worker
        exhausted = self._attempts >= self._max_attempts
        if exhausted and len(self._routes) == 1:
            return None
        if not self._budget.try_spend():
            if self._on_budget_refused is not None:
                self._on_budget_refused(self._ctx.model.name)
            return None
        if exhausted:  # this model had its tries: go on with the next fallback model
            self._switch(self._routes.pop(0), self._routes[0])
        worker = self._pick()
        if worker is not None and self._gate is not None:
            self._gate.reacquire()
        return worker

    def finished(self, worker: Worker, *, ok: bool, error: GatewayError | None = None) -> None:
        self._release()

    def has_alternative(self) -> bool:
        """Another healthy worker of the current model that this request has not tried, with attempts
        left (a stream cut midway is continued only on the same model, never on a fallback)."""
        if self._attempts >= self._max_attempts or not self._routes:
            return False
        return self._routes[0].has_untried(self._tried, time.monotonic())

    def _release(self) -> None:
        if self._gate is not None:
            self._gate.release()

    def _pick(self) -> Worker | None:
        now = time.monotonic()
        while self._routes:
            worker = self._routes[0].choose(self._tried, now)
            if worker is not None:
                self._tried.append(worker)
                self._attempts += 1
                return worker
            if len(self._routes) == 1:
                return None
            self._switch(self._routes.pop(0), self._routes[0])
        return None

    def _switch(self, old: Route, new: Route) -> None:
        """Serve the request with a fallback model from now on (``max_attempts`` tries of its own)."""
        self._attempts = 0
        ctx = self._ctx
        retarget(ctx, new.model)
        ctx.log["fallback_from"] = old.model.name
        if self._on_fallback is not None:
            self._on_fallback(old.model.name, new.model.name)
