"""Routing: choose the worker for each request among the workers of its model.

This is the minimal policy (round robin over healthy workers, retry on another worker when a failure
happened before any byte reached the client). It hands its choice to the core as a ``RoutePlan``.
"""

from __future__ import annotations

import itertools
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.context import ModelResponse, RequestContext
from gateway.errors import GatewayError
from gateway.pipeline import Plugin
from gateway.services import Services
from gateway.workers import Worker


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Literal["round_robin"] = "round_robin"
    max_attempts: int = Field(3, ge=1, le=10, description="tries per request, each on a different worker")


class RoundRobinPlan:
    """Round robin over the available workers; a retry never returns to a worker that failed."""

    __slots__ = ("_attempts", "_candidates", "_max_attempts", "_start", "_tried")

    def __init__(self, candidates: list[Worker], start: int, max_attempts: int) -> None:
        self._candidates = candidates
        self._start = start
        self._max_attempts = max_attempts
        self._tried: list[Worker] = []
        self._attempts = 0

    def next_worker(self, failed: Worker | None, error: GatewayError | None) -> Worker | None:
        if self._attempts >= self._max_attempts or not self._candidates:
            return None
        now = time.monotonic()
        n = len(self._candidates)
        for offset in range(n):
            worker = self._candidates[(self._start + self._attempts + offset) % n]
            if worker not in self._tried and worker.available(now):
                self._tried.append(worker)
                self._attempts += 1
                return worker
        return None

    def finished(self, worker: Worker, *, ok: bool, error: GatewayError | None = None) -> None:
        return None


class RoutingPlugin(Plugin):
    name = "routing"
    Config = RoutingConfig

    def __init__(self, config: RoutingConfig, services: Services) -> None:
        super().__init__(config, services)
        self._counter = itertools.count()

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        workers = self.services.workers
        urls = ctx.snapshot.models.worker_urls[ctx.model.name]
        candidates = [workers.get(url) for url in urls]
        ctx.plan = RoundRobinPlan(candidates, next(self._counter), self.config.max_attempts)
        return None
