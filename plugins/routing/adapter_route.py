"""A request for a LoRA adapter: the route that places it (``placement``) and the plan that loads it.

``AdapterRoute`` is the routing ``Route`` of an adapter: among the base model's workers it ranks the
available ones with the placement scorers. ``AdapterPlan`` is the core's ``RoutePlan`` with one more
step, ``prepare(worker)``, which the core awaits before each attempt (the first one, a retry, or the
continuation of a stream cut midway): it makes sure the chosen worker holds the request's adapter, loading
it there if needed, so a request, its retries and its failover all reach a worker that has, or loads, the
adapter. It also counts the requests using each adapter on each worker, so an adapter in use is never
the one evicted. When the worker answers that it does not know the adapter after all (another gateway
replica unloaded it since this one last read the worker's list), ``model_missing`` forgets that the worker
holds it, and the core tries the request there once more: ``prepare`` then loads it again.

With a bound on its tenant's loads (``LoadQuota``), a request's first attempt is placed on a worker that
holds its adapter, overloaded or not, when the tenant has no token left, and a load its first attempt
starts takes a token or is refused with a 429 (nothing sent to a worker). Later attempts of the request
(a retry elsewhere, the retry after the worker's 404, the continuation of a cut stream) are placed as
usual and load without a charge: the request was admitted, the client may have been sent half an answer,
and the worker's failure, not the tenant, caused the load (bounded per request by ``max_attempts`` and the
retry budget, the one retry after a 404 and ``upstream.stream_resumptions``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial

from gateway.pipeline.adapters import LoraSettings
from gateway.pipeline.config import AdapterModel, ModelConfig
from gateway.upstream.workers import Worker
from gateway.wire.errors import GatewayError
from plugins.routing.adapter_loader import AdapterLoader
from plugins.routing.config import ModelRouting
from plugins.routing.load_quota import LoadQuota
from plugins.routing.placement import Scene, Scorer, WorkerView, load_cap, rank
from plugins.routing.plan import Plan
from plugins.routing.policies import LoadBias, WorkerPool

log = logging.getLogger("gateway.routing.adapters")

#: ``lora_of(worker, base)``: the LoRA settings a worker runs with (its ``max_loras`` slots are shared by every
#: model whose adapters it serves), ``base`` the adapter's base model.
LoraOf = Callable[[Worker, str], LoraSettings]


class AdapterRoute:
    """One adapter as a request may use it: the base model's pool, ranked by the placement scorers."""

    __slots__ = ("_base", "_lora_of", "_pool", "_routing", "_rr", "_scorers", "bias", "may_load", "model")

    def __init__(
        self,
        model: AdapterModel,
        routing: ModelRouting,
        pool: WorkerPool,
        lora_of: LoraOf,
        weighted: Sequence[tuple[Scorer, float]],
        bias: LoadBias | None,
    ) -> None:
        self.model: ModelConfig = model
        self._base = model.base
        self._routing = routing
        self._pool = pool
        self._lora_of = lora_of
        self._scorers = weighted
        self._rr = 0
        self.bias = bias
        #: Set by the plan when its tenant's loads are bounded: False when the next pick may not start a load.
        self.may_load: Callable[[], bool] | None = None

    def pool_available(self, now: float) -> bool:
        return self._pool.any_available(now)

    def has_untried(self, tried: list[Worker], now: float) -> bool:
        return any(w.available(now) and w not in tried for w in self._pool.workers)

    def views(self, tried: list[Worker], now: float) -> list[WorkerView]:
        """The snapshot placement ranks: the available workers not tried yet, rotated per request."""
        name = self.model.upstream_name
        workers = self._pool.workers
        start = self._rr % len(workers) if workers else 0
        self._rr += 1
        bias = self.bias
        lora_of, base = self._lora_of, self._base
        return [
            WorkerView(
                worker=w,
                load=w.in_flight + (bias(w) if bias is not None else 0.0),
                holds=w.adapters.holds(name),
                free_slots=lora_of(w, base).max_loras - w.adapters.occupied(),
            )
            for w in workers[start:] + workers[:start]
            if w.available(now) and w not in tried
        ]

    def choose(self, tried: list[Worker], now: float) -> Worker | None:
        views = self.views(tried, now)
        if not views:
            return None
        routing = self._routing
        scene = Scene(cap=load_cap([v.load for v in views], routing.load_factor, routing.load_slack))
        ranked = rank(views, scene, self._scorers)
        if not ranked[0].holds and self.may_load is not None and not self.may_load():
            # Past its tenant's load bound: a worker that holds the adapter, however loaded, rather than a
            # load; without one, the best worker, where the plan's prepare refuses to load it.
            return next((v.worker for v in ranked if v.holds), ranked[0].worker)
        return ranked[0].worker


class AdapterPlan(Plan):
    """A ``Plan`` whose attempts first make sure their worker holds the request's adapter."""

    __slots__ = ("_first", "_loader", "_quota", "_settings_of", "_using")

    def use(self, loader: AdapterLoader, settings_of: LoraOf, quota: LoadQuota | None = None) -> AdapterPlan:
        """Called once, right after construction: the loader, the LoRA settings of each worker and the
        bound on the loads of the request's tenant (None: unbounded)."""
        self._loader = loader
        self._settings_of = settings_of
        self._using: dict[Worker, tuple[str, float | None]] = {}  # worker -> (adapter, when learnt held)
        self._quota = quota
        self._first = True  # until the first attempt's prepare: the one attempt whose load is charged
        if quota is not None:
            for route in self._routes:
                if isinstance(route, AdapterRoute):
                    route.may_load = self._may_load
        return self

    def _may_load(self) -> bool:
        return not self._first or self._quota is None or self._quota.ready()

    async def prepare(self, worker: Worker) -> None:
        """Awaited by the core before it sends an attempt to ``worker``. The request's model now (a
        fallback may have changed it) decides: a base model needs nothing."""
        first, self._first = self._first, False
        model = self._ctx.model
        if not isinstance(model, AdapterModel):
            return
        name = model.upstream_name
        quota = self._quota if first else None
        starting = partial(quota.charge, model.name) if quota is not None else None
        # In use from before the load is awaited: a request that waits on another request's load must
        # not find its adapter evicted, by a third request's load, between that load and its attempt.
        worker.adapters.acquire(name)
        try:
            await self._loader.ensure(worker, model.adapter, self._settings_of(worker, model.base), starting)
        except BaseException:
            worker.adapters.release(name)
            raise
        self._using[worker] = (name, worker.adapters.learnt.get(name))

    def model_missing(self, worker: Worker) -> bool:
        """The core's optional step after ``worker`` answered that it does not know the request's model:
        the adapter this plan's ``prepare`` found there was unloaded behind this gateway (another replica
        made room). Forgotten, unless the worker's state changed since (a load or read that already put it
        right), and the attempt is made there once more: ``prepare`` loads it again. Counted in
        ``gateway_adapter_retries`` (not the core's retries elsewhere, which say that workers fail)."""
        using = self._using.get(worker)
        if using is None:  # no adapter prepared there: the 404 stands
            return False
        name, learnt = using
        state = worker.adapters
        if state.learnt.get(name) == learnt:
            state.removed(name)
            log.warning("worker %s no longer holds adapter %s (unloaded by another gateway?)", worker.url, name)
        if self._gate is not None:
            self._gate.reacquire()  # the failed attempt's finished() releases the slot it held
        self._loader.metrics.adapter_retries.labels(worker.url, name).inc()  # True: the core retries there
        return True

    def finished(self, worker: Worker, *, ok: bool, error: GatewayError | None = None) -> None:
        using = self._using.pop(worker, None)
        if using is not None:
            worker.adapters.release(using[0])
        super().finished(worker, ok=ok, error=error)
