"""Cache paths the other cache tests leave alone: lookups without single-flight, answers that are not
stored (too large, not finished), and purges that span many SCAN batches or meet an unreachable Redis."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis

from plugins.cache.config import CacheConfig
from plugins.cache.keys import entry_pattern
from plugins.cache.policy import decide
from tests.plugins.cache.test_single_flight import burst
from tests.support.cache import (
    PLUGINS,
    PREFIX,
    cache_gateway_config,
    chat,
    entry_names,
    namespace,
    redis_client,
    wait_stored,
)
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory
from tests.wire.test_error_shape import assert_error_shape

__all__ = ["namespace", "redis_client"]  # fixtures, used by name

TOKEN = "cover-cache-token"


def not_stored(server: ServerThread, reason: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("gateway_cache_not_stored_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def purge(server: ServerThread, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        server.url + "/admin/plugins/cache/purge", json=body, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30
    )


async def test_without_single_flight_a_miss_is_stored_and_then_hit(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    config = cache_gateway_config(upstream_url, namespace, coalesce=False)
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        first = (await burst([server.url], 1))[0]
        assert first.headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace)
        second = (await burst([server.url], 1))[0]
        assert second.headers["x-cache"] == "hit"
        assert {**second.json(), "id": "", "created": 0} == {**first.json(), "id": "", "created": 0}
        assert len(upstream.requests) == 1
        # ... but identical concurrent misses each go to the engine: nobody leads, nobody waits
        upstream.behavior.delay_s = 1.0  # all three are looked up while the first is still computed
        replies = await burst([server.url], 3, max_tokens=7)
        assert [r.headers["x-cache"] for r in replies] == ["miss"] * 3
    assert len(upstream.requests) == 4


def test_an_answer_larger_than_max_value_bytes_is_served_but_not_stored(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    upstream.behavior.text = "long answer " * 50
    config = cache_gateway_config(upstream_url, namespace, max_value_bytes=256)
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        assert chat(server.url).json()["choices"][0]["message"]["content"] == upstream.behavior.text
        assert chat(server.url).headers["x-cache"] == "miss"
        assert not_stored(server, "too_large") == 2
    assert entry_names(redis_client, namespace) == []
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("finish_reason", ["abort", "error", None])
def test_an_answer_that_did_not_finish_normally_is_not_stored(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    finish_reason: str | None,
) -> None:
    upstream.behavior.finish_reason = finish_reason  # type: ignore[assignment]
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        assert chat(server.url).status_code == 200
        assert not_stored(server, "incomplete") == 1
        assert chat(server.url).headers["x-cache"] == "miss"  # the lock was released: no wait, no hit
    assert entry_names(redis_client, namespace) == []


def test_a_purge_larger_than_one_scan_batch_deletes_everything_of_the_namespace(
    gateway_factory: GatewayFactory, upstream_url: str, namespace: str, redis_client: redis.Redis
) -> None:
    base = entry_pattern(PREFIX, namespace, None).removesuffix("*")
    with redis_client.pipeline(transaction=False) as pipe:
        for i in range(1234):
            pipe.set(f"{base}m1:{i:05d}", b"x", ex=300)
        pipe.execute()
    other = f"{PREFIX}:{namespace}x:e:m1:keep"  # a namespace that only shares a prefix
    redis_client.set(other, b"x", ex=300)
    try:
        config = cache_gateway_config(upstream_url, namespace)
        with gateway_factory(config, plugins=PLUGINS, admin_token=TOKEN) as (_, server):
            response = purge(server, {})
            assert response.status_code == 200, response.text
            assert response.json()["result"] == {"purged": 1234, "namespace": namespace, "model": None}
        assert entry_names(redis_client, namespace) == []
        assert redis_client.exists(other) == 1
    finally:
        redis_client.delete(other)


def test_a_purge_while_redis_is_unreachable_is_a_503(gateway_factory: GatewayFactory, upstream_url: str) -> None:
    config = cache_gateway_config(upstream_url, "unreachable")
    with gateway_factory(config, plugins=PLUGINS, admin_token=TOKEN, redis_url="redis://127.0.0.1:1/0") as (_, server):
        assert chat(server.url).headers["x-cache"] == "bypass"  # requests go on without the cache
        error = assert_error_shape(purge(server, {"model": "m1"}), 503)
        assert error["code"] == "cache_unavailable" and "not purged" in error["message"]


def test_a_stream_asking_for_usage_on_every_event_stays_out_of_the_cache(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    """vLLM's ``continuous_usage_stats`` puts usage on every event: neither a stored answer nor recorded
    events would replay that shape to a client asking otherwise, so such a stream is neither looked up nor
    stored, and the same request without it is not answered from it."""
    continuous = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        for _ in range(2):
            reply = chat(server.url, **continuous)
            assert reply.status_code == 200 and reply.headers["x-cache"] == "bypass"
        assert chat(server.url, stream=True).headers["x-cache"] == "miss"
    assert len(upstream.requests) == 3
    assert decide(CacheConfig(), "chat/completions", "m1", {"temperature": 0, **continuous}, {}).reason == (
        "continuous_usage"
    )
