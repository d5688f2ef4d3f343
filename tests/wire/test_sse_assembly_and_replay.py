"""SSE framing, stream assembly and replay beyond the basic round trips: what vLLM really streams
(logprobs in pieces, reasoning, stop reasons, tool-call arguments split across chunks, SSE comments)
and the contract that replaying a complete response and assembling it again gives that response back."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire.streaming import DONE, SSEParser, StreamAssembler, delta_tokens, encode_event, replay


def _assemble(events: list[bytes]) -> StreamAssembler:
    assembler = StreamAssembler()
    parser = SSEParser()
    for event in events:
        for payload in parser.feed(event):
            if payload != b"[DONE]":
                assembler.add(orjson.loads(payload))
    assert parser.pending == b""
    return assembler


# -- SSEParser ------------------------------------------------------------------------------------


def test_parser_ignores_comments_event_names_and_events_without_data() -> None:
    parser = SSEParser()
    stream = b': keep-alive\n\nevent: ping\n\nid: 7\ndata: {"a": 1}\n\nretry: 100\n\ndata: [DONE]\n\n'
    assert parser.feed(stream) == [b'{"a": 1}', b"[DONE]"]


def test_parser_joins_multi_line_data_and_accepts_data_without_a_space() -> None:
    parser = SSEParser()
    assert parser.feed(b'data:{\ndata: "a": 1}\n\n') == [b'{\n"a": 1}']


def test_parser_keeps_an_unfinished_event_pending_until_its_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a"') == []
    assert parser.pending == b'data: {"a"'
    assert parser.feed(b": 1}\n") == []
    assert parser.feed(b"\n") == [b'{"a": 1}']
    assert parser.pending == b""


def test_parser_handles_crlf_split_between_two_feeds() -> None:
    parser = SSEParser()
    out = parser.feed(b'data: {"a": 1}\r')
    out += parser.feed(b"\n\r\n")
    assert out == [b'{"a": 1}']


# -- StreamAssembler ------------------------------------------------------------------------------


def _chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": choices, **extra}


def test_assembler_merges_logprobs_streamed_in_pieces_without_aliasing_the_chunks() -> None:
    first = _chunk([{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [{"token": "a"}]}}])
    second = _chunk([{"index": 0, "delta": {"content": "b"}, "logprobs": {"content": [{"token": "b"}]}}])
    last = _chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}])
    assembler = StreamAssembler()
    for chunk in (first, second, last):
        assembler.add(chunk)
    choice = assembler.result()["choices"][0]
    assert choice["message"]["content"] == "ab"
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["a", "b"]
    assert first["choices"][0]["logprobs"]["content"] == [{"token": "a"}]  # the chunk itself is untouched


def test_assembler_keeps_reasoning_stop_reason_and_system_fingerprint() -> None:
    assembler = StreamAssembler()
    assembler.add(
        _chunk([{"index": 0, "delta": {"role": "assistant", "reasoning_content": "think "}}], system_fingerprint="fp")
    )
    assembler.add(_chunk([{"index": 0, "delta": {"reasoning_content": "more"}}]))
    assembler.add(_chunk([{"index": 0, "delta": {"content": "42"}}]))
    assembler.add(_chunk([{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "###"}]))
    result = assembler.result()
    assert result["system_fingerprint"] == "fp"
    assert result["object"] == "chat.completion"
    message = result["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "42", "reasoning_content": "think more"}
    assert result["choices"][0]["stop_reason"] == "###"


def test_assembler_builds_tool_call_arguments_from_pieces_by_index() -> None:
    assembler = StreamAssembler()
    assembler.add(_chunk([{"index": 0, "delta": {"role": "assistant", "content": None}}]))
    calls = [
        [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get", "arguments": ""}}],
        [{"index": 1, "id": "call_b", "function": {"name": "put", "arguments": '{"k"'}}],
        [{"index": 0, "function": {"arguments": '{"x":'}}],
        [{"index": 0, "function": {"arguments": " 1}"}}],
        [{"index": 1, "function": {"arguments": ": 2}"}}],
    ]
    for piece in calls:
        assembler.add(_chunk([{"index": 0, "delta": {"tool_calls": piece}}]))
    assembler.add(_chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]))
    message = assembler.result()["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "get", "arguments": '{"x": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "put", "arguments": '{"k": 2}'}},
    ]


def test_assembler_is_incomplete_while_any_choice_lacks_a_finish_reason() -> None:
    assembler = StreamAssembler()
    assert not assembler.complete  # nothing yet
    assembler.add(_chunk([{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {"content": "b"}}]))
    assembler.add(_chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    assert not assembler.complete
    assembler.add(_chunk([{"index": 1, "delta": {}, "finish_reason": "length"}]))
    assert assembler.complete
    assert [c["finish_reason"] for c in assembler.result()["choices"]] == ["stop", "length"]


def test_assembler_takes_usage_from_the_usage_only_chunk() -> None:
    assembler = StreamAssembler()
    assembler.add(_chunk([{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]))
    assembler.add(_chunk([], usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}))
    assert assembler.result()["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_assembler_of_legacy_completions_concatenates_text_and_logprobs() -> None:
    assembler = StreamAssembler()
    base = {"id": "cmpl", "object": "text_completion", "created": 1, "model": "m"}
    assembler.add(
        {**base, "choices": [{"index": 0, "text": "Hel", "logprobs": {"tokens": ["Hel"], "token_logprobs": [-0.1]}}]}
    )
    assembler.add(
        {**base, "choices": [{"index": 0, "text": "lo", "logprobs": {"tokens": ["lo"], "token_logprobs": [-0.2]}}]}
    )
    assembler.add({**base, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    result = assembler.result()
    assert result["object"] == "text_completion"
    choice = result["choices"][0]
    assert choice["text"] == "Hello"
    assert choice["logprobs"] == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -0.2]}
    assert choice["finish_reason"] == "length"


# -- replay ---------------------------------------------------------------------------------------

CHAT_WITH_EVERYTHING: dict[str, Any] = {
    "id": "chatcmpl-1",
    "created": 7,
    "model": "m",
    "system_fingerprint": "fp-1",
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "The answer.", "reasoning_content": "Let me think."},
            "logprobs": {"content": [{"token": "The", "logprob": -0.5}]},
            "finish_reason": "stop",
            "stop_reason": "</s>",
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "Other."},
            "logprobs": None,
            "finish_reason": "length",
        },
    ],
    "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10},
}

COMPLETION_WITH_EVERYTHING: dict[str, Any] = {
    "id": "cmpl-1",
    "created": 7,
    "model": "m",
    "object": "text_completion",
    "choices": [
        {
            "index": 0,
            "text": "abc",
            "logprobs": {"tokens": ["abc"], "token_logprobs": [-1.0]},
            "finish_reason": "stop",
            "stop_reason": 13,
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


@pytest.mark.parametrize("response", [CHAT_WITH_EVERYTHING, COMPLETION_WITH_EVERYTHING], ids=["chat", "completions"])
def test_replay_then_assemble_gives_the_response_back(response: dict[str, Any]) -> None:
    original = copy.deepcopy(response)
    events = list(replay(response, include_usage=True))
    assert events[-1] == DONE
    assembler = _assemble(events)
    assert assembler.complete
    assert assembler.result() == original
    assert response == original  # replay does not change what it was given


def test_replay_chunks_have_the_stream_object_type_and_meta_fields() -> None:
    events = [orjson.loads(e[6:]) for e in list(replay(CHAT_WITH_EVERYTHING, include_usage=True))[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert {(e["id"], e["created"], e["model"], e["system_fingerprint"]) for e in events} == {
        ("chatcmpl-1", 7, "m", "fp-1")
    }
    assert events[-1]["choices"] == [] and events[-1]["usage"] == CHAT_WITH_EVERYTHING["usage"]
    # exactly one finishing event per choice, and it is the last one for that choice
    finals = [(c["index"], c["finish_reason"]) for e in events for c in e["choices"] if c["finish_reason"]]
    assert finals == [(0, "stop"), (1, "length")]


def test_replay_without_include_usage_sends_no_usage_chunk() -> None:
    events = [orjson.loads(e[6:]) for e in list(replay(COMPLETION_WITH_EVERYTHING, include_usage=False))[:-1]]
    assert all("usage" not in e for e in events)
    assert all(e["choices"] for e in events)


def test_replay_recognises_chat_by_its_messages_when_object_is_missing() -> None:
    response = {"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}
    events = [orjson.loads(e[6:]) for e in list(replay(response, include_usage=False))[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_replay_of_an_empty_answer_ends_the_stream_without_content_events() -> None:
    response = {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}],
    }
    events = list(replay(response, include_usage=True))
    assert events[-1] == DONE
    deltas = [orjson.loads(e[6:])["choices"][0]["delta"] for e in events[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {}]  # role, then the finish; no usage to send


def test_encode_event_is_one_sse_data_line() -> None:
    assert encode_event({"a": [1, "é"]}) == 'data: {"a":[1,"é"]}\n\n'.encode()


# -- the one-step path for a token chunk ----------------------------------------------------------

_CONTENT = st.fixed_dictionaries({"content": st.text(max_size=4)})
_DELTAS = st.one_of(
    _CONTENT,
    _CONTENT,
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.just("")}),
    st.fixed_dictionaries({"reasoning_content": st.text(max_size=4)}),
    st.fixed_dictionaries({"content": st.none()}),
    st.just({}),
)
_LOGPROBS = {"content": [{"token": "a", "logprob": -0.1}]}
_CHOICES = st.fixed_dictionaries(
    {
        "index": st.sampled_from([0, 0, 1]),
        "delta": _DELTAS,
        "logprobs": st.sampled_from([None, None, _LOGPROBS]),
        "finish_reason": st.sampled_from([None, None, "stop"]),
    }
)
_CHUNKS = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.just("c1"),
            "object": st.just("chat.completion.chunk"),
            "created": st.just(7),
            "model": st.just("m"),
            "choices": st.lists(_CHOICES, min_size=1, max_size=2),
        },
        optional={"usage": st.just({"total_tokens": 3})},
    ),
    max_size=10,
)


@settings(max_examples=400, deadline=None)
@given(chunks=_CHUNKS)
def test_the_one_step_token_path_assembles_what_the_general_path_does(chunks: list[dict[str, Any]]) -> None:
    """``StreamAssembler.add`` takes the common chunk (one choice, a delta with only content) in one step;
    whatever the chunks, the answer is the one the general path builds."""
    general = StreamAssembler()
    general._add_token = lambda choice: False  # type: ignore[method-assign]
    fast = StreamAssembler()
    for chunk in chunks:
        general.add(copy.deepcopy(chunk))
        fast.add(copy.deepcopy(chunk))
    assert fast.result() == general.result()
    assert fast.complete == general.complete


def _token_chunk(choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [choice], **extra}


_TOKEN = {"index": 0, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None}


@pytest.mark.parametrize(
    "near_miss",
    [
        _token_chunk({**_TOKEN, "finish_reason": "length"}),
        _token_chunk({**_TOKEN, "logprobs": _LOGPROBS}),
        _token_chunk({**_TOKEN, "delta": {"content": "b", "reasoning_content": "r"}}),
        _token_chunk({**_TOKEN, "delta": {"reasoning_content": "r"}}),
        _token_chunk({**_TOKEN, "index": 1}),
        _token_chunk({**_TOKEN, "stop_reason": None}),
        _token_chunk(_TOKEN, usage={"total_tokens": 3}),
        _token_chunk(_TOKEN, system_fingerprint="fp"),
    ],
)
def test_a_chunk_that_is_not_only_a_token_takes_the_general_path(near_miss: dict[str, Any]) -> None:
    """After a first token, each way a chunk can differ from "one choice, content only" (a finish, logprobs,
    another member or choice, usage) still reaches the answer."""
    general = StreamAssembler()
    general._add_token = lambda choice: False  # type: ignore[method-assign]
    fast = StreamAssembler()
    for chunk in (_token_chunk({**_TOKEN, "delta": {"role": "assistant", "content": "a"}}), near_miss):
        general.add(copy.deepcopy(chunk))
        fast.add(copy.deepcopy(chunk))
    assert fast.result() == general.result()


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
def test_reasoning_is_assembled_replayed_and_counted_under_either_name(name: str) -> None:
    """vLLM 0.32 (installed here) streams a reasoning model's thinking as ``reasoning``; earlier releases
    and other servers as ``reasoning_content``. Either is kept under its own name, replayed, and counted
    as generated tokens."""
    chunks = [
        _chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
        _chunk([{"index": 0, "delta": {name: "think "}}]),
        _chunk([{"index": 0, "delta": {name: "more"}}]),
        _chunk([{"index": 0, "delta": {"content": "42"}}]),
        _chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
    ]
    assembler = StreamAssembler()
    for c in chunks:
        assembler.add(c)
    answer = assembler.result()
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "42", name: "think more"}
    assert [delta_tokens(c) for c in chunks] == [0, 1, 1, 1, 0]
    again = StreamAssembler()
    for event in replay(answer, include_usage=False):
        if event != DONE:
            again.add(orjson.loads(event[len(b"data: ") :]))
    assert again.result()["choices"][0]["message"] == answer["choices"][0]["message"]
