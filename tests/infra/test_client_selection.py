"""The process settings that pick the protocol clients (``GATEWAY_UPSTREAM_CLIENT``, ``GATEWAY_REDIS_CLIENT``):
each library implementation carries the gateway end to end (the cache plugin's Redis scripts, plain and
streamed answers, a large answer), and a name that is neither is refused when settings are read."""

from __future__ import annotations

import pytest
import redis
from pydantic import ValidationError

from gateway.infra.http1 import Http1Client
from gateway.infra.http_aiohttp import AiohttpClient
from gateway.infra.redis_autopipe import AutoPipeline
from gateway.infra.redis_py import RedisPyPipeline
from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig, make_http_client
from gateway.upstream.workers import WorkerTable
from tests.support.cache import (
    PLUGINS,
    cache_gateway_config,
    namespace,
    redis_client,
    sdk_chat,
    stream_text,
    wait_stored,
)
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]  # fixtures used by name below


@pytest.mark.parametrize(("upstream_client", "redis_client_name"), [("aiohttp", "redis-py"), ("http1", "autopipe")])
def test_each_client_pair_serves_misses_hits_and_streams_through_the_gateway(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    upstream_client: str,
    redis_client_name: str,
) -> None:
    settings = {"upstream_client": upstream_client, "redis_client": redis_client_name}
    config = cache_gateway_config(upstream_url, namespace)
    with gateway_factory(config, plugins=PLUGINS, **settings) as (app, server):
        services = app.state.services
        http = services.upstream._http
        assert isinstance(http, AiohttpClient if upstream_client == "aiohttp" else Http1Client)
        state, first = sdk_chat(server.url, stream=False)
        assert state == "miss"
        wait_stored(redis_client, namespace)
        state, second = sdk_chat(server.url, stream=True)
        assert state == "hit"
        pipelines = list(services._pipelines.values())
        assert pipelines and all(
            isinstance(p, RedisPyPipeline if redis_client_name == "redis-py" else AutoPipeline) for p in pipelines
        )
        upstream.behavior.text = "x" * (3 << 20)  # an answer over both clients' buffer limits
        state, large = sdk_chat(server.url, stream=False, messages=[{"role": "user", "content": "big"}])
        assert state == "miss" and large.choices[0].message.content == "x" * (3 << 20)
    assert first.choices[0].message.content == stream_text(second) == "Hello from the fake worker."


def test_an_unknown_client_name_is_refused() -> None:
    with pytest.raises(ValidationError):
        Settings(upstream_client="httpx")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Settings(redis_client="aioredis")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown upstream client"):
        make_http_client("httpx", UpstreamConfig())


async def test_services_build_the_pipeline_the_settings_name() -> None:
    for name, cls in (("redis-py", RedisPyPipeline), ("autopipe", AutoPipeline)):
        services = Services(Settings(redis_client=name), UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
        try:
            pipe = services.redis_pipeline(socket_timeout_s=1, connect_timeout_s=1)
            assert isinstance(pipe, cls)
            assert services.redis_pipeline(socket_timeout_s=1, connect_timeout_s=1) is pipe
            assert await pipe.execute("PING") == b"PONG"
        finally:
            await services.aclose()
