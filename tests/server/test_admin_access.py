"""Admin routes are reachable only with the admin token, whatever the path spelling or headers; with
``GATEWAY_ADMIN_PORT`` the public port has no admin routes at all; tokens are compared with
``hmac.compare_digest``.

Requests are written on a raw socket so no client library normalises the path (``..``, ``//``,
percent-encoding) or the Host header before the gateway sees them.
"""

from __future__ import annotations

import hmac
import socket
from typing import Any

import httpx
import orjson
import pytest

from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "admin-token-under-test-7c1f"

PATHS = [
    "/admin/config",
    "//admin/config",
    "///admin//config",
    "/admin/../admin/config",
    "/v1/../admin/config",
    "/./admin/./config",
    "/%61dmin/config",
    "/admin%2Fconfig",
    "/%2Fadmin/config",
    "/ADMIN/config",
    "/Admin/Config",
    "/admin/config/",
    "/admin;/config",
    "/admin/config;x=1",
    "/admin/config%00",
    "/admin/config?token=" + TOKEN,
    "/admin/config#x",
    "http://localhost/admin/config",
    "/admin/reload",
    "/admin/plugins/routing/status",
]
HEADER_TRICKS: list[dict[str, str]] = [
    {},
    {"Host": "localhost"},
    {"Host": "127.0.0.1"},
    {"Host": "admin"},
    {"Host": "localhost:1"},
    {"X-Forwarded-For": "127.0.0.1"},
    {"X-Forwarded-Host": "localhost", "X-Forwarded-Proto": "https"},
    {"X-Real-IP": "127.0.0.1", "X-Client-IP": "127.0.0.1"},
    {"Forwarded": "for=127.0.0.1;host=localhost"},
    {"X-Original-URL": "/admin/config", "X-Rewrite-URL": "/admin/config"},
    {"X-Forwarded-Prefix": "/admin", "X-Forwarded-Path": "/admin/config"},
    {"Authorization": "Basic " + TOKEN},  # the right secret in the wrong scheme
    {"Authorization": "Bearer " + TOKEN[:-1]},  # a prefix of the token
    {"Authorization": "Bearer " + TOKEN + "x"},
    {"X-Admin-Token": TOKEN.upper()},
]


def raw_request(port: int, method: str, target: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request with the target and headers exactly as given; returns (status, body)."""
    lines = [f"{method} {target} HTTP/1.1"]
    if not any(k.lower() == "host" for k in headers):
        lines.append(f"Host: 127.0.0.1:{port}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("\r\n".join(lines).encode("latin-1") + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        payload = _dechunk(payload)
    return status, payload


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def assert_refused(status: int, payload: bytes, allowed: tuple[int, ...]) -> None:
    assert status in allowed, (status, payload[:300])
    if status == 400 and not payload.startswith(b"{"):
        return  # uvicorn's own answer to an unparsable request line: it never reached the app
    error = orjson.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert TOKEN not in error["message"]


@pytest.fixture
def admin_on_main_port(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> Any:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (_, server):
        yield server


@pytest.mark.parametrize("headers", HEADER_TRICKS, ids=lambda h: ",".join(h) or "plain")
def test_no_path_or_header_trick_reaches_admin_without_the_token(
    admin_on_main_port: Any, headers: dict[str, str]
) -> None:
    port = admin_on_main_port.port
    version = httpx.get(admin_on_main_port.url + "/admin/config", headers={"authorization": f"Bearer {TOKEN}"})
    assert version.status_code == 200  # the token itself works
    before = version.json()["version"]
    for path in PATHS:
        for method, body in (("GET", b""), ("POST", b"{}"), ("PUT", b"models: []\n")):
            status, payload = raw_request(port, method, path, headers, body)
            # 401/403 from the admin guard, 404/405 for spellings that are not an admin route, 400
            # for a request line the server cannot parse. Never 2xx, never a redirect into admin.
            assert_refused(status, payload, (400, 401, 403, 404, 405))
    after = httpx.get(admin_on_main_port.url + "/admin/config", headers={"authorization": f"Bearer {TOKEN}"})
    assert after.json()["version"] == before


def test_with_an_admin_port_the_public_port_has_no_admin_routes_even_with_the_token(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    admin_port = free_port()
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN, admin_port=admin_port) as (_, server):
        good = {"Authorization": f"Bearer {TOKEN}"}
        for path in PATHS:
            for headers in (
                {},
                good,
                {**good, "Host": f"127.0.0.1:{admin_port}"},
                {**good, "X-Forwarded-Port": str(admin_port)},
            ):
                status, payload = raw_request(server.port, "GET", path, headers)
                assert_refused(status, payload, (400, 404, 405))
        # The admin port serves admin, still only with the token, and serves no client routes.
        status, _ = raw_request(admin_port, "GET", "/admin/config", good)
        assert status == 200
        status, payload = raw_request(admin_port, "GET", "/admin/config", {"Host": "localhost"})
        assert_refused(status, payload, (401,))
        status, payload = raw_request(
            admin_port,
            "POST",
            "/v1/chat/completions",
            good,
            b'{"model":"m1","messages":[{"role":"user","content":"x"}]}',
        )
        assert_refused(status, payload, (404, 405))
    assert upstream.requests == []


def test_admin_disabled_without_a_token_even_from_loopback(gateway: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}, {"Host": "localhost"}):
        status, payload = raw_request(gateway.port, "GET", "/admin/config", headers)
        assert_refused(status, payload, (403,))
        assert orjson.loads(payload)["error"]["code"] == "admin_disabled"


def test_admin_token_is_compared_with_compare_digest(admin_on_main_port: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("gateway.server.admin_auth.hmac.compare_digest", recording)
    statuses = []
    for presented in ("wrong", TOKEN, "é-non-ascii"):
        response = httpx.get(admin_on_main_port.url + "/admin/config", headers={b"x-admin-token": presented.encode()})
        statuses.append(response.status_code)
    assert statuses == [403, 200, 403]
    assert len(calls) == 3
    assert all(isinstance(a, bytes) and b == TOKEN.encode() for a, b in calls)
