"""The cache's Prometheus metrics, created once per process on the app's registry.

They live in ``services.shared`` (see ``shared.shared_state``) so a config reload, which builds a new
plugin instance, reuses them instead of registering the same names twice.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.ops.fast_metrics import CachedLabels

HIT_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits = Counter("gateway_cache_hits", "Requests answered from the cache", ["model"], registry=r)
        self.misses = Counter("gateway_cache_misses", "Cacheable requests sent to the engine", ["model"], registry=r)
        self.bypasses = Counter(
            "gateway_cache_bypasses",
            "Requests the cache stayed out of, by reason (nondeterministic, cache_control, redis, ...)",
            ["model", "reason"],
            registry=r,
        )
        self.stores = Counter("gateway_cache_stores", "Answers written to the cache", ["model"], registry=r)
        self.not_stored = Counter(
            "gateway_cache_not_stored",
            "Answers not written, by reason (incomplete, clamped, resumed, too_large, backlog, no_store, bad_usage)",
            ["model", "reason"],
            registry=r,
        )
        self.errors = Counter("gateway_cache_errors", "Redis failures and timeouts, by operation", ["op"], registry=r)
        self.bytes = Counter(
            "gateway_cache_bytes", "Cached answer bytes, by direction (stored|served)", ["direction"], registry=r
        )
        self.hit_latency = Histogram(
            "gateway_cache_hit_duration_seconds",
            "Time the cache hook spends answering a hit (key, Redis round trip)",
            ["model"],
            buckets=HIT_LATENCY_BUCKETS,
            registry=r,
        )
        self.coalesced = Counter(
            "gateway_cache_coalesced",
            "Requests that waited for an identical in-flight request, by outcome",
            ["model", "outcome"],
            registry=r,
        )
        # The labelled ones are on the request path: their children are looked up once per label set.
        labelled = ("hits", "misses", "bypasses", "stores", "not_stored", "errors", "bytes", "hit_latency", "coalesced")
        for name in labelled:
            setattr(self, name, CachedLabels(getattr(self, name)))
        self.breaker_open = Gauge(
            "gateway_cache_breaker_open",
            "1 while the Redis circuit breaker is open",
            registry=r,
            multiprocess_mode="livemax",
        )
