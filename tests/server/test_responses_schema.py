"""Every Response object the gateway sends (returned, stored, and in every stream event that carries
one) and every stream event validates against the Responses schema of OpenAI's OpenAPI spec
(``tests.support.responses_schema``: the spec as published, every field it lets be null present), for
plain, tool-calling, structured, truncated-by-max-tokens and failed turns, against the fake worker and
the real Redis. ``POST /v1/responses/compact`` and the WebSocket mode are refused with a reason."""

from __future__ import annotations

import base64
import os
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory
from tests.support.responses import responses_gateway
from tests.support.responses_schema import check_event, check_response, errors

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture
def server(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    with responses_gateway(gateway_factory, upstream_url) as srv:
        yield srv


def events(server: ServerThread, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=10) as reply:
        raw = reply.read()
    return [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


BODIES: list[dict[str, Any]] = [
    {"model": "m1", "input": "hi"},
    {"model": "m1", "instructions": "Be brief.", "input": "hi", "max_output_tokens": 20, "metadata": {"a": "b"}},
    {"model": "m1", "input": "weather?", "tools": [TOOL], "tool_choice": "required"},
    {"model": "m1", "input": "count", "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}}},
    {"model": "m1", "input": "hi", "user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k"},
]


@pytest.mark.parametrize("body", BODIES, ids=["plain", "echoed", "tools", "json_schema", "identifiers"])
def test_returned_streamed_and_stored_responses_validate(
    server: ServerThread, upstream: FakeUpstream, body: dict[str, Any]
) -> None:
    if "tools" in body:
        upstream.behavior.tool_calls = [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    if "text" in body:
        upstream.behavior.text = '{"n": 4}'
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    response = reply.json()
    check_response(response)
    stored = httpx.get(f"{server.url}/v1/responses/{response['id']}").json()
    check_response(stored)
    streamed = events(server, body)
    assert streamed[0]["type"] == "response.created" and streamed[-1]["type"] == "response.completed"
    for event in streamed:
        check_event(event)
    check_response(httpx.get(f"{server.url}/v1/responses/{streamed[-1]['response']['id']}").json())


def test_incomplete_and_failed_streams_validate(server: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.finish_reason = "length"
    cut = events(server, {"model": "m1", "input": "hi", "max_output_tokens": 2})
    assert cut[-1]["type"] == "response.incomplete"
    for event in cut:
        check_event(event)
    upstream.behavior.finish_reason = "stop"
    upstream.behavior.cut_after = 1  # the worker goes away mid-stream: an error event
    failed = events(server, {"model": "m1", "input": "hi"})
    assert failed[-1]["type"] == "error"
    for event in failed:
        check_event(event)


def test_the_checker_catches_a_missing_field() -> None:
    """The check can fail: a Response without a field the spec requires, or one it lets be null."""
    assert errors("Response", {"id": "resp_1", "object": "response"})
    reply = {"id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "m", "output": []}
    with pytest.raises(AssertionError, match="top_logprobs"):
        check_response(
            {
                **reply,
                "error": None,
                "incomplete_details": None,
                "instructions": None,
                "metadata": {},
                "parallel_tool_calls": True,
                "temperature": 1,
                "tool_choice": "auto",
                "tools": [],
                "top_p": 1,
            }
        )


def test_compact_and_websocket_mode_are_refused_with_a_reason(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.compact(model="m1", input="a long conversation")
    assert caught.value.code == "unsupported_endpoint" and "truncation" in caught.value.message
    # the WebSocket handshake is answered with an OpenAI error instead of an upgrade
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(
            f"GET /v1/responses HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    error = orjson.loads(body)["error"]
    assert error["code"] == "unsupported_transport" and "stream" in error["message"]
