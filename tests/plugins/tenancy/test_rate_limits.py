"""Rate limits against real Redis: exact under concurrency across two replicas, OpenAI's headers and
SDK errors, completion tokens charged, and the configured behaviour while Redis is down."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

KEY = "sk-gw-limits-test-key"
HEADERS = {"authorization": f"Bearer {KEY}"}
UNREACHABLE = "redis://127.0.0.1:1/0"
OPENAI_NAMES = [
    f"x-ratelimit-{part}-{kind}" for kind in ("requests", "tokens") for part in ("limit", "remaining", "reset")
]


def tenancy(prefix: str, upstream_url: str, key_limits: dict[str, int], **config: Any) -> dict[str, Any]:
    keys = [{"id": "k1", "tenant": "t1", "hash": hash_key(KEY, PEPPER.encode()), "limits": key_limits}]
    section = {"redis_prefix": prefix, "keys": keys, **config}
    return base_config([upstream_url], plugins=[{"name": "tenancy", "config": section}, {"name": "routing"}])


# "abcd" is 1 token + 4 for the chat template = 5, the prompt_tokens the fake worker reports; with
# max_tokens 3 (the fake's completion_tokens) the admission estimate equals the final charge: 8.
BODY = {"model": "m1", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 3}


async def burst(servers: list[ServerThread], total: int) -> list[int]:
    """``total`` concurrent requests spread over ``servers``; the status codes."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=total)) as client:

        async def one(i: int) -> int:
            url = servers[i % len(servers)].url + "/v1/chat/completions"
            return (await client.post(url, json=BODY, headers=HEADERS)).status_code

        return list(await asyncio.gather(*(one(i) for i in range(total))))


@pytest.mark.parametrize(
    ("limits", "admitted"),
    [({"requests_per_minute": 5}, 5), ({"tokens_per_minute": 80}, 10)],
    ids=["rpm", "tpm"],
)
def test_limits_hold_under_64_concurrent_requests_on_two_replicas(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    limits: dict[str, int],
    admitted: int,
) -> None:
    config = tenancy(prefix, upstream_url, limits)
    with gateway_factory(config) as (_, a), gateway_factory(config) as (_, b):
        statuses = asyncio.run(burst([a, b], 64))
    assert statuses.count(200) == admitted  # never more: the refill in a 1 s burst is < 1 request
    assert statuses.count(429) == 64 - admitted
    assert len(upstream.requests) == admitted


def test_headers_use_openai_names_and_sdk_raises_rate_limit_error(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url, {"requests_per_minute": 2, "tokens_per_minute": 1000})
    with gateway_factory(config) as (_, server):
        ok = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=HEADERS)
        assert ok.status_code == 200
        assert [name for name in OPENAI_NAMES if name in ok.headers] == OPENAI_NAMES
        assert ok.headers["x-ratelimit-limit-requests"] == "2"
        assert ok.headers["x-ratelimit-remaining-requests"] == "1"
        assert ok.headers["x-ratelimit-limit-tokens"] == "1000"
        assert ok.headers["x-ratelimit-remaining-tokens"] == "992"
        assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        messages: Any = BODY["messages"]
        client.chat.completions.create(model="m1", messages=messages, max_tokens=3)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="m1", messages=messages, max_tokens=3)
        error = info.value
        assert error.code == "rate_limit_exceeded"
        assert "requests per min (RPM)" in error.message and "key 'k1'" in error.message
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert [name for name in OPENAI_NAMES if name in error.response.headers] == OPENAI_NAMES


def test_tenant_limit_is_shared_by_its_keys(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    other = "sk-gw-second-key-of-t1"
    config = tenancy(prefix, upstream_url, {}, tenants={"t1": {"requests_per_minute": 3}})
    config["plugins"][0]["config"]["keys"].append(
        {"id": "k2", "tenant": "t1", "hash": hash_key(other, PEPPER.encode())}
    )
    with gateway_factory(config) as (_, server):
        url = server.url + "/v1/chat/completions"
        codes = [
            httpx.post(url, json=BODY, headers={"authorization": f"Bearer {k}"}).status_code for k in (KEY, other) * 2
        ]
    assert codes == [200, 200, 200, 429]


def test_request_larger_than_the_token_limit_is_refused(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(tenancy(prefix, upstream_url, {"tokens_per_minute": 100})) as (_, server):
        reply = httpx.post(server.url + "/v1/chat/completions", json={**BODY, "max_tokens": 500}, headers=HEADERS)
    assert reply.status_code == 429
    assert "Request too large for tokens per min (TPM)" in reply.json()["error"]["message"]
    assert upstream.requests == []


def test_tool_definitions_count_toward_the_reservation(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """A request whose prompt is mostly tool definitions reserves them: 100 tools of 40 characters each
    are about 1,000 tokens, more than the key's 500 a minute, so it is refused before a worker sees it
    (a short message and max_tokens alone would fit)."""
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "x" * 40, "parameters": {}}}
        for i in range(100)
    ]
    body = {**BODY, "max_tokens": 10}
    with gateway_factory(tenancy(prefix, upstream_url, {"tokens_per_minute": 500})) as (_, server):
        url = server.url + "/v1/chat/completions"
        refused = httpx.post(url, json={**body, "tools": tools}, headers=HEADERS)
        allowed = httpx.post(url, json=body, headers=HEADERS)
    assert refused.status_code == 429
    assert "Request too large for tokens per min (TPM)" in refused.json()["error"]["message"]
    assert allowed.status_code == 200
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_tokens_are_charged_when_known(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, include_usage: bool
) -> None:
    config = tenancy(prefix, upstream_url, {"tokens_per_minute": 1000}, reserve_max_tokens=False)
    upstream.behavior.text = "x" * 40  # sent as 3 events (3 tokens; chars/4 would say 10); usage says 3
    with gateway_factory(config, admin_token="adm") as (_, server):
        body: dict[str, Any] = {**BODY, "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        started = time.monotonic()
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=HEADERS) as stream:
            assert stream.read().endswith(b"data: [DONE]\n\n")
        after = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=HEADERS)
        elapsed = time.monotonic() - started
        usage = httpx.post(
            server.url + "/admin/plugins/tenancy/usage", json={"key_id": "k1"}, headers={"authorization": "Bearer adm"}
        ).json()["result"]
    completion = 3  # usage when the stream carried it, else the token events it sent
    # the second request saw the first one's prompt (5) + completion already charged, plus its own 5;
    # the bucket refills at 1000/60 tokens per second meanwhile, so allow what the elapsed time gave back
    expected = 1000 - (5 + completion) - 5
    refilled = int(elapsed * 1000 / 60) + 1
    assert expected <= int(after.headers["x-ratelimit-remaining-tokens"]) <= expected + refilled
    assert usage["day"]["completion_tokens"] == completion + 3
    assert usage["day"]["tokens"] == 5 + completion + 5 + 3
    assert usage["month"]["requests"] == 2


def test_redis_down_fail_closed_refuses_with_503(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url, {"requests_per_minute": 100})
    with gateway_factory(config, redis_url=UNREACHABLE) as (_, server):
        reply = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=HEADERS)
        unknown = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers={"authorization": "Bearer sk-x"})
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "tenancy_unavailable"
    assert unknown.status_code == 503  # cannot tell a bad key from a new one: not a 401
    assert upstream.requests == []


def test_redis_down_fail_open_enforces_a_local_limit(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url, {"requests_per_minute": 6}, redis_down="fail_open", fail_open_share=0.5)
    with gateway_factory(config, redis_url=UNREACHABLE) as (_, server):
        codes = [
            httpx.post(server.url + "/v1/chat/completions", json=BODY, headers=HEADERS).status_code for _ in range(4)
        ]
        unknown = httpx.post(server.url + "/v1/chat/completions", json=BODY, headers={"authorization": "Bearer sk-x"})
    assert codes == [200, 200, 200, 429]  # half of 6 on this replica alone
    assert unknown.status_code == 503
    assert len(upstream.requests) == 3


def test_images_are_reserved_against_the_token_limit(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """Each image part reserves the image estimate (2048 tokens by default) on admission: a request with
    one image leaves the limit minus 5 + 2048 + 3, and one whose three images exceed the limit is refused
    before a worker sees it, through the chat and the Messages APIs alike (their images were free)."""
    data = "iVBORw0KGgo" + "A" * 1_000_000  # a base64 PNG of 750 kB
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    text = {"type": "text", "text": "abcd"}
    config = tenancy(prefix, upstream_url, {"tokens_per_minute": 5000})
    with gateway_factory(config) as (_, server):
        url = server.url + "/v1/chat/completions"
        one = httpx.post(url, json={**BODY, "messages": [{"role": "user", "content": [text, image]}]}, headers=HEADERS)
        assert one.status_code == 200
        assert one.headers["x-ratelimit-remaining-tokens"] == str(5000 - (5 + 2048 + 3))
        three = {**BODY, "messages": [{"role": "user", "content": [text, image, image, image]}]}
        refused = httpx.post(url, json=three, headers=HEADERS)
        assert refused.status_code == 429
        assert "Request too large for tokens per min (TPM)" in refused.json()["error"]["message"]
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        messages = {"model": "m1", "max_tokens": 3, "messages": [{"role": "user", "content": [block] * 3}]}
        anthropic = httpx.post(server.url + "/v1/messages", json=messages, headers=HEADERS)
        assert anthropic.status_code == 429
        assert anthropic.json()["type"] == "error"
    assert len(upstream.requests) == 1


def test_the_media_part_estimates_are_a_setting(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """``media_tokens`` sets what an image, audio or video part reserves: with images of 100 tokens and
    clips of 10, "abcd", an image, a clip and max_tokens 3 reserve 1 + 100 + 10 + 4 + 3."""
    image = {"type": "image_url", "image_url": {"url": "https://images.example.com/cat.png"}}
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}
    content = [{"type": "text", "text": "abcd"}, image, audio]
    limits = {"tokens_per_minute": 5000}
    config = tenancy(prefix, upstream_url, limits, media_tokens={"image": 100, "audio": 10})
    with gateway_factory(config) as (_, server):
        body = {**BODY, "messages": [{"role": "user", "content": content}]}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers=HEADERS)
    assert reply.status_code == 200
    assert reply.headers["x-ratelimit-remaining-tokens"] == str(5000 - (1 + 100 + 10 + 4 + 3))
