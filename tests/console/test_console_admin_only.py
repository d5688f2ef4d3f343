"""Every route the console reads or writes is the admin token holder's only: a tenant's client key, valid
on the public API, is refused on each of them (in ``Authorization`` or in ``x-admin-token``, on the admin
port and on the public port), and the playground never forwards the admin token to a worker."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import USAGE_KEYS, prefix, usage_plugins

__all__ = ["prefix"]  # the fixture, imported to be used here

TOKEN = "console-admin-only-token-7f31"
TENANT_KEY = USAGE_KEYS["k2"]

#: What the page calls (console.js, charts.js, usage.js, batches.js), with a body where it sends one.
CONSOLE_CALLS: list[tuple[str, str, Any]] = [
    ("GET", "/admin/reloads", None),
    ("GET", "/admin/stats", None),
    ("GET", "/admin/series", None),
    ("GET", "/admin/workers", None),
    ("GET", "/admin/config", None),
    ("GET", "/admin/batches?limit=50", None),
    ("POST", "/admin/config/diff", b"models: []"),
    ("PUT", "/admin/config", b"models: []"),
    ("POST", "/admin/reload", None),
    ("POST", "/admin/plugins/tenancy/list_keys", b"{}"),
    ("POST", "/admin/plugins/tenancy/usage", b'{"tenant": "acme"}'),
    ("POST", "/admin/plugins/tenancy/usage_history", b'{"tenant": "acme"}'),
    ("POST", "/admin/plugins/tenancy/create_key", b'{"tenant": "acme", "id": "stolen"}'),
    ("POST", "/admin/plugins/tenancy/revoke_key", b'{"id": "k1"}'),
]
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _refused_with_tenant_key(base: str, method: str, path: str, body: Any) -> None:
    for headers in ({"authorization": f"Bearer {TENANT_KEY}"}, {"x-admin-token": TENANT_KEY}):
        answer = httpx.request(method, base + path, headers=headers, content=body)
        assert answer.status_code == 403, (path, headers, answer.text)
        assert answer.json()["error"]["code"] == "invalid_admin_token", path


@pytest.mark.parametrize("own_port", [True, False], ids=["admin-port", "public-port"])
def test_a_tenant_key_opens_no_console_route(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, own_port: bool
) -> None:
    admin_port = free_port() if own_port else None
    config = base_config([upstream_url], plugins=usage_plugins(prefix))
    with gateway_factory(config, admin_token=TOKEN, admin_port=admin_port) as (_, server):
        admin = f"http://127.0.0.1:{admin_port}" if own_port else server.url
        # The key is a good client key: the public API answers it.
        as_client = {"authorization": f"Bearer {TENANT_KEY}"}
        client_call = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=as_client)
        assert client_call.status_code == 200, client_call.text
        served = len(upstream.requests)

        for method, path, body in CONSOLE_CALLS:
            _refused_with_tenant_key(admin, method, path, body)
        if not own_port:  # on the public port the page and its files are admin routes too
            for path in ("/admin/ui", "/admin/ui/console.js", "/admin/ui/batches.js"):
                _refused_with_tenant_key(admin, "GET", path, None)

        # The playground: a client key in x-admin-token is refused; in Authorization alone, it is no admin token.
        as_admin = httpx.post(admin + "/admin/ui/chat", json=CHAT, headers={"x-admin-token": TENANT_KEY})
        assert as_admin.status_code == 403
        assert as_admin.json()["error"]["code"] == "invalid_admin_token"
        only_key = httpx.post(admin + "/admin/ui/chat", json=CHAT, headers={"authorization": f"Bearer {TENANT_KEY}"})
        assert only_key.status_code == 401
        assert len(upstream.requests) == served  # nothing of the above reached a worker

        # Nothing the refused calls asked for happened: no key created, none revoked.
        listed = httpx.post(admin + "/admin/plugins/tenancy/list_keys", json={}, headers={"x-admin-token": TOKEN})
        assert sorted(k["id"] for k in listed.json()["result"]["keys"]) == sorted(USAGE_KEYS)


def test_the_playground_never_hands_the_admin_token_to_a_worker(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    admin_port = free_port()
    config = base_config([upstream_url], plugins=usage_plugins(prefix))
    with gateway_factory(config, admin_token=TOKEN, admin_port=admin_port) as (_, _server):
        headers = {"x-admin-token": TOKEN, "authorization": f"Bearer {TENANT_KEY}", "x-request-id": "console-abc"}
        answer = httpx.post(f"http://127.0.0.1:{admin_port}/admin/ui/chat", json=CHAT, headers=headers)
        assert answer.status_code == 200, answer.text
        seen = upstream.requests[-1]
        assert "x-admin-token" not in seen.headers
        assert all(TOKEN not in value for value in seen.headers.values())
        assert TOKEN.encode() not in seen.raw
        assert TOKEN not in answer.text and all(TOKEN not in v for v in answer.headers.values())
