"""The room every stream recorded for the cache holds together (``GATEWAY_MAX_RECORDING_BYTES``,
``gateway.pipeline.recordings``): past it a stream is still stored, as its answer without its events'
chunking, and a stream's room comes back however the stream ends, its client leaving mid-way included.
Without the bound, as many long streams as routing admits (256 a model in deploy/k8s) held up to 2 MiB
of events each."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import redis

from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from plugins.cache.store import decode_entry
from tests.support.cache import (
    MESSAGES,
    PLUGINS,
    cache_gateway_config,
    entry_names,
    namespace,
    redis_client,
    sdk_chat,
    stream_text,
    wait_stored,
)
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory

__all__ = ["namespace", "redis_client"]  # fixtures used by name below


class ChunkReader(Plugin):
    """Placed after the cache, reads every chunk: the stream is parsed, and the cache records its events
    itself (``on_chunk``) instead of the core's recording of a pass-through stream."""

    name = "chunk_reader"

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return chunk


@pytest.mark.parametrize("path", ["pass-through", "parsed"])
def test_with_no_room_left_a_stream_is_stored_as_its_answer(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    namespace: str,
    redis_client: redis.Redis,
    path: str,
) -> None:
    upstream.behavior.chunks = 5
    after = ("chunk_reader",) if path == "parsed" else ()
    config = cache_gateway_config(upstream_url, namespace, after=after)
    plugins = {**PLUGINS, "chunk_reader": ChunkReader}
    with gateway_factory(config, plugins=plugins, max_recording_bytes=0) as (app, server):
        state, live = sdk_chat(server.url, stream=True)
        wait_stored(redis_client, namespace)
        [name] = entry_names(redis_client, namespace)
        entry = decode_entry(redis_client.get(name) or b"")
        hit_state, replayed = sdk_chat(server.url, stream=True)
        assert app.state.services.recordings.left == 0
    assert (state, hit_state) == ("miss", "hit")
    assert entry is not None and entry.body and not entry.chunks  # the answer, not the worker's events
    assert stream_text(replayed) == stream_text(live) == upstream.behavior.text
    assert len(upstream.requests) == 1


def test_a_stream_whose_client_leaves_gives_its_room_back(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, namespace: str
) -> None:
    upstream.behavior.chunks = 6
    upstream.behavior.hang_after = 3  # the worker goes quiet mid-stream; the client then leaves
    config = cache_gateway_config(upstream_url, namespace)
    with gateway_factory(config, plugins=PLUGINS) as (app, server):
        pool = app.state.services.recordings
        body = {"model": "m1", "messages": MESSAGES, "temperature": 0, "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", server.url + "/v1/chat/completions", json=body) as response,
        ):
            lines = response.iter_lines()  # kept: leaving its loop would close the connection
            assert next(lines).startswith("data: ")
            assert pool.left < pool.total  # the stream is in flight, its recording holds a grant
        # the client left mid-stream: the recording's room comes back without a settlement
        deadline = time.monotonic() + 10
        while pool.left != pool.total and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.left == pool.total
