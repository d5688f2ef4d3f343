"""Tenancy keys against real Redis: created on one replica and usable on another, revoked everywhere
within a second, 401/404 in OpenAI's shape, and never written to a log line."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.ops.logs import JSONFormatter
from gateway.pipeline.services import TENANT_OF
from gateway.wire.errors import AuthenticationFailed
from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

ADMIN = "admin-secret-token"


def tenancy(prefix: str, upstream_url: str, **config: Any) -> dict[str, Any]:
    section = {"redis_prefix": prefix, **config}
    return base_config([upstream_url], plugins=[{"name": "tenancy", "config": section}, {"name": "routing"}])


def admin(server: ServerThread, action: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{server.url}/admin/plugins/tenancy/{action}", json=body, headers={"authorization": f"Bearer {ADMIN}"}
    )


def chat(server: ServerThread, key: str | None, model: str = "m1") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)


def sdk(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_key_created_on_one_replica_works_on_another_and_revocation_reaches_it(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url, tenants={"team-a": {}})
    with (
        gateway_factory(config, admin_token=ADMIN) as (_, a),
        gateway_factory(config, admin_token=ADMIN) as (_, b),
    ):
        created = admin(a, "create_key", {"tenant": "team-a", "id": "ci-bot"})
        assert created.status_code == 200, created.text
        key = created.json()["result"]["key"]
        reply = sdk(b, key).chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "Hello from the fake worker."
        listed = admin(b, "list_keys", {}).json()["result"]["keys"]
        assert listed == [{"id": "ci-bot", "tenant": "team-a", "source": "redis"}]

        assert admin(a, "revoke_key", {"id": "ci-bot"}).json()["result"] == {"id": "ci-bot", "revoked": True}
        assert chat(a, key).status_code == 401  # the replica that revoked it: at once
        time.sleep(1.0)  # every other replica: within a second (key_cache_ttl_s <= 1)
        refused = chat(b, key)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert admin(a, "revoke_key", {"id": "ci-bot"}).status_code == 404


def test_sdk_raises_authentication_error_and_never_sees_the_key(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    bad = "sk-gw-this-is-not-a-real-key-0123456789"
    with gateway_factory(tenancy(prefix, upstream_url)) as (_, server):
        with pytest.raises(openai.AuthenticationError) as info:
            sdk(server, bad).chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        assert info.value.code == "invalid_api_key"
        assert info.value.status_code == 401
        assert bad not in info.value.response.text
        missing = chat(server, None)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        basic = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Basic dXNlcjpwYXNz"},
        )
        assert basic.status_code == 401
    assert upstream.requests == []


def test_model_not_allowed_is_404_like_openai(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    key = "sk-config-key-for-team-b"
    keys = [{"id": "b1", "tenant": "team-b", "hash": hash_key(key, PEPPER.encode()), "models": ["other-*"]}]
    with gateway_factory(tenancy(prefix, upstream_url, keys=keys)) as (_, server):
        with pytest.raises(openai.NotFoundError) as info:
            sdk(server, key).chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        assert info.value.code == "model_not_found"
        assert "do not have access" in info.value.message
    assert upstream.requests == []


def test_config_key_by_hash_with_patterns_and_aliases(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    key = "sk-config-key-for-team-c"
    keys = [{"id": "c1", "tenant": "team-c", "hash": "sha256:" + hash_key(key, PEPPER.encode()), "models": ["m?"]}]
    with gateway_factory(tenancy(prefix, upstream_url, keys=keys), admin_token=ADMIN) as (app, server):
        assert chat(server, key).status_code == 200
        assert chat(server, key, model="alias-1").status_code == 200  # an alias of an allowed model
        # a key defined in config.yaml cannot be revoked through the API
        assert admin(server, "revoke_key", {"id": "c1"}).json()["error"]["code"] == "config_key"
        tenant_of = app.state.services.shared[TENANT_OF]
        loop = server.server.servers[0].get_loop()
        found = asyncio.run_coroutine_threadsafe(tenant_of({"authorization": f"Bearer {key}"}), loop)
        assert found.result(timeout=5) == "team-c"
        refused = asyncio.run_coroutine_threadsafe(tenant_of({"authorization": "Bearer sk-nope"}), loop)
        with pytest.raises(AuthenticationFailed):
            refused.result(timeout=5)
        # the admin API tells a client key apart from the admin token
        as_client = httpx.post(
            f"{server.url}/admin/plugins/tenancy/list_keys", json={}, headers={"authorization": f"Bearer {key}"}
        )
        assert as_client.status_code == 403


def test_auth_off_makes_every_request_the_anonymous_tenant(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url, auth=False, anonymous_tenant="dev")
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        assert chat(server, None).status_code == 200
        assert chat(server, "anything").status_code == 200
        usage = admin(server, "usage", {"tenant": "dev"}).json()["result"]
        assert usage["day"]["requests"] == 2
        assert usage["day"]["prompt_tokens"] == 10  # the fake worker reports 5 per request


def test_keys_never_appear_in_logs_or_metrics(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    secrets: list[str] = ["sk-gw-wrong-key-that-must-not-leak"]
    config = tenancy(prefix, upstream_url, tenants={"t": {"requests_per_minute": 2}})
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        key = admin(server, "create_key", {"tenant": "t", "id": "leaky"}).json()["result"]["key"]
        secrets += [key, hash_key(key, PEPPER.encode())]
        for _ in range(3):  # 200, 200, 429
            chat(server, key)
        chat(server, secrets[0])
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            headers={"authorization": f"Bearer {key}"},
        ) as stream:
            stream.read()
        admin(server, "usage", {"key_id": "leaky"})
        admin(server, "revoke_key", {"id": "leaky"})
        chat(server, key)
        metrics = httpx.get(f"{server.url}/metrics", headers={"x-admin-token": ADMIN}).text
        public = httpx.get(f"{server.url}/metrics").text
    assert 'gateway_tenancy_refusals_total{reason="requests_per_minute",tenant="t"} 2.0' in metrics
    assert 'gateway_tenancy_refusals_total{reason="requests_per_minute"} 2.0' in public
    formatter = JSONFormatter()
    lines = [formatter.format(record) for record in caplog.records]
    assert any('"tenant":"t"' in line for line in lines)  # the access log did run
    for secret in secrets:
        assert secret not in metrics
        assert not [line for line in lines if secret in line]


def test_a_created_key_whose_id_the_running_config_declares_is_refused_and_can_be_revoked(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """``create_key`` refuses an id any loaded config declared (it is kept in Redis as config's), and a
    config declaring a created id is refused when it loads; but where that record is missing (the config
    loaded while Redis was unreachable) a replica whose config does not declare the id may create it
    while another runs a config that does. The created key is then refused (two keys under one id would
    share its counters and limits), and revoking that id revokes it (which would otherwise stay in Redis
    with no way to remove it), while the config's key stays valid until removed there."""
    declared = "sk-gw-declared-in-config"
    keys = [{"id": "shared-id", "tenant": "team-b", "hash": hash_key(declared, PEPPER.encode())}]
    with (
        gateway_factory(tenancy(prefix, upstream_url, keys=keys), admin_token=ADMIN) as (_, server),
        gateway_factory(tenancy(prefix, upstream_url), admin_token=ADMIN) as (_, older),
    ):
        taken = admin(older, "create_key", {"tenant": "team-a", "id": "shared-id"})
        assert taken.status_code == 400 and taken.json()["error"]["code"] == "key_exists"  # config's, in Redis
        with redis.Redis() as client:  # as if the config had loaded while Redis was unreachable
            assert client.hdel(f"{prefix}:key-ids", "shared-id") == 1
        created = admin(older, "create_key", {"tenant": "team-a", "id": "shared-id"})
        assert created.status_code == 200, created.text
        made = created.json()["result"]["key"]
        assert chat(older, made).status_code == 200  # that replica's config does not declare the id
        refused = chat(server, made)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert chat(server, declared).status_code == 200

        revoked = admin(server, "revoke_key", {"id": "shared-id"})
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["result"]["revoked"] is True
        assert "config.yaml also declares" in revoked.json()["result"]["note"]
        refused = chat(server, made)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert chat(server, declared).status_code == 200
        listed = admin(server, "list_keys", {}).json()["result"]["keys"]
        assert listed == [{"id": "shared-id", "tenant": "team-b", "source": "config"}]
        # Nothing created is left under the id: the config's key is removed in config.yaml.
        again = admin(server, "revoke_key", {"id": "shared-id"})
        assert again.status_code == 400 and again.json()["error"]["code"] == "config_key"
