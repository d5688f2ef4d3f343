"""A tool call's arguments in Anthropic's stream: held until the call's block ends, then one
``input_json_delta`` with the object (the one ``message_from_chat`` gives the whole answer), or none when
they are no JSON object, whichever block comes next (another call, text) or the end of the answer."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire.anthropic_output import MessageStream, message_from_chat


def _call(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        call.update(id=f"call_{index}", type="function")
        call["function"]["name"] = name
    return call


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    return [orjson.loads(part.split(b"\ndata: ", 1)[1]) for part in raw]


def test_each_calls_arguments_come_whole_as_its_block_ends() -> None:
    calls = [("get_weather", ['{"city": ', '"Paris"}']), ("get_time", ["{zone: ", "UTC}"]), ("ping", ["[1, ", "2]"])]
    out = MessageStream("msg_1", "m1")
    raw: list[bytes] = []
    for index, (name, pieces) in enumerate(calls):
        raw += out.feed(_chunk({"tool_calls": [_call(index, pieces[0], name)]}))
        raw += out.feed(_chunk({"tool_calls": [_call(index, pieces[1])]}))
    raw += out.feed(_chunk({"content": "Done."}, "tool_calls"))
    raw += out.close()
    events = _events(raw)
    kinds = [(e["type"], e.get("index"), (e.get("delta") or {}).get("partial_json")) for e in events]
    assert kinds == [
        ("content_block_start", 0, None),
        ("content_block_delta", 0, '{"city":"Paris"}'),  # one delta, the object
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_stop", 1, None),  # not JSON: input stays {}
        ("content_block_start", 2, None), ("content_block_stop", 2, None),  # an array: no object either
        ("content_block_start", 3, None), ("content_block_delta", 3, None), ("content_block_stop", 3, None),
        ("message_delta", None, None),
    ]  # fmt: skip
    assert [e["content_block"].get("input") for e in events if e["type"] == "content_block_start"] == [{}, {}, {}, None]
    assert events[-1]["delta"]["stop_reason"] == "tool_use"

    # the whole answer agrees, call by call
    whole = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "content": None,
                    "tool_calls": [
                        {"id": f"call_{i}", "function": {"name": name, "arguments": "".join(pieces)}}
                        for i, (name, pieces) in enumerate(calls)
                    ],
                },
            }
        ]
    }
    inputs = [block["input"] for block in message_from_chat("msg_2", "m1", whole)["content"]]
    assert inputs == [{"city": "Paris"}, {}, {}]


def test_arguments_cut_short_by_max_tokens_are_an_empty_input() -> None:
    out = MessageStream("msg_1", "m1")
    raw = out.feed(_chunk({"tool_calls": [_call(0, '{"city": "Pa', "get_weather")]}, "length"))
    events = _events(raw + out.close())
    assert [e["type"] for e in events] == ["content_block_start", "content_block_stop", "message_delta"]
    assert events[-1]["delta"]["stop_reason"] == "max_tokens"


def test_text_that_came_during_a_call_follows_its_block() -> None:
    """Held while the call's block is open, then one text block after it, as the next call starts or the
    answer ends."""
    out = MessageStream("msg_1", "m1")
    raw = out.feed(_chunk({"tool_calls": [_call(0, '{"city": ', "get_weather")]}))
    raw += out.feed(_chunk({"content": "\n", "tool_calls": [_call(0, '"Paris"}')]}))
    raw += out.feed(_chunk({"content": "Checking."}, "tool_calls"))
    raw += out.close()
    kinds = [(e["type"], e.get("index"), e.get("delta")) for e in _events(raw)]
    assert kinds == [
        ("content_block_start", 0, None),
        ("content_block_delta", 0, {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, {"type": "text_delta", "text": "\nChecking."}),  # all of it held
        ("content_block_stop", 1, None),
        ("message_delta", None, {"stop_reason": "tool_use", "stop_sequence": None}),
    ]

    out = MessageStream("msg_2", "m1")
    raw = out.feed(_chunk({"tool_calls": [_call(0, '{"city": "Paris"}', "get_weather")]}))
    raw += out.feed(_chunk({"content": "\n"}, "tool_calls"))
    raw += out.close()
    assert [(e["type"], e.get("index")) for e in _events(raw)][-3:] == [
        ("content_block_delta", 1), ("content_block_stop", 1), ("message_delta", None),
    ]  # fmt: skip
