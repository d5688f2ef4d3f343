"""``plugins/tenancy/charges.py`` on its own: what happens to a charge whose reply comes later, fails,
or finds the script gone, without the answer waiting for it. The path through Redis and the gateway is
tests/plugins/tenancy/test_billing.py's (a silenced Redis, SCRIPT FLUSH before the charge)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from gateway.ops.fast_metrics import CachedLabels
from plugins.tenancy.admitted import Admitted
from plugins.tenancy.charges import Charges
from plugins.tenancy.limits import LocalLimiter, Plan, RedisLimiter
from plugins.tenancy.metrics import TenancyMetrics

Charge = tuple[Plan, int, int, int]


class ScriptedLimiter:
    """``RedisLimiter``'s two charge calls: ``charge_soon`` hands out a future the test answers;
    ``charge`` (the awaited one, which loads a missing script) fails with ``again_raises`` if set."""

    def __init__(self) -> None:
        self.sent: list[tuple[Charge, asyncio.Future[Any]]] = []
        self.again: list[Charge] = []
        self.again_raises: BaseException | None = None

    def charge_soon(self, plan: Plan, delta: int, prompt: int, completion: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append(((plan, delta, prompt, completion), future))
        return future

    async def charge(self, plan: Plan, delta: int, prompt: int, completion: int) -> None:
        await asyncio.sleep(0)
        self.again.append((plan, delta, prompt, completion))
        if self.again_raises is not None:
            raise self.again_raises


class Tokens:
    """The metrics ``Charges`` counts into, on a registry of the test's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        counter = Counter("tokens", "tokens", ["tenant", "kind"], registry=self.registry)
        self.metrics = cast(TenancyMetrics, SimpleNamespace(tokens=CachedLabels(counter)))

    def counted(self, tenant: str, kind: str) -> float:
        return self.registry.get_sample_value("tokens_total", {"tenant": tenant, "kind": kind}) or 0.0


class Setup:
    def __init__(self) -> None:
        self.limiter = ScriptedLimiter()
        self.local = LocalLimiter(1.0)
        self.tokens = Tokens()
        self.errors: list[tuple[str, BaseException]] = []
        self.charges = Charges(
            cast(RedisLimiter, self.limiter),
            self.local,
            self.tokens.metrics,
            lambda op, exc: self.errors.append((op, exc)),
        )


def admitted(*, via_redis: bool = True) -> Admitted:
    return Admitted(Plan([], []), reserved=100, prompt_estimate=10, via_redis=via_redis)


async def test_a_charge_is_sent_at_once_and_due_until_redis_answers() -> None:
    s = Setup()
    s.charges.apply("t1", admitted(), -80, 12, 8)
    [(charge, future)] = s.limiter.sent
    assert charge[1:] == (-80, 12, 8)
    assert s.charges.due == 1
    assert (s.tokens.counted("t1", "prompt"), s.tokens.counted("t1", "completion")) == (12, 8)
    future.set_result(1)
    await asyncio.sleep(0)  # the done callback runs in the next loop turn
    assert s.charges.due == 0
    assert s.errors == []


async def test_settled_waits_for_every_reply_still_due() -> None:
    s = Setup()
    for _ in range(3):
        s.charges.apply("t1", admitted(), -1, 1, 0)
    waiting = asyncio.ensure_future(s.charges.settled())
    await asyncio.sleep(0)
    for _, future in s.limiter.sent[:2]:
        future.set_result(1)
    await asyncio.sleep(0.01)
    assert not waiting.done()
    s.limiter.sent[2][1].set_result(1)
    await asyncio.wait_for(waiting, 1)
    assert s.charges.due == 0


async def test_a_redis_error_is_reported_and_not_raised() -> None:
    s = Setup()
    s.charges.apply("t1", admitted(), -1, 1, 0)
    error = RedisConnectionError("down")
    s.limiter.sent[0][1].set_exception(error)
    await s.charges.settled()
    assert s.errors == [("charge", error)]
    assert s.limiter.again == []


async def test_a_script_redis_forgot_is_charged_again_and_settled_waits_for_it() -> None:
    s = Setup()
    s.charges.apply("t1", admitted(), -5, 3, 2)
    charge, future = s.limiter.sent[0]
    future.set_exception(NoScriptError("NOSCRIPT"))
    await asyncio.sleep(0)  # the callback starts the second charge
    assert s.charges.due == 1
    await s.charges.settled()
    assert s.limiter.again == [charge]
    assert s.charges.due == 0 and s.errors == []


async def test_the_second_charge_failing_is_reported() -> None:
    s = Setup()
    s.limiter.again_raises = RedisConnectionError("gone")
    s.charges.apply("t1", admitted(), -5, 3, 2)
    s.limiter.sent[0][1].set_exception(NoScriptError("NOSCRIPT"))
    await asyncio.sleep(0)
    await s.charges.settled()
    assert [op for op, _ in s.errors] == ["charge"]


async def test_any_other_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    s = Setup()
    s.charges.apply("t1", admitted(), -1, 1, 0)
    s.limiter.sent[0][1].set_exception(ValueError("a bug"))
    await s.charges.settled()
    assert "a charge failed" in caplog.text
    assert s.errors == []


async def test_a_charge_admitted_without_redis_goes_to_the_local_limiter() -> None:
    s = Setup()
    seen: list[int] = []
    s.local.charge = lambda plan, delta: seen.append(delta)  # type: ignore[method-assign]
    s.charges.apply("t1", admitted(via_redis=False), -70, 20, 10)
    assert seen == [-70]
    assert s.limiter.sent == [] and s.charges.due == 0
    assert s.tokens.counted("t1", "completion") == 10


async def test_a_refund_is_not_counted_as_tokens() -> None:
    """A later refund (an answer refused after it was charged) lowers the counters, not the token metric."""
    s = Setup()
    s.charges.apply("t1", admitted(), -20, -10, -10)
    assert (s.tokens.counted("t1", "prompt"), s.tokens.counted("t1", "completion")) == (0, 0)
    assert s.limiter.sent[0][0][1:] == (-20, -10, -10)
    s.limiter.sent[0][1].set_result(1)
    await s.charges.settled()
