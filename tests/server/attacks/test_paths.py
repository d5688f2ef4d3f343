"""Percent-encoded paths are decoded once, before routing, for every route; encoded slashes, dot
segments and control characters are a 400 before any route sees them."""

from __future__ import annotations

import httpx
import pytest

from tests.server.attacks.raw import CHAT, connect, parse, read_until_closed, served
from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import GatewayFactory, base_config

ADMIN = "paths-admin-token"


def raw_request(port: int, method: str, target: str, headers: str = "", body: bytes = b"") -> tuple[int, bytes]:
    """Send the target exactly as written (clients normalise paths; an attacker does not)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n{headers}"
    if body:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    with connect(port) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        status, _, payload = parse(read_until_closed(sock))
    return status, payload


def test_encoded_paths_behave_as_the_decoded_path(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    body = httpx.Request("POST", "/", json=CHAT).read()
    auth = f"authorization: Bearer {ADMIN}\r\n"
    with gateway_factory(base_config([upstream_url]), admin_token=ADMIN) as (_, server):
        port = server.port
        for target in ("/v1/chat/completions", "/v1/%63hat/completions", "/%76%31/chat/completions"):
            status, payload = raw_request(port, "POST", target, body=body)
            assert status == 200 and b"chat.completion" in payload, (target, payload)
        # the admin routes: the same answer as the decoded path, token required either way
        assert raw_request(port, "GET", "/admin/config")[0] == raw_request(port, "GET", "/%61dmin/config")[0] == 401
        assert raw_request(port, "GET", "/%61dmin/config", auth)[0] == 200
        assert raw_request(port, "GET", "/v1/%6dodels")[0] == 200
        # decoded once: a double-encoded path stays encoded and matches nothing
        assert raw_request(port, "GET", "/%2561dmin/config", auth)[0] == 404
    assert len(upstream.requests) == 3


@pytest.mark.parametrize(
    "target",
    [
        "/v1%2Fchat/completions",
        "/v1%2fchat/completions",
        "/v1%5Cchat/completions",
        "/v1/../admin/config",
        "/v1/./chat/completions",
        "/v1/%2e%2e/admin/config",
        "/v1/%2E/chat/completions",
        "/health%00",
        "/health%0d%0aX-Injected:%201",
        "/v1\\chat/completions",
    ],
)
def test_ambiguous_paths_are_400_before_routing(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, target: str
) -> None:
    with gateway_factory(base_config([upstream_url]), admin_token=ADMIN) as (_, server):
        body = httpx.Request("POST", "/", json=CHAT).read()
        for method, payload in (("POST", body), ("GET", b"")):
            status, answer = raw_request(server.port, method, target, f"authorization: Bearer {ADMIN}\r\n", payload)
            assert status == 400, (target, answer)
            error = httpx.Response(400, content=answer).json()["error"]
            assert error["code"] == "invalid_path" and error["type"] == "invalid_request_error"
        served(server)
    assert len(upstream.requests) == 1  # the normal client's


def test_the_admin_port_applies_the_same_rules_and_the_public_port_has_no_admin_routes(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    admin_port = free_port()
    auth = f"authorization: Bearer {ADMIN}\r\n"
    # raw_request's Host is "gateway": a name the admin port answers only when it is listed
    settings = {"admin_token": ADMIN, "admin_port": admin_port, "admin_hosts": "gateway"}
    with gateway_factory(base_config([upstream_url]), **settings) as (_, server):
        assert raw_request(server.port, "GET", "/%61dmin/config", auth)[0] == 404
        assert raw_request(admin_port, "GET", "/%61dmin/config", auth)[0] == 200
        assert raw_request(admin_port, "GET", "/%61dmin%2Fconfig", auth)[0] == 400
        assert raw_request(admin_port, "GET", "/admin/../admin/config", auth)[0] == 400
