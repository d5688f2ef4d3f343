"""The cache through the gateway: real Redis, fake worker on a real socket, the openai SDK as client."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from plugins.cache.store import decode_entry, encode_entry
from tests.support.cache import (
    PLUGINS,
    cache_gateway_config,
    chat,
    entry_names,
    namespace,
    public_entry_key,
    redis_client,
    sdk_chat,
    stream_text,
    wait_stored,
)
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

TEXT = "Hello from the fake worker."


@pytest.mark.parametrize(
    ("first_stream", "second_stream"), [(False, False), (False, True), (True, False), (True, True)]
)
def test_miss_then_hit_in_every_stream_combination(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    first_stream: bool,
    second_stream: bool,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        usage = {"stream_options": {"include_usage": True}}
        state, first = sdk_chat(server.url, stream=first_stream, **(usage if first_stream else {}))
        assert state == "miss"
        wait_stored(redis_client, namespace)
        state, second = sdk_chat(server.url, stream=second_stream, **(usage if second_stream else {}))
        assert state == "hit"
    assert len(upstream.requests) == 1
    texts = [
        stream_text(r) if s else r.choices[0].message.content
        for r, s in ((first, first_stream), (second, second_stream))
    ]
    assert texts == [TEXT, TEXT]
    usages = [r[-1].usage if s else r.usage for r, s in ((first, first_stream), (second, second_stream))]
    assert usages[0] is not None and usages[0] == usages[1]  # a hit reports the original usage


def test_stream_without_usage_is_stored_with_usage_but_the_client_never_sees_it(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        state, chunks = sdk_chat(server.url, stream=True)
        assert state == "miss"
        assert all(chunk.usage is None for chunk in chunks)
        assert upstream.requests[0].body["stream_options"] == {"include_usage": True}
        wait_stored(redis_client, namespace)
        state, reply = sdk_chat(server.url, stream=False)
    assert state == "hit"
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_hit_returns_the_stored_bytes_and_marks_itself(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        first = chat(server.url)
        wait_stored(redis_client, namespace)
        second = chat(server.url)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    # the same answer, under a fresh id and created (tests/plugins/cache/test_replayed_answers.py)
    assert {**second.json(), "id": "", "created": 0} == {**first.json(), "id": "", "created": 0}
    assert int(second.headers["age"]) >= 0
    [name] = entry_names(redis_client, namespace)
    raw = redis_client.get(name)
    assert raw is not None
    decoded = decode_entry(raw)
    assert decoded is not None
    stored = orjson.loads(decoded[1])  # stored with its id and created marked, to be renewed per hit
    assert {**stored, "id": "", "created": 0} == {**first.json(), "id": "", "created": 0}
    assert stored["id"] == "chatcmpl-\x00" and stored["created"] == -1


def test_legacy_completions_hit_streamed(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        from tests.support.cache import sdk

        client = sdk(server.url)
        first = client.completions.create(model="m1", prompt="Once", temperature=0)
        wait_stored(redis_client, namespace)
        raw = client.completions.with_raw_response.create(model="m1", prompt="Once", temperature=0, stream=True)
        chunks = list(raw.parse())
    assert raw.headers["x-cache"] == "hit"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text == TEXT
    assert len(upstream.requests) == 1


def test_n_greater_than_one_replays_every_choice(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        state, reply = sdk_chat(server.url, stream=False, n=3)
        assert state == "miss" and len(reply.choices) == 3
        wait_stored(redis_client, namespace)
        state, chunks = sdk_chat(server.url, stream=True, n=3)
    assert state == "hit"
    assert [stream_text(chunks, i) for i in range(3)] == [TEXT] * 3
    finishes = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}


TOOL_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-tools",
    "object": "chat.completion",
    "created": 1,
    "model": "m1",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                    },
                    {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": '{"tz": "UTC"}'}},
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
}


class ToolAnswer(Plugin):
    """After the cache: answers with tool calls, standing in for a worker that called tools."""

    name = "tool_answer"

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        return ModelResponse(json=TOOL_ANSWER)


def test_tool_call_answers_replay_as_tool_call_deltas(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    config = cache_gateway_config(upstream_url, namespace, after=("tool_answer",))
    with gateway_factory(config, plugins={**PLUGINS, "tool_answer": ToolAnswer}) as (_, server):
        state, reply = sdk_chat(server.url, stream=False)
        assert state == "miss"
        wait_stored(redis_client, namespace)
        state, chunks = sdk_chat(server.url, stream=True, stream_options={"include_usage": True})
    assert state == "hit"
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                slot = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += delta.id or ""
                slot["name"] += (delta.function and delta.function.name) or ""
                slot["arguments"] += (delta.function and delta.function.arguments) or ""
    expected = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in reply.choices[0].message.tool_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 21


def test_tenants_never_share_entries(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    config = cache_gateway_config(upstream_url, namespace, before=("tenant_from_header",))
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        assert chat(server.url, headers={"x-tenant": "a"}).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace, 1)
        assert chat(server.url, headers={"x-tenant": "b"}).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace, 2)
        # The unscoped default and a tenant named like it are still different scopes.
        assert chat(server.url, headers={"x-tenant": "public"}).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace, 3)
        assert chat(server.url).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace, 4)
        assert chat(server.url, headers={"x-tenant": "a"}).headers["x-cache"] == "hit"
        assert chat(server.url, headers={"x-tenant": "b"}).headers["x-cache"] == "hit"
        assert chat(server.url).headers["x-cache"] == "hit"
    assert len(upstream.requests) == 4


def test_a_config_with_tenancy_after_the_cache_is_refused(
    gateway_factory: GatewayFactory, upstream_url: str, namespace: str
) -> None:
    """Placed after the cache, tenancy would see a hit's request only after it was answered: no key
    check, no limits, and every caller in the public scope. Such a config is refused (the running one
    stays); tenancy before the cache is taken."""
    config = cache_gateway_config(upstream_url, namespace)
    with gateway_factory(config, plugins=PLUGINS, admin_token="adm") as (_, server):

        def reload(plugins: dict[str, tuple[str, ...]]) -> httpx.Response:
            body = orjson.dumps(cache_gateway_config(upstream_url, namespace, **plugins))  # type: ignore[arg-type]
            return httpx.put(server.url + "/admin/config", content=body, headers={"authorization": "Bearer adm"})

        refused = reload({"after": ("tenancy",)})
        assert refused.status_code == 400
        assert "'tenancy' must come before 'cache'" in refused.json()["error"]["message"]
        assert chat(server.url).status_code == 200  # the running config serves on, without a key
        assert reload({"before": ("tenancy",)}).status_code == 200


def test_no_cache_skips_the_lookup_but_stores_and_no_store_skips_the_store(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        assert chat(server.url, headers={"cache-control": "no-store"}).headers["x-cache"] == "miss"
        assert chat(server.url, headers={"Cache-Control": "no-cache, no-store"}).headers["x-cache"] == "bypass"
        time.sleep(0.2)  # give a (wrong) background store the time to land before checking there is none
        assert entry_names(redis_client, namespace) == []
        assert chat(server.url, headers={"cache-control": "no-cache"}).headers["x-cache"] == "bypass"
        wait_stored(redis_client, namespace)
        assert chat(server.url).headers["x-cache"] == "hit"
        assert chat(server.url, headers={"cache-control": "no-cache"}).headers["x-cache"] == "bypass"
        assert chat(server.url, headers={"cache-control": "no-store"}).headers["x-cache"] == "hit"
    assert len(upstream.requests) == 4


def test_max_age_refuses_older_entries(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    config = cache_gateway_config(upstream_url, namespace)
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        first = chat(server.url)
        wait_stored(redis_client, namespace)
        key = public_entry_key(config, namespace, {"messages": [{"role": "user", "content": "hi"}], "temperature": 0})
        redis_client.set(key.entry, encode_entry(first.content, time.time() - 600), px=60_000)  # ten minutes old
        assert chat(server.url, headers={"cache-control": "max-age=3600"}).headers["x-cache"] == "hit"
        assert chat(server.url, headers={"cache-control": "max-age=60"}).headers["x-cache"] == "miss"
        assert chat(server.url, headers={"cache-control": "max-age=0"}).headers["x-cache"] == "bypass"
    assert len(upstream.requests) == 3


def test_nondeterministic_requests_bypass(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        assert chat(server.url, temperature=0.7).headers["x-cache"] == "bypass"
        assert chat(server.url, temperature=0.7).headers["x-cache"] == "bypass"
        assert chat(server.url, temperature=0.7, seed=5).headers["x-cache"] == "miss"
    assert len(upstream.requests) == 3


def test_errors_are_not_stored(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        upstream.behavior.status = 400
        assert chat(server.url).status_code == 400
        upstream.behavior.status = 500
        assert chat(server.url).status_code == 502
        upstream.behavior.finish_reason = "abort"  # vLLM's finish reason for an aborted request
        upstream.behavior.status = 200
        assert chat(server.url).status_code == 200
        time.sleep(0.2)
        assert entry_names(redis_client, namespace) == []
        upstream.behavior.finish_reason = "stop"
        assert chat(server.url).headers["x-cache"] == "miss"
    assert len(upstream.requests) == 4


def test_cut_streams_are_not_stored(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        upstream.behavior.cut_after = 2
        cut = chat(server.url, stream=True)
        assert b'"error"' in cut.content and cut.content.endswith(b"data: [DONE]\n\n")
        time.sleep(0.2)
        assert entry_names(redis_client, namespace) == []
        upstream.behavior.cut_after = None
        assert chat(server.url, stream=True).headers["x-cache"] == "miss"
    assert len(upstream.requests) == 2


def test_an_answer_that_fails_a_later_plugin_is_not_stored(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    config = cache_gateway_config(upstream_url, namespace, after=("reject_on_header",))
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        rejected = chat(server.url, headers={"x-reject": "1"})
        assert rejected.status_code == 502 and rejected.json()["error"]["code"] == "validation_failed"
        streamed = chat(server.url, headers={"x-reject": "1"}, stream=True)
        assert b"validation_failed" in streamed.content
        time.sleep(0.2)
        assert entry_names(redis_client, namespace) == []
        assert chat(server.url).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace)
        assert chat(server.url).headers["x-cache"] == "hit"
    assert len(upstream.requests) == 3


class NoStoreOnHeader(Plugin):
    """Placed after the cache: marks the answer ``Cache-Control: no-store`` when ``x-no-store`` is sent,
    like a plugin whose answer to this request is not the one to give others (guided_json's cut stream)."""

    name = "no_store_on_header"

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        if ctx.headers.get("x-no-store"):
            response.headers["cache-control"] = "private, no-store"
        return None


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_a_later_plugin_marks_no_store_is_not_stored(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    stream: bool,
) -> None:
    config = cache_gateway_config(upstream_url, namespace, after=("no_store_on_header",))
    with gateway_factory(config, plugins={**PLUGINS, "no_store_on_header": NoStoreOnHeader}) as (app, server):
        marked = chat(server.url, headers={"x-no-store": "1"}, stream=stream)
        assert marked.status_code == 200 and marked.headers["x-cache"] == "miss"
        # looked up after the first answer's store, if any, was sent (one connection, in order)
        assert chat(server.url, stream=stream).headers["x-cache"] == "miss"
        wait_stored(redis_client, namespace)
        assert chat(server.url, stream=stream).headers["x-cache"] == "hit"
        not_stored = app.state.services.metrics.registry.get_sample_value(
            "gateway_cache_not_stored_total", {"model": "m1", "reason": "no_store"}
        )
    assert len(upstream.requests) == 2
    assert not_stored == 1


def test_a_new_namespace_starts_empty(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        chat(server.url)
        wait_stored(redis_client, namespace)
    other = namespace + "b"
    try:
        with gateway_factory(cache_gateway_config(upstream_url, other), plugins=PLUGINS) as (_, server):
            assert chat(server.url).headers["x-cache"] == "miss"
    finally:
        from tests.support.cache import delete_namespace

        delete_namespace(redis_client, other)
