"""The cache and the plugins that check answers, in either order in ``plugins``, through the gateway
with real Redis. ``on_request`` runs in list order and ``on_response`` / ``on_chunk`` in reverse, so:

- guided_json listed before the cache would have the cache keep each answer before guided_json retried
  it, refused it or marked it no-store; such a config is refused (``Plugin.replaces_answers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis

from plugins.cache import CachePlugin
from plugins.guided_json import GuidedJSONPlugin
from plugins.safety import SafetyPlugin
from tests.plugins.cache.test_with_guided_json import VALID, LimitedWorker, _chat, _whole
from tests.support.cache import namespace, redis_client, wait_stored
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

PLUGINS = {"cache": CachePlugin, "guided_json": GuidedJSONPlugin, "safety": SafetyPlugin}
ANSWER = "the code is zz1234, keep it"
REDACT = {"id": "codes", "kind": "pattern", "patterns": ["zz[0-9]+"], "action": "redact", "apply_to": ["output"]}
BLOCK = {**REDACT, "action": "block"}


def _sections(namespace: str, order: list[str], rule: dict[str, Any]) -> list[dict[str, Any]]:
    sections = {
        "cache": {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 100}},
        "guided_json": {"name": "guided_json", "config": {"probe": False}},
        "safety": {"name": "safety", "config": {"rules": [rule]}},
    }
    return [sections[name] for name in order] + [{"name": "routing"}]


@pytest.fixture
def gateway(gateway_factory: GatewayFactory, namespace: str) -> Iterator[Any]:
    """``gateway(worker, order, rule=REDACT)`` -> (the gateway's URL, the config's dict builder)."""
    stack = contextlib.ExitStack()

    def start(worker: LimitedWorker, order: list[str], rule: dict[str, Any] = REDACT) -> tuple[str, Any]:
        worker_url = stack.enter_context(ServerThread(worker, lifespan="off")).url

        def config(order: list[str]) -> dict[str, Any]:
            return base_config([worker_url], plugins=_sections(namespace, order, rule))

        _, server = stack.enter_context(gateway_factory(config(order), plugins=PLUGINS, admin_token="adm"))
        return str(server.url), config

    with stack:
        yield start


# -- guided_json before the cache: refused --------------------------------------------------------


def test_a_config_listing_guided_json_before_the_cache_is_refused(
    gateway: Any, redis_client: redis.Redis, namespace: str
) -> None:
    """Listed first, guided_json's on_response would run after the cache's: the cache would store a whole
    answer cut by the worker's limit before guided_json retried it, and serve that cut answer (200,
    finish_reason "length") to the next identical request, where there is no worker to retry with; store
    a stream guided_json then marks no-store; and store an invalid answer before guided_json refused it.
    An admin reload to that order is answered 400 naming both, and the running config serves on."""
    worker = LimitedWorker(VALID, default_limit=4)
    url, config = gateway(worker, ["cache", "guided_json"])

    def reload(order: list[str]) -> httpx.Response:
        return httpx.put(
            url + "/admin/config", content=orjson.dumps(config(order)), headers={"authorization": "Bearer adm"}
        )

    refused = reload(["guided_json", "cache"])
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "'cache' must come before 'guided_json'" in message
    # the running config serves on: the cut answer retried, and the retried answer stored and served
    assert _whole(_chat(url)) == (VALID, "stop")
    wait_stored(redis_client, namespace)
    again = _chat(url)
    assert again.headers["x-cache"] == "hit" and _whole(again) == (VALID, "stop")
    assert [b.get("max_tokens") for b in worker.bodies] == [None, 2048]
    assert reload(["safety", "cache", "guided_json"]).status_code == 200


def test_the_shipped_plugins_refuse_guided_json_before_the_cache(namespace: str) -> None:
    """What the gateway loads at start-up and on a reload (through the installed entry points): the order
    is refused with the cache listed anywhere after guided_json, and taken the other way round."""
    from gateway.pipeline.config import ConfigError, GatewayConfig
    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.validate import resolve_plugins

    def resolve(order: list[str]) -> list[str]:
        config = GatewayConfig.model_validate(
            base_config(["http://127.0.0.1:9"], plugins=_sections(namespace, order, REDACT))
        )
        return [item.entry.name for item in resolve_plugins(config, PluginRegistry())]

    for order in (["guided_json", "cache"], ["guided_json", "safety", "cache"]):
        with pytest.raises(ConfigError, match="'cache' must come before 'guided_json'"):
            resolve(order)
    assert resolve(["safety", "cache", "guided_json"]) == ["safety", "cache", "guided_json", "routing"]
    assert resolve(["cache", "guided_json", "safety"]) == ["cache", "guided_json", "safety", "routing"]
