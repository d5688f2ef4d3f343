"""Single-flight: concurrent identical misses make one upstream call, also across gateway replicas; a
lock's release still retrying at shutdown stops when cancelled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.server.app import GatewayApp
from plugins.cache.breaker import CircuitBreaker
from plugins.cache.config import CacheConfig
from plugins.cache.keys import CacheKey
from plugins.cache.metrics import CacheMetrics
from plugins.cache.shared import CacheShared
from plugins.cache.store import CacheStore
from plugins.cache.writes import CacheWrites
from tests.support.cache import MESSAGES, PLUGINS, cache_gateway_config, namespace, redis_client
from tests.support.cancellation import CutAwait, stopped_when_cancelled
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]


async def burst(urls: list[str], n: int, **extra: Any) -> list[httpx.Response]:
    """``n`` identical requests at once, spread round robin over ``urls``."""
    body = {"model": "m1", "messages": MESSAGES, "temperature": 0, **extra}
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
        calls = [client.post(urls[i % len(urls)] + "/v1/chat/completions", json=body) for i in range(n)]
        return list(await asyncio.gather(*calls))


def coalesced(app: GatewayApp, outcome: str) -> float:
    value = app.state.services.metrics.registry.get_sample_value(
        "gateway_cache_coalesced_total", {"model": "m1", "outcome": outcome}
    )
    return value or 0.0


async def test_concurrent_identical_misses_make_one_upstream_call(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, namespace: str
) -> None:
    upstream.behavior.delay_s = 0.5
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (app, server):
        replies = await burst([server.url], 8)
        assert coalesced(app, "hit") == 7
    assert len(upstream.requests) == 1
    assert sorted(r.headers["x-cache"] for r in replies) == ["hit"] * 7 + ["miss"]
    # one answer, served to each under its own id (tests/plugins/cache/test_replayed_answers.py)
    assert len({r.json()["choices"][0]["message"]["content"] for r in replies}) == 1
    assert len({r.json()["id"] for r in replies}) == 8


async def test_streaming_followers_get_the_answer_replayed(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, namespace: str
) -> None:
    upstream.behavior.delay_s = 0.5
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        replies = await burst([server.url], 6, stream=True)
    assert len(upstream.requests) == 1
    for reply in replies:
        assert reply.content.endswith(b"data: [DONE]\n\n")
        assert b"Hello" in reply.content


async def test_coalescing_spans_gateway_replicas(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, namespace: str
) -> None:
    # Long enough that every request of the burst arrives while the leader computes, on a loaded machine
    # too (with 0.5 s a replica's requests sometimes came after the answer was stored: plain hits).
    upstream.behavior.delay_s = 2.0
    config = cache_gateway_config(upstream_url, namespace)
    with (
        gateway_factory(config, plugins=PLUGINS) as (app_a, a),
        gateway_factory(config, plugins=PLUGINS) as (app_b, b),
    ):
        replies = await burst([a.url, b.url], 8)
        # Both replicas had followers; the replica without the leader could only learn through Redis.
        assert coalesced(app_a, "hit") >= 3 and coalesced(app_b, "hit") >= 3
    assert len(upstream.requests) == 1
    assert all(r.status_code == 200 for r in replies)


async def test_a_failed_leader_releases_its_followers(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    upstream.behavior.delay_s = 0.5
    upstream.behavior.status = 500
    config = cache_gateway_config(upstream_url, namespace, coalesce_wait_s=60)
    with gateway_factory(config, plugins=PLUGINS) as (app, server):
        replies = await burst([server.url], 5)
        # The followers learned the leader was gone (they did not wait out coalesce_wait_s) and went
        # to the engine themselves.
        assert coalesced(app, "leader_gone") == 4
    assert [r.status_code for r in replies] == [502] * 5
    assert len(upstream.requests) == 5
    assert list(redis_client.scan_iter(match=f"gwcache:{namespace}:*")) == []  # no lock left behind


async def test_a_follower_waits_only_as_long_as_configured(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, namespace: str
) -> None:
    upstream.behavior.delay_s = 1.0
    config = cache_gateway_config(upstream_url, namespace, coalesce_wait_s=0.1)
    with gateway_factory(config, plugins=PLUGINS) as (app, server):
        replies = await burst([server.url], 3)
        assert coalesced(app, "timeout") == 2
    assert len(upstream.requests) == 3
    assert all(r.status_code == 200 for r in replies)


async def test_a_lookup_that_timed_out_after_taking_the_lock_does_not_strand_followers(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, namespace: str
) -> None:
    """Redis ran the lookup script (and took the lock) but its reply came too late for the client: the
    request bypasses the cache, and the lock it may hold is dropped so later identical requests do not
    wait out ``coalesce_wait_s`` for a leader that does not know it leads."""
    from plugins.cache.store import RedisUnavailable

    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (app, server):
        plugin = next(b.plugin for b in app.state.holder.current.pipeline.plugins if b.name == "cache")
        store = plugin.store  # type: ignore[attr-defined]
        original = store.lookup
        calls = 0

        async def late_reply(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            result = await original(*args, **kwargs)
            if calls == 1:
                raise RedisUnavailable("reply arrived after the timeout")
            return result

        store.lookup = late_reply
        first = await burst([server.url], 1)
        assert first[0].headers["x-cache"] == "bypass"
        # Once the stray lock is gone, the next identical request leads instead of waiting ~30 s.
        async with httpx.AsyncClient(timeout=10) as client:
            body = {"model": "m1", "messages": MESSAGES, "temperature": 0}
            for _ in range(50):
                second = await client.post(server.url + "/v1/chat/completions", json=body)
                if second.headers["x-cache"] in {"miss", "hit"}:
                    break
                await asyncio.sleep(0.05)
        assert second.status_code == 200
        assert coalesced(app, "timeout") == 0


async def test_a_release_cancelled_inside_a_redis_call_stops() -> None:
    """``drain`` cancels the releases still retrying at shutdown; one whose Redis call turns the
    cancellation into redis' own error (which the store reports as Redis unavailable, what a release
    retries after) must stop instead of retrying on until the lock expires."""
    client = aioredis.Redis.from_url("redis://127.0.0.1:6379")  # never connected: it only registers scripts
    evalsha = CutAwait(lambda: RedisConnectionError("Connection closed by server."))
    pipeline = SimpleNamespace(evalsha=evalsha)  # the batched commands' evalsha
    store = CacheStore(client, pipeline, client, CircuitBreaker(3, 1.0), 5.0, on_error=lambda op: None)  # type: ignore[arg-type]
    writes = CacheWrites(CacheConfig(), store, CacheShared(CacheMetrics(CollectorRegistry()), store.breaker))
    writes.release_soon(CacheKey("d", "gw:cache:cut:entry", "gw:cache:cut:lock"), b"token", local_leader=False)
    (release,) = writes._tasks
    try:
        await asyncio.wait_for(evalsha.entered.wait(), 5)
        done = await stopped_when_cancelled(release, 2)  # what drain does to a release still under way
        assert evalsha.converted, "the Redis call never saw the cancellation"
        assert done, "the release went on retrying after it was cancelled"
    finally:
        release.cancel()
        await asyncio.wait({release}, timeout=5)
        await client.aclose()


async def test_a_request_cancelled_while_its_lookup_takes_the_lock_does_not_strand_followers(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, namespace: str
) -> None:
    """The client went away while the lookup was under way: the script ran (and took the lock) but the
    request was cancelled before it learned it leads. The lock is dropped, so later identical requests
    lead instead of waiting out ``coalesce_wait_s`` for a leader that is gone."""
    config = cache_gateway_config(upstream_url, namespace, coalesce_wait_s=4)
    with gateway_factory(config, plugins=PLUGINS) as (app, server):
        plugin = next(b.plugin for b in app.state.holder.current.pipeline.plugins if b.name == "cache")
        store = plugin.store  # type: ignore[attr-defined]
        original = store.lookup
        calls = 0
        taken = asyncio.Event()

        async def slow_reply(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            result = await original(*args, **kwargs)
            if calls == 1:
                taken.set()
                await asyncio.sleep(30)  # the reply is late: the client leaves meanwhile
            return result

        store.lookup = slow_reply
        body = {"model": "m1", "messages": MESSAGES, "temperature": 0}
        async with httpx.AsyncClient(timeout=10) as client:
            streamed = {**body, "stream": True}
            leaving = asyncio.create_task(client.post(server.url + "/v1/chat/completions", json=streamed))
            await asyncio.wait_for(taken.wait(), 10)
            leaving.cancel()  # the client closes its connection
            await asyncio.wait({leaving})
            await asyncio.sleep(0.3)  # the gateway notices and cancels the request
            started = asyncio.get_running_loop().time()
            second = await client.post(server.url + "/v1/chat/completions", json=body)
            waited = asyncio.get_running_loop().time() - started
        assert second.status_code == 200
        assert second.headers["x-cache"] == "miss", "the next identical request did not lead"
        assert waited < 2
        assert coalesced(app, "timeout") == 0
