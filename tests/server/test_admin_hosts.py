"""The admin port answers only a ``Host`` no one else's DNS can stand for (an IP literal, ``localhost``, a
name in ``GATEWAY_ADMIN_HOSTS``): a page on a rebinding domain cannot read ``/metrics`` or the console
through a browser. Anything else is a 421 ``host_not_allowed`` in OpenAI's shape, whatever the token.

Requests are written on a raw socket so the Host header is exactly the one under test."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.ops.settings import Settings
from gateway.server.admin_hosts import host_allowed, host_names
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "admin-hosts-token-3b81"
LISTED = "Gateway-Admin.Monitoring.svc., prom-target"  # a Service name as Prometheus scrapes it, and another
PATHS = ["/metrics", "/admin/ui", "/admin/config", "/ready", "/admin/nowhere"]


def raw_get(port: int, path: str, hosts: list[str]) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` with exactly the ``Host`` headers given (none, one or several) and the admin token."""
    lines = [f"GET {path} HTTP/1.1", *(f"Host: {h}" for h in hosts), f"Authorization: Bearer {TOKEN}"]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("\r\n".join([*lines, "Connection: close", "", ""]).encode("latin-1"))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    return int(status_line.split(" ", 2)[1]), headers, body


@pytest.fixture
def admin_port(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> Iterator[tuple[int, ServerThread]]:
    """(the admin port, the public server) of a gateway with ``LISTED`` names."""
    port = free_port()
    settings = {"admin_token": TOKEN, "admin_port": port, "admin_hosts": LISTED}
    with gateway_factory(base_config([upstream_url]), **settings) as (_, server):
        yield port, server


ALLOWED = [
    "127.0.0.1:{port}", "127.0.0.1", "10.12.0.7:8001", "LOCALHOST:{port}", "localhost", "localhost.", "[::1]:{port}",
    "[::1]", "[2001:db8::7]:8001", "gateway-admin.monitoring.svc:{port}", "GATEWAY-ADMIN.MONITORING.SVC.",
    "prom-target", "prom-target:9100",
]  # fmt: skip


@pytest.mark.parametrize("host", ALLOWED)
def test_ip_literals_localhost_and_listed_names_are_answered(admin_port: tuple[int, ServerThread], host: str) -> None:
    port, _ = admin_port
    status, _, body = raw_get(port, "/metrics", [host.format(port=port)])
    assert status == 200, body[:300]
    assert b"gateway_requests" in body or b"# HELP" in body


#: Well-formed hosts: what a browser sends for a page on a rebinding domain (and near misses of the
#: allowed ones).
REFUSED = [
    ["evil.example"], ["evil.example:{port}"], ["rebind.127.0.0.1.nip.io:{port}"], ["127.0.0.1.evil.example"],
    ["localhost.evil.example"], ["evil-localhost"], ["prom-target.evil.example"], ["gateway-admin:{port}"],
    ["127.1"], ["0x7f.0.0.1"], ["2130706433:{port}"],
]  # fmt: skip
#: Not a host at all, or not one: the front door may refuse these first (400 ``invalid_http_request``).
MALFORMED = [
    ["::1"], ["[::1"], ["[::1]x"], ["[evil.example]:80"], ["127.0.0.1:"], ["127.0.0.1:80x"], ["127.0.0.1:123456"],
    [":{port}"], [""], ["127.0.0.1", "evil.example"], ["localhost", "localhost"],
]  # fmt: skip


def assert_refused(port: int, hosts: list[str], codes: tuple[str, ...]) -> None:
    for path in PATHS:
        status, headers, body = raw_get(port, path, [h.format(port=port) for h in hosts])
        assert status in (421, 400), (path, status, body[:300])
        error = orjson.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] in codes, error
        assert (status == 421) == (error["code"] == "host_not_allowed")
        assert headers.get("x-request-id")  # the front door's own 400s carry one too
        assert b"gateway_" not in body and TOKEN.encode() not in body


@pytest.mark.parametrize("hosts", REFUSED, ids=lambda h: "|".join(h))
def test_any_other_host_is_a_421_whatever_the_token(admin_port: tuple[int, ServerThread], hosts: list[str]) -> None:
    port, _ = admin_port
    assert_refused(port, hosts, ("host_not_allowed",))
    _, _, body = raw_get(port, "/metrics", [hosts[0].format(port=port)])
    assert "GATEWAY_ADMIN_HOSTS" in orjson.loads(body)["error"]["message"]


@pytest.mark.parametrize("hosts", MALFORMED, ids=lambda h: "|".join(h) or "empty")
def test_a_malformed_or_repeated_host_is_refused(admin_port: tuple[int, ServerThread], hosts: list[str]) -> None:
    port, _ = admin_port
    assert_refused(port, hosts, ("host_not_allowed", "invalid_http_request"))


def test_a_request_without_host_is_refused(admin_port: tuple[int, ServerThread]) -> None:
    port, _ = admin_port
    status, _, body = raw_get(port, "/metrics", [])
    assert status in (400, 421), body[:300]  # HTTP/1.1 requires Host: the parser may refuse it first
    assert b"gateway_" not in body


def test_the_public_port_answers_any_host(admin_port: tuple[int, ServerThread]) -> None:
    """Clients reach the public port by whatever name their ingress has: it checks no Host."""
    _, server = admin_port
    reply = httpx.get(server.url + "/v1/models", headers={"host": "api.example.com"})
    assert reply.status_code == 200, reply.text


def test_the_listed_names_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_HOSTS", " vllm-gateway-admin , ,metrics.internal.")
    names = host_names(Settings().admin_host_names())
    assert names == {"localhost", "vllm-gateway-admin", "metrics.internal"}
    assert host_allowed("vllm-gateway-admin:8001", names) and host_allowed("Metrics.Internal", names)
    monkeypatch.delenv("GATEWAY_ADMIN_HOSTS")
    assert host_names(Settings().admin_host_names()) == {"localhost"}
