"""Audit fields name the authenticated principal (issue 30): the reload history's "who" and the audit
line of a plugin action (a key created) say the admin token's holder and the connection's address; an
``X-Forwarded-For`` header counts only from a proxy named in ``GATEWAY_FORWARDED_ALLOW_IPS`` (none by
default: before, uvicorn's default believed it from 127.0.0.1, so any local process could write any
name into the history)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import yaml

from gateway.ops.settings import Settings
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import prefix

__all__ = ["prefix"]  # the fixture, used by name

ADMIN = "audit-principal-admin-token"
SPOOFED = "203.0.113.66"  # TEST-NET-3: no real client
HEADERS = {"authorization": f"Bearer {ADMIN}", "x-forwarded-for": SPOOFED, "content-type": "application/yaml"}


def config(prefix: str, upstream_url: str) -> dict[str, Any]:
    tenancy = {"name": "tenancy", "config": {"redis_prefix": prefix}}
    return base_config([upstream_url], plugins=[tenancy, {"name": "routing"}])


def push_and_read_history(server_url: str, body: dict[str, Any]) -> dict[str, Any]:
    pushed = httpx.put(server_url + "/admin/config", content=yaml.safe_dump(body), headers=HEADERS, timeout=10)
    assert pushed.status_code == 200, pushed.text
    history = httpx.get(server_url + "/admin/reloads", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert history.status_code == 200, history.text
    latest: dict[str, Any] = history.json()["reloads"][0]
    return latest


def test_the_reload_history_names_the_principal_not_a_forwarded_header(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    body = config(prefix, upstream_url)
    with gateway_factory(body, admin_token=ADMIN) as (_, server):
        body["upstream"]["idle_timeout_s"] = 3  # a change, so the push is a reload
        latest = push_and_read_history(server.url, body)
    assert SPOOFED not in latest["who"]
    assert latest["who"] == "admin token holder from 127.0.0.1"


def test_a_key_creation_is_audited_under_the_principal(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with gateway_factory(config(prefix, upstream_url), admin_token=ADMIN) as (_, server):
        with caplog.at_level(logging.INFO, logger="gateway.admin"):
            made = httpx.post(
                server.url + "/admin/plugins/tenancy/create_key",
                json={"tenant": "acme", "id": "audited-key"},
                headers={**HEADERS, "content-type": "application/json"},
                timeout=10,
            )
        assert made.status_code == 200, made.text
        key = made.json()["result"]["key"]
    lines = [r.fields for r in caplog.records if r.name == "gateway.admin" and hasattr(r, "fields")]
    assert {"who": "admin token holder from 127.0.0.1", "plugin": "tenancy", "action": "create_key"}.items() <= (
        lines[-1].items()
    )
    assert lines[-1]["id"] == "audited-key"
    assert SPOOFED not in caplog.text and key not in caplog.text  # the key itself is never logged


def test_forwarded_headers_count_only_from_a_configured_proxy(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    body = config(prefix, upstream_url)
    with gateway_factory(body, admin_token=ADMIN, forwarded_allow_ips="127.0.0.1") as (_, server):
        body["upstream"]["idle_timeout_s"] = 3
        latest = push_and_read_history(server.url, body)
    assert latest["who"] == f"admin token holder from {SPOOFED}"  # the proxy on 127.0.0.1 is believed


def test_forwarded_headers_are_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_FORWARDED_ALLOW_IPS", raising=False)
    assert Settings().proxy_options() == {"proxy_headers": False, "forwarded_allow_ips": None}
    monkeypatch.setenv("GATEWAY_FORWARDED_ALLOW_IPS", "10.0.0.0/8, 192.168.1.5")
    assert Settings().proxy_options() == {"proxy_headers": True, "forwarded_allow_ips": "10.0.0.0/8, 192.168.1.5"}
