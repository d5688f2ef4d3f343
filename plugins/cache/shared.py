"""The cache's state that outlives a config reload: its metrics, its Redis circuit breaker, the
single-flight leaders of this process, the entries it is giving their body and its lock tokens (kept in
``services.shared``)."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field

from gateway.pipeline.services import Services
from plugins.cache.breaker import CircuitBreaker
from plugins.cache.config import CacheConfig
from plugins.cache.flight import LocalLeaders
from plugins.cache.metrics import CacheMetrics

#: The key of this state in ``services.shared``, and of a request's pending store in ``ctx.state``.
SHARED_KEY = "cache"


@dataclass
class CacheShared:
    """Per-process cache state that outlives config reloads (kept in ``services.shared``)."""

    metrics: CacheMetrics
    breaker: CircuitBreaker
    leaders: LocalLeaders = field(default_factory=LocalLeaders)
    # The Redis keys of the entries this process is writing back with their body (``CacheWrites.keep_body``):
    # concurrent hits on one entry of events only send one rewrite, not one each.
    replacing: set[str] = field(default_factory=set)
    reported_open: bool = False
    # Lock tokens only need to be unique among every process sharing the Redis (they never leave the
    # gateway): a random prefix per process and a counter, instead of the OS random source per miss.
    _token_prefix: bytes = field(default_factory=lambda: secrets.token_bytes(12))
    _token_counter: itertools.count[int] = field(default_factory=itertools.count)

    def lock_token(self) -> bytes:
        return self._token_prefix + next(self._token_counter).to_bytes(8, "big")


def shared_state(services: Services, config: CacheConfig) -> CacheShared:
    shared = services.shared.get(SHARED_KEY)
    if shared is None:
        shared = CacheShared(
            metrics=CacheMetrics(services.metrics.registry),
            breaker=CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s),
        )
        services.shared[SHARED_KEY] = shared
    else:
        shared.breaker.configure(config.breaker_failures, config.breaker_cooldown_s)
    assert isinstance(shared, CacheShared)
    return shared
