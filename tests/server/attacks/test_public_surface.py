"""What the public port tells a caller without credentials: /ready its status only, /metrics no tenant
or key id, the same 401 for every model, and a request with two credentials is a 400."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import orjson

from plugins.tenancy.keys import hash_key
from tests.server.attacks.raw import CHAT, connect, parse, read_until_closed
from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

ADMIN = "surface-admin-token"
KEY = "sk-surface-key-of-tenant-acme"
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}


def tenancy_config(prefix: str, upstream_url: str) -> dict[str, Any]:
    config = base_config(
        [upstream_url],
        plugins=[
            {
                "name": "tenancy",
                "config": {
                    "redis_prefix": prefix,
                    "keys": [
                        {"id": "acme-ci", "tenant": "acme", "hash": hash_key(KEY, PEPPER.encode()), "models": ["m1"]}
                    ],
                },
            },
            {"name": "routing"},
        ],
    )
    config["models"].append({"name": "m2", "workers": [upstream_url]})
    return config


def chat(url: str, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": model}, headers=headers or {}, timeout=10)


def test_ready_and_metrics_show_who_calls_only_to_the_admin(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    admin_port = free_port()
    config = tenancy_config(prefix, upstream_url)
    with gateway_factory(config, admin_token=ADMIN, admin_port=admin_port) as (_, server):
        assert chat(server.url, "m1", {"authorization": f"Bearer {KEY}"}).status_code == 200
        assert chat(server.url, "m1", {"authorization": "Bearer sk-wrong"}).status_code == 401
        public = httpx.get(server.url + "/metrics").text
        assert "acme" not in public and "acme-ci" not in public and "tenant=" not in public and "key_id=" not in public
        assert "gateway_tenancy_requests_total 1.0" in public  # summed over tenants and keys
        assert 'gateway_tenancy_refusals_total{reason="invalid_api_key"} 1.0' in public
        assert "gateway_in_flight_requests" in public and "gateway_requests_total" in public  # what an HPA needs
        for full in (
            httpx.get(server.url + "/metrics", headers=AS_ADMIN).text,
            httpx.get(f"http://127.0.0.1:{admin_port}/metrics").text,  # the admin port: every series
        ):
            assert 'gateway_tenancy_requests_total{key_id="acme-ci",tenant="acme"} 1.0' in full
        # any other credential on the public port is the admin API's refusal, not a public view
        assert httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 403

        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        detailed = httpx.get(server.url + "/ready", headers=AS_ADMIN).json()
        assert set(detailed["models"]) == {"m1", "m2"} and detailed["config_version"]
        assert set(httpx.get(f"http://127.0.0.1:{admin_port}/ready").json()["models"]) == {"m1", "m2"}


def test_the_same_401_for_every_model_without_a_valid_key(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(tenancy_config(prefix, upstream_url)) as (_, server):
        for credentials in ({}, {"authorization": "Bearer sk-not-a-key"}, {"authorization": "Basic abc"}):
            answers = {
                model: chat(server.url, model, credentials) for model in ("m1", "m2", "alias-1", "no-such-model")
            }
            for model in ("m1", "no-such-model"):
                answers[f"/tokenize {model}"] = httpx.post(
                    server.url + "/tokenize", json={"model": model, "prompt": "hi"}, headers=credentials
                )
            answers["GET /v1/models/m1"] = httpx.get(server.url + "/v1/models/m1", headers=credentials)
            answers["GET /v1/models/nope"] = httpx.get(server.url + "/v1/models/nope", headers=credentials)
            assert {r.status_code for r in answers.values()} == {401}, {k: r.status_code for k, r in answers.items()}
            assert len({r.content for r in answers.values()}) == 1  # word for word
        # with a valid key: a model it may not use and one that does not exist are the same 404
        key = {"authorization": f"Bearer {KEY}"}
        other, missing = chat(server.url, "m2", key), chat(server.url, "no-such-model", key)
        assert other.status_code == missing.status_code == 404
        assert other.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"
        assert other.json()["error"]["message"].replace("m2", "X") == missing.json()["error"]["message"].replace(
            "no-such-model", "X"
        )
    assert upstream.requests == []


def send_two(port: int, method: str, path: str, first: str, second: str, body: bytes = b"") -> tuple[int, dict]:
    head = f"{method} {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n{first}\r\n{second}\r\n"
    if body:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    sock: socket.socket
    with connect(port) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        status, _, payload = parse(read_until_closed(sock))
    return status, orjson.loads(payload)


def test_two_credentials_are_a_400_wherever_they_are_read(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    body = orjson.dumps(CHAT)
    good, bad = f"Authorization: Bearer {KEY}", "Authorization: Bearer sk-other"
    with gateway_factory(tenancy_config(prefix, upstream_url), admin_token=ADMIN) as (_, server):
        cases = [
            ("POST", "/v1/chat/completions", good, bad, body),
            ("POST", "/v1/chat/completions", bad, good, body),
            ("POST", "/v1/chat/completions", good, good, body),
            ("POST", "/v1/chat/completions", good, good.lower(), body),
            ("POST", "/v1/chat/completions", good, bad, orjson.dumps({**CHAT, "model": "no-such-model"})),
            ("GET", "/v1/models", good, bad, b""),
            ("GET", "/admin/config", f"Authorization: Bearer {ADMIN}", bad, b""),
            ("GET", "/admin/config", bad, f"Authorization: Bearer {ADMIN}", b""),
            ("GET", "/admin/config", f"x-admin-token: {ADMIN}", "x-admin-token: other", b""),
            ("GET", "/metrics", f"Authorization: Bearer {ADMIN}", bad, b""),
        ]
        for method, path, first, second, payload in cases:
            status, answer = send_two(server.port, method, path, first, second, payload)
            assert status == 400, (method, path, first, second, answer)
            assert answer["error"]["code"] == "duplicate_credentials"
        # one of each is fine
        assert chat(server.url, "m1", {"authorization": f"Bearer {KEY}"}).status_code == 200
    assert len(upstream.requests) == 1
