"""Optional: each worker's own view of its load, scraped from its Prometheus /metrics in the background.

The gateway's in-flight counters are exact but blind to what a worker holds for other gateway replicas
or how full its KV cache is. When enabled, least_outstanding adds
``waiting_weight * vllm:num_requests_waiting + kv_weight * vllm:kv_cache_usage_perc`` to a worker's
in-flight count. Samples older than ``max_age_s`` count as unknown (0), so a stale scrape never pins
traffic away from a worker. Scrapes never sit on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.ops.tasks import cancel_and_wait
from gateway.upstream.client import UpstreamClient
from gateway.upstream.worker_load import parse_vllm_load as parse_load
from gateway.upstream.workers import Worker, WorkerTable
from plugins.routing.config import LoadMetricsConfig

log = logging.getLogger("gateway.routing.load")


def parse_vllm_load(text: str) -> tuple[float, float]:
    """(requests waiting, KV cache usage 0..1) summed over the engines in one /metrics page."""
    sample = parse_load(text)
    return sample.waiting, sample.kv_usage


@dataclass(slots=True)
class _Sample:
    waiting: float
    kv_usage: float
    at: float


class WorkerLoadScraper:
    """Scrapes every worker in the table each ``interval_s``; ``bias(worker)`` is the extra load."""

    def __init__(
        self,
        config: LoadMetricsConfig,
        workers: WorkerTable,
        upstream: UpstreamClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.workers = workers
        self.upstream = upstream
        self._clock = clock
        self._samples: dict[str, _Sample] = {}
        self._task: asyncio.Task[None] | None = None

    def bias(self, worker: Worker) -> float:
        sample = self._samples.get(worker.url)
        if sample is None or self._clock() - sample.at > self.config.max_age_s:
            return 0.0
        return self.config.waiting_weight * sample.waiting + self.config.kv_weight * sample.kv_usage

    def record(self, url: str, waiting: float, kv_usage: float) -> None:
        self._samples[url] = _Sample(waiting, kv_usage, self._clock())

    async def scrape_once(self) -> None:
        workers = [w for w in self.workers.all() if w.available()]
        results = await asyncio.gather(*(self._scrape(w.url) for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, tuple):
                self.record(worker.url, *result)
        known = {w.url for w in self.workers.all()}
        for url in [u for u in self._samples if u not in known]:
            del self._samples[url]

    async def _scrape(self, url: str) -> tuple[float, float] | None:
        status, body = await self.upstream.get(url + "/metrics", timeout_s=self.config.timeout_s)
        if status != 200:
            return None
        return parse_vllm_load(body.decode("utf-8", "replace"))

    async def start(self) -> None:
        if self.config.enabled:
            self._task = asyncio.create_task(self._loop(), name="routing-load-scrape")

    async def _loop(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception:
                log.exception("worker load scrape failed")
            await asyncio.sleep(self.config.interval_s)

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
