"""The tenancy plugin's Prometheus metrics: created once per process, kept in ``services.shared``.

Labels carry tenant names and key ids, never keys or digests; those labels are private
(``Metrics.mark_private``): the public ``/metrics`` sums them away (refusals by reason, tokens by kind,
admitted requests in all), the admin port and a scrape with the admin token see them.

A key's series go when the process learns the key is gone (``forget_key``): revoked here, found revoked
at a lookup, or dropped from config.yaml by a reload. Keys come and go through the admin API at will, so
series kept for every key ever seen would grow ``/metrics`` for as long as the process runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from prometheus_client import Counter

from gateway.ops.fast_metrics import CachedLabels
from gateway.ops.metrics import remove_series
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
        #: The key ids the live config.yaml declares (``config_live``): a reload that drops one forgets it.
        self._config_ids: frozenset[str] = frozenset()

    def forget_key(self, key_id: str) -> None:
        """Stop exporting the series of key ``key_id`` (gone for good: an id is never reused). Its cached
        child goes too, so a request still in flight when it went starts a new series rather than counting
        into one no scrape reads. In multiprocess mode each process's file keeps the removed values until
        that process exits (prometheus_client cannot remove them), as ``Metrics.forget_worker`` says."""
        with warnings.catch_warnings():  # multiprocess mode's "not implemented": as said above
            warnings.simplefilter("ignore", UserWarning)
            remove_series(self.admitted, "key_id", key_id)

    def config_live(self, key_ids: Iterable[str]) -> None:
        """A config declaring ``key_ids`` went live: forget the keys the previous live config declared and
        this one does not (their ids stay taken, ``plugins.tenancy.keys``, so they are gone for good)."""
        live = frozenset(key_ids)
        for key_id in self._config_ids - live:
            self.forget_key(key_id)
        self._config_ids = live

    @classmethod
    def of(cls, services: Services) -> TenancyMetrics:
        """The process's instance (reloads build new plugins; metrics must not be registered twice)."""
        metrics = services.shared.get(_SHARED)
        if metrics is None:
            metrics = services.shared[_SHARED] = cls(services)
        return metrics
