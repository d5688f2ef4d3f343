"""The request shapes the gateway checks itself, at their edges: stream flags per endpoint, message
and prompt shapes OpenAI accepts (and the near misses it does not), counts that are not integers, and
a client that goes away halfway through sending its body."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest

from gateway.wire.protocol import requested_completion_tokens, requested_prompts
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import wait_for
from tests.wire.test_error_shape import assert_error_shape

MESSAGES = [{"role": "user", "content": "hi"}]


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "m1", **body})


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/embeddings", {"input": "x", "stream": True}, "stream", None),
        ("/v1/embeddings", {}, "input", "missing_required_parameter"),
        ("/v1/completions", {}, "prompt", "missing_required_parameter"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "stream": True, "stream_options": "usage"},
            "stream_options",
            None,
        ),
        ("/v1/chat/completions", {"messages": [*MESSAGES, "and also this"]}, "messages[1]", None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 42}]}, "messages[0].content", None),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0].role", None),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": True}, "n", None),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1.5}, "max_tokens", None),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens", None),
        ("/v1/completions", {"prompt": []}, "prompt", None),
        ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt", None),
        ("/v1/completions", {"prompt": [True, False]}, "prompt", None),
        ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt", None),
        ("/v1/completions", {"prompt": ["a", ["b"]]}, "prompt", None),
    ],
)
def test_shapes_the_gateway_refuses_before_any_upstream_call(
    gateway: ServerThread, upstream: FakeUpstream, path: str, body: dict[str, Any], param: str, code: str | None
) -> None:
    error = assert_error_shape(post(gateway, path, body), 400)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert upstream.requests == []


@pytest.mark.parametrize(
    "prompt",
    ["plain text", ["two", "prompts"], [101, 102, 103], [[101, 102], [103]]],
    ids=["text", "texts", "token-ids", "token-id-lists"],
)
def test_every_prompt_form_openai_accepts_is_passed_through_as_sent(
    gateway: ServerThread, upstream: FakeUpstream, prompt: Any
) -> None:
    assert post(gateway, "/v1/completions", {"prompt": prompt, "max_tokens": 3}).status_code == 200
    assert upstream.requests[-1].body["prompt"] == prompt


def test_chat_content_parts_and_tool_messages_are_accepted(gateway: ServerThread, upstream: FakeUpstream) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "call it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "t", "content": "42"},
    ]
    assert post(gateway, "/v1/chat/completions", {"messages": messages}).status_code == 200
    assert upstream.requests[-1].body["messages"] == messages


def test_a_null_stream_flag_means_not_streamed(gateway: ServerThread, upstream: FakeUpstream) -> None:
    response = post(gateway, "/v1/chat/completions", {"messages": MESSAGES, "stream": None})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.json()["object"] == "chat.completion"


def test_an_alias_is_rewritten_to_the_served_name_and_the_rest_left_byte_for_byte(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    raw = b'{"model":"m1","messages":[{"role":"user","content":"hi"}],  "temperature" : 0.5}'
    assert httpx.post(gateway.url + "/v1/chat/completions", content=raw).status_code == 200
    assert upstream.requests[-1].raw == raw  # the exact bytes: nothing re-serialised
    aliased = raw.replace(b'"m1"', b'"alias-1"')
    assert httpx.post(gateway.url + "/v1/chat/completions", content=aliased).status_code == 200
    assert upstream.requests[-1].body == {"model": "m1", "messages": MESSAGES, "temperature": 0.5}


def requests_with_status(server: ServerThread, status: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("gateway_requests_total{") and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_leaves_while_sending_its_body_is_counted_as_499(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b'Content-Length: 5000\r\n\r\n{"model": "m1", "messages": ['
        )
    wait_for(lambda: requests_with_status(gateway, "499") == 1, 5, "the abandoned request to be counted")
    assert upstream.requests == []
    assert (
        httpx.post(gateway.url + "/v1/chat/completions", json={"model": "m1", "messages": MESSAGES}).status_code == 200
    )


@pytest.mark.parametrize(
    ("endpoint", "prompt", "prompts"),
    [
        ("completions", ["a", "b", "c"], 3),
        ("completions", [[1, 2], [3]], 2),
        ("completions", [1, 2, 3], 1),  # one prompt of token ids
        ("completions", "abc", 1),
        # Only the legacy completions endpoint batches prompts: a list elsewhere (an operator's extra field
        # on chat, which vLLM's chat ignores) asks for one generation.
        ("chat/completions", ["a", "b", "c"], 1),
        ("embeddings", ["a", "b", "c"], 1),
    ],
)
def test_only_a_completions_prompt_list_is_a_batch(endpoint: str, prompt: Any, prompts: int) -> None:
    body = {"prompt": prompt, "max_tokens": 5, "n": 2}
    assert requested_prompts(endpoint, body) == prompts
    assert requested_completion_tokens(endpoint, body) == 5 * 2 * prompts
