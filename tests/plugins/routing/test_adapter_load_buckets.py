"""The token buckets that bound the adapter loads each tenant causes (``plugins.routing.load_quota``)."""

from __future__ import annotations

import pytest

from plugins.routing.load_quota import LoadQuota, TenantLoadBuckets
from tests.support.clock import Clock


def test_a_bucket_holds_a_minutes_loads_and_refills_at_that_rate() -> None:
    clock = Clock()
    buckets = TenantLoadBuckets(3, clock=clock)
    assert buckets.ready("a")
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert not buckets.ready("a") and buckets.take("a") == pytest.approx(20.0)  # a token every 20 s
    assert buckets.ready("b") and buckets.take("b") == 0.0  # each tenant its own
    clock.now += 5
    assert buckets.take("a") == pytest.approx(15.0)  # refused: nothing taken
    clock.now += 15
    assert buckets.ready("a") and buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(20.0)
    clock.now += 3600  # idle for long: full again, no more
    assert [buckets.take("a") for _ in range(4)][-2:] == [0.0, pytest.approx(20.0)]
    buckets.per_minute = 6  # a reload: the level is kept, the rate changes
    assert buckets.take("a") == pytest.approx(10.0)


def test_the_buckets_keep_at_most_max_tenants_the_least_recently_used_dropped() -> None:
    clock = Clock()
    buckets = TenantLoadBuckets(1, max_tenants=2, clock=clock)
    for tenant in ("a", "b"):
        assert buckets.take(tenant) == 0.0
    assert not buckets.ready("a")  # a bucket only ready() looks at is not kept, nor moved
    assert buckets.take("c") == 0.0  # a is dropped: the least recently charged
    assert len(buckets) == 2 and buckets.ready("a")
    assert not buckets.ready("b") and not buckets.ready("c")


def test_a_bound_lifted_by_a_reload_refuses_nothing_even_to_a_quota_made_before() -> None:
    """A request's quota is made when it is planned; a reload that sets the rate to 0 (no bound) before
    its load starts lets it load, and never divides by that 0."""
    buckets = TenantLoadBuckets(1, clock=Clock())
    quota = LoadQuota(buckets, "a", on_refused=lambda model: None)
    quota.charge("m")
    assert not quota.ready()
    buckets.per_minute = 0
    assert quota.ready() and buckets.take("a") == 0.0
    quota.charge("m")  # no RateLimited
