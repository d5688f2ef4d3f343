"""Token budgets against real Redis with an injected clock: refused with a 429 that names the budget
and its reset time, reset at the UTC day and month boundaries, and reported by the admin API."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx

from plugins.tenancy import TenancyPlugin
from plugins.tenancy.budgets import format_duration, window
from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

KEY = "sk-gw-budget-test-key"
BODY = {"model": "m1", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 3}  # 8 tokens, see limits


def clocked(start: datetime) -> tuple[type[TenancyPlugin], list[float]]:
    """A TenancyPlugin whose wall clock the test moves."""
    now = [start.timestamp()]

    class ClockedTenancy(TenancyPlugin):
        clock = staticmethod(lambda: now[0])

    return ClockedTenancy, now


def config(prefix: str, upstream_url: str, key_limits: dict[str, int], tenants: dict[str, Any]) -> dict[str, Any]:
    keys = [{"id": "k1", "tenant": "t1", "hash": hash_key(KEY, PEPPER.encode()), "limits": key_limits}]
    section = {"redis_prefix": prefix, "keys": keys, "tenants": tenants}
    return base_config([upstream_url], plugins=[{"name": "tenancy", "config": section}, {"name": "routing"}])


def chat(server: ServerThread) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer {KEY}"})


def usage(server: ServerThread, body: dict[str, str]) -> dict[str, Any]:
    reply = httpx.post(server.url + "/admin/plugins/tenancy/usage", json=body, headers={"authorization": "Bearer adm"})
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["result"])


def test_daily_key_budget_refuses_then_resets_at_midnight_utc(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    plugin, now = clocked(datetime(2025, 1, 15, 23, 59, 30, tzinfo=UTC))
    with gateway_factory(
        config(prefix, upstream_url, {"tokens_per_day": 20}, {}), plugins={"tenancy": plugin}, admin_token="adm"
    ) as (_, server):
        assert [chat(server).status_code for _ in range(2)] == [200, 200]  # 8 + 8 of 20
        refused = chat(server)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "insufficient_quota"
        assert error["type"] == "rate_limit_error"
        assert "daily token budget of key 'k1'" in error["message"]
        assert "used 16 of 20" in error["message"]
        assert "resets at 2025-01-16T00:00:00Z (in 30s)" in error["message"]
        assert refused.headers["retry-after"] == "30"
        report = usage(server, {"key_id": "k1"})
        assert report["day"] == {
            "requests": 2,
            "tokens": 16,
            "prompt_tokens": 10,
            "completion_tokens": 6,
            "budget_tokens": 20,
            "resets_at": "2025-01-16T00:00:00Z",
        }
        now[0] = datetime(2025, 1, 16, 0, 0, 0, tzinfo=UTC).timestamp()  # the boundary itself
        assert chat(server).status_code == 200
        assert usage(server, {"key_id": "k1"})["day"]["tokens"] == 8
        assert usage(server, {"key_id": "k1"})["month"]["tokens"] == 24  # the month goes on
    assert len(upstream.requests) == 3


def test_monthly_tenant_budget_resets_on_the_first(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    plugin, now = clocked(datetime(2024, 12, 31, 23, 0, 0, tzinfo=UTC))
    cfg = config(prefix, upstream_url, {}, {"t1": {"tokens_per_month": 10}})
    with gateway_factory(cfg, plugins={"tenancy": plugin}, admin_token="adm") as (_, server):
        assert chat(server).status_code == 200
        refused = chat(server)
        assert refused.status_code == 429
        message = refused.json()["error"]["message"]
        assert "monthly token budget of tenant 't1'" in message
        assert "resets at 2025-01-01T00:00:00Z (in 1h0m0s)" in message
        now[0] = datetime(2025, 1, 1, 0, 0, 0, tzinfo=UTC).timestamp()
        assert chat(server).status_code == 200
        report = usage(server, {"tenant": "t1"})
        assert report["month"]["tokens"] == 8
        assert report["month"]["budget_tokens"] == 10
        assert report["month"]["resets_at"] == "2025-02-01T00:00:00Z"


def test_usage_query_needs_exactly_one_subject(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(config(prefix, upstream_url, {}, {}), admin_token="adm") as (_, server):
        url = server.url + "/admin/plugins/tenancy/usage"
        both = httpx.post(url, json={"key_id": "k1", "tenant": "t1"}, headers={"authorization": "Bearer adm"})
        unknown = httpx.post(url, json={"key_id": "nope"}, headers={"authorization": "Bearer adm"})
    assert both.status_code == 400
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "key_not_found"


def test_windows_and_durations() -> None:
    leap = datetime(2024, 2, 29, 12, 0, tzinfo=UTC).timestamp()
    assert window("day", leap) == ("d20240229", datetime(2024, 3, 1, tzinfo=UTC).timestamp())
    assert window("month", leap) == ("m202402", datetime(2024, 3, 1, tzinfo=UTC).timestamp())
    december = datetime(2024, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()
    assert window("month", december) == ("m202412", datetime(2025, 1, 1, tzinfo=UTC).timestamp())
    assert [format_duration(ms) for ms in (20, 1500, 360_000, 3_723_000)] == ["20ms", "1.5s", "6m0s", "1h2m3s"]
