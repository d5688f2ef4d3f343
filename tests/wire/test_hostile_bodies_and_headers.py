"""Hostile and malformed request bodies and headers: each is answered in OpenAI's error shape (or
served), nothing returns 5xx, and the gateway keeps serving afterwards."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.wire.protocol import MAX_DEPTH, decimal
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m1", "messages": MESSAGES}


def post(server: ServerThread, body: Any, path: str = "/v1/chat/completions", **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=30, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"] == "application/json"
    assert "x-request-id" in response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def still_serving(server: ServerThread) -> None:
    assert post(server, CHAT).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m1","messages":[{"role":"user","content":"\xff\xfe bad"}]}',  # invalid UTF-8
        b'{"model":"m1","messages":[{"role":"user","content":"\xed\xa0\x80"}]}',  # UTF-8-encoded surrogate
        b'{"model":"m1","messages":[{"role":"user","content":"\\ud800"}]}',  # lone surrogate escape
        b'{"model":"m1","messages":[{"role":"user","content":"x"}],"temperature":NaN}',
        b'{"model":"m1","messages":[{"role":"user","content":"x"}],"temperature":Infinity}',
        b'{"model":"m1","messages":[{"role":"user","content":"x"}],"temperature":-Infinity}',
        b'{"model":"m1","messages":[{"role":"user","content":"x"}],"temperature":1e999}',
        b'{"model":"m1","messages":[{"role":"user","content":"x"}],}',
        b"\xef\xbb\xbf" + b'{"model":"m1"}',  # a byte-order mark
        b'{"model":"m1"' + b" " * 100_000,  # truncated
        b"[" * 5000 + b"]" * 5000,
        b"\x00" * 1000,
        b"null",
        b'"a string"',
    ],
)
def test_malformed_json_is_a_400_invalid_json(gateway: ServerThread, upstream: FakeUpstream, raw: bytes) -> None:
    assert_error(post(gateway, raw), 400, code="invalid_json")
    assert upstream.requests == []
    still_serving(gateway)


@pytest.mark.parametrize("model", ["m1", "alias-1"])  # an alias makes the gateway re-serialise the body
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 300, 1000, 1100])
def test_deeply_nested_json_is_refused_before_anything_re_serialises_it(
    gateway: ServerThread, upstream: FakeUpstream, model: str, depth: int
) -> None:
    raw = b'{"model":"%s","messages":[{"role":"user","content":"x"}],"metadata":' % model.encode()
    raw += b"[" * depth + b"]" * depth + b"}"
    assert_error(post(gateway, raw), 400, code="invalid_json")
    assert upstream.requests == []


def test_nesting_within_the_limit_is_served(gateway: ServerThread, upstream: FakeUpstream) -> None:
    nested: Any = {}
    for _ in range(MAX_DEPTH - 3):
        nested = {"a": nested}
    response = post(gateway, {**CHAT, "model": "alias-1", "metadata": nested})
    assert response.status_code == 200
    assert upstream.requests[-1].body["metadata"] == nested


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "n"])
@pytest.mark.parametrize("value", [0, -1, -(2**63), 1.5, "10", True, None, [1], 1e300])
def test_bad_counts_are_400_naming_the_field(
    gateway: ServerThread, upstream: FakeUpstream, name: str, value: Any
) -> None:
    response = post(gateway, {**CHAT, name: value})
    if value is None:
        assert response.status_code == 200  # null means "not set", as OpenAI treats it
        return
    assert_error(response, 400, param=name)
    assert upstream.requests == []


def test_enormous_max_tokens_reaches_the_worker_which_decides(gateway: ServerThread, upstream: FakeUpstream) -> None:
    """The context window is the worker's to enforce (it knows the prompt's token count); the gateway
    passes even 2**64-1 through unchanged rather than guessing (see test_badinput_engine for vLLM's 400)."""
    response = post(gateway, {**CHAT, "max_tokens": 2**64 - 1})
    assert response.status_code == 200
    assert upstream.requests[-1].body["max_tokens"] == 2**64 - 1


def test_enormous_n_is_refused(gateway: ServerThread, upstream: FakeUpstream) -> None:
    for n in (129, 10**6, 2**64 - 1, 2**70):
        assert_error(post(gateway, {**CHAT, "n": n}), 400, param="n")
    assert upstream.requests == []


def test_thousands_of_messages_and_tools_are_served(gateway: ServerThread, upstream: FakeUpstream) -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(5000)]
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {}}}}
        for i in range(3000)
    ]
    response = post(gateway, {"model": "m1", "messages": messages, "tools": tools})
    assert response.status_code == 200
    assert len(upstream.requests[-1].body["messages"]) == 5000
    assert len(upstream.requests[-1].body["tools"]) == 3000


def test_thousands_of_bad_messages_name_the_first_bad_one(gateway: ServerThread, upstream: FakeUpstream) -> None:
    messages: list[Any] = [{"role": "user", "content": "x"}] * 4000 + [{"role": "robot", "content": "x"}]
    assert_error(post(gateway, {"model": "m1", "messages": messages}), 400, param="messages[4000].role")
    assert upstream.requests == []


def test_body_over_the_limit_is_413_whether_announced_or_streamed(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(base_config([upstream_url], limits={"max_body_bytes": 64 * 1024})) as (_, server):
        big = {"model": "m1", "messages": [{"role": "user", "content": "x" * 100_000}]}
        assert_error(post(server, big), 413, code="request_too_large")

        def chunks() -> Iterator[bytes]:  # no content-length: the limit applies while reading
            yield b'{"model":"m1","messages":[{"role":"user","content":"'
            for _ in range(200):
                yield b"y" * 1024
            yield b'"}]}'

        assert_error(httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30), 413)
        # An announced length over the limit is refused before the body is read.
        status = raw_status(server.port, b"POST", {b"content-length": str(10**12).encode()}, b"{}")
        assert status == 413
        still_serving(server)
    assert len(upstream.requests) == 1


def raw_status(port: int, method: bytes, headers: dict[bytes, bytes], body: bytes) -> int:
    head = method + b" /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += b"".join(k + b": " + v + b"\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + b"\r\n" + body)
        data = sock.recv(65536)
    return int(data.split(b" ", 2)[1]) if data else 0


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"x-big": "a" * 1_000_000}, 431),
        ({f"x-h{i}": "v" for i in range(5000)}, 431),
        ({"x-request-id": "r" * 100_000}, 431),
        ({"authorization": "Bearer " + "k" * 500_000}, 431),
        ({"x-request-id": "r" * 20_000}, 200),
        ({"content-type": "application/json; charset=" + "z" * 10_000}, 200),
    ],
    ids=["one-1MB-header", "5000-headers", "huge-request-id", "huge-bearer", "20KB-request-id", "odd-content-type"],
)
def test_huge_headers_do_not_crash_the_gateway(
    gateway: ServerThread, upstream: FakeUpstream, headers: dict[str, str], status: int
) -> None:
    """Beyond the front door's bounds (32 KiB, 100 fields) a 431 in OpenAI's shape; within them the
    gateway answers normally (a long x-request-id is replaced, not echoed). Either way it keeps serving."""
    response = post(gateway, CHAT, headers=headers)
    assert response.status_code == status
    if status == 431:
        assert response.json()["error"]["code"] == "request_header_fields_too_large"
        assert not upstream.requests
    else:
        assert len(response.headers["x-request-id"]) <= 128
    still_serving(gateway)


@pytest.fixture
def tenancy_prefix(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("GATEWAY_TENANCY_PEPPER", "pepper-for-badinput")
    prefix = f"test:badinput:{uuid.uuid4().hex}"
    yield prefix
    client = redis.Redis()
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def test_enormous_max_tokens_against_token_budgets_is_a_refusal_not_a_crash(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, tenancy_prefix: str
) -> None:
    """The tenancy plugin reserves max_tokens on admission: 2**64-1 must be a 429, not a Redis or
    arithmetic failure."""
    tenancy = {
        "redis_prefix": tenancy_prefix,
        "auth": False,
        "tenants": {"local": {"tokens_per_minute": 1000, "tokens_per_day": 10_000}},
    }
    config = base_config([upstream_url], plugins=[{"name": "tenancy", "config": tenancy}, {"name": "routing"}])
    with gateway_factory(config) as (_, server):
        for value in (2**53 + 1, 2**63 - 1, 2**64 - 1, 10**30):
            response = post(server, {**CHAT, "max_tokens": value})
            assert response.status_code in (400, 429), response.text
            assert response.json()["error"]["type"] in ("rate_limit_error", "invalid_request_error")
        assert post(server, {**CHAT, "max_tokens": 10}).status_code == 200


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("20", 20), ("007", 7), ("9" * 18, int("9" * 18)), ("\u00b2", None), ("1" * 19, None),
     ("1" * 5000, None), ("", None), ("-1", None), (" 1", None), ("1e3", None)],
)  # fmt: skip
def test_a_client_given_number_is_ascii_digits_or_nothing(text: str, value: int | None) -> None:
    """Query limits and Cache-Control ages: "²" is a digit to str.isdigit but not to int, and int refuses
    more than 4,300 digits; neither may raise."""
    assert decimal(text) == value


def test_a_limit_of_thousands_of_digits_is_a_400(gateway: ServerThread) -> None:
    reply = httpx.get(gateway.url + "/v1/responses/resp_" + "0" * 48 + "/input_items", params={"limit": "1" * 5000})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "limit"
