"""Prometheus metrics, all prefixed ``gateway_``, on a registry owned by the app (no global registry).

Several uvicorn worker processes: ``gateway serve --workers N`` points ``PROMETHEUS_MULTIPROC_DIR`` at a
fresh directory *before* uvicorn starts the processes (prometheus_client picks its value class when a
metric is first built, from that variable). Every process then writes its samples to memory-mapped files
there and ``/metrics``, served by any process, adds them up with ``MultiProcessCollector``: counters and
histograms sum, in-flight/queued gauges sum over live processes, health and config info take the max.

Private labels: a metric whose labels name who is calling (tenants, key ids) is marked with
``mark_private(metric, labels=...)``. ``render(private=False)`` (the public ``/metrics``) sums its
series over those labels (``gateway_tenancy_refusals_total{reason=...}`` stays, without ``tenant``);
only the admin port or a caller with the admin token sees them (``render(private=True)``).

Models and workers are the admin's too: the public rendering sums away every label in
``ADMIN_ONLY_LABELS`` (model and worker names, whatever the family; ``gateway_worker_healthy`` becomes
the number of healthy workers) and leaves out the families in ``ADMIN_ONLY_FAMILIES``. A caller without
a key may list no model, so no public series names one, and none moves differently for a request
naming a model that exists and one that does not (both stop at the same 401).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.ops.fast_metrics import CachedLabels

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Labels that name a model (an alias, a canary target, a fallback, an adapter) or a worker: summed away
#: on the public ``/metrics`` whatever the family, plugins' included.
ADMIN_ONLY_LABELS = frozenset({"model", "worker", "target", "fallback", "adapter"})
#: Families only the admin side shows. Which plugin hooks ran tells whether a request got past the
#: model lookup (``on_request``) or stopped at it (``on_models``): a model oracle without a key.
ADMIN_ONLY_FAMILIES = frozenset({"gateway_plugin_hook_duration_seconds"})

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class _StatusLabels(dict[int, str]):
    """``gateway_requests_total``'s ``status`` label for an answered HTTP status: ``STATUS_LABELS[status]``.

    A worker's own status below 500 reaches the client as it is, so naming every status would let one
    buggy or hostile worker add a series per code it invents (hundreds per model and route, held for the
    process's life). The statuses the gateway answers itself and those OpenAI's API documents are named;
    any other is counted under its class (``"4xx"``). A subscript, not a call: the request path pays one
    dict lookup, no more than ``str(status)`` did."""

    __slots__ = ()

    def __missing__(self, status: int) -> str:
        return f"{status // 100}xx"  # not stored: the mapping stays the fixed set below


#: 0 is a request that ended with no answer sent at all.
STATUS_LABELS = _StatusLabels(
    (status, str(status))
    for status in (0, 200, 400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 429, 499, 500, 502, 503, 504)
)


class Metrics:
    """Every metric the core exports. Plugins add their own through ``registry``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        #: Set when several processes share the metrics (see the module docstring).
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        self._version: str | None = None
        #: Metric family -> the labels only the admin may see (``mark_private``).
        self.private_labels: dict[str, frozenset[str]] = {}
        self._health_exported: set[str] = set()
        self._declare_requests(self.registry)
        self._declare_operations(self.registry)
        self._declare_adapters(self.registry)
        # The metrics touched by every request look each label set's child up once (CachedLabels);
        # their label values (models, routes, statuses, plugins, hooks) come from small sets.
        for name in ("requests", "latency", "ttft", "in_flight", "tpot", "tokens", "hook_duration"):
            setattr(self, name, CachedLabels(getattr(self, name)))
        #: The metrics with a ``worker`` label holding a worker's URL: ``forget_worker`` removes a gone
        #: worker's series from each. A plugin's own such metric joins the list.
        self.worker_metrics: list[Any] = [
            self.upstream_errors,
            self.worker_healthy,
            self.adapter_loads,
            self.adapter_evictions,
            self.adapter_load_seconds,
            self.adapter_retries,
        ]

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """What every request adds to: counts, latencies, tokens, the in-flight and queued gauges."""
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by model, route and HTTP status",
            ["model", "route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "gateway_request_duration_seconds",
            "Time from request to last byte",
            ["model", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Time to the first streamed chunk",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "gateway_in_flight_requests",
            "Requests being answered now, by model",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.queued = Gauge(
            "gateway_queued_requests",
            "Requests admitted but waiting for a worker slot, by model (the autoscaling signal); set by"
            " the plugin that queues",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tpot = Histogram(
            "gateway_time_per_output_token_seconds",
            "Streams: mean gap between output events after the first (approximately one token each)",
            ["model"],
            buckets=TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens reported by workers, by model and kind (prompt|completion)",
            ["model", "kind"],
            registry=r,
        )

    def _declare_operations(self, r: CollectorRegistry) -> None:
        """Workers, retries and resumptions, plugin hooks, managed workers' events, the config version."""
        self.upstream_errors = Counter(
            "gateway_upstream_errors",
            "Failures talking to workers, by worker and kind",
            ["worker", "kind"],
            registry=r,
        )
        self.retries = Counter("gateway_upstream_retries", "Requests retried on another worker", ["model"], registry=r)
        self.stream_resumptions = Counter(
            "gateway_stream_resumptions",
            "Streams continued on another worker after theirs failed midway, by model and reason (reset|idle|eof)",
            ["model", "reason"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "gateway_worker_healthy",
            "1 when a worker passes its health checks",
            ["worker"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.hook_duration = Histogram(
            "gateway_plugin_hook_duration_seconds",
            "Plugin hook time, by plugin, hook and outcome",
            ["plugin", "hook", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_worker_events = Counter(
            "gateway_engine_worker_events",
            "Lifecycle events of managed vLLM workers (ready, exited, restarting, restarted, restart_failed,"
            " failed, stopped), by worker and event",
            ["worker", "event"],
            registry=r,
        )
        self.config_info = Gauge(
            "gateway_config_info",
            "The running config version (value 1)",
            ["version"],
            registry=r,
            multiprocess_mode="livemax",
        )

    def _declare_adapters(self, r: CollectorRegistry) -> None:
        # LoRA adapters on workers (routing loads and evicts them). Adapter names may be a tenant's
        # own: the public /metrics sums them away, the admin side sees them.
        self.adapter_loads = Counter(
            "gateway_adapter_loads",
            "LoRA adapter loads on workers, by worker, adapter and outcome (ok|error)",
            ["worker", "adapter", "outcome"],
            registry=r,
        )
        self.adapter_evictions = Counter(
            "gateway_adapter_evictions",
            "LoRA adapters unloaded from workers, by worker, adapter and reason (lru|admin)",
            ["worker", "adapter", "reason"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "gateway_adapter_load_seconds", "Time to load a LoRA adapter on a worker", ["worker"], registry=r
        )
        # Not in gateway_upstream_retries: that one says workers fail; this one that replicas sharing
        # workers unload each other's adapters (or a worker restarted unseen), which the worker is not
        # to blame for.
        self.adapter_retries = Counter(
            "gateway_adapter_retries",
            "Requests retried on the same worker after it answered that it did not hold their LoRA adapter, "
            "which the gateway believed it held (the adapter loaded there again first), by worker and adapter",
            ["worker", "adapter"],
            registry=r,
        )
        self.mark_private(self.adapter_loads, self.adapter_evictions, self.adapter_retries, labels=("adapter",))

    # The pipeline's HookObserver (gateway.ops.tracing): gateway_plugin_hook_duration_seconds.
    def observe_hook(self, plugin: str, hook: str, outcome: str, seconds: float) -> None:
        self.hook_duration.labels(plugin, hook, outcome).observe(seconds)

    def hook_recorder(self, plugin: str, hook: str) -> Callable[[float], None]:
        observe: Callable[[float], None] = self.hook_duration.labels(plugin, hook, "ok").observe
        return observe

    def set_worker_health(self, health: dict[str, bool]) -> None:
        """Export each worker's health (1/0); a worker no longer in ``health`` stops being exported
        (in multiprocess mode its last value lingers in that process's file until it exits)."""
        for url in self._health_exported.difference(health):
            with contextlib.suppress(KeyError):
                self.worker_healthy.remove(url)
        for url, ok in health.items():
            self.worker_healthy.labels(url).set(1 if ok else 0)
        self._health_exported = set(health)

    def forget_worker(self, url: str) -> None:
        """Stop exporting every series of the worker at ``url``. The worker table calls this when a
        worker leaves it for good (discovery's answer no longer lists it, a reload removed it, and its
        last request has finished), not while it is only unhealthy or ejected: otherwise every address
        ever seen keeps its series, and on Kubernetes each rollout or scale event brings pods with new
        addresses, so /metrics grows for as long as the gateway runs. A worker that comes back starts
        new series (counters from 0: a reset to Prometheus). In multiprocess mode each process's file
        keeps the removed values until that process exits (prometheus_client cannot remove them)."""
        with warnings.catch_warnings():  # multiprocess mode's "not implemented": as said above
            warnings.simplefilter("ignore", UserWarning)
            for metric in self.worker_metrics:
                remove_series(metric, "worker", url)
        self._health_exported.discard(url)

    def declare_models(self, names: list[str]) -> None:
        """Give every configured model its in-flight and queued series from the start (at 0): a series
        that appears only once a request for a model got past the model lookup would tell, even summed,
        that a model named by a caller without a key exists."""
        for name in names:
            self.in_flight.labels(name)
            self.queued.labels(name)

    def set_config_version(self, version: str) -> None:
        # Zero the old series rather than remove it: in multiprocess mode a removed label set would
        # live on in this process's file with its last value.
        if self._version is not None and self._version != version:
            self.config_info.labels(self._version).set(0)
        self._version = version
        self.config_info.labels(version).set(1)

    def mark_private(self, *metrics: Any, labels: tuple[str, ...] = ("tenant", "key_id")) -> None:
        """These metrics' ``labels`` name who is calling: only ``render(private=True)`` shows them;
        the public rendering sums the series over them."""
        for metric in metrics:
            self.private_labels[metric._name] = frozenset(labels)

    def _source(self) -> Any:
        """The registry to read: this process's, or every process's files in multiprocess mode."""
        if self.multiprocess_dir is None:
            return self.registry
        source = CollectorRegistry()
        MultiProcessCollector(source, path=self.multiprocess_dir)
        return source

    def collect(self) -> Iterator[Metric]:
        """Every metric family with all its series (private labels included): for readers in the process
        (the console's live figures), which need numbers rather than exposition text."""
        yield from self._source().collect()

    def render(self, *, private: bool = False) -> bytes:
        """The exposition text; without ``private``, private labels are summed away."""
        source: Any = self._source()
        if not private:
            source = _PublicView(source, self.private_labels)
        return generate_latest(source)


def remove_series(metric: Any, label: str, value: str) -> None:
    """Remove every series of ``metric`` (a labelled metric or its ``CachedLabels``) whose ``label`` is
    ``value``, whatever its other labels. Reads the metric's series once: for rare events (a worker
    gone), not the request path."""
    names = tuple(metric._labelnames)  # prometheus_client's order of them, which remove() takes
    found = {
        tuple(sample.labels[name] for name in names)
        for family in metric.collect()
        for sample in family.samples
        if sample.labels.get(label) == value
    }
    for values in found:
        metric.remove(*values)


class _PublicView:
    """Another collector's families without the admin-only ones, with the private labels of the marked
    ones and the admin-only labels of all summed away."""

    def __init__(self, source: Any, private: dict[str, frozenset[str]]) -> None:
        self.source, self.private = source, private

    def collect(self) -> Any:
        for family in self.source.collect():
            if family.name in ADMIN_ONLY_FAMILIES:
                continue
            marked = self.private.get(family.name) or self.private.get(family.name.removesuffix("_total"))
            hidden = ADMIN_ONLY_LABELS | (marked or frozenset())
            if not any(hidden.intersection(sample.labels) for sample in family.samples):
                yield family
                continue
            sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # a creation time per hidden series: no sum of them means anything
                kept = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in hidden))
                sums[(sample.name, kept)] = sums.get((sample.name, kept), 0.0) + sample.value
            public = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, kept), value in sums.items():
                public.add_sample(name, dict(kept), value)
            yield public
