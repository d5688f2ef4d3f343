"""Redis stopped, paused or unreachable: requests still succeed, and caching resumes when it returns.

The checks on time below are not performance targets: they show that a request did not wait for a
paused Redis (the pause is far longer than the bound they allow).
"""

from __future__ import annotations

import time

from gateway.server.app import GatewayApp
from tests.support.cache import PLUGINS, ThrowawayRedis, cache_gateway_config, chat, throwaway_redis
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["throwaway_redis"]


def errors(app: GatewayApp) -> float:
    registry = app.state.services.metrics.registry
    return sum(
        registry.get_sample_value("gateway_cache_errors_total", {"op": op}) or 0.0
        for op in ("warm_up", "lookup", "poll", "store", "release")
    )


def wait_until_cached(url: str, timeout_s: float = 10.0) -> None:
    """Send requests until one is stored and the next is a hit (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if chat(url).headers["x-cache"] == "hit":
            return
        time.sleep(0.05)
    raise AssertionError("caching did not resume")


def test_unreachable_redis_fails_open_and_the_breaker_stops_trying(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = cache_gateway_config(upstream_url, "unreachable", breaker_failures=2, breaker_cooldown_s=60)
    with gateway_factory(config, plugins=PLUGINS, redis_url="redis://127.0.0.1:1/0") as (app, server):
        first = [chat(server.url) for _ in range(3)]
        tried = errors(app)
        later = [chat(server.url, stream=True) for _ in range(3)]
        assert errors(app) == tried  # breaker open: no more Redis calls
        gauge = app.state.services.metrics.registry.get_sample_value("gateway_cache_breaker_open")
    assert tried >= 2
    assert gauge == 1
    assert all(r.status_code == 200 and r.headers["x-cache"] == "bypass" for r in first + later)
    assert len(upstream.requests) == 6


def test_stopped_redis_then_restarted(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, throwaway_redis: ThrowawayRedis
) -> None:
    config = cache_gateway_config(upstream_url, "stopped", breaker_failures=1, breaker_cooldown_s=0.3)
    with gateway_factory(config, plugins=PLUGINS, redis_url=throwaway_redis.url) as (_, server):
        wait_until_cached(server.url)
        throwaway_redis.stop()
        down = [chat(server.url) for _ in range(3)]
        assert all(r.status_code == 200 and r.headers["x-cache"] == "bypass" for r in down)
        throwaway_redis.start()  # empty: persistence is off
        wait_until_cached(server.url)


def test_paused_redis_adds_at_most_its_timeout(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, throwaway_redis: ThrowawayRedis
) -> None:
    config = cache_gateway_config(upstream_url, "paused", breaker_failures=1, breaker_cooldown_s=0.3)
    with (
        gateway_factory(config, plugins=PLUGINS, redis_url=throwaway_redis.url) as (_, server),
        throwaway_redis.client() as direct,
    ):
        wait_until_cached(server.url)
        direct.execute_command("CLIENT", "PAUSE", 4000, "ALL")
        paused_at = time.monotonic()
        during = []
        for stream in (False, True, False):
            started = time.monotonic()
            reply = chat(server.url, stream=stream)
            during.append((reply, time.monotonic() - started))
        assert time.monotonic() - paused_at < 3.0  # none of them waited for the pause to end
        assert all(r.status_code == 200 and r.headers["x-cache"] == "bypass" for r, _ in during)
        assert all(seconds < 2.0 for _, seconds in during)
        direct.ping()  # blocks until the pause is over
        wait_until_cached(server.url)  # the entry stored before the pause is served again
