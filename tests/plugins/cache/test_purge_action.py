"""The cache's admin action (purge by namespace or model) and its metrics surviving a rebuild."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis

from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import WorkerTable
from gateway.wire.errors import InvalidRequest, NotFound
from plugins.cache import CacheConfig, CachePlugin
from plugins.cache.keys import make_key
from plugins.cache.store import encode_entry
from tests.support.cache import REDIS_URL, entry_names, namespace, redis_client
from tests.support.gateways import base_config

__all__ = ["namespace", "redis_client"]


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    built = Services(
        settings=Settings(redis_url=REDIS_URL),
        upstream=UpstreamClient(UpstreamConfig()),
        workers=WorkerTable(),
        metrics=Metrics(),
    )
    yield built
    await built.aclose()


async def fill(plugin: CachePlugin, namespace: str, models: list[str], per_model: int) -> None:
    for model in models:
        for i in range(per_model):
            key = make_key(
                prefix="gwcache",
                namespace=namespace,
                tenant=None,
                default_scope="public",
                endpoint="chat/completions",
                model=model,
                body={"messages": [{"role": "user", "content": str(i)}], "temperature": 0},
            )
            await plugin.store.store(key, encode_entry(b"{}", time.time()), 60_000, None)


async def test_purge_by_model_then_by_namespace(services: Services, namespace: str, redis_client: redis.Redis) -> None:
    plugin = CachePlugin(CacheConfig(namespace=namespace), services)
    other = CachePlugin(CacheConfig(namespace=namespace + "x"), services)
    try:
        await fill(plugin, namespace, ["m1", "m1:big", "m[2]"], 3)
        await fill(other, namespace + "x", ["m1"], 2)
        assert await plugin.on_admin("purge", {"model": "m1"}) == {"purged": 3, "namespace": namespace, "model": "m1"}
        assert len(entry_names(redis_client, namespace)) == 6  # "m1:big" is another model
        assert (await plugin.on_admin("purge", {"model": "m[2]"}))["purged"] == 3
        assert (await plugin.on_admin("purge", {}))["purged"] == 3
        assert entry_names(redis_client, namespace) == []
        assert len(entry_names(redis_client, namespace + "x")) == 2  # other namespaces untouched
        assert (await plugin.on_admin("purge", {"namespace": namespace + "x"}))["purged"] == 2
    finally:
        await plugin.aclose()
        await other.aclose()


async def test_purge_rejects_bad_arguments_and_unknown_actions(services: Services, namespace: str) -> None:
    plugin = CachePlugin(CacheConfig(namespace=namespace), services)
    with pytest.raises(InvalidRequest):
        await plugin.on_admin("purge", {"namespace": "a:*"})
    with pytest.raises(InvalidRequest):
        await plugin.on_admin("purge", {"model": 3})
    with pytest.raises(NotFound):
        await plugin.on_admin("flush", {})


async def test_a_rebuilt_plugin_reuses_metrics_and_breaker(services: Services, namespace: str) -> None:
    first = CachePlugin(CacheConfig(namespace=namespace), services)
    second = CachePlugin(CacheConfig(namespace=namespace + "b", breaker_failures=7), services)  # a reload
    assert second.metrics is first.metrics
    assert second.store.breaker is first.store.breaker and first.store.breaker.failures == 7


async def test_purge_by_an_alias_purges_the_models_entries(
    services: Services, namespace: str, redis_client: redis.Redis
) -> None:
    """Entries are kept under the model's name; a purge naming one of its aliases purges them."""
    plugin = CachePlugin(CacheConfig(namespace=namespace), services)
    plugin.prepare(GatewayConfig.model_validate(base_config(["http://127.0.0.1:1"])))  # m1, alias "alias-1"
    try:
        await fill(plugin, namespace, ["m1", "m2"], 2)
        assert await plugin.on_admin("purge", {"model": "alias-1"}) == {
            "purged": 2, "namespace": namespace, "model": "m1",
        }  # fmt: skip
        assert (await plugin.on_admin("purge", {"model": "m2"}))["purged"] == 2  # not in the config: as given
        assert entry_names(redis_client, namespace) == []
    finally:
        await plugin.aclose()
