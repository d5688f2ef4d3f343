"""What routing shares across config reloads: admission gates, retry budgets and its metrics.

Kept in ``services.shared["routing"]`` so a reload neither forgets requests already admitted (limits are
updated in place) nor registers its metrics twice.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.ops.metrics import LATENCY_BUCKETS
from gateway.pipeline.capacity import ADMISSION_OF, ModelAdmission
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.services import Services
from gateway.upstream.kv_index import BlockIndex
from gateway.upstream.workers import WorkerTable
from plugins.routing.accuracy import AccuracyTracker
from plugins.routing.adapter_loader import AdapterLoader
from plugins.routing.admission import ModelGate
from plugins.routing.cache_keys import KeyHomes
from plugins.routing.config import AdmissionConfig, RetryBudgetConfig
from plugins.routing.load_quota import ANONYMOUS, LoadQuota, TenantLoadBuckets
from plugins.routing.pending import PendingBlocks
from plugins.routing.plan import RetryBudget
from plugins.routing.prompt_tokens import PromptTokenizer

SHARED_KEY = "routing"
ADAPTERS_HELD = "gateway_worker_adapters"


class _WorkerCollector(Collector):
    """Per-worker load and health, read from the worker table when /metrics is scraped."""

    def __init__(self, workers: WorkerTable, gates: dict[str, ModelGate]) -> None:
        self.workers = workers
        self.gates = gates

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("gateway_worker_in_flight", "Requests at each worker now", labels=["worker"])
        ejected = GaugeMetricFamily(
            "gateway_worker_ejected", "1 while a worker is ejected after repeated failures", labels=["worker"]
        )
        ejections = GaugeMetricFamily(
            "gateway_worker_consecutive_ejections", "Ejections in a row without a success", labels=["worker"]
        )
        for worker in self.workers.all():
            in_flight.add_metric([worker.url], worker.in_flight)
            ejected.add_metric([worker.url], 0 if worker.available() or not worker.healthy else 1)
            ejections.add_metric([worker.url], worker.ejections)
        admitted = GaugeMetricFamily(
            "gateway_routing_admitted", "Requests holding an admission slot, by model", labels=["model"]
        )
        queued = GaugeMetricFamily("gateway_routing_queued", "Requests waiting for a slot, by model", labels=["model"])
        for name, gate in self.gates.items():
            admitted.add_metric([name], gate.in_flight)
            queued.add_metric([name], gate.queued)
        held = GaugeMetricFamily(
            ADAPTERS_HELD, "1 for each LoRA adapter a worker holds (as it says)", labels=["worker", "adapter"]
        )
        for worker in self.workers.all():
            for name in worker.adapters.held:
                held.add_metric([worker.url, name], 1)
        yield from (in_flight, ejected, ejections, admitted, queued, held)


class RoutingShared:
    """Process-wide routing state; one per ``Services``."""

    def __init__(self, services: Services) -> None:
        self.gates: dict[str, ModelGate] = {}
        self.budgets: dict[str, RetryBudget] = {}
        #: The routing plugin (``RoutingPlugin``) whose config is live (set by its ``went_live``): the one
        #: that may re-point the worker table's KV event and load feeds and forget discovered refs. Typed
        #: by the base class: ``plugin`` imports this module, and no module imports one that imports it back.
        self.live: Plugin | None = None
        r = services.metrics.registry
        self.rejected = Counter(
            "gateway_routing_rejected",
            "Requests refused by admission, health or their tenant's adapter load bound, by model and reason",
            ["model", "reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "gateway_routing_queue_wait_seconds",
            "Time admitted requests waited for a slot",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "gateway_routing_fallbacks", "Requests served by a fallback model", ["model", "fallback"], registry=r
        )
        self.targets = Counter(
            "gateway_routing_target",
            "Requests by requested model and the weighted target chosen",
            ["model", "target"],
            registry=r,
        )
        self.budget_exhausted = Counter(
            "gateway_routing_retry_budget_exhausted", "Retries refused by the retry budget", ["model"], registry=r
        )
        self._declare_precise_metrics(r)
        #: precise_prefix: per model, its predictions against the truth (kept across reloads).
        self.accuracy: dict[str, AccuracyTracker] = {}
        #: precise_prefix: per model, the blocks recently placed on each worker (its demand on the cache).
        self.demand: dict[str, BlockIndex] = {}
        #: precise_prefix: per model, the blocks placed on each worker whose KV events have not come yet.
        self.pending: dict[str, PendingBlocks] = {}
        #: precise_prefix: per model, where each prompt_cache_key lineage went last.
        self.homes: dict[str, KeyHomes] = {}
        #: precise_prefix: loaded tokenizers by (path, chat template), so a reload does not load them again.
        self.tokenizers: dict[tuple[str, str | None], PromptTokenizer] = {}
        r.register(_WorkerCollector(services.workers, self.gates))
        services.metrics.private_labels[ADAPTERS_HELD] = frozenset({"adapter"})
        self._queued_gauge = services.metrics.queued
        self._services = services
        self._loader: AdapterLoader | None = None
        #: Per tenant, the adapter loads this process started lately (``adapters.tenant_loads_per_minute``).
        self.tenant_loads = TenantLoadBuckets(0)
        services.shared[ADMISSION_OF] = self.admission_of

    def _declare_precise_metrics(self, r: CollectorRegistry) -> None:
        """precise_prefix: how its predictions compare with the workers' and how requests were placed."""
        self.prediction_error = Histogram(
            "gateway_routing_prefix_prediction_error_tokens",
            "precise_prefix: |predicted - reported cached prompt tokens| per checked request",
            ["model"],
            buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            registry=r,
        )
        self.prediction_within_block = Gauge(
            "gateway_routing_prefix_prediction_within_block",
            "precise_prefix: share of recent checked requests predicted within one KV block",
            ["model"],
            registry=r,
        )
        self.placement_degraded = Gauge(
            "gateway_routing_placement_degraded",
            "1 while precise_prefix falls back to approximate affinity (predictions disagree with the workers)",
            ["model"],
            registry=r,
        )
        self.placements = Counter(
            "gateway_routing_placements",
            "precise_prefix: requests placed, by how (precise, fallback) and why",
            ["model", "how"],
            registry=r,
        )

    def admission_of(self, model: str) -> ModelAdmission | None:
        """The model's admission now (the core's ``ADMISSION_OF``: the batch runner's idle check)."""
        gate = self.gates.get(model)
        if gate is None:
            return None
        return ModelAdmission(gate.in_flight, gate.limits.max_in_flight, gate.queued)

    @classmethod
    def of(cls, services: Services) -> RoutingShared:
        shared = services.shared.get(SHARED_KEY)
        if not isinstance(shared, cls):
            shared = services.shared[SHARED_KEY] = cls(services)
        return shared

    def gate(self, model: str, limits: AdmissionConfig) -> ModelGate:
        gate = self.gates.get(model)
        if gate is None:
            queued = self._queued_gauge
            gate = self.gates[model] = ModelGate(model, limits, lambda m, n: queued.labels(m).set(n))
        elif gate.limits is not limits and gate.limits != limits:  # pydantic's == walks every field
            gate.limits = limits
        return gate

    def loader(self, timeout_s: float) -> AdapterLoader:
        """The process's adapter loader (its single flights span config reloads)."""
        if self._loader is None:
            self._loader = AdapterLoader(self._services.upstream, self._services.metrics)
            self._services.workers.on_removed.append(self._loader.forget)
        self._loader.timeout_s = timeout_s
        return self._loader

    def load_quota(self, tenant: str | None) -> LoadQuota | None:
        """A request's share of its tenant's adapter loads (None: unbounded). The buckets outlive reloads;
        the live config sets their rate (``RoutingPlugin.went_live``)."""
        if not self.tenant_loads.per_minute:
            return None
        return LoadQuota(self.tenant_loads, tenant or ANONYMOUS, self._refused_load)

    def _refused_load(self, model: str) -> None:
        self.rejected.labels(model, "adapter_load_rate").inc()

    def budget(self, model: str, config: RetryBudgetConfig) -> RetryBudget:
        budget = self.budgets.get(model)
        if budget is None:
            budget = self.budgets[model] = RetryBudget(config)
        elif budget.config is not config and budget.config != config:
            budget.config = config
        return budget
