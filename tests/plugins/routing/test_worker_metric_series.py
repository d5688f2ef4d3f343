"""A worker's metric series live as long as the worker table holds it: a worker discovery no longer
finds (a pod replaced by a rollout, with a new address) or a reload removes takes its series with it, so
/metrics does not grow with every address ever seen. One only unhealthy, or kept through a failed lookup,
keeps them; one that comes back starts new ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.adapters import AdapterConfig, LoraSettings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import WorkerTable
from plugins.routing.adapter_loader import AdapterLoader
from plugins.routing.discovery import DnsDiscovery
from plugins.routing.telemetry import RoutingShared
from tests.support.gateways import base_config

REF = "dns://vllm-worker.ns.svc:8000"


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    built = Services(Settings(), UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
    RoutingShared.of(built)  # routing's per-worker gauges, read from the table at each scrape
    yield built
    await built.aclose()


def serve(services: Services) -> None:
    """What traffic leaves in each live worker's series: a failure, an adapter loaded, evicted and found
    unloaded behind the gateway (a retry there), its health exported (as ``GET /health`` does)."""
    metrics = services.metrics
    for worker in services.workers.all():
        metrics.upstream_errors.labels(worker.url, "connect").inc()
        metrics.adapter_loads.labels(worker.url, "sql-lora", "ok").inc()
        metrics.adapter_evictions.labels(worker.url, "sql-lora", "lru").inc()
        metrics.adapter_load_seconds.labels(worker.url).observe(0.2)
        metrics.adapter_retries.labels(worker.url, "sql-lora").inc()
    metrics.set_worker_health({w.url: w.available() for w in services.workers.all()})


def series_by_worker(metrics: Metrics) -> dict[str, int]:
    """Worker URL -> how many label sets name it in the registry (a histogram's buckets counted once)."""
    found: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            if "worker" in sample.labels:
                found.add((family.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))))
    counts: dict[str, int] = {}
    for _, labels in found:
        worker = dict(labels)["worker"]
        counts[worker] = counts.get(worker, 0) + 1
    return counts


async def test_fifty_replaced_pods_leave_only_the_live_workers_series(services: Services) -> None:
    pods = ["10.2.0.1", "10.2.0.2"]
    failing = False

    async def resolver(host: str, port: int) -> list[str]:
        if failing:
            raise OSError("SERVFAIL")
        return list(pods)

    discovery = DnsDiscovery(services.workers, [REF], interval_s=60, timeout_s=1, resolver=resolver)
    await discovery.refresh()
    serve(services)
    per_worker = series_by_worker(services.metrics)["http://10.2.0.1:8000"]
    for i in range(50):  # a rolling update: each pod in turn replaced by one with a new address
        pods[i % 2] = f"10.3.0.{i + 1}"
        await discovery.refresh()
        serve(services)
    live = {w.url for w in services.workers.all()}
    assert live == {"http://10.3.0.49:8000", "http://10.3.0.50:8000"}
    assert series_by_worker(services.metrics) == dict.fromkeys(live, per_worker)

    # Unhealthy, ejected, or kept through a failed lookup: still a worker, its series stay.
    unhealthy = services.workers.get("http://10.3.0.49:8000")
    services.workers.set_health(unhealthy, False, "connection refused")
    failing = True
    await discovery.refresh()
    serve(services)
    assert series_by_worker(services.metrics) == dict.fromkeys(live, per_worker)
    failing = False

    # Dropped from the answer while a request is still at it: its series go when that request ends.
    busy = services.workers.get("http://10.3.0.50:8000")
    busy.in_flight = 1
    pods[:] = ["10.3.0.49"]
    await discovery.refresh()
    assert "http://10.3.0.50:8000" in series_by_worker(services.metrics)
    busy.in_flight = 0
    services.workers.all()  # the health loop's next round notices
    assert set(series_by_worker(services.metrics)) == {"http://10.3.0.49:8000"}

    # A pod that comes back (same address) starts new series, which /metrics shows.
    pods[:] = ["10.3.0.49", "10.3.0.50"]
    await discovery.refresh()
    services.metrics.upstream_errors.labels("http://10.3.0.50:8000", "connect").inc()
    sample = services.metrics.registry.get_sample_value(
        "gateway_upstream_errors_total", {"worker": "http://10.3.0.50:8000", "kind": "connect"}
    )
    assert sample == 1


async def test_a_worker_removed_by_a_config_reload_takes_its_series(services: Services) -> None:
    holder = RuntimeHolder(PluginRegistry(discover=False), services)
    await holder.load(GatewayConfig.model_validate(base_config(["http://a:8000", "http://b:8000"], plugins=[])))
    serve(services)
    assert set(series_by_worker(services.metrics)) == {"http://a:8000", "http://b:8000"}
    await holder.load(GatewayConfig.model_validate(base_config(["http://a:8000"], plugins=[])))
    serve(services)
    assert set(series_by_worker(services.metrics)) == {"http://a:8000"}
    await holder.aclose()


ADAPTER = AdapterConfig(name="sql-lora", path="/adapters/sql")


class _Loaded:
    status = 200

    async def read_at_most(self, max_bytes: int) -> bytes:
        return b"Success"


class LoraWorkers:
    """Workers' ``/v1/load_lora_adapter`` as the loader calls it: each load succeeds, once ``hold`` is set."""

    config = UpstreamConfig()  # the bounds the loader reads its answers with

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.hold.set()
        self.reached = asyncio.Event()  # a load is at the worker

    async def open(self, url: str, path: str, body: bytes) -> _Loaded:
        self.reached.set()
        await self.hold.wait()
        return _Loaded()


def adapter_loader(services: Services, workers: LoraWorkers) -> AdapterLoader:
    loader = RoutingShared.of(services).loader(60.0)
    loader.upstream = workers  # type: ignore[assignment]
    return loader


async def test_replaced_pods_leave_no_adapter_lock_behind(services: Services) -> None:
    pods = ["10.4.0.1", "10.4.0.2"]

    async def resolver(host: str, port: int) -> list[str]:
        return list(pods)

    loader = adapter_loader(services, LoraWorkers())
    discovery = DnsDiscovery(services.workers, [REF], interval_s=60, timeout_s=1, resolver=resolver)
    for i in range(50):  # a rolling update; every live pod loads the adapter
        pods[i % 2] = f"10.5.0.{i + 1}"
        await discovery.refresh()
        for worker in services.workers.all():
            await loader.ensure(worker, ADAPTER, LoraSettings())
    live = {w.url for w in services.workers.all()}
    assert live == {"http://10.5.0.49:8000", "http://10.5.0.50:8000"}
    assert set(loader._locks) == live


async def test_a_load_that_lands_after_its_worker_left_leaves_no_series(services: Services) -> None:
    pods = ["10.6.0.1", "10.6.0.2"]

    async def resolver(host: str, port: int) -> list[str]:
        return list(pods)

    workers = LoraWorkers()
    loader = adapter_loader(services, workers)
    discovery = DnsDiscovery(services.workers, [REF], interval_s=60, timeout_s=1, resolver=resolver)
    await discovery.refresh()
    leaving = services.workers.get("http://10.6.0.1:8000")
    workers.hold.clear()
    load = asyncio.create_task(loader.ensure(leaving, ADAPTER, LoraSettings()))
    await workers.reached.wait()
    pods[:] = ["10.6.0.2"]  # the pod goes while its load is in progress (no request in flight on it)
    await discovery.refresh()
    assert "http://10.6.0.1:8000" not in {w.url for w in services.workers.all()}
    workers.hold.set()
    await load
    await loader.ensure(services.workers.get("http://10.6.0.2:8000"), ADAPTER, LoraSettings())
    assert set(series_by_worker(services.metrics)) == {"http://10.6.0.2:8000"}
    assert set(loader._locks) == {"http://10.6.0.2:8000"}

    # The same address back in the table: its loads count again.
    pods[:] = ["10.6.0.1", "10.6.0.2"]
    await discovery.refresh()
    await loader.ensure(services.workers.get("http://10.6.0.1:8000"), ADAPTER, LoraSettings())
    assert "http://10.6.0.1:8000" in series_by_worker(services.metrics)
