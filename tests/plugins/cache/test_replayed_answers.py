"""What a cache hit looks like to an openai SDK user: a fresh id and created on every hit, every other
field as the original had it, the replay said only in headers, and a replayed stream chunked like the
original (real Redis, the fake worker on a real socket, the SDK as client)."""

from __future__ import annotations

import struct
import time
from typing import Any

import orjson
import pytest
import redis

from plugins.cache.replay import fresh_answer, stored_body
from plugins.cache.store import decode_entry
from tests.support.cache import (
    PLUGINS,
    cache_gateway_config,
    chat,
    entry_names,
    namespace,
    public_entry_key,
    redis_client,
    sdk,
    sdk_chat,
    wait_stored,
)
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

FINGERPRINT = "fp_test_4711"


def _without(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def test_json_hits_get_fresh_ids_and_keep_every_other_field(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    upstream.behavior.system_fingerprint = FINGERPRINT
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        first = chat(server.url)
        wait_stored(redis_client, namespace)
        before = int(time.time())
        hits = [chat(server.url), chat(server.url)]
    assert len(upstream.requests) == 1
    original = first.json()
    assert first.headers["x-cache"] == "miss"
    ids = {original["id"]}
    for hit in hits:
        assert hit.status_code == 200
        assert hit.headers["x-cache"] == "hit" and int(hit.headers["age"]) >= 0
        body = hit.json()
        assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
        ids.add(body["id"])
        assert body["created"] >= before > original["created"]  # the fake says created=1
        assert body["system_fingerprint"] == FINGERPRINT
        assert _without(body, "id", "created") == _without(original, "id", "created")
        assert "cache" not in orjson.dumps(body).decode()  # the replay is said in headers only
    assert len(ids) == 3  # the original and each hit: all different


def test_a_replayed_stream_keeps_the_original_chunking(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    upstream.behavior.system_fingerprint = FINGERPRINT
    upstream.behavior.chunks = 7
    upstream.behavior.text = "one two three four five six seven"
    usage = {"stream_options": {"include_usage": True}}
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        state, original = sdk_chat(server.url, stream=True, **usage)
        assert state == "miss"
        wait_stored(redis_client, namespace)
        replays = [sdk_chat(server.url, stream=True, **usage) for _ in range(2)]
    assert len(upstream.requests) == 1
    seen_ids = {original[0].id}
    for state, chunks in replays:
        assert state == "hit"
        # role chunk, 7 content chunks, the finish chunk and the usage chunk: as the worker sent them
        assert len(chunks) == len(original) == 10
        ids = {c.id for c in chunks}
        assert len(ids) == 1 and ids.isdisjoint(seen_ids)  # one id across the replay, new per replay
        seen_ids |= ids
        assert len({c.created for c in chunks}) == 1 and chunks[0].created > original[0].created
        for replayed, first in zip(chunks, original, strict=True):
            assert replayed.system_fingerprint == FINGERPRINT
            assert _without(replayed.model_dump(), "id", "created") == _without(first.model_dump(), "id", "created")
    assert len(seen_ids) == 3


def test_a_replayed_stream_without_usage_keeps_the_chunking_and_hides_usage(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    upstream.behavior.chunks = 5
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        _, original = sdk_chat(server.url, stream=True)
        wait_stored(redis_client, namespace)
        state, replayed = sdk_chat(server.url, stream=True)
        # a client asking for usage on the replay gets the usage the original stream was stored with
        _, with_usage = sdk_chat(server.url, stream=True, stream_options={"include_usage": True})
    assert state == "hit"
    assert [c.choices[0].delta.content for c in replayed] == [c.choices[0].delta.content for c in original]
    assert all(c.usage is None for c in replayed)
    assert len(with_usage) == len(original) + 1 and with_usage[-1].usage is not None
    assert with_usage[-1].usage.completion_tokens == 5


def test_a_json_answer_replayed_as_a_stream_and_back(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    """A non-streamed original has no events to keep: the replay is one content delta, with the
    original's fields (system_fingerprint) on each event, and still a fresh id."""
    upstream.behavior.system_fingerprint = FINGERPRINT
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        _, original = sdk_chat(server.url, stream=False)
        wait_stored(redis_client, namespace)
        state, chunks = sdk_chat(server.url, stream=True)
    assert state == "hit"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == original.choices[0].message.content
    assert {c.system_fingerprint for c in chunks} == {FINGERPRINT}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != original.id


def test_legacy_completions_hits_keep_their_id_style(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        client = sdk(server.url)
        first = client.completions.create(model="m1", prompt="Once", temperature=0)
        wait_stored(redis_client, namespace)
        second = client.completions.create(model="m1", prompt="Once", temperature=0)
        streamed = list(client.completions.create(model="m1", prompt="Once", temperature=0, stream=True))
    assert first.id == "cmpl-fake"
    assert second.id.startswith("cmpl-") and second.id != first.id
    assert second.choices[0].text == first.choices[0].text
    assert {c.id for c in streamed} != {second.id} and all(c.id.startswith("cmpl-") for c in streamed)


def test_stream_events_are_stored_only_while_they_fit(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    """Events cost more bytes than the answer: past ``max_value_bytes`` the answer is stored without
    them, and a streaming hit is replayed from the object instead."""
    upstream.behavior.chunks = 60
    upstream.behavior.text = "x" * 600
    config = cache_gateway_config(upstream_url, namespace, max_value_bytes=4096)
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        _, original = sdk_chat(server.url, stream=True)
        wait_stored(redis_client, namespace)
        [name] = entry_names(redis_client, namespace)
        raw = redis_client.get(name)
        state, replayed = sdk_chat(server.url, stream=True)
    assert raw is not None
    decoded = decode_entry(raw)
    assert decoded is not None and decoded[2] == b""
    assert state == "hit"
    assert "".join(c.choices[0].delta.content or "" for c in replayed) == "x" * 600
    assert len(replayed) < len(original)


@pytest.mark.parametrize("stream", [False, True])
def test_an_entry_written_before_events_were_kept_is_still_served(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    stream: bool,
) -> None:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    config = cache_gateway_config(upstream_url, namespace)
    key = public_entry_key(config, namespace, body)
    stored = {
        "id": "chatcmpl-old",
        "object": "chat.completion",
        "created": 5,
        "model": "m1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "old"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    redis_client.set(key.entry, b"\x01" + struct.pack(">d", time.time()) + orjson.dumps(stored), px=60_000)
    with gateway_factory(config, plugins=PLUGINS) as (_, server):
        state, reply = sdk_chat(server.url, stream=stream)
    assert state == "hit" and not upstream.requests
    ids = {c.id for c in reply} if stream else {reply.id}
    assert len(ids) == 1 and "chatcmpl-old" not in ids


def test_answer_text_that_looks_like_the_stored_markers_is_replayed_verbatim(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    """Stored events carry markers in place of id and created; a model (or a prompt steering it) that
    writes those markers as text cannot get them replaced: inside a string every quote is escaped."""
    upstream.behavior.text = 'a "id":"\\u0000", "created":-1, \x00 {"id":"\u0000"} z'
    upstream.behavior.chunks = 4
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        _, original = sdk_chat(server.url, stream=True)
        wait_stored(redis_client, namespace)
        state, replayed = sdk_chat(server.url, stream=True)
    assert state == "hit"
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks) for chunks in (original, replayed)]
    assert texts == [upstream.behavior.text] * 2
    assert [c.choices[0].delta.content for c in replayed] == [c.choices[0].delta.content for c in original]


@pytest.mark.parametrize(
    "answer",
    [
        {"id": "chatcmpl-abc", "object": "chat.completion", "created": 7, "model": "m", "choices": [],
         "system_fingerprint": "fp"},
        {"id": "cmpl-x", "object": "text_completion", "created": 7, "model": "m",
         "choices": [{"index": 0, "text": '\x00","created":-1, "id":"\x00', "finish_reason": "stop"}]},
        {"id": "noprefix", "created": 7},  # nothing after created: stored marked, renewed by parsing
        {"object": "chat.completion", "model": "m"},  # no id at all: stored as it is, given one
        {"id": 'we"ird\\-\x00', "created": 7, "model": "m"},
    ],
)  # fmt: skip
def test_a_stored_answer_renews_exactly_its_id_and_created(answer: dict[str, Any]) -> None:
    stored = stored_body(answer)
    seen = set()
    for stamp in (1_800_000_000, 1_800_000_001):
        fresh = fresh_answer(stored, b"", stamp).json
        assert fresh["created"] == stamp
        assert {k: v for k, v in fresh.items() if k not in ("id", "created")} == _without(answer, "id", "created")
        original = answer.get("id")
        prefix = original[: original.index("-") + 1] if isinstance(original, str) and "-" in original else ""
        if not isinstance(original, str):
            prefix = "chatcmpl-"
        assert fresh["id"].startswith(prefix) and len(fresh["id"]) == len(prefix) + 32
        seen.add(fresh["id"])
    assert len(seen) == 2
