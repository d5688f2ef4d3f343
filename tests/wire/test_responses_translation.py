"""The Responses <-> chat completions translation, as pure functions: input items to messages, and a chat
stream to the Responses event sequence (text then a tool call in one answer, a cut by max tokens)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.wire.errors import InvalidRequest
from gateway.wire.responses_chat import chat_request, instructions_as_seen, items_as_seen
from gateway.wire.responses_events import EventStream
from gateway.wire.responses_output import response_object
from gateway.wire.responses_request import parse_request
from tests.support.responses_schema import check_event


def events_of(data: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for blob in data:
        for block in blob.split(b"\n\n"):
            if block:
                kind, payload = block.split(b"\n", 1)
                event = orjson.loads(payload.removeprefix(b"data: "))
                assert kind == b"event: " + event["type"].encode()
                out.append(event)
    return out


def test_items_become_messages_in_order() -> None:
    req = parse_request(
        {
            "model": "m",
            "instructions": "Be nice.",
            "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": t} for t in "ab"]},
                {"role": "assistant", "content": "Let me check."},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
            ],
        }
    )  # fmt: skip
    assert all(item["id"] for item in req.input_items)
    chat = chat_request(req, "served", [])
    assert chat["model"] == "served" and "stream" not in chat
    assert chat["messages"] == [
        {"role": "system", "content": "Be nice."},
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "a\nb"},  # parts are lines, as vLLM joins them
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_the_cache_key_goes_with_the_chat_request_for_routing() -> None:
    req = parse_request({"model": "m", "input": "hi", "prompt_cache_key": "user-7", "user": "u"})
    chat = chat_request(req, "served", [])
    assert chat["prompt_cache_key"] == "user-7" and chat["user"] == "u"
    assert "prompt_cache_key" not in chat_request(parse_request({"model": "m", "input": "hi"}), "served", [])
    with pytest.raises(InvalidRequest):
        parse_request({"model": "m", "input": "hi", "prompt_cache_key": 7})


@pytest.mark.parametrize(
    "body",
    [
        {"input": ""},  # an empty string is a (short) message, but an empty list is not
        {"tool_choice": {"type": "function", "name": "missing"}, "tools": [{"type": "function", "name": "f"}]},
        {"metadata": {"k": 1}},
        {"max_output_tokens": 0},
        {"temperature": "hot"},
        {"stream_options": {"include_obfuscation": False}},  # only with stream
        {"text": {"format": {"type": "json_schema", "name": "x"}}},  # no schema
        {"input": [{"role": ["user"], "content": "hi"}]},  # a role that is not a string (not hashable)
        {"input": [{"type": "message", "role": {"name": "user"}, "content": "hi"}]},
    ],
)
def test_bad_fields_are_400s(body: dict[str, Any]) -> None:
    full = {"model": "m", "input": "hi", **body}
    if body == {"input": ""}:
        full["input"] = []
    with pytest.raises(InvalidRequest):
        parse_request(full)


def test_text_then_tool_call_stream_closes_the_message_first() -> None:
    req = parse_request({"model": "m", "input": "hi", "stream": True})
    stream = EventStream(response_object(req, "resp_1", "m", 1, "in_progress", []))
    data = stream.start()
    data += stream.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    data += stream.feed({"choices": [{"index": 0, "delta": {"content": "Checking"}}]})
    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    data += stream.feed({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    data += stream.feed(
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]}
    )
    data += stream.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    data += stream.feed({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}})
    data += stream.close()
    data.append(stream.completed())
    events = events_of(data)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e.get("output_index") for e in events[2:13]] == [0] * 6 + [1] * 5
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 11
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Checking"
    assert final["output"][1] == {
        "id": final["output"][1]["id"],
        "type": "function_call",
        "call_id": "call_9",
        "name": "f",
        "arguments": '{"a": 1}',
        "status": "completed",
    }


def _call(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    """A chat stream's tool call delta: the first of a call names it, the others carry arguments only."""
    named = {"id": f"call_{index}", "type": "function", "function": {"name": name}} if name else {"function": {}}
    named["function"]["arguments"] = arguments
    return {"index": index, **named}


def _delta(finish_reason: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish_reason}]}


def test_text_that_came_during_a_call_is_a_message_after_its_item() -> None:
    """Held (with its logprobs) while the call is open, then one message item once the call's item is
    done: as the answer ends, or, before it, as the next call starts."""
    req = parse_request({"model": "m", "input": "hi", "stream": True})
    stream = EventStream(response_object(req, "resp_1", "m", 1, "in_progress", []))
    logprob = {"token": "\n", "logprob": -0.5, "bytes": [10], "top_logprobs": []}
    data = stream.feed(_delta(tool_calls=[_call(0, '{"city": ', "get_weather")]))
    chunk = _delta(content="\n", tool_calls=[_call(0, '"Paris"}')])  # the call's end and the text after it
    chunk["choices"][0]["logprobs"] = {"content": [logprob]}
    data += stream.feed(chunk)
    data += stream.feed(_delta("tool_calls", content="Checking."))
    data += stream.close()
    events = events_of(data)
    for event in events:
        check_event(event)  # as OpenAI's spec has each of them
    assert [(e["type"], e["output_index"]) for e in events] == [
        ("response.output_item.added", 0),
        ("response.function_call_arguments.delta", 0),
        ("response.function_call_arguments.delta", 0),
        ("response.function_call_arguments.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
    ]
    assert events[3]["arguments"] == '{"city": "Paris"}' and events[3]["name"] == "get_weather"
    assert events[7]["delta"] == "\nChecking." and events[7]["logprobs"] == [logprob]  # all of it held
    call, message = stream.response["output"]
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_0", "get_weather", '{"city": "Paris"}')
    assert message["content"][0]["text"] == "\nChecking." and message["content"][0]["logprobs"] == [logprob]
    assert call["status"] == message["status"] == "completed"

    stream = EventStream(response_object(req, "resp_2", "m", 1, "in_progress", []))
    data = stream.feed(_delta(tool_calls=[_call(0, '{"city": ', "get_weather")]))
    data += stream.feed(_delta(content="\n", tool_calls=[_call(0, '"Paris"}'), _call(1, "{}", "get_time")]))
    data += stream.feed(_delta("tool_calls"))
    data += stream.close()
    added_and_done = [
        (e["type"], e["item"]["type"]) for e in events_of(data) if e["type"].startswith("response.output_item.")
    ]
    assert added_and_done == [
        ("response.output_item.added", "function_call"),
        ("response.output_item.done", "function_call"),
        ("response.output_item.added", "message"),
        ("response.output_item.done", "message"),
        ("response.output_item.added", "function_call"),
        ("response.output_item.done", "function_call"),
    ]
    assert [item.get("name") for item in stream.response["output"]] == ["get_weather", None, "get_time"]


def test_a_stream_cut_by_max_tokens_is_incomplete() -> None:
    req = parse_request({"model": "m", "input": "hi", "stream": True, "max_output_tokens": 2})
    stream = EventStream(response_object(req, "resp_1", "m", 1, "in_progress", []))
    stream.start()
    stream.feed({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": "length"}]})
    done = events_of(stream.close())
    assert done[-1]["type"] == "response.output_item.done" and done[-1]["item"]["status"] == "incomplete"
    final = events_of([stream.completed()])[0]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_items_as_seen_take_every_text_from_what_the_worker_was_given() -> None:
    req = parse_request(
        {
            "model": "m",
            "instructions": "key sk-1",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"role": "user", "content": "secret sk-1"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"k": "sk-1"}'},
                {"type": "function_call_output", "call_id": "c", "output": "sk-1"},
            ],
        }
    )
    history = [{"type": "message", "id": "m0", "role": "user", "status": "completed", "content": []}]
    body = chat_request(req, "m", history)
    seen = orjson.loads(orjson.dumps(body).replace(b"sk-1", b"[SECRET]"))
    items = items_as_seen(req, history, seen)
    assert items[0] is req.input_items[0]  # untouched: its parts kept as sent
    assert items[1]["content"] == [{"type": "input_text", "text": "secret [SECRET]"}]
    assert items[2]["arguments"] == '{"k": "[SECRET]"}' and items[3]["output"] == "[SECRET]"
    assert [i["id"] for i in items] == [i["id"] for i in req.input_items]
    assert instructions_as_seen(req, seen) == "key [SECRET]"
    # a plugin that added a message: every text comes from the messages' tail, none from the raw input
    seen["messages"].insert(1, {"role": "system", "content": "added"})
    assert "sk-1" not in str(items_as_seen(req, history, seen))


def test_text_between_calls_is_read_back_from_the_one_assistant_message() -> None:
    """[call, text, call, text, text] of assistant items: the first text joins the message its call opened
    (as vLLM's entrypoint builds it), a text after a text is a message of its own (as vLLM's too); each item,
    a redaction applied, is read back from where it went."""
    call = {"type": "function_call", "name": "f", "arguments": '{"k": "sk-1"}'}
    req = parse_request(
        {
            "model": "m",
            "input": [
                {**call, "call_id": "c1"},
                {"role": "assistant", "content": "between sk-1"},
                {**call, "call_id": "c2"},
                {"role": "assistant", "content": "after"},
                {"role": "assistant", "content": "more"},
            ],
        }
    )
    body = chat_request(req, "m", [])
    assert [(m["content"], [c["id"] for c in m.get("tool_calls", [])]) for m in body["messages"]] == [
        ("between sk-1", ["c1", "c2"]),
        ("after", []),
        ("more", []),
    ]
    seen = orjson.loads(orjson.dumps(body).replace(b"sk-1", b"[SECRET]"))
    items = items_as_seen(req, [], seen)
    assert [i.get("arguments") or i["content"][0]["text"] for i in items] == [
        '{"k": "[SECRET]"}',
        "between [SECRET]",
        '{"k": "[SECRET]"}',
        "after",
        "more",
    ]
    assert [i["id"] for i in items] == [i["id"] for i in req.input_items]
