"""A forced tool call asked through the Responses API (``/v1/responses``) or Anthropic's Messages API
(``/v1/messages``) is checked as a chat one is (``test_forced_tool_calls``): both translate the request into a
chat request whose ``tool_choice`` forces the call, so guided_json checks the returned call's arguments
against the function's schema. What the client gets is the API's own shape: a valid call unchanged, a broken
one a 422 (OpenAI's error body; Anthropic's ``{"type": "error", "error": {...}}``), a streamed one ending with
the API's error event (Responses: ``error``, never ``response.completed``; Messages: ``event: error``, never
``message_stop``), and nothing stored. ``tool_choice`` auto is not checked."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import redis

from tests.plugins.guided_json.test_forced_tool_calls import TIME, WEATHER
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

ASK = "Weather in Paris?"
RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
]
MESSAGES_TOOLS: list[Any] = [
    {"name": "get_weather", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]
#: Each API's forcing tool_choice (named, "required"), the chat one it becomes in the request a worker sees.
RESPONSES_FORCING = [({"type": "function", "name": "get_weather"}, "get_weather"), ("required", "required")]
MESSAGES_FORCING = [({"type": "tool", "name": "get_weather"}, "get_weather"), ({"type": "any"}, "required")]
GOOD = '{"city": "Paris", "days": 3}'
#: Arguments the function's schema refuses, and words of the refusal's message.
BROKEN = [
    ('{"city": "Paris", "days": 0}', "tool call 0 (get_weather), its arguments: the answer does not match"),
    ('{"town": "Paris"}', "'city' is a required property"),
]


def _call(arguments: str, name: str = "get_weather") -> dict[str, str]:
    return {"id": "call_1", "name": name, "arguments": arguments}


def _sent_choice(upstream: FakeUpstream) -> Any:
    """The tool_choice of the last chat request a worker was sent, as a name or "required"."""
    choice = [r.body for r in upstream.requests if r.path == "/v1/chat/completions"][-1]["tool_choice"]
    return choice["function"]["name"] if isinstance(choice, dict) else choice


def _sse(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    """Each event of a stream: its ``event:`` name (None when it has none) and its data."""
    events = []
    for block in raw.split(b"\n\n"):
        lines = block.split(b"\n")
        name = next((line[7:].decode() for line in lines if line.startswith(b"event: ")), None)
        data = next((line[6:] for line in lines if line.startswith(b"data: ")), None)
        if data is not None and data != b"[DONE]":
            events.append((name, orjson.loads(data)))
    return events


@pytest.fixture
def stored() -> Iterator[str]:
    """A unique Redis prefix for this test's stored responses, deleted afterwards."""
    prefix = "test:forcedresp:" + uuid.uuid4().hex[:12]
    yield prefix
    client = redis.Redis()
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def _stored_responses(prefix: str) -> list[bytes]:
    client = redis.Redis()
    try:
        return list(client.scan_iter(match=f"{prefix}:*resp_*", count=1000))
    finally:
        client.close()


@pytest.fixture
def guided(gateway_factory: GatewayFactory, upstream_url: str, stored: str) -> Iterator[ServerThread]:
    plugins: list[dict[str, Any]] = [{"name": "guided_json", "config": {"probe": False}}, {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins, responses={"redis_prefix": stored})
    with gateway_factory(config) as (_, server):
        yield server


def _openai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _anthropic(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=20)


# -- the Responses API -----------------------------------------------------------------------------


@pytest.mark.parametrize(("choice", "sent"), RESPONSES_FORCING, ids=["named", "required"])
def test_responses_a_valid_forced_call_passes_unchanged(
    guided: ServerThread, upstream: FakeUpstream, choice: Any, sent: str
) -> None:
    upstream.behavior.tool_calls = [_call(GOOD)]
    client = _openai(guided)
    reply = client.responses.create(model="m1", input=ASK, tools=RESPONSES_TOOLS, tool_choice=choice)
    assert _sent_choice(upstream) == sent
    assert [(i.type, i.call_id, i.name, i.arguments) for i in reply.output] == [  # type: ignore[union-attr]
        ("function_call", "call_1", "get_weather", GOOD)
    ]
    with client.responses.stream(model="m1", input=ASK, tools=RESPONSES_TOOLS, tool_choice=choice) as stream:
        final = stream.get_final_response()
    assert [(i.call_id, i.arguments) for i in final.output] == [("call_1", GOOD)]  # type: ignore[union-attr]


@pytest.mark.parametrize(("choice", "sent"), RESPONSES_FORCING, ids=["named", "required"])
@pytest.mark.parametrize(("arguments", "words"), BROKEN, ids=["schema", "missing-property"])
def test_responses_a_broken_forced_call_is_a_422_in_openais_shape_and_not_stored(
    guided: ServerThread, upstream: FakeUpstream, stored: str, choice: Any, sent: str, arguments: str, words: str
) -> None:
    upstream.behavior.tool_calls = [_call(arguments)]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        _openai(guided).with_options(max_retries=3).responses.create(
            model="m1", input=ASK, tools=RESPONSES_TOOLS, tool_choice=choice
        )
    assert _sent_choice(upstream) == sent
    assert info.value.response.headers["x-should-retry"] == "false"
    error = info.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == "guided_output_invalid" and error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert len(upstream.requests) == 1  # neither the SDK nor the gateway asked again
    assert _stored_responses(stored) == []


@pytest.mark.parametrize(("choice", "sent"), RESPONSES_FORCING, ids=["named", "required"])
def test_responses_a_stream_with_a_broken_forced_call_ends_with_an_error_event(
    guided: ServerThread, upstream: FakeUpstream, stored: str, choice: Any, sent: str
) -> None:
    arguments, words = BROKEN[0]
    upstream.behavior.tool_calls = [_call(arguments)]
    body = {"model": "m1", "input": ASK, "tools": RESPONSES_TOOLS, "tool_choice": choice, "stream": True}
    with httpx.stream("POST", guided.url + "/v1/responses", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        events = [data for _, data in _sse(reply.read())]
    assert _sent_choice(upstream) == sent
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "error", kinds
    assert "response.completed" not in kinds and kinds.count("error") == 1
    last = events[-1]
    assert last["code"] == last["error"]["code"] == "guided_output_invalid" and words in last["message"]
    stream = _openai(guided).responses.create(
        model="m1", input=ASK, tools=RESPONSES_TOOLS, tool_choice=choice, stream=True
    )
    with pytest.raises(openai.APIError) as raised:
        list(stream)
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "guided_output_invalid"
    assert _stored_responses(stored) == []


def test_responses_tool_choice_auto_is_not_checked(guided: ServerThread, upstream: FakeUpstream) -> None:
    arguments = BROKEN[0][0]
    upstream.behavior.tool_calls = [_call(arguments, "delete_files")]
    client = _openai(guided)
    reply = client.responses.create(model="m1", input=ASK, tools=RESPONSES_TOOLS, tool_choice="auto", store=False)
    assert [(i.name, i.arguments) for i in reply.output] == [("delete_files", arguments)]  # type: ignore[union-attr]
    with client.responses.stream(
        model="m1", input=ASK, tools=RESPONSES_TOOLS, tool_choice="auto", store=False
    ) as stream:
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output] == [("delete_files", arguments)]  # type: ignore[union-attr]


# -- the Messages API ------------------------------------------------------------------------------


@pytest.mark.parametrize(("choice", "sent"), MESSAGES_FORCING, ids=["tool", "any"])
def test_messages_a_valid_forced_call_passes_unchanged(
    guided: ServerThread, upstream: FakeUpstream, choice: Any, sent: str
) -> None:
    upstream.behavior.tool_calls = [_call(GOOD)]
    client = _anthropic(guided)
    asked: dict[str, Any] = {
        "model": "m1", "max_tokens": 64, "messages": [{"role": "user", "content": ASK}],
        "tools": MESSAGES_TOOLS, "tool_choice": choice,
    }  # fmt: skip
    message = client.messages.create(**asked)
    assert _sent_choice(upstream) == sent
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    for answer in (message, streamed):
        assert [(b.type, b.id, b.name, b.input) for b in answer.content] == [  # type: ignore[union-attr]
            ("tool_use", "call_1", "get_weather", orjson.loads(GOOD))
        ]
        assert answer.stop_reason == "tool_use"


@pytest.mark.parametrize(("choice", "sent"), MESSAGES_FORCING, ids=["tool", "any"])
@pytest.mark.parametrize(("arguments", "words"), BROKEN, ids=["schema", "missing-property"])
def test_messages_a_broken_forced_call_is_a_422_in_anthropics_shape(
    guided: ServerThread, upstream: FakeUpstream, choice: Any, sent: str, arguments: str, words: str
) -> None:
    upstream.behavior.tool_calls = [_call(arguments)]
    with pytest.raises(anthropic.UnprocessableEntityError) as info:
        _anthropic(guided).with_options(max_retries=3).messages.create(
            model="m1", max_tokens=64, messages=[{"role": "user", "content": ASK}],
            tools=MESSAGES_TOOLS, tool_choice=choice,
        )  # fmt: skip
    assert _sent_choice(upstream) == sent
    assert info.value.response.headers["x-should-retry"] == "false"
    body = info.value.body
    assert isinstance(body, dict) and body == {"type": "error", "error": body["error"]}, body
    assert body["error"]["type"] == "invalid_request_error" and set(body["error"]) == {"type", "message"}
    assert words in body["error"]["message"]
    assert len(upstream.requests) == 1


@pytest.mark.parametrize(("choice", "sent"), MESSAGES_FORCING, ids=["tool", "any"])
def test_messages_a_stream_with_a_broken_forced_call_ends_with_an_error_event(
    guided: ServerThread, upstream: FakeUpstream, choice: Any, sent: str
) -> None:
    arguments, words = BROKEN[0]
    upstream.behavior.tool_calls = [_call(arguments)]
    body = {
        "model": "m1", "max_tokens": 64, "messages": [{"role": "user", "content": ASK}],
        "tools": MESSAGES_TOOLS, "tool_choice": choice, "stream": True,
    }  # fmt: skip
    with httpx.stream("POST", guided.url + "/v1/messages", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        events = _sse(reply.read())
    assert _sent_choice(upstream) == sent
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "error", names
    assert "message_stop" not in names and names.count("error") == 1
    assert all(name == data["type"] for name, data in events)  # Anthropic's events only, no chat-shaped one
    error = events[-1][1]
    assert error == {"type": "error", "error": {"type": "invalid_request_error", "message": error["error"]["message"]}}
    assert words in error["error"]["message"]
    asked = {k: v for k, v in body.items() if k != "stream"}
    with pytest.raises(anthropic.APIStatusError) as raised, _anthropic(guided).messages.stream(**asked) as stream:
        stream.get_final_message()
    assert isinstance(raised.value.body, dict) and raised.value.body["error"]["type"] == "invalid_request_error"


def test_messages_tool_choice_auto_is_not_checked(guided: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.tool_calls = [_call('{"path": "/"}', "delete_files")]
    client = _anthropic(guided)
    asked: dict[str, Any] = {
        "model": "m1", "max_tokens": 64, "messages": [{"role": "user", "content": ASK}],
        "tools": MESSAGES_TOOLS, "tool_choice": {"type": "auto"},
    }  # fmt: skip
    message = client.messages.create(**asked)
    with client.messages.stream(**asked) as stream:
        streamed = stream.get_final_message()
    assert _sent_choice(upstream) == "auto"
    for answer in (message, streamed):
        assert [(b.name, b.input) for b in answer.content] == [("delete_files", {"path": "/"})]  # type: ignore[union-attr]
