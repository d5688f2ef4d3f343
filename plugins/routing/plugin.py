"""Routing: choose the worker for each request among the workers of its model.

Per request, in ``on_request`` (the terminal plugin): pick the weighted target (canary), skip to a
fallback model when the target has no healthy worker (503 at once when none has), take an admission
slot (429 with ``Retry-After`` when the model is full), and hand the core a ``Plan`` that picks the
worker by the model's policy and the next one after a retryable failure. A canary target or fallback
the request may not use (``ctx.allows_model``: the key's allow-list) is never chosen. Everything on this path is
in-memory arithmetic; the only waits are the bounded admission queue and none at all when it is empty.

A LoRA adapter (``AdapterModel``) is routed among its base model's workers by the placement scorers
(``adapter_route``), and its plan loads it on the chosen worker before the attempt (``adapter_loader``);
what each worker holds is read back from the workers in the background (``gateway.upstream.adapters``).
"""

from __future__ import annotations

import logging
import random
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from gateway.engine.spec import merged_lora
from gateway.pipeline.adapters import LoraSettings
from gateway.pipeline.config import AdapterModel, GatewayConfig, ModelConfig
from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.services import Services
from gateway.upstream.adapters import AdapterSync
from gateway.upstream.workers import Worker
from gateway.wire.errors import ServiceUnavailable
from plugins.routing.adapter_admin import ACTIONS as ADAPTER_ACTIONS
from plugins.routing.adapter_admin import AdapterAdmin
from plugins.routing.adapter_route import AdapterPlan, AdapterRoute
from plugins.routing.admission import ModelGate
from plugins.routing.cache_keys import affinity_text
from plugins.routing.canary import WeightedTargets, fallback_chain, retarget, unknown_references
from plugins.routing.config import ModelRouting, RoutingConfig
from plugins.routing.discovery import DnsDiscovery, Resolver, system_resolver
from plugins.routing.placement import scorers
from plugins.routing.plan import Plan
from plugins.routing.policies import LoadBias, WorkerPool, prompt_prefix, stable_hash
from plugins.routing.precise import STATE_KEY, PrecisePlacement, PreciseRequest, placement_view
from plugins.routing.precise_setup import TokenizerSources, build_placements, follow_workers, tokenizer_sources
from plugins.routing.telemetry import RoutingShared
from plugins.routing.workerload import WorkerLoadScraper

if TYPE_CHECKING:
    from gateway.upstream.workers import WorkerTable

log = logging.getLogger("gateway.routing.adapters")


class ModelRoute:
    """One model as a request may use it: its pool and policy, and the request's affinity key
    (computed once, on the first pick, and reused for retries)."""

    __slots__ = ("_ctx", "_key", "_pool", "_routing", "bias", "model", "precise")

    def __init__(
        self, model: ModelConfig, routing: ModelRouting, pool: WorkerPool, ctx: RequestContext, bias: LoadBias | None
    ) -> None:
        self.model = model
        self._routing = routing
        self._pool = pool
        self._ctx = ctx
        self._key: int | None = -1
        self.bias = bias
        self.precise: PreciseRequest | None = None  # precise_prefix: the prompt's blocks, when predicted

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def pool_available(self, now: float) -> bool:
        return self._pool.any_available(now)

    def has_untried(self, tried: list[Worker], now: float) -> bool:
        return any(w.available(now) and w not in tried for w in self._pool.workers)

    def choose(self, tried: list[Worker], now: float) -> Worker | None:
        policy = self._routing.policy
        if policy == "round_robin":
            return self._pool.round_robin(tried, now)
        if policy != "least_outstanding":
            precise = self.precise
            if precise is not None:
                worker = precise.choose(self._pool, tried, now)
                if worker is not None:
                    return worker
            key = self._affinity_key()  # precise_prefix falls back to approximate affinity
            if key is not None:
                routing = self._routing
                worker = self._pool.hashed(key, routing.load_factor, tried, now, routing.load_slack)
                if precise is not None and worker is not None:
                    precise.note(worker)  # still checked: a degraded model recovers by itself
                return worker
        return self._pool.least_outstanding(tried, now, self.bias)

    def _affinity_key(self) -> int | None:
        if self._key == -1:
            ctx = self._ctx
            if self._routing.policy == "session_affinity":
                text = ctx.headers.get(self._routing.session_header, "")
            else:
                text = affinity_text(prompt_prefix(ctx.endpoint, ctx.body, self._routing.prefix_chars), ctx.body)
            self._key = stable_hash(text.encode("utf-8", "surrogatepass")) if text else None
        return self._key


class RoutingPlugin(Plugin):
    name = "routing"
    Config = RoutingConfig
    #: precise_prefix checks a stream's reported cached tokens, its usage only: streams keep the pass-through.
    reads_stream_text = False

    #: How ``dns://`` refs are resolved; a subclass may replace it (tests control the answers).
    resolver: Resolver = staticmethod(system_resolver)

    def __init__(self, config: RoutingConfig, services: Services) -> None:
        super().__init__(config, services)
        self.shared = RoutingShared.of(services)
        self.rng = random.Random()
        self._models: dict[str, ModelConfig] = {}
        self._refs: dict[str, list[str]] = {}
        self._targets: dict[str, WeightedTargets] = {}
        self._chains: dict[str, list[str]] = {}
        self._pools: dict[str, tuple[int, WorkerPool]] = {}
        self._discovery: DnsDiscovery | None = None
        self.load = WorkerLoadScraper(config.load_metrics, services.workers, services.upstream)
        self._gateway_config: GatewayConfig | None = None
        self._tokenizers: TokenizerSources = {}
        self._precise: dict[str, PrecisePlacement] = {}
        self._lora: dict[str, LoraSettings] = {}  # base model -> its own adapter settings
        self._worker_lora: dict[str, LoraSettings] = {}  # worker URL or dns:// ref -> what it runs with
        self._lora_by_url: tuple[int, dict[str, LoraSettings]] = (-1, {})  # per worker table generation
        self._adapter_names: dict[str, AdapterModel] = {}  # every adapter name and alias
        self._adapter_sync: AdapterSync | None = None
        weights = config.adapters
        self._scorers = scorers(weights.affinity_weight, weights.free_slot_weight, weights.load_weight)

    def prepare(self, config: GatewayConfig) -> None:
        """Check the model names this section refers to and learn the model table."""
        known = {m.name for m in config.served_models}
        problems = unknown_references(self.config, known)
        if problems:
            raise ValueError("; ".join(problems))
        managed = {w.name: w.url for w in config.engine.workers}
        for model in config.served_models:
            self._models[model.name] = model
            settings = model.lora_settings
            if settings is not None:
                self._lora[model.name] = settings
            if isinstance(model, AdapterModel):
                self._adapter_names.update(dict.fromkeys((model.name, *model.aliases), model))
            self._refs[model.name] = [managed.get(ref, ref) for ref in model.workers]
            self._chains[model.name] = fallback_chain(model.name, self.config, known)
            targets = self.config.for_model(model.name).targets
            if targets and model.name in self.config.models:
                self._targets[model.name] = WeightedTargets(targets, self.rng)
        for ref, settings in config.worker_lora().items():
            self._worker_lora[managed.get(ref, ref)] = settings
        self._gateway_config = config
        self._tokenizers = tokenizer_sources(self.config, config, self.services.settings.model_dir)
        refs = [ref for refs in self._refs.values() for ref in refs if ref.startswith("dns://")]
        self._discovery = DnsDiscovery(
            self.services.workers,
            refs,
            interval_s=self.config.discovery.dns_interval_s,
            timeout_s=self.config.discovery.dns_timeout_s,
            resolver=self.resolver,
            live=self._live,
        )

    def model_moves(self) -> dict[str, list[str]]:
        """Where a request for each model may be served: its canary targets and its fallbacks."""
        moves: dict[str, list[str]] = {}
        for name, chain in self._chains.items():
            targets = list(self.config.for_model(name).targets) if name in self._targets else []
            moves[name] = [*targets, *chain[1:]]
        return moves

    async def start(self) -> None:
        if self._discovery is not None:
            await self._discovery.start()
        await self.load.start()
        if self._lora:
            cfg = self.config.adapters
            self._adapter_sync = AdapterSync(
                self.services.upstream.get,
                self.lora_workers,
                interval_s=cfg.sync_interval_s,
                timeout_s=cfg.sync_timeout_s,
            )
            self._adapter_sync.start()
        if self._gateway_config is not None:
            self._precise = await build_placements(self._tokenizers, self.config, self.services, self.shared)

    def _follow(self) -> None:
        """Follow the KV events and load of the precise models' workers (when this config goes live, and
        again whenever their set changes: ``dns://`` workers come and go). The feeds are the process's, so
        only the live config's instance says what they follow: not one still starting (a later plugin may
        refuse its config), nor a retired one still serving its last requests."""
        if self._gateway_config is None or not self._live():
            return
        refs = (ref for model in self._precise for ref in self._refs.get(model, ()))
        follow_workers(self.services.workers.expand(refs), self.config, self._gateway_config, self.services)

    def _live(self) -> bool:
        """Whether this instance's config is the live one (``went_live`` ran, and no other config's since)."""
        return self.shared.live is self

    async def aclose(self) -> None:
        if self._live():
            self.shared.live = None
        if self._discovery is not None:
            await self._discovery.aclose()
        await self.load.aclose()
        if self._adapter_sync is not None:
            await self._adapter_sync.aclose()

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        """Operator actions on adapters (``plugins.routing.adapter_admin``), and ``placement``: each precise
        model's state (degraded or not, the share of recent predictions within one block, and per worker
        the blocks indexed and the state of its event stream)."""
        if action == "placement":
            return placement_view(self._precise, self.pool, self.services.workers)
        if action not in ADAPTER_ACTIONS:
            return await super().on_admin(action, body)
        loader = partial(self.shared.loader, self.config.adapters.load_timeout_s)
        admin = AdapterAdmin(
            self._adapter_names,
            self._lora,
            self.lora_of,
            lambda name: self.pool(name).workers,
            loader,
            self.services.workers.all,
        )
        return await admin.handle(action, body)

    def went_live(self) -> None:
        """This config's routing now says what the process-wide state follows: the discovered ``dns://``
        refs it no longer names are forgotten, and the KV event and load feeds follow its precise models'
        workers (``_follow``), and the tenants' adapter load buckets refill at its rate.

        Pins are kept on the workers across reloads; a pin this config no longer backs (its adapter was
        removed or renamed, or the worker no longer serves the adapter's base model) is dropped, so the
        adapter is evicted as any other when room is needed, or unloaded by the operator."""
        self.shared.live = self
        self.shared.tenant_loads.per_minute = self.config.adapters.tenant_loads_per_minute or 0
        if self._discovery is not None:
            self._discovery.retain()
        self._follow()
        backed: dict[str, set[str]] = {}  # worker URL -> served names of the adapters it serves
        for model in self._adapter_names.values():
            for worker in self.pool(model.base).workers:
                backed.setdefault(worker.url, set()).add(model.upstream_name)
        for worker in self.services.workers.all():
            pinned = worker.adapters.pinned
            stale = pinned - backed.get(worker.url, set())
            if stale:
                pinned -= stale
                log.info("unpinned adapters %s on %s: not in the live config", ", ".join(sorted(stale)), worker.url)

    def lora_of(self, worker: Worker, base: str) -> LoraSettings:
        """The LoRA settings ``worker`` runs with, its ``max_loras`` slots shared by every model whose adapters
        it serves (``base``'s own settings for a worker the config does not list, e.g. one leaving)."""
        table: WorkerTable = self.services.workers
        generation, by_url = self._lora_by_url
        if generation != table.generation:
            wanted: dict[str, list[LoraSettings]] = {}
            for ref, settings in self._worker_lora.items():
                for url in table.expand((ref,)):
                    wanted.setdefault(url, []).append(settings)
            by_url = {url: lora for url, settings in wanted.items() if (lora := merged_lora(settings)) is not None}
            self._lora_by_url = (table.generation, by_url)
        return by_url.get(worker.url) or self._lora[base]

    def lora_workers(self) -> list[Worker]:
        """The workers of the models that serve adapters (each once)."""
        workers = {id(w): w for name in self._lora for w in self.pool(name).workers}
        return list(workers.values())

    def route(self, model: ModelConfig, ctx: RequestContext, bias: LoadBias | None) -> ModelRoute | AdapterRoute:
        routing = self.config.for_model(model.name)
        if isinstance(model, AdapterModel):
            return AdapterRoute(model, routing, self.pool(model.name), self.lora_of, self._scorers, bias)
        return ModelRoute(model, routing, self.pool(model.name), ctx, bias)

    def pool(self, model: str) -> WorkerPool:
        """The model's workers, rebuilt only when the worker table changed."""
        table: WorkerTable = self.services.workers
        cached = self._pools.get(model)
        if cached is not None and cached[0] == table.generation:
            return cached[1]
        pool = WorkerPool([table.get(url) for url in table.expand(self._refs.get(model, ()))])
        if model in self._precise and any(w.url not in table.kv.workers for w in pool.workers):  # new workers
            self._follow()
        self._pools[model] = (table.generation, pool)
        return pool

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        requested = ctx.model.name
        picker = self._targets.get(requested)
        if picker is not None:
            self._split(ctx, picker.pick())
        bias = self.load.bias if self.config.load_metrics.enabled else None
        routes = [
            self.route(self._models[name], ctx, bias)
            for name in self._chains.get(ctx.model.name, (ctx.model.name,))
            if name in self._models and (name == ctx.model.name or ctx.allows_model(name))
        ]
        now = time.monotonic()
        while routes and not routes[0].pool_available(now):
            routes.pop(0)
        if not routes:
            self.shared.rejected.labels(requested, "no_healthy_worker").inc()
            raise ServiceUnavailable(
                f"No healthy worker serves model '{requested}' right now; try again shortly.",
                code="no_healthy_worker",
                headers={"retry-after": "1"},
            )
        if routes[0].model is not ctx.model:
            self.shared.fallbacks.labels(ctx.model.name, routes[0].model.name).inc()
            ctx.log["fallback_from"] = ctx.model.name
            retarget(ctx, routes[0].model)
        model = ctx.model.name
        admission = self.config.for_model(model).admission
        gate = self.shared.gate(model, admission) if admission.max_in_flight is not None else None
        if gate is not None:
            await self._admit(ctx, gate)
        await self._predict(ctx, routes[0])
        adapters = any(isinstance(r.model, AdapterModel) for r in routes)
        plan = (AdapterPlan if adapters else Plan)(
            ctx,
            routes,
            gate=gate,
            budget=self.shared.budget(model, self.config.retry_budget),
            max_attempts=self.config.max_attempts,
            on_fallback=self._count_fallback,
            on_budget_refused=self._count_budget_refused,
        )
        if isinstance(plan, AdapterPlan):
            quota = self.shared.load_quota(ctx.tenant)
            plan.use(self.shared.loader(self.config.adapters.load_timeout_s), self.lora_of, quota)
        ctx.plan = plan
        return None

    def _split(self, ctx: RequestContext, target: str) -> None:
        """A canary split picked ``target`` for the request: it goes there, if its key may use it."""
        requested = ctx.model.name
        if target != requested and not ctx.allows_model(target):
            target = requested  # the key may not use the canary: it stays on the model it named
        self.shared.targets.labels(requested, target).inc()
        if target != requested:
            retarget(ctx, self._models[target])

    async def _admit(self, ctx: RequestContext, gate: ModelGate) -> None:
        """A place within the model's in-flight bound, queued by priority (a 429 or 503 past the queue's)."""
        model = ctx.model.name
        try:
            waited = await gate.acquire(ctx.priority, ctx.tenant or "")
        except Exception:
            self.shared.rejected.labels(model, "over_capacity").inc()
            raise
        if waited:
            self.shared.queue_wait.labels(model).observe(waited)

    async def _predict(self, ctx: RequestContext, route: ModelRoute | AdapterRoute) -> None:
        """precise_prefix: the prompt's blocks, for placing it and for checking the worker's answer (the
        only reason this plugin reads responses, and only their usage, so a stream keeps the byte
        pass-through: ``reads_stream_text``; every other request steps aside)."""
        placement = self._precise.get(route.model.name) if isinstance(route, ModelRoute) else None
        if placement is not None and isinstance(route, ModelRoute):
            route.precise = await placement.predict(ctx, route.pool)
            if route.precise is not None:
                ctx.state[STATE_KEY] = route.precise
                return
        ctx.step_aside(self)

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        request = ctx.state.get(STATE_KEY)
        if isinstance(request, PreciseRequest):
            request.placement.check(ctx, response)
        return None

    def _count_fallback(self, model: str, fallback: str) -> None:
        self.shared.fallbacks.labels(model, fallback).inc()

    def _count_budget_refused(self, model: str) -> None:
        self.shared.budget_exhausted.labels(model).inc()
