"""Tenants are isolated in the cache, and no credential ever reaches a log line.

Real tenancy and cache plugins against the real Redis: two tenants send the same deterministic
request; each tenant's second request is a hit, and neither ever gets the other's answer. A whole run
(client keys right and wrong, admin token right and wrong, streams, refusals, reloads) is logged at
DEBUG through the gateway's JSON formatter, and no secret appears in any line or in /metrics.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.ops.logs import JSONFormatter
from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

ADMIN = "adm-" + uuid.uuid4().hex
PEPPER = "pepper-" + uuid.uuid4().hex
BODY = {"model": "m1", "messages": [{"role": "user", "content": "what is the secret plan?"}], "temperature": 0}


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """(tenancy prefix, cache namespace) of this test; their Redis keys are deleted afterwards."""
    monkeypatch.setenv("GATEWAY_TENANCY_PEPPER", PEPPER)
    tag = uuid.uuid4().hex[:12]
    prefix, namespace = f"test:sec:{tag}", f"sec{tag}"
    yield prefix, namespace
    client = redis.Redis()
    for pattern in (f"{prefix}*", f"gwcache:{namespace}:*"):
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    client.close()


def config(upstream_url: str, prefix: str, namespace: str) -> dict[str, Any]:
    return base_config(
        [upstream_url],
        plugins=[
            {"name": "tenancy", "config": {"redis_prefix": prefix}},
            {"name": "cache", "config": {"namespace": namespace, "timeout_ms": 200}},
            {"name": "routing"},
        ],
    )


def create_key(server: ServerThread, tenant: str, key_id: str) -> str:
    reply = httpx.post(
        server.url + "/admin/plugins/tenancy/create_key",
        json={"tenant": tenant, "id": key_id},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["result"]["key"])


def ask(server: ServerThread, key: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions", json={**BODY, **extra}, headers={"authorization": f"Bearer {key}"}
    )


def wait_entries(client: redis.Redis, namespace: str, count: int) -> None:
    import time

    deadline = time.monotonic() + 5
    while len(list(client.scan_iter(match=f"gwcache:{namespace}:e:*"))) < count:
        assert time.monotonic() < deadline, f"expected {count} cache entries"
        time.sleep(0.01)


def test_a_tenant_never_reads_another_tenants_cached_answer(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, names: tuple[str, str]
) -> None:
    prefix, namespace = names
    client = redis.Redis()
    with gateway_factory(config(upstream_url, prefix, namespace), admin_token=ADMIN) as (_, server):
        key_a, key_b = create_key(server, "acme", "a1"), create_key(server, "globex", "b1")
        upstream.behavior.text = "acme's confidential answer"
        first_a = ask(server, key_a)
        assert first_a.headers["x-cache"] == "miss"
        wait_entries(client, namespace, 1)
        upstream.behavior.text = "globex's own answer"
        first_b = ask(server, key_b)
        assert first_b.headers["x-cache"] == "miss", "tenant B was served tenant A's cached answer"
        assert "acme" not in first_b.text
        wait_entries(client, namespace, 2)
        # Each tenant now hits its own entry, and only its own.
        again_a, again_b = ask(server, key_a), ask(server, key_b)
        assert (again_a.headers["x-cache"], again_b.headers["x-cache"]) == ("hit", "hit")
        assert "acme's confidential answer" in again_a.text and "globex's own answer" in again_b.text
        # A second key of tenant A shares A's entries (the scope is the tenant, not the key).
        key_a2 = create_key(server, "acme", "a2")
        assert ask(server, key_a2).headers["x-cache"] == "hit"
        # Headers a client controls do not pick the scope.
        spoof = httpx.post(
            server.url + "/v1/chat/completions",
            json=BODY,
            headers={"authorization": f"Bearer {key_b}", "x-tenant": "acme", "x-tenant-id": "acme"},
        )
        assert "acme" not in spoof.text
        # Nor does anything in the body: user, metadata, cache_salt are the client's own fields.
        for extra in ({"user": "acme"}, {"metadata": {"tenant": "acme"}}, {"cache_salt": "acme"}):
            assert "acme" not in ask(server, key_b, **extra).text
        # Without a key there is no answer at all, cached or not.
        anonymous = httpx.post(server.url + "/v1/chat/completions", json=BODY)
        assert anonymous.status_code == 401
        assert "acme" not in anonymous.text
    # Two misses, then cache_salt (a key field) misses once; user and metadata hit B's own entry.
    assert len(upstream.requests) == 2 + 1
    client.close()


def test_no_credential_appears_in_any_log_line_or_metric(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    names: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefix, namespace = names
    caplog.set_level(logging.DEBUG)
    wrong_key = "sk-gw-" + uuid.uuid4().hex
    wrong_admin = "adm-wrong-" + uuid.uuid4().hex
    cfg = config(upstream_url, prefix, namespace)
    cfg["logging"] = {"level": "DEBUG", "access_log": True}
    with gateway_factory(cfg, admin_token=ADMIN, log_level="DEBUG") as (_, server):
        key = create_key(server, "acme", "k1")
        secrets = [ADMIN, PEPPER, key, hash_key(key, PEPPER.encode()), wrong_key, wrong_admin]
        for credential in (key, wrong_key, ADMIN):
            ask(server, credential)
            ask(server, credential, vllm_xargs={"x": 1})  # a refusal
            with httpx.stream(
                "POST",
                server.url + "/v1/chat/completions",
                json={**BODY, "stream": True},
                headers={"authorization": f"Bearer {credential}"},
            ) as stream:
                stream.read()
        for token in (ADMIN, wrong_admin, key):
            for header in ({"authorization": f"Bearer {token}"}, {"x-admin-token": token}):
                httpx.get(server.url + "/admin/config", headers=header)
                httpx.post(server.url + "/admin/reload", headers=header)
        put = httpx.put(
            server.url + "/admin/config", content=orjson.dumps(cfg), headers={"authorization": f"Bearer {ADMIN}"}
        )
        assert put.status_code == 200
        shown = httpx.get(server.url + "/admin/config", headers={"authorization": f"Bearer {ADMIN}"}).text
        metrics = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    formatter = JSONFormatter()
    lines = [formatter.format(record) for record in caplog.records]
    assert any('"route":"chat/completions"' in line for line in lines)  # access lines were written
    assert any('"tenant":"acme"' in line for line in lines)
    for secret in secrets:
        leaked = [line for line in lines if secret in line]
        assert not leaked, leaked[:3]
        assert secret not in metrics
        assert secret not in shown
