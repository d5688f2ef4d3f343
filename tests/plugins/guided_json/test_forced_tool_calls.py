"""A forced tool call's arguments are checked on the way back against its function's ``parameters`` schema,
as a ``response_format`` answer is against its schema: a worker that ignores the constraint (or a model
with no guided decoding) is a 422 ``guided_output_invalid``, or one error event ending a stream, not
arguments the client's code then fails on. ``tool_choice: "auto"`` is left alone (the model may answer
in text), and a request that forces no call still passes through untouched."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from plugins.guided_json.tool_calls import ForcedCalls, find_call_problems
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
COMMENT = b": the worker's own comment\n\n"  # kept by a byte pass-through, dropped by a relay that parses events


@pytest.fixture
def guided(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    plugins: list[dict[str, Any]] = [{"name": "guided_json", "config": {"probe": False}}, {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=plugins)) as (_, server):
        yield server


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, str]:
    return {"id": call_id, "name": name, "arguments": arguments}


def _stream(server: ServerThread, **fields: Any) -> bytes:
    body = {"model": "m1", "messages": MESSAGES, "stream": True, "tools": TOOLS, **fields}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        return reply.read()


def _events(raw: bytes) -> list[str]:
    return [line[6:].decode() for line in raw.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_valid_forced_call_passes_unchanged(guided: ServerThread, upstream: FakeUpstream, choice: Any) -> None:
    arguments = '{"city": "Paris",  "days": 3}'  # the worker's own spacing: passed on as it wrote it
    upstream.behavior.tool_calls = [_call("get_weather", arguments)]
    reply = _client(guided).chat.completions.create(model="m1", messages=MESSAGES, tools=TOOLS, tool_choice=choice)
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "get_weather", arguments)
    assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
@pytest.mark.parametrize(
    ("calls", "words"),
    [
        (
            [_call("get_weather", '{"city": "Par')],
            "tool call 0 (get_weather), its arguments: the answer is not valid JSON",
        ),
        ([_call("get_weather", '{"city": 5}')], "tool call 0 (get_weather), its arguments: the answer does not match"),
        ([_call("get_weather", '{"town": "Paris"}')], "'city' is a required property"),
        ([_call("delete_files", '{"path": "/"}')], 'tool call 0 names "delete_files", which is not a function'),
        (
            [_call("get_weather", '{"city": "Paris"}'), _call("get_weather", '{"city": "Lyon", "days": 0}', "call_2")],
            "tool call 1 (get_weather), its arguments: the answer does not match the schema at days",
        ),
    ],
    ids=["invalid-json", "wrong-type", "missing-property", "unknown-tool", "second-call"],
)
def test_an_invalid_forced_call_is_a_422_the_sdk_does_not_retry(
    guided: ServerThread, upstream: FakeUpstream, choice: Any, calls: list[dict[str, str]], words: str
) -> None:
    upstream.behavior.tool_calls = calls
    with pytest.raises(openai.UnprocessableEntityError) as info:
        _client(guided).with_options(max_retries=3).chat.completions.create(
            model="m1", messages=MESSAGES, tools=TOOLS, tool_choice=choice
        )
    assert info.value.response.headers["x-should-retry"] == "false"
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "guided_output_invalid", error
    assert error["type"] == "invalid_request_error"
    assert words in error["message"] and "finish_reason: tool_calls" in error["message"]
    assert len(upstream.requests) == 1  # neither the SDK nor the gateway asked again


def test_a_call_to_another_offered_tool_than_the_named_one_is_refused(
    guided: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.tool_calls = [_call("get_time", '{"zone": "CET"}')]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        _client(guided).chat.completions.create(model="m1", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED)
    assert isinstance(info.value.body, dict)
    assert 'names "get_time", which is not a function' in info.value.body["message"]
    upstream.behavior.tool_calls = [_call("get_time", '{"zone": "CET"}')]  # the same call is fine when required
    reply = _client(guided).chat.completions.create(model="m1", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    assert reply.choices[0].message.tool_calls is not None


def test_a_text_answer_to_a_forced_call_is_refused(guided: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.text = "It is sunny."
    with pytest.raises(openai.UnprocessableEntityError) as info:
        _client(guided).chat.completions.create(model="m1", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    assert isinstance(info.value.body, dict) and "no tool call" in info.value.body["message"]


def test_with_tool_choice_auto_nothing_is_checked_and_the_stream_passes_through(
    guided: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.tool_calls = [_call("delete_files", '{"path": ')]
    reply = _client(guided).chat.completions.create(model="m1", messages=MESSAGES, tools=TOOLS, tool_choice="auto")
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.arguments == '{"path": '
    upstream.behavior.preamble = COMMENT
    for fields in ({"tool_choice": "auto"}, {}):
        raw = _stream(guided, **fields)
        assert raw.startswith(COMMENT)  # the worker's bytes as they were: this plugin stepped aside
        assert all("error" not in orjson.loads(e) for e in _events(raw)[:-1])


def test_a_stream_with_valid_forced_calls_ends_normally(guided: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.tool_calls = [
        _call("get_weather", '{"city": "Paris", "days": 2}'),
        _call("get_time", '{"zone": "CET"}', "call_2"),
    ]
    stream = _client(guided).chat.completions.create(
        model="m1", messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True
    )
    arguments: dict[int, str] = {}
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            piece = delta.function.arguments if delta.function else None
            arguments[delta.index] = arguments.get(delta.index, "") + (piece or "")
    assert arguments == {0: '{"city": "Paris", "days": 2}', 1: '{"zone": "CET"}'}


@pytest.mark.parametrize(
    ("calls", "words"),
    [
        ([_call("get_weather", '{"city": "Paris", "days": "two"}')], "tool call 0 (get_weather)"),
        (
            [_call("get_weather", '{"city": "Paris"}'), _call("get_time", '{"zone": 1}', "call_2")],
            "tool call 1 (get_time), its arguments: the answer does not match the schema at zone",
        ),
        ([_call("delete_files", "{}")], 'names "delete_files"'),
    ],
    ids=["schema", "second-call", "unknown-tool"],
)
def test_a_stream_with_an_invalid_forced_call_ends_with_an_error_event(
    guided: ServerThread, upstream: FakeUpstream, calls: list[dict[str, str]], words: str
) -> None:
    """Each call's arguments arrive in pieces; they are checked once the stream has them all (per
    tool-call index), and the stream then ends with one error event and [DONE], as for content."""
    upstream.behavior.tool_calls = calls
    events = _events(_stream(guided, tool_choice="required"))
    assert events[-1] == "[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "guided_output_invalid" and words in error["message"]
    assert all("error" not in orjson.loads(e) for e in events[:-2])
    stream = _client(guided).chat.completions.create(
        model="m1", messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True
    )
    with pytest.raises(openai.APIError) as raised:
        list(stream)
    assert isinstance(raised.value.body, dict) and raised.value.body["code"] == "guided_output_invalid"


def test_refused_calls_are_counted_apart_from_refused_content(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    plugins: list[dict[str, Any]] = [{"name": "guided_json", "config": {"probe": False}}, {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=plugins)) as (app, server):
        upstream.behavior.tool_calls = [_call("get_weather", "{}")]
        with pytest.raises(openai.UnprocessableEntityError):
            _client(server).chat.completions.create(model="m1", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED)
        registry = app.state.services.metrics.registry
        family = next(f for f in registry.collect() if f.name == "gateway_guided_json_invalid_answers")
    counted = {
        (s.labels["finish_reason"], s.labels["action"]): s.value for s in family.samples if s.name.endswith("_total")
    }
    assert counted == {("tool_calls", "tool_refused"): 1.0}


def test_a_call_cut_by_the_token_limit_is_reported_as_truncated() -> None:
    """Returned as it is, as a cut response_format answer is (the fake worker never cuts a call)."""
    calls = ForcedCalls({"f": (None,)})
    cut = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": '}}]},
            }
        ]
    }
    problems = find_call_problems(calls, cut)
    assert [(p.index, p.truncated) for p in problems] == [(0, True)]
    whole = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            }
        ]
    }
    assert find_call_problems(calls, whole) == []
