"""Redis failing under load: stopped (process killed), paused (``CLIENT PAUSE``) and black-holed (a
proxy in the path that swallows every byte and leaves connections open), while the cache and tenancy
plugins both use it.

A throwaway redis-server on a free port takes the faults (the shared one at 6379 is never touched),
behind a switchable TCP proxy that the gateway talks to. What must hold: no request waits longer than
the plugins' Redis bounds allow (nothing hangs); the cache fails open (requests are served, uncached);
tenancy follows its configured ``redis_down`` policy (fail_open: served; fail_closed: 503
``tenancy_unavailable`` in OpenAI's shape); and everything recovers when Redis does.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from plugins.cache import CachePlugin
from tests.support.cache import ThrowawayRedis
from tests.support.fakes import FakeUpstream
from tests.support.faults import SwitchableProxy, check_openai_error, wait_for
from tests.support.gateways import GatewayFactory, base_config

FAULT_S = 3.0
# The longest a request may take while Redis misbehaves: tenancy's and the cache's bounds per call, a
# few calls each, with generous slack for a loaded CI machine. A hang would reach the client timeout.
BOUND_S = 5.0
# How soon after Redis answers again every request must succeed: the breaker's cooldown and pooled
# connections to the old server being replaced, with slack for a loaded machine.
RECOVERY_S = 5.0


@dataclass
class Outcome:
    started: float
    ended: float
    status: int
    cache: str | None
    body: dict[str, Any]


@pytest.fixture
def redis_path() -> Iterator[tuple[ThrowawayRedis, SwitchableProxy]]:
    server = ThrowawayRedis()
    server.start()
    try:
        with SwitchableProxy(server.port) as proxy:
            yield server, proxy
    finally:
        server.stop()


def gateway_config(upstream_url: str, policy: str) -> dict[str, Any]:
    tenancy = {
        "auth": False,
        "tenants": {"local": {"requests_per_minute": 1_000_000}},
        "redis_prefix": f"test:faults:{uuid.uuid4().hex}",
        "redis_down": policy,
    }
    cache = {"namespace": "f" + uuid.uuid4().hex[:12], "timeout_ms": 100, "breaker_cooldown_s": 0.5}
    plugins: list[dict[str, Any]] = [
        {"name": "tenancy", "config": tenancy},
        {"name": "cache", "config": cache},
        {"name": "routing"},
    ]
    return base_config([upstream_url], plugins=plugins)


async def load(url: str, stop: asyncio.Event, out: list[Outcome]) -> None:
    """Eight clients in a loop: every other request repeats one prompt (cache hits when Redis works)."""
    async with httpx.AsyncClient(timeout=30) as client:

        async def one_client(n: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                content = "same question" if i % 2 else f"question {n}-{i}-{uuid.uuid4().hex[:6]}"
                body = {"model": "m1", "messages": [{"role": "user", "content": content}], "temperature": 0}
                started = time.monotonic()
                reply = await client.post(url + "/v1/chat/completions", json=body)
                ended = time.monotonic()
                out.append(Outcome(started, ended, reply.status_code, reply.headers.get("x-cache"), reply.json()))

        await asyncio.gather(*(one_client(n) for n in range(8)))


async def run_with_fault(
    url: str, inject: Callable[[], Awaitable[None]], heal: Callable[[], Awaitable[None]]
) -> dict[str, list[Outcome]]:
    """Load before, during and after the fault; each request is filed under the phase it lay wholly in
    (requests that straddle a boundary prove nothing either way and are left out, except for the bound)."""
    out: list[Outcome] = []
    stop = asyncio.Event()
    task = asyncio.create_task(load(url, stop, out))
    # Bounded: until a few dozen requests were served with Redis healthy, one of them from the cache.
    # Waiting for the hit, not a fixed count: on a loaded machine the cache's first calls can exceed its
    # 100 ms bound and open its breaker for a moment, and the check below needs a hit before the fault.
    for _ in range(200):
        await asyncio.sleep(0.05)
        if len(out) >= 32 and any(o.cache == "hit" for o in out):
            break
    await asyncio.sleep(0.2)
    fault_at = time.monotonic()
    await inject()
    await asyncio.sleep(FAULT_S)
    await heal()
    healed_at = time.monotonic()
    await asyncio.sleep(RECOVERY_S + 1.5)
    stop.set()
    await asyncio.wait_for(task, timeout=60)
    # Recovered: from some moment within RECOVERY_S of Redis answering again, every request succeeds.
    post = [o for o in out if o.started > healed_at]
    last_failure = max((o.started for o in post if o.status != 200), default=healed_at)
    assert last_failure < healed_at + RECOVERY_S, f"requests still failed {last_failure - healed_at:.2f} s after"
    return {
        "all": out,
        "before": [o for o in out if o.ended < fault_at],
        "fault": [o for o in out if o.started > fault_at + 0.3 and o.ended < fault_at + FAULT_S - 0.3],
        "after": [o for o in out if o.started > last_failure],
    }


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
@pytest.mark.parametrize(
    "fault",
    [
        "stop",
        "pause",
        "blackhole",
    ],
)
def test_redis_fault_under_load(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    redis_path: tuple[ThrowawayRedis, SwitchableProxy],
    fault: str,
    policy: str,
    request: pytest.FixtureRequest,
) -> None:
    server, proxy = redis_path

    async def inject() -> None:
        if fault == "stop":
            await asyncio.to_thread(server.stop)
        elif fault == "pause":
            with server.client() as direct:
                await asyncio.to_thread(direct.execute_command, "CLIENT", "PAUSE", int(FAULT_S * 1000), "ALL")
        else:
            proxy.blackholed.set()

    async def heal() -> None:
        if fault == "stop":
            await asyncio.to_thread(server.start)
        elif fault == "blackhole":
            proxy.blackholed.clear()
        # a pause ends by itself after FAULT_S

    config = gateway_config(upstream_url, policy)
    with gateway_factory(config, plugins={"cache": CachePlugin}, redis_url=f"redis://127.0.0.1:{proxy.port}/0") as (
        _,
        gateway,
    ):
        by_phase = asyncio.run(run_with_fault(gateway.url, inject, heal))

    assert all(by_phase.values()), {p: len(v) for p, v in by_phase.items()}
    slowest = max(o.ended - o.started for o in by_phase["all"])
    assert slowest < BOUND_S, f"a request waited {slowest:.2f} s for Redis"
    # Redis healthy: everything served, and the repeated prompt comes from the cache.
    for phase in ("before", "after"):
        assert {o.status for o in by_phase[phase]} == {200}, [o.body for o in by_phase[phase] if o.status != 200]
    assert any(o.cache == "hit" for o in by_phase["before"])
    assert any(o.cache == "hit" for o in by_phase["after"]), "caching did not resume after the fault"
    during = by_phase["fault"]
    if policy == "fail_open":
        # The cache fails open and tenancy admits per replica: every request is served.
        assert {o.status for o in during} == {200}, [o.body for o in during if o.status != 200]
    else:
        refused = [o for o in during if o.status != 200]
        assert refused, "fail_closed tenancy admitted requests it could not count"
        for o in refused:
            assert o.status == 503
            assert check_openai_error(o.body)["code"] == "tenancy_unavailable"


def test_a_lock_whose_store_failed_is_released_once_redis_answers_again(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    redis_path: tuple[ThrowawayRedis, SwitchableProxy],
) -> None:
    """A leader's answer could not be stored (Redis went silent meanwhile): its single-flight lock must
    not outlive the outage, or every identical request after it waits out ``coalesce_wait_s``."""
    server, proxy = redis_path
    upstream.behavior.delay_s = 0.5  # the leader is at the engine when Redis goes silent
    cache = {"namespace": "f" + uuid.uuid4().hex[:12], "timeout_ms": 100, "breaker_cooldown_s": 0.3}
    config = base_config([upstream_url], plugins=[{"name": "cache", "config": cache}, {"name": "routing"}])
    body = {"model": "m1", "messages": [{"role": "user", "content": "lock me"}], "temperature": 0}
    with (
        server.client() as direct,
        gateway_factory(config, plugins={"cache": CachePlugin}, redis_url=f"redis://127.0.0.1:{proxy.port}/0") as (
            _,
            gateway,
        ),
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        threading.Timer(0.2, proxy.blackholed.set).start()
        leader = client.post("/v1/chat/completions", json=body)
        assert leader.status_code == 200  # the answer is delivered; only storing it failed
        time.sleep(0.5)
        locks = [name for name in direct.scan_iter(match=f"*{cache['namespace']}*") if b":l:" in name]
        assert locks, "the leader's lock should still be in Redis while it is unreachable"
        proxy.blackholed.clear()
        wait_for(
            lambda: not any(True for _ in direct.scan_iter(match=f"*{cache['namespace']}*")),
            10,
            "the orphaned single-flight lock to be released",
        )
        follower = client.post("/v1/chat/completions", json=body)
    assert follower.status_code == 200
