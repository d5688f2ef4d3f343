"""Prometheus metrics, all prefixed ``gateway_``, on a registry owned by the app (no global registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class Metrics:
    """Every metric the core exports. Plugins add their own through ``registry``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
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
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens reported by workers, by model and kind (prompt|completion)",
            ["model", "kind"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors",
            "Failures talking to workers, by worker and kind",
            ["worker", "kind"],
            registry=r,
        )
        self.retries = Counter("gateway_upstream_retries", "Requests retried on another worker", ["model"], registry=r)
        self.worker_healthy = Gauge(
            "gateway_worker_healthy",
            "1 when a worker passes its health checks",
            ["worker"],
            registry=r,
            multiprocess_mode="max",
        )
        self.hook_duration = Histogram(
            "gateway_plugin_hook_duration_seconds",
            "Plugin hook time, by plugin, hook and outcome",
            ["plugin", "hook", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.config_info = Gauge(
            "gateway_config_info",
            "The running config version (value 1)",
            ["version"],
            registry=r,
            multiprocess_mode="max",
        )

    def observe_hook(self, plugin: str, hook: str, outcome: str, seconds: float) -> None:
        self.hook_duration.labels(plugin, hook, outcome).observe(seconds)

    def set_config_version(self, version: str) -> None:
        self.config_info.clear()
        self.config_info.labels(version).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
