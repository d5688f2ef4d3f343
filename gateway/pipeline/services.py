"""Process-wide services shared by every config snapshot: they outlive reloads.

Plugins receive this object in their constructor instead of reaching for globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from gateway.infra.redis_autopipe import AutoPipeline
from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.upstream.client import UpstreamClient
from gateway.upstream.workers import WorkerTable

if TYPE_CHECKING:
    from gateway.ops.tracing import Tracing


@dataclass
class Services:
    settings: Settings
    upstream: UpstreamClient
    workers: WorkerTable
    metrics: Metrics
    #: Free-form registry for things plugins share across reloads (e.g. a compiled-schema LRU, a
    #: circuit breaker), keyed by the plugin's name. Survives config swaps; closed on shutdown only.
    shared: dict[str, Any] = field(default_factory=dict)
    #: OpenTelemetry tracing, or None when no OTLP endpoint is configured (the default: no cost).
    tracing: Tracing | None = None
    _redis: dict[tuple[float, float], aioredis.Redis] = field(default_factory=dict)
    _pipelines: dict[tuple[float, float], AutoPipeline] = field(default_factory=dict)

    def redis(self, *, socket_timeout_s: float = 0.25, connect_timeout_s: float = 0.25) -> aioredis.Redis:
        """A pooled Redis client for ``settings.redis_url`` with these timeouts (one pool per pair).

        Every call on it is bounded; callers decide what a failure means (cache: fail open; limits:
        their configured policy).
        """
        key = (socket_timeout_s, connect_timeout_s)
        client = self._redis.get(key)
        if client is None:
            client = aioredis.Redis.from_url(
                self.settings.redis_url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=connect_timeout_s,
                health_check_interval=0,
                retry_on_timeout=False,
            )
            self._redis[key] = client
        return client

    def redis_pipeline(self, *, socket_timeout_s: float = 0.25, connect_timeout_s: float = 0.25) -> AutoPipeline:
        """Commands on ``redis(...)`` with these timeouts, batched per event-loop turn (one per pair)."""
        key = (socket_timeout_s, connect_timeout_s)
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            client = self.redis(socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s)
            pipeline = self._pipelines[key] = AutoPipeline(client)
        return pipeline

    async def aclose(self) -> None:
        for pipeline in self._pipelines.values():
            await pipeline.aclose()
        self._pipelines.clear()
        for client in self._redis.values():
            await client.aclose()
        self._redis.clear()
        await self.workers.aclose()
        await self.upstream.aclose()
