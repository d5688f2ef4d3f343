"""Streaming: relayed as it arrives, cut streams end with one error event, disconnects reach the worker."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.wire.streaming import SSEParser, StreamAssembler, replay
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class Inspect(Plugin):
    """Forces the parsed-stream path (a plugin that looks at chunks)."""

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return chunk


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


@pytest.fixture(params=["bytes", "parsed"])
def stream_gateway(
    request: pytest.FixtureRequest, gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> Any:
    plugins = [{"name": "routing"}] if request.param == "bytes" else [{"name": "inspect"}, {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins)
    with gateway_factory(config, plugins={"inspect": Inspect}) as (_, server):
        yield server


def test_sse_headers_and_include_usage(stream_gateway: ServerThread) -> None:
    body = {**CHAT, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stream_gateway.url + "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-request-id"]
        events = sse_events(response.read().decode())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3


def test_chunks_are_relayed_as_they_arrive(stream_gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.pace_s = 0.3
    upstream.behavior.chunks = 3
    arrivals = []
    started = time.monotonic()
    with httpx.stream("POST", stream_gateway.url + "/v1/chat/completions", json=CHAT) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - started)
    # Not buffered: the first event arrives well before the last one was produced.
    assert arrivals[0] < arrivals[-1] - 0.6


def test_cut_stream_ends_with_one_error_event_then_done(stream_gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.cut_after = 2
    with httpx.stream("POST", stream_gateway.url + "/v1/chat/completions", json=CHAT) as response:
        events = sse_events(response.read().decode())
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1
    # The worker's connection broke mid-body (upstream_error) or ended cleanly without [DONE].
    assert errors[0]["error"]["code"] in {"upstream_error", "stream_incomplete"}
    assert errors[0]["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"


def test_idle_worker_mid_stream_is_bounded(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    config["upstream"]["idle_timeout_s"] = 0.3
    upstream.behavior.pace_s = 2.0
    with gateway_factory(config) as (_, server):
        started = time.monotonic()
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=CHAT, timeout=10) as response:
            events = sse_events(response.read().decode())
        assert time.monotonic() - started < 2.0
    assert events[-2]["error"]["code"] == "upstream_timeout"
    assert events[-1] == "[DONE]"


def test_a_steady_stream_longer_than_the_idle_bound_is_not_cut(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    # The idle bound is per gap, not per stream: 8 chunks 0.25 s apart (2 s in all) under a 1 s bound all
    # arrive (a gap 4x under the bound, so a briefly held-up machine does not cut the stream either).
    config = base_config([upstream_url])
    config["upstream"]["idle_timeout_s"] = 1.0
    upstream.behavior.pace_s = 0.25
    upstream.behavior.chunks = 8
    with (
        gateway_factory(config) as (_, server),
        httpx.stream("POST", server.url + "/v1/chat/completions", json=CHAT, timeout=10) as response,
    ):
        events = sse_events(response.read().decode())
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict))
    assert text == upstream.behavior.text


def test_client_disconnect_cancels_the_upstream_request(stream_gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.pace_s = 0.2
    upstream.behavior.chunks = 50
    with httpx.stream("POST", stream_gateway.url + "/v1/chat/completions", json=CHAT) as response:
        for line in response.iter_lines():
            if "Hello" in line or "content" in line:
                break  # leave mid-stream; the connection closes
    deadline = time.monotonic() + 5
    while upstream.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.disconnects == 1
    assert upstream.completed_streams == 0


def test_client_disconnect_during_a_non_stream_request_reaches_the_worker(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.hang = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=0.5)
    deadline = time.monotonic() + 5
    while upstream.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.disconnects == 1


def test_early_stream_failure_before_headers_is_a_plain_error(
    stream_gateway: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.status = 400
    response = httpx.post(stream_gateway.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_sse_parser_handles_arbitrary_boundaries() -> None:
    data = b'data: {"a": 1}\n\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(data)):
        parser = SSEParser()
        out: list[bytes] = []
        for i in range(0, len(data), size):
            out += parser.feed(data[i : i + size])
        assert out == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def test_assembler_and_replay_round_trip_with_n_and_tool_calls() -> None:
    response = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "first"},
                "logprobs": None,
                "finish_reason": "stop",
            },
            {
                "index": 1,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            },
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    assembler = StreamAssembler()
    events = list(replay(response, include_usage=True))
    assert events[-1] == b"data: [DONE]\n\n"
    for event in events[:-1]:
        assembler.add(orjson.loads(event[6:]))
    assert assembler.complete
    result = assembler.result()
    assert result["choices"][0]["message"]["content"] == "first"
    assert result["choices"][1]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert result["usage"] == response["usage"]


def test_completions_replay_round_trip() -> None:
    response = {
        "id": "c",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}],
    }
    assembler = StreamAssembler()
    for event in list(replay(response, include_usage=False))[:-1]:
        assembler.add(orjson.loads(event[6:]))
    assert assembler.result()["choices"] == response["choices"]


def test_model_response_is_lazy_both_ways() -> None:
    raw = b'{"a": 1}'
    response = ModelResponse(body=raw)
    assert response.body is raw
    assert response.json == {"a": 1}
    response.replace_json({"b": 2})
    assert response.body == b'{"b":2}'
