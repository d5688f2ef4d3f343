"""The tenancy plugin's Prometheus metrics: created once per process, kept in ``services.shared``.

Labels carry tenant names and key ids, never keys or digests; those labels are private
(``Metrics.mark_private``): the public ``/metrics`` sums them away (refusals by reason, tokens by kind,
admitted requests in all), the admin port and a scrape with the admin token see them.
"""

from __future__ import annotations

from prometheus_client import Counter

from gateway.ops.fast_metrics import CachedLabels
from gateway.pipeline.services import Services

_SHARED = "tenancy.metrics"


class TenancyMetrics:
    def __init__(self, services: Services) -> None:
        r = services.metrics.registry
        # Counted on every request: each child looked up once (as many as prometheus_client keeps anyway).
        self.admitted = CachedLabels(
            Counter(
                "gateway_tenancy_requests", "Requests admitted, by tenant and key id", ["tenant", "key_id"], registry=r
            )
        )
        self.tokens = CachedLabels(
            Counter(
                "gateway_tenancy_tokens",
                "Tokens used, by tenant and kind (prompt|completion)",
                ["tenant", "kind"],
                registry=r,
            )
        )
        self.refusals = Counter(
            "gateway_tenancy_refusals",
            "Requests refused by tenancy, by tenant ('-' when unknown) and reason",
            ["tenant", "reason"],
            registry=r,
        )
        services.metrics.mark_private(self.admitted.metric, self.tokens.metric, self.refusals)
        self.redis_errors = Counter(
            "gateway_tenancy_redis_errors", "Redis calls that failed, by operation", ["op"], registry=r
        )

    @classmethod
    def of(cls, services: Services) -> TenancyMetrics:
        """The process's instance (reloads build new plugins; metrics must not be registered twice)."""
        metrics = services.shared.get(_SHARED)
        if metrics is None:
            metrics = services.shared[_SHARED] = cls(services)
        return metrics
