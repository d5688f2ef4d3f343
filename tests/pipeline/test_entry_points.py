"""Third-party plugins are discovered through the "gateway.plugins" entry-point group."""

from __future__ import annotations

import httpx

from gateway.pipeline.registry import PluginRegistry
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config


def test_installed_package_is_discovered_and_runs(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    registry = PluginRegistry()
    assert "example_header" in registry.names()
    assert {"routing", "safety", "cache", "guided_json", "tenancy"} <= set(registry.names())
    plugins = [{"name": "example_header", "config": {"value": "yes"}}, {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=plugins)) as (_, server):
        response = httpx.post(
            server.url + "/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        )
    assert response.status_code == 200
    assert response.headers["x-example-plugin"] == "yes"
