"""A streamed answer the cache stores is kept as the worker's events, not parsed on the miss
(``plugins/cache/replay.py`` ``marked_events``, ``plugins/cache/policy.py`` ``events_complete``): what a
later hit of either shape gets, and which worker events the byte path leaves to the parsing one. The
parsing path (``recorded_event`` per event, ``is_complete`` on the assembled answer) is the reference."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.infra.redis_autopipe import AutoPipeline
from gateway.wire.streaming import SSEParser, StreamAssembler
from plugins.cache.breaker import CircuitBreaker
from plugins.cache.keys import CacheKey
from plugins.cache.policy import events_complete, is_complete, stream_choices
from plugins.cache.replay import body_of_events, fresh_answer, marked_events, recorded_event
from plugins.cache.store import CacheStore, Entry, decode_entry, encode_entry, encode_events_entry
from tests.support.cache import (
    MESSAGES,
    PLUGINS,
    cache_gateway_config,
    entry_names,
    namespace,
    redis_client,
    sdk_chat,
    wait_stored,
)
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

# Text a client could make a model say: JSON members and markers inside content are escaped.
TRICKY = 'He said "id":"chatcmpl-fake","created":1, "finish_reason":"stop" and "error": {} \\u0000 é'


def _without(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def _stream(url: str, **body: Any) -> tuple[str, list[dict[str, Any]]]:
    payload = {"model": "m1", "messages": MESSAGES, "temperature": 0, "stream": True, **body}
    response = httpx.post(url + "/v1/chat/completions", json=payload, timeout=30)
    assert response.status_code == 200
    payloads = SSEParser().feed(response.content)
    assert payloads[-1] == b"[DONE]"
    return response.headers["x-cache"], [orjson.loads(p) for p in payloads[:-1]]


def _assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    assembler = StreamAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.result()


@pytest.mark.parametrize("text", ["Hello from the fake worker.", TRICKY])
def test_a_streamed_miss_is_stored_as_its_events_and_serves_either_shape(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    text: str,
) -> None:
    upstream.behavior.text = text
    upstream.behavior.chunks = 4
    usage = {"stream_options": {"include_usage": True}}
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        state, original = _stream(server.url, **usage)
        wait_stored(redis_client, namespace)
        [name] = entry_names(redis_client, namespace)
        entry = decode_entry(redis_client.get(name) or b"")
        expiry_ms = redis_client.pttl(name)
        hit_state, answer = sdk_chat(server.url, stream=False)
        kept = _rewritten(redis_client, name)
        again_state, again = sdk_chat(server.url, stream=False)
        stream_state, replayed = _stream(server.url, **usage)
    assert (state, hit_state, again_state, stream_state) == ("miss", "hit", "hit", "hit")
    assert len(upstream.requests) == 1
    # kept as the worker's events (role, four pieces, the finish, the usage), not parsed into a body
    assert entry is not None and entry.body == b"" and entry.id_prefix == "chatcmpl-"
    assert len(entry.chunks.split(b"\n")) == len(original) == 7
    # the first hit that is not streamed wrote the answer into the entry: same events, creation time, expiry
    assert kept.body and kept.chunks == entry.chunks and kept.created == entry.created
    assert 0 < redis_client.pttl(name) <= expiry_ms
    assert again.model_dump(exclude={"id", "created"}) == answer.model_dump(exclude={"id", "created"})
    assert again.id != answer.id and again.id.startswith("chatcmpl-")
    # the answer a hit that is not streamed gets: what the events add up to, under a fresh id and created
    expected = _assembled(original)
    body = answer.model_dump(exclude_unset=True)
    assert answer.choices[0].message.content == text
    assert answer.id.startswith("chatcmpl-") and answer.id != expected["id"] and answer.created > expected["created"]
    assert _without(body, "id", "created") == _without(expected, "id", "created")
    # a streamed hit: the same events, one fresh id and created on all of them
    assert [_without(c, "id", "created") for c in replayed] == [_without(c, "id", "created") for c in original]
    assert len({c["id"] for c in replayed}) == 1 and replayed[0]["id"] not in (answer.id, original[0]["id"])
    assert len({c["created"] for c in replayed}) == 1 and replayed[0]["created"] >= again.created >= answer.created


def _rewritten(client: redis.Redis, name: bytes, timeout_s: float = 10.0) -> Entry:
    """The entry under ``name`` once it holds a body (the rewrite runs after the hit's reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        entry = decode_entry(client.get(name) or b"")
        if entry is not None and entry.body:
            return entry
        assert time.monotonic() < deadline, "the entry was not rewritten with its body"
        time.sleep(0.02)


def test_the_rewrite_replaces_only_the_entry_it_read(redis_client: redis.Redis, namespace: str) -> None:
    """Between a hit's lookup and its rewrite the key may have expired, or another answer been stored
    there: the rewrite leaves both as they are, and keeps the entry's expiry when it is the one read."""
    key = CacheKey("d", f"gw:cache:{namespace}:test:entry", f"gw:cache:{namespace}:test:lock")
    read = encode_events_entry("chatcmpl-", 1700000000.25, b"{}")
    later = encode_events_entry("chatcmpl-", 1700000001.5, b"{}")
    body = encode_entry(b'{"a":1}', 1700000000.25, b"{}")

    async def replace_in_turn() -> None:
        client = redis.asyncio.Redis.from_url("redis://127.0.0.1:6379")
        pipeline = AutoPipeline(client)
        store = CacheStore(client, pipeline, client, CircuitBreaker(3, 1.0), 5.0, on_error=lambda op: None)
        try:
            await store.replace(key, body, read)  # gone: not written back
            assert redis_client.exists(key.entry) == 0
            redis_client.set(key.entry, later, px=60_000)
            await store.replace(key, body, read)  # another entry stored since: kept
            assert redis_client.get(key.entry) == later
            redis_client.set(key.entry, read, px=60_000)
            await store.replace(key, body, read)
        finally:
            await pipeline.aclose()
            await client.aclose()

    asyncio.run(replace_in_turn())
    assert redis_client.get(key.entry) == body and 0 < redis_client.pttl(key.entry) <= 60_000


async def test_concurrent_whole_hits_on_an_entry_of_events_send_one_rewrite(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every hit that is not streamed and reads the entry of events only before its rewrite has landed
    assembles the answer; one rewrite of the entry goes to Redis, not one of up to ``max_value_bytes``
    per hit (a client streaming once and then sending many identical requests at once would otherwise
    make the gateway write megabytes to the shared Redis). The rewrites are held until every hit has
    been answered, so each hit reads the entry as the stream left it."""
    sent: list[int] = []  # the size of each rewrite sent
    release = threading.Event()
    held: set[asyncio.Task[None]] = set()
    replace_soon = CacheStore.replace_soon

    def hold(self: CacheStore, key: CacheKey, entry: bytes, read: bytes, done: Callable[[bool | None], None]) -> bool:
        sent.append(len(entry))

        async def later() -> None:
            await asyncio.to_thread(release.wait, 30)
            if not replace_soon(self, key, entry, read, done):
                done(False)

        task = asyncio.get_running_loop().create_task(later())
        held.add(task)
        task.add_done_callback(held.discard)
        return True

    upstream.behavior.text = "x" * 4096
    upstream.behavior.chunks = 16
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        await asyncio.to_thread(_stream, server.url)
        await asyncio.to_thread(wait_stored, redis_client, namespace)
        [name] = entry_names(redis_client, namespace)
        monkeypatch.setattr(CacheStore, "replace_soon", hold)
        try:
            body = {"model": "m1", "messages": MESSAGES, "temperature": 0}
            async with httpx.AsyncClient(timeout=30) as client:
                url = server.url + "/v1/chat/completions"
                replies = await asyncio.gather(*(client.post(url, json=body) for _ in range(8)))
            assert [r.headers["x-cache"] for r in replies] == ["hit"] * 8
            held_entry = decode_entry(redis_client.get(name) or b"")
            assert held_entry is not None and not held_entry.body  # still the stream's events only
            assert len(sent) == 1, f"{len(sent)} rewrites of {sum(sent)} bytes in all"
        finally:
            release.set()
        kept = await asyncio.to_thread(_rewritten, redis_client, name)
        async with httpx.AsyncClient(timeout=30) as client:
            again = await client.post(server.url + "/v1/chat/completions", json=body)
    assert kept.body and again.headers["x-cache"] == "hit"
    assert len(sent) == 1 and len(upstream.requests) == 1
    assert {r.json()["choices"][0]["message"]["content"] for r in [*replies, again]} == {"x" * 4096}


def test_tool_call_streams_take_the_parsing_path_and_replay_alike(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    """A tool call's delta has a member named ``id`` of its own: the events are parsed and stored with
    the answer, as before this path existed, and a streamed hit replays them with the call's id kept."""
    upstream.behavior.tool_calls = [{"id": "call_1", "name": "lookup", "arguments": '{"q": "x"}'}]
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        _, original = _stream(server.url)
        wait_stored(redis_client, namespace)
        [name] = entry_names(redis_client, namespace)
        entry = decode_entry(redis_client.get(name) or b"")
        state, replayed = _stream(server.url)
    assert entry is not None and entry.body and entry.chunks  # the answer and its events
    assert state == "hit"
    assert [_without(c, "id", "created") for c in replayed] == [_without(c, "id", "created") for c in original]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in replayed if c["choices"][0]["delta"].get("tool_calls")]
    assert calls[0]["id"] == "call_1"


def test_a_streamed_tool_call_answer_served_whole_has_no_content_as_a_live_one(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
) -> None:
    """vLLM's first event of every chat stream carries ``"content": ""``; a whole answer that only calls
    tools has ``content: null``. A hit that is not streamed, on an answer first streamed, must look like
    the live answer to the same request."""
    upstream.behavior.tool_calls = [{"id": "call_1", "name": "lookup", "arguments": '{"q": "x"}'}]
    with gateway_factory(cache_gateway_config(upstream_url, namespace), plugins=PLUGINS) as (_, server):
        _, live = sdk_chat(server.url, stream=False, extra_headers={"cache-control": "no-store"})
        _stream(server.url)
        wait_stored(redis_client, namespace)
        state, hit = sdk_chat(server.url, stream=False)
    assert state == "hit"
    assert live.choices[0].message.content is None
    assert hit.choices[0].message.content is None
    assert hit.choices[0].message.tool_calls == live.choices[0].message.tool_calls


# -- the byte path against the parsing one ---------------------------------------------------------

_pieces = st.sampled_from([*'ab "\\:,{}[]\n\x00é', '"id":', '"id":"chatcmpl-abc"', '"created":1700000000,'])
_texts = st.lists(_pieces, max_size=8).map("".join)


def _chunk(
    index: int, delta: dict[str, Any], finish: str | None, stamp: int = 1700000000, ident: str = "chatcmpl-abc"
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    head = {"id": ident, "object": "chat.completion.chunk", "created": stamp, "model": "m"}
    return {**head, "choices": [choice]}


_Stream = tuple[list[dict[str, Any]], int]  # the events, the number of choices
# ids and created stamps whose members are as long as the markers ("abcdef", -1), shorter, or longer
_idents = st.sampled_from(["chatcmpl-abc", "cmpl-7", "abcdef", "x", "chatcmpl-" + "f" * 32])
_stamps = st.sampled_from([1700000000, -1, 0, 12, 1])


@st.composite
def _streams(draw: st.DrawFn) -> _Stream:
    choices = draw(st.integers(1, 3))
    ident, stamp = draw(_idents), draw(_stamps)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return _chunk(index, delta, finish, stamp, ident)

    chunks = [chunk(i, {"role": "assistant", "content": ""}) for i in range(choices)]
    for _ in range(draw(st.integers(0, 6))):
        chunks.append(chunk(draw(st.integers(0, choices - 1)), {"content": draw(_texts)}))
    for index in range(choices):
        chunks.append(chunk(index, {}, draw(st.sampled_from([None, "stop", "length", "abort", "tool_calls"]))))
    if draw(st.booleans()):
        chunks.append({**chunk(0, {}), "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
    return chunks, choices


def _blob(chunks: list[dict[str, Any]]) -> bytes:
    return b"\n".join(orjson.dumps(c) for c in chunks)


def _marked(chunks: list[dict[str, Any]]) -> tuple[bytes, str]:
    """The events as the byte path stores them (every generated stream is in the worker's form)."""
    marked = marked_events(_blob(chunks))
    assert marked is not None
    return marked


@settings(max_examples=300, deadline=None)
@given(_streams())
def test_marking_events_as_bytes_stores_what_marking_them_parsed_stores(stream: _Stream) -> None:
    chunks, _ = stream
    events, prefix = _marked(chunks)
    assert prefix == (chunks[0]["id"].split("-")[0] + "-" if "-" in chunks[0]["id"] else "")
    assert [orjson.loads(line) for line in events.split(b"\n")] == [orjson.loads(recorded_event(c)) for c in chunks]


@settings(max_examples=300, deadline=None)
@given(_streams())
def test_the_body_written_from_stored_events_is_the_answer_they_add_up_to(stream: _Stream) -> None:
    chunks, _ = stream
    events, prefix = _marked(chunks)
    answer = fresh_answer(body_of_events(prefix, events), b"", 5).json
    expected = _assembled(chunks)
    assert _without(answer, "id", "created") == _without(expected, "id", "created")
    assert answer["created"] == 5 and answer["id"].startswith(prefix) and answer["id"] != expected["id"]


@settings(max_examples=300, deadline=None)
@given(_streams())
def test_completeness_from_the_finishing_events_is_the_assembled_answers(stream: _Stream) -> None:
    chunks, choices = stream
    assert events_complete(_blob(chunks), choices) is is_complete(_assembled(chunks))


@pytest.mark.parametrize("last", [(0, 1, 2), (1,), ()])
def test_events_with_created_as_their_last_member_are_marked_too(last: tuple[int, ...]) -> None:
    """Another server's member order (created last, before the closing brace) in every event, some or
    none: each event's created is marked all the same."""
    chunks = [_chunk(0, {"role": "assistant", "content": ""}, None), _chunk(0, {"content": "a"}, None)]
    chunks.append(_chunk(0, {}, "stop"))
    reordered = [
        {**{k: v for k, v in c.items() if k != "created"}, "created": c["created"]} if i in last else c
        for i, c in enumerate(chunks)
    ]
    events, _ = _marked(reordered)
    assert [orjson.loads(line) for line in events.split(b"\n")] == [orjson.loads(recorded_event(c)) for c in chunks]


def test_the_choices_a_stream_must_finish_are_known_only_for_one_prompt() -> None:
    assert stream_choices("chat/completions", {"n": 3}) == 3
    assert stream_choices("chat/completions", {"n": True}) == 1
    assert stream_choices("completions", {"prompt": "once"}) == 1
    # a list of prompts has n choices for each: its stream is assembled to tell
    assert stream_choices("completions", {"prompt": ["a", "b"], "n": 2}) is None
    assert stream_choices("completions", {"prompt": [1, 2, 3]}) is None


def test_events_not_in_the_workers_form_are_left_to_the_parsing_path() -> None:
    chunks = [_chunk(0, {"content": "a"}, None), _chunk(0, {}, "stop")]
    spaced = b"\n".join(json.dumps(c).encode() for c in chunks)  # '"id": "..."': another server's style
    assert marked_events(spaced) is None
    assert events_complete(spaced, 1) is True  # found by parsing every event that is not compact
    assert events_complete(spaced.replace(b'"finish_reason":', b'"finish_reason" :'), 1) is None
    later = [chunks[0], _chunk(0, {}, "stop", stamp=17000000001)]  # a created the first one's is a prefix of
    assert marked_events(_blob(later)) is None
    # another id as long as the marker (the replacement does not change the length): still counted
    other = [_chunk(0, {"content": "a"}, None, ident="abcdef"), _chunk(0, {}, "stop", ident="abcdeg")]
    assert marked_events(_blob(other)) is None
    tool = _chunk(0, {"tool_calls": [{"index": 0, "id": "call_1", "type": "function"}]}, None)
    assert marked_events(_blob([tool, chunks[1]])) is None
    no_id = {k: v for k, v in chunks[1].items() if k != "id"}
    assert marked_events(_blob([chunks[0], no_id])) is None
    assert marked_events(b"not json\n" + orjson.dumps(chunks[1])) is None
    # a finishing event that is not JSON: not complete (nothing is stored)
    assert events_complete(orjson.dumps(chunks[0]) + b'\n{"finish_reason":"stop"', 1) is False
    # a choice that never finished, or an index that is not a number
    assert events_complete(_blob(chunks), 2) is False
    odd = {**chunks[1], "choices": [{"index": "0", "delta": {}, "finish_reason": "stop"}]}
    assert events_complete(_blob([chunks[0], odd]), 1) is None


def test_a_replayed_streams_usage_is_read_without_assembling_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Billing a streamed hit reads the stored usage event alone; the answer is assembled only when read."""
    import plugins.cache.replay as replay

    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunks = [
        _chunk(0, {"content": "a"}, None),
        _chunk(0, {}, "stop"),
        {**_chunk(0, {}, None), "choices": [], "usage": usage},
    ]
    marked = marked_events(_blob(chunks))
    assert marked is not None
    answer = replay.fresh_answer_of_events(marked[1], marked[0], 5)
    with monkeypatch.context() as patched:
        patched.setattr(replay, "_assembled", lambda events: pytest.fail("assembled"))
        assert answer.usage == usage
    assert answer.json["usage"] == usage and answer.json["choices"][0]["message"]["content"] == "a"
    assert answer.json["id"].startswith("chatcmpl-") and answer.json["id"] != "chatcmpl-abc"
    # without a usage event the answer is assembled to look for one
    plain = replay.fresh_answer_of_events("chatcmpl-", marked[0].rsplit(b"\n", 1)[0], 5)
    assert plain.usage is None
