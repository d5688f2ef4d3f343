"""``RedisLimiter.check``, against real Redis: what an admission of one request of so many tokens would
decide now, for every bucket and budget of a plan, reserving nothing (a refusal is counted in the usage
history, as an admission's refusal is). Tenancy refuses a Responses continuation by it before the
conversation is loaded (``tests/server/test_responses_with_plugins.py``)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from gateway.infra.redis_py import RedisPyPipeline
from plugins.tenancy.budgets import Budget
from plugins.tenancy.limits import Bucket, Plan, RedisLimiter
from tests.support.tenancy import prefix

__all__ = ["prefix"]  # the fixture, used by name


def plan(prefix: str, requests: int, tokens: int, day_budget: int | None) -> Plan:
    buckets = [
        Bucket("key", "k1", "requests", requests, f"{prefix}:rpm"),
        Bucket("key", "k1", "tokens", tokens, f"{prefix}:tpm"),
    ]
    return Plan(buckets, [Budget("key", "k1", "day", day_budget, f"{prefix}:day", 0.0, 3600)])


def state(prefix: str) -> dict[str, object]:
    """Every counter of the plan as Redis holds it."""
    client = redis.Redis()
    try:
        return {name: client.get(f"{prefix}:{name}") for name in ("rpm", "tpm")} | {
            "day": client.hgetall(f"{prefix}:day")
        }
    finally:
        client.close()


async def test_check_decides_as_an_admission_would_and_reserves_nothing(prefix: str) -> None:
    client = aioredis.Redis()
    limiter = RedisLimiter(client, RedisPyPipeline(client))
    try:
        limited = plan(prefix, requests=2, tokens=100, day_budget=1000)
        for _ in range(3):  # any number of checks: nothing counted
            assert (await limiter.check(limited, 1)).admitted
        assert state(prefix) == {"rpm": None, "tpm": None, "day": {}}

        assert (await limiter.admit(limited, 100)).admitted  # the token bucket is now empty
        before = state(prefix)
        refused = await limiter.check(limited, 1)
        assert not refused.admitted and refused.status == 1 and refused.bucket is limited.buckets[1]
        assert refused.retry_after_ms > 0 and refused.headers()["x-ratelimit-remaining-tokens"] == "0"
        after = state(prefix)
        assert {k: after[k] for k in ("rpm", "tpm")} == {k: before[k] for k in ("rpm", "tpm")}
        assert after["day"] == {**before["day"], b"refusals": b"1"}  # the refusal, counted once
        assert (await limiter.admit(limited, 1)).status == 1  # the admission agrees

        assert (await limiter.admit(plan(prefix + ":r", 1, 100, None), 1)).admitted  # one request a minute, used
        assert (await limiter.check(plan(prefix + ":r", 1, 100, None), 1)).status == 1

        spent = plan(prefix + ":b", requests=10, tokens=10_000, day_budget=50)
        assert (await limiter.admit(spent, 50)).admitted  # the day's budget, all used
        over = await limiter.check(spent, 1)
        assert over.status == 2 and over.budget is spent.budgets[0]
    finally:
        await client.aclose()


async def test_check_refuses_exactly_what_the_admission_refuses(prefix: str) -> None:
    """The check is the admission script run without reserving: at the edge of a budget (exact, unlike a
    bucket that refills as time passes) and of a limit, the same amounts pass and fail."""
    client = aioredis.Redis()
    limiter = RedisLimiter(client, RedisPyPipeline(client))
    try:
        budget = plan(prefix, requests=10, tokens=10_000, day_budget=50)
        assert (await limiter.admit(budget, 30)).admitted  # 20 left in the day's budget
        fits, over = await limiter.check(budget, 20), await limiter.check(budget, 21)
        assert (fits.status, fits.granted, fits.used[budget.budgets[0]]) == (0, 20, 30)
        assert (over.status, over.budget, over.granted) == (2, budget.budgets[0], 21)
        assert (await limiter.admit(budget, 21)).status == 2
        assert (await limiter.admit(budget, 20)).admitted
        # one script decides both: the check runs the plan's admission call, its limits packed once
        assert len(budget.calls) == 1

        small = plan(prefix + ":s", requests=10, tokens=100, day_budget=None)
        larger = await limiter.check(small, 101)  # more than the bucket holds: never admitted
        assert (larger.status, larger.bucket) == (3, small.buckets[1])
        assert (await limiter.admit(small, 101)).status == 3
        assert state(prefix + ":s") == {"rpm": None, "tpm": None, "day": {b"refusals": b"2"}}
    finally:
        await client.aclose()
