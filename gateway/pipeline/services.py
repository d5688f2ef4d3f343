"""Process-wide services shared by every config snapshot: they outlive reloads.

Plugins receive this object in their constructor instead of reaching for globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from gateway.infra.redis_api import RedisPipeline
from gateway.infra.redis_autopipe import AutoPipeline
from gateway.infra.redis_py import RedisPyPipeline
from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.recordings import RecordingPool
from gateway.upstream.client import UpstreamClient
from gateway.upstream.workers import WorkerTable

if TYPE_CHECKING:
    from gateway.ops.tracing import Tracing

#: ``shared[TENANT_OF]``: registered by the plugin that knows who is calling (tenancy), an
#: ``async (headers) -> tenant`` that raises a ``GatewayError`` (401) for missing or bad credentials. What
#: the core keeps per caller (stored Responses) is scoped by it; without it, every caller shares one scope.
TENANT_OF = "tenant_of"


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
    #: The room every stream being recorded for the cache may hold together (``GATEWAY_MAX_RECORDING_BYTES``).
    recordings: RecordingPool = field(init=False)
    _redis: dict[tuple[float, float], aioredis.Redis] = field(default_factory=dict)
    _pipelines: dict[tuple[float, float], RedisPipeline] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.recordings = RecordingPool(self.settings.max_recording_bytes)
        # A worker gone from the table for good takes its metric series with it: workers discovered
        # through DNS change address with every pod, and kept series would grow without bound. Once: a
        # copy (``dataclasses.replace``, one per multipart request) runs this again on the same table.
        if self.metrics.forget_worker not in self.workers.on_removed:
            self.workers.on_removed.append(self.metrics.forget_worker)

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

    def redis_pipeline(self, *, socket_timeout_s: float = 0.25, connect_timeout_s: float = 0.25) -> RedisPipeline:
        """Commands on ``redis(...)`` with these timeouts, batched per event-loop turn (one per pair), by the
        implementation ``settings.redis_client`` names (``gateway.infra.redis_api`` has the contract)."""
        key = (socket_timeout_s, connect_timeout_s)
        existing = self._pipelines.get(key)
        if existing is not None:
            return existing
        client = self.redis(socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s)
        pipeline: RedisPipeline = (
            RedisPyPipeline(client) if self.settings.redis_client == "redis-py" else AutoPipeline(client)
        )
        self._pipelines[key] = pipeline
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
