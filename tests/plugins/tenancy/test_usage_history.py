"""The usage history (``usage_history``): per key and per tenant, per UTC hour and day, requests,
refusals and tokens counted by the admission and charge scripts themselves, against real Redis."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import redis

from plugins.tenancy.budgets import usage_key
from plugins.tenancy.history import periods
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import USAGE_KEYS, prefix, usage_plugins

__all__ = ["prefix"]  # the fixture, used by name

ADMIN = {"authorization": "Bearer adm"}
KEYS = USAGE_KEYS


def config(prefix: str, upstream_url: str) -> dict[str, Any]:
    return base_config([upstream_url], plugins=usage_plugins(prefix))


def history(server: ServerThread, **query: Any) -> dict[str, Any]:
    reply = httpx.post(server.url + "/admin/plugins/tenancy/usage_history", json=query, headers=ADMIN)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()["result"]
    return result


def chat(server: ServerThread, key: str) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 8}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


def last(server: ServerThread, period: str, **scope: str) -> dict[str, Any]:
    """The newest row, once the charges of the requests sent are settled (a moment after the reply)."""
    deadline = time.monotonic() + 10
    while True:
        row: dict[str, Any] = history(server, period=period, days=1, **scope)["rows"][-1]
        if row["completion_tokens"] or time.monotonic() > deadline:
            return row
        time.sleep(0.05)


def test_requests_refusals_and_tokens_per_hour_and_day_per_key_and_tenant(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.chunks = 4  # the fake worker's usage: 4 completion tokens per answer
    with gateway_factory(config(prefix, upstream_url), admin_token="adm") as (_, server):
        statuses = [chat(server, KEYS["k1"]).status_code for _ in range(5)]  # 3 per minute: 2 refused
        statuses += [chat(server, KEYS["k2"]).status_code]
        assert statuses == [200, 200, 200, 429, 429, 200]
        answered = chat(server, KEYS["k2"]).json()["usage"]
        prompt = answered["prompt_tokens"]
        assert answered["completion_tokens"] == 4

        for period in ("hour", "day"):
            k1 = last(server, period, key_id="k1")
            assert (k1["requests"], k1["refusals"]) == (3, 2)
            assert (k1["prompt_tokens"], k1["completion_tokens"]) == (3 * prompt, 3 * 4)
            k2 = last(server, period, key_id="k2")
            assert (k2["requests"], k2["refusals"], k2["completion_tokens"]) == (2, 0, 2 * 4)
            acme = last(server, period, tenant="acme")
            assert (acme["requests"], acme["refusals"]) == (5, 2)
            assert (acme["prompt_tokens"], acme["completion_tokens"]) == (5 * prompt, 5 * 4)
            # another tenant's key never shows in acme's counters, nor acme's in it
            globex = history(server, period=period, days=1, tenant="globex")["rows"]
            assert all(row["requests"] == row["refusals"] == row["prompt_tokens"] == 0 for row in globex)

        # the day's counters are the ones the budgets keep: the same numbers as the `usage` action
        day = httpx.post(server.url + "/admin/plugins/tenancy/usage", json={"key_id": "k1"}, headers=ADMIN)
        assert day.json()["result"]["day"]["requests"] == 3


def test_one_row_per_period_oldest_first_and_every_counter_expires(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(config(prefix, upstream_url), admin_token="adm") as (_, server):
        assert chat(server, KEYS["other"]).status_code == 200
        hours = history(server, tenant="globex", period="hour")["rows"]
        days = history(server, tenant="globex", period="day", days=7)["rows"]
        assert len(hours) == 30 * 24 and len(days) == 7
        assert [r["start_unix"] for r in hours] == sorted(r["start_unix"] for r in hours)
        assert hours[-1]["start_unix"] <= time.time() < hours[-1]["start_unix"] + 3600
        assert days[-1]["start"] == datetime.now(UTC).strftime("%Y-%m-%dT00:00:00Z")
        for bad in ({"tenant": "globex", "days": 31}, {"tenant": "globex", "period": "week"}, {"days": 3}):
            reply = httpx.post(server.url + "/admin/plugins/tenancy/usage_history", json=bad, headers=ADMIN)
            assert reply.status_code == 400, bad
    client = redis.Redis()
    try:
        keys = list(client.scan_iter(match=f"{prefix}*:usage:*"))
        assert keys
        assert all(0 < client.ttl(key) <= 400 * 86400 for key in keys)
        hour_id = "h" + datetime.now(UTC).strftime("%Y%m%d%H")
        hour_key = usage_key(prefix, "globex", "tenant", "globex", hour_id)
        assert 30 * 86400 < client.ttl(hour_key) <= 31 * 86400
    finally:
        client.close()


@pytest.mark.parametrize("period", ["hour", "day"])
def test_the_periods_end_with_the_current_one(period: str) -> None:
    now = datetime(2026, 3, 1, 0, 30, tzinfo=UTC).timestamp()
    starts = periods(period, 2, now)  # type: ignore[arg-type]
    if period == "hour":
        assert len(starts) == 48
        assert starts[-1] == datetime(2026, 3, 1, 0, tzinfo=UTC)
        assert starts[0] == datetime(2026, 2, 27, 1, tzinfo=UTC)
    else:
        assert starts == [datetime(2026, 2, 28, tzinfo=UTC), datetime(2026, 3, 1, tzinfo=UTC)]
