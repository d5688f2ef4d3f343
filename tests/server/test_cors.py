"""CORS, with real preflight requests: off by default; when configured, a preflight is answered at the ASGI
level without reaching a route or a plugin (tenancy with auth on would refuse it otherwise), an origin,
method or header the config does not allow gets a 403 without CORS headers, and every actual response to an
allowed origin, errors and SSE streams included, carries the headers, while other origins' get none. A real
chromium page on another origin calls the gateway: allowed, its fetch works; not allowed, the browser
blocks it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.pipeline.config import ConfigError, parse_config
from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

ALLOWED = "https://app.example.com"
PEPPER = "pepper-" + uuid.uuid4().hex
KEY = "sk-cors-" + uuid.uuid4().hex
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "Hi"}]}


def preflight(
    url: str, origin: str, method: str = "POST", headers: str = "authorization, content-type"
) -> httpx.Response:
    return httpx.options(
        url,
        headers={"origin": origin, "access-control-request-method": method, "access-control-request-headers": headers},
    )


@pytest.fixture
def server(
    gateway_factory: GatewayFactory, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ServerThread]:
    monkeypatch.setenv("GATEWAY_TENANCY_PEPPER", PEPPER)
    prefix = f"test:cors:{uuid.uuid4().hex[:12]}"
    keys = [{"id": "k1", "tenant": "acme", "hash": hash_key(KEY, PEPPER.encode())}]
    plugins = [{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}}, {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins, cors={"allow_origins": [ALLOWED, "http://127.0.0.1:1"]})
    with gateway_factory(config, admin_token="adm") as (_, running):
        yield running
    client = redis.Redis()
    stale = list(client.scan_iter(match=f"{prefix}*"))
    if stale:
        client.delete(*stale)
    client.close()


def test_off_by_default(gateway: ServerThread) -> None:
    url = gateway.url + "/v1/chat/completions"
    reply = preflight(url, ALLOWED)
    assert reply.status_code == 405 and "access-control-allow-origin" not in reply.headers
    assert "access-control-allow-origin" not in httpx.post(url, json=CHAT, headers={"origin": ALLOWED}).headers


def test_preflight_is_answered_without_a_route_or_plugin(server: ServerThread, upstream: FakeUpstream) -> None:
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/models", "/v1/no-such-route"):
        reply = preflight(server.url + path, ALLOWED, headers="Authorization, Content-Type, X-Stainless-OS")
        assert reply.status_code == 204, (path, reply.text)
        assert reply.headers["access-control-allow-origin"] == ALLOWED
        assert reply.headers["access-control-allow-methods"] == "DELETE, GET, OPTIONS, POST"
        assert reply.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
        assert reply.headers["access-control-max-age"] == "600"
    assert upstream.requests == []  # and tenancy (auth on) would have refused it: no plugin saw it


@pytest.mark.parametrize(
    ("origin", "method", "headers"),
    [
        ("https://evil.example.com", "POST", "content-type"),
        ("https://app.example.com.evil.com", "POST", "content-type"),
        ("http://app.example.com", "POST", "content-type"),  # another scheme is another origin
        ("null", "POST", "content-type"),
        (ALLOWED, "PUT", "content-type"),
        (ALLOWED, "POST", "content-type, x-admin-token"),
    ],
)
def test_preflight_refuses_what_the_config_does_not_allow(
    server: ServerThread, origin: str, method: str, headers: str
) -> None:
    reply = preflight(server.url + "/v1/chat/completions", origin, method, headers)
    assert reply.status_code == 403
    assert reply.json()["error"]["code"] == "cors_not_allowed"
    assert not [h for h in reply.headers if h.startswith("access-control-")]


def test_actual_responses_carry_the_headers_for_allowed_origins_only(server: ServerThread) -> None:
    allowed = {"origin": ALLOWED, "authorization": f"Bearer {KEY}"}
    url = server.url + "/v1/chat/completions"
    answers = [
        httpx.post(url, json=CHAT, headers=allowed),  # an answer
        httpx.post(url, json=CHAT, headers={"origin": ALLOWED}),  # tenancy's 401
        httpx.post(url, json={**CHAT, "model": "nope"}, headers=allowed),  # 404
        httpx.post(server.url + "/v1/%2e%2e/admin", headers=allowed),  # the path check's 400
        httpx.post(server.url + "/v1/messages", json={"model": "m1"}, headers=allowed),  # Anthropic's 400
        httpx.get(server.url + "/v1/models", headers=allowed),
    ]
    assert [a.status_code for a in answers] == [200, 401, 404, 400, 400, 200]
    for answer in answers:
        assert answer.headers["access-control-allow-origin"] == ALLOWED
        assert answer.headers["access-control-expose-headers"] == "x-request-id, retry-after"
        assert answer.headers["vary"] == "origin"
    with httpx.stream("POST", url, json={**CHAT, "stream": True}, headers=allowed) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert stream.headers["access-control-allow-origin"] == ALLOWED
        assert "[DONE]" in stream.read().decode()

    # another origin's request still runs (CORS is the browser's rule, keys are the gateway's), bare
    other = httpx.post(url, json=CHAT, headers={**allowed, "origin": "https://evil.example.com"})
    assert other.status_code == 200 and not [h for h in other.headers if h.startswith("access-control-")]
    # the admin API is never for other origins' pages
    admin = httpx.get(server.url + "/admin/config", headers={"origin": ALLOWED, "x-admin-token": "adm"})
    assert admin.status_code == 200 and "access-control-allow-origin" not in admin.headers


def test_origins_are_checked_when_the_config_is() -> None:
    for origin in ("app.example.com", "https://app.example.com/", "https://app.example.com/path", "ftp://x"):
        with pytest.raises(ConfigError, match="is not an origin"):
            parse_config(orjson.dumps({**base_config(["http://127.0.0.1:1"]), "cors": {"allow_origins": [origin]}}))
    config = parse_config(orjson.dumps({**base_config(["http://127.0.0.1:1"]), "cors": {"allow_origins": ["*"]}}))
    assert config.cors.allow_origins == ["*"]


class _Page:
    """Serves one HTML page from its own origin (another port of 127.0.0.1)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": b"<!doctype html><title>app</title>"})


def test_a_browser_on_another_origin(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream, tmp_path: Path
) -> None:
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("no chromium (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with ServerThread(_Page()) as app_page, ServerThread(_Page()) as other_page:
        config = base_config([upstream_url], cors={"allow_origins": [app_page.url]})
        with gateway_factory(config) as (_, gateway), sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])
            try:
                script = """async ([url, body]) => {
                    try {
                        const r = await fetch(url, {method: "POST", body: JSON.stringify(body),
                            headers: {"content-type": "application/json", "authorization": "Bearer unused"}});
                        return [r.status, (await r.json()).choices[0].message.content, r.headers.get("x-request-id")];
                    } catch (e) { return ["blocked", String(e)]; }
                }"""
                results = []
                for origin in (app_page, other_page):
                    page = browser.new_page()
                    page.goto(origin.url + "/")
                    results.append(page.evaluate(script, [gateway.url + "/v1/chat/completions", CHAT]))
                    page.close()
            finally:
                browser.close()
    assert results[0][:2] == [200, "Hello from the fake worker."] and results[0][2]  # x-request-id exposed
    assert results[1][0] == "blocked"
    # the disallowed page's preflight was refused: its POST never reached the gateway's routes
    assert len([r for r in upstream.requests if r.path == "/v1/chat/completions"]) == 1
