"""The counters a request touches (its plan) are built once per key, tenant and UTC hour, and rebuilt
when the hour changes, the clock moves back, or the key's limits change (a key edited through the
admin API comes back from Redis as a new record)."""

from __future__ import annotations

from datetime import UTC, datetime

from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import WorkerTable
from plugins.tenancy import TenancyPlugin
from plugins.tenancy.config import Limits, TenancyConfig
from plugins.tenancy.keys import KeyInfo

NOW = [datetime(2025, 3, 31, 23, 59, 59, tzinfo=UTC).timestamp()]


class Clocked(TenancyPlugin):
    clock = staticmethod(lambda: NOW[0])


def plugin() -> Clocked:
    config = TenancyConfig(redis_prefix="gwtest:plans", tenants={"t1": {"tokens_per_day": 100}})
    return Clocked(config, Services(Settings(), UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics()))


def key(limits: Limits) -> KeyInfo:
    return KeyInfo("k1", "t1", ("*",), limits, "redis")


def test_one_plan_per_key_and_hour() -> None:
    tenancy, info = plugin(), key(Limits(requests_per_minute=5, tokens_per_day=50))
    NOW[0] = datetime(2025, 3, 31, 22, 0, 0, tzinfo=UTC).timestamp()
    plan = tenancy.plans.of(info, "t1")
    NOW[0] += 3599.9
    assert tenancy.plans.of(info, "t1") is plan
    assert tenancy.plans.of(None, "t1") is not plan  # an anonymous request of the tenant: its own plan
    NOW[0] += 0.1  # 23:00: the hour's usage counter is another key
    later = tenancy.plans.of(info, "t1")
    assert later is not plan
    assert [b.redis_key for b in later.budgets if b.period == "hour"] != [
        b.redis_key for b in plan.budgets if b.period == "hour"
    ]
    NOW[0] += 3600  # midnight at the end of March: a new day and a new month
    periods = {b.period: b.redis_key for b in tenancy.plans.of(info, "t1").budgets if b.scope == "key"}
    assert periods["day"].endswith(":d20250401") and periods["month"].endswith(":m202504")
    NOW[0] -= 7200  # a clock set back: not the cached hour either
    assert [b.redis_key for b in tenancy.plans.of(info, "t1").budgets] == [b.redis_key for b in plan.budgets]


def test_changed_limits_get_a_new_plan() -> None:
    tenancy = plugin()
    NOW[0] = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC).timestamp()
    before = tenancy.plans.of(key(Limits(requests_per_minute=5)), "t1")
    after = tenancy.plans.of(key(Limits(requests_per_minute=9)), "t1")
    assert [b.limit for b in before.buckets if b.scope == "key"] == [5]
    assert [b.limit for b in after.buckets if b.scope == "key"] == [9]
    assert tenancy.plans.of(key(Limits(requests_per_minute=5)), "t1") is before  # an equal record: the same plan
