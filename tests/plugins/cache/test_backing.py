"""The cache key names the model's backing: a config that changes the model's served name or its
workers makes older entries unreachable at once (no scan, no purge), and an answer a fallback model
produced is never stored under the requested model's key."""

from __future__ import annotations

import httpx
import orjson
import redis

from plugins.cache.keys import backing_of, make_key
from tests.plugins.routing.test_through_the_gateway import dead_url
from tests.support.cache import PLUGINS, cache_gateway_config, chat, entry_names, namespace, redis_client, wait_stored
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]  # fixtures used by name below


def reload(url: str, config: dict[str, object]) -> None:
    reply = httpx.put(url + "/admin/config", content=orjson.dumps(config), headers={"authorization": "Bearer adm"})
    assert reply.status_code == 200, reply.text


def test_a_new_served_name_or_worker_set_misses_the_old_entries(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    config = cache_gateway_config(upstream_url, namespace)
    with gateway_factory(config, plugins=PLUGINS, admin_token="adm") as (_, server):
        assert chat(server.url).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace)
        assert chat(server.url).headers["x-cache"] == "hit"
        config["models"][0]["served_name"] = "m1-v2"  # the same gateway name, other weights behind it
        reload(server.url, config)
        assert chat(server.url).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace, count=2)
        config["models"][0]["workers"] = [upstream_url, upstream_url.replace("127.0.0.1", "localhost")]
        reload(server.url, config)
        assert chat(server.url).headers["x-cache"] == "miss"
        config["models"][0]["workers"] = [upstream_url]
        reload(server.url, config)
        assert chat(server.url).headers["x-cache"] == "hit"  # back to a backing that has its entry
    assert [seen.body["model"] for seen in upstream.requests] == ["m1", "m1-v2", "m1-v2"]


def test_backing_hash_names_served_name_workers_and_managed_models() -> None:
    base = backing_of("m1", ["http://a", "http://b"], {})
    assert base == backing_of("m1", ["http://b", "http://a"], {})  # order of workers does not matter
    assert base != backing_of("m1-v2", ["http://a", "http://b"], {})
    assert base != backing_of("m1", ["http://a"], {})
    assert backing_of("m1", ["cpu-0"], {"cpu-0": "smollm2"}) != backing_of("m1", ["cpu-0"], {"cpu-0": "qwen"})
    args = {"prefix": "p", "namespace": "n", "tenant": None, "default_scope": "s", "endpoint": "e", "model": "m1"}
    body = {"messages": []}
    assert make_key(**args, body=body, backing=base).entry != make_key(**args, body=body, backing="other").entry


def test_an_answer_from_a_fallback_is_not_stored_under_the_requested_model(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    config = cache_gateway_config(dead_url(), namespace)
    config["plugins"][-1] = {"name": "routing", "config": {"models": {"m1": {"fallbacks": ["m2"]}}}}
    config["models"].append({"name": "m2", "workers": [upstream_url]})
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        first = chat(server.url)
        second = chat(server.url)
    assert first.status_code == second.status_code == 200
    assert [seen.body["model"] for seen in upstream.requests] == ["m2", "m2"]  # never answered from m1's key
    assert entry_names(redis_client, namespace) == []
