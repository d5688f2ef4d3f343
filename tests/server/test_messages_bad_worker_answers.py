"""A worker whose chat answer is not what the Messages translation reads: a 502 in Anthropic's shape (as the
OpenAI routes answer a worker's body that is not JSON), never the gateway's own 500 nor a Message made of
what could be read; a stream whose chunk is malformed midway ends with one ``error`` event of that kind,
which the ``anthropic`` SDK raises. A ``/tokenize`` answer without a token count is a 502 on ``count_tokens``
too. A scripted worker sends the exact bytes."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import orjson
import pytest

from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.scripted_worker import GOOD_CHOICE, ScriptedWorker, chunk, completion

ASK = {"model": "m1", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def scripted(gateway_factory: GatewayFactory) -> Iterator[tuple[ScriptedWorker, str]]:
    worker = ScriptedWorker()
    with ServerThread(worker) as server, gateway_factory(base_config([server.url])) as (_, gateway):
        yield worker, gateway.url


@pytest.mark.parametrize(
    "body",
    [
        orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion"}),  # no choices
        completion(choices="none"),
        completion(choices={"0": GOOD_CHOICE}),
        completion(choices=[]),
        completion(choices=["Hello"]),
        completion(choices=[{"index": 0, "finish_reason": "stop"}]),  # a choice without its message
        completion(choices=[{**GOOD_CHOICE, "message": "Hello"}]),
        completion(choices=[{**GOOD_CHOICE, "finish_reason": 1}]),
        completion(choices=[{**GOOD_CHOICE, "message": {"role": "assistant", "content": 42}}]),
        completion(choices=[{**GOOD_CHOICE, "message": {"content": None, "tool_calls": "get_weather"}}]),
        completion(choices=[{**GOOD_CHOICE, "message": {"content": None, "tool_calls": ["get_weather"]}}]),
        completion(choices=[{**GOOD_CHOICE, "message": {"content": None, "tool_calls": [{"function": "f"}]}}]),
        b"[1, 2]",
        b"null",
        b"<html>Internal Server Error</html>",  # not JSON at all: already a 502 before
    ],
    ids=["no-choices", "choices-string", "choices-object", "choices-empty", "choice-string", "no-message",
         "message-string", "finish-reason-number", "content-number", "tool-calls-string", "tool-call-string",
         "function-string", "array", "null", "not-json"],
)  # fmt: skip
def test_a_malformed_answer_is_a_502_in_anthropics_shape(scripted: tuple[ScriptedWorker, str], body: bytes) -> None:
    worker, url = scripted
    worker.body = body
    reply = httpx.post(url + "/v1/messages", json=ASK)
    assert reply.status_code == 502, reply.text
    error = reply.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "api_error" and "model worker" in error["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as caught:
        anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(**ASK)  # type: ignore[arg-type]
    assert caught.value.status_code == 502


def test_a_well_formed_answer_with_odd_usage_is_still_a_message(scripted: tuple[ScriptedWorker, str]) -> None:
    """``usage`` is read leniently (as the proxy counts it): a count that is not a number counts 0."""
    worker, url = scripted
    worker.body = completion(usage={"prompt_tokens": "5", "completion_tokens": 3})
    message = httpx.post(url + "/v1/messages", json=ASK).json()
    assert message["content"] == [{"type": "text", "text": "Hello"}]
    assert message["usage"] == {"input_tokens": 0, "output_tokens": 3}


HELLO = chunk({"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": None})
STOP = chunk({"index": 0, "delta": {}, "finish_reason": "stop"})


@pytest.mark.parametrize(
    "bad",
    [
        chunk(None, choices="none"),
        chunk(None, choices={"0": {"delta": {"content": "x"}}}),
        chunk("Hello"),
        chunk({"index": 0, "delta": "Hello"}),
        chunk({"index": 0, "delta": {"content": 42}}),
        chunk({"index": 0, "delta": {"tool_calls": "get_weather"}}),
        chunk({"index": 0, "delta": {"tool_calls": ["get_weather"]}}),
        chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": 7}}]}}),
        chunk({"index": 0, "delta": {"tool_calls": [{"index": [0], "function": {"name": "f", "arguments": "{}"}}]}}),
        chunk({"index": 0, "delta": {}, "finish_reason": 1}),
        chunk({"index": "0", "delta": {"content": "lost"}}),  # not skipped as another choice's: its text is lost
        b"[1]",
        b"null",
    ],
    ids=["choices-string", "choices-object", "choice-string", "delta-string", "content-number", "tool-calls-string",
         "tool-call-string", "arguments-number", "index-array", "finish-reason-number", "choice-index-string",
         "array", "null"],
)  # fmt: skip
def test_a_malformed_chunk_midway_ends_the_stream_with_an_error_event(
    scripted: tuple[ScriptedWorker, str], bad: bytes
) -> None:
    worker, url = scripted
    worker.events = [HELLO, bad, STOP, b"[DONE]"]
    reply = httpx.post(url + "/v1/messages", json={**ASK, "stream": True})
    assert reply.status_code == 200
    events = [line[7:] for line in reply.text.splitlines() if line.startswith("event: ")]
    assert events[-1] == "error" and "message_stop" not in events and "message_delta" not in events
    last = orjson.loads(reply.text.rstrip("\n").rsplit("\n", 1)[-1].removeprefix("data: "))
    assert last["type"] == "error" and last["error"]["type"] == "api_error"
    assert "model worker" in last["error"]["message"]  # the worker's fault, not "the gateway failed"

    client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(**ASK) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


@pytest.mark.parametrize(
    "error",
    ["boom", None, [1], {"message": 5, "type": 7, "code": {"x": 1}}],
    ids=["string", "null", "array", "fields-not-strings"],
)
def test_a_workers_error_event_of_any_shape_ends_the_stream_as_the_workers_failure(
    scripted: tuple[ScriptedWorker, str], error: object
) -> None:
    """vLLM fails a stream after its headers with an ``error`` event; one whose ``error`` is not the object
    it should be is still the worker's failure (read as the chat route reads it), never the gateway's own."""
    worker, url = scripted
    worker.events = [HELLO, orjson.dumps({"error": error}), STOP, b"[DONE]"]
    reply = httpx.post(url + "/v1/messages", json={**ASK, "stream": True})
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "error" and "message_stop" not in kinds, kinds
    assert events[-1]["error"]["type"] == "api_error"
    assert isinstance(events[-1]["error"]["message"], str) and "model worker" in events[-1]["error"]["message"]


@pytest.mark.parametrize(
    "plugins",
    [
        [{"name": "routing"}],
        [{"name": "safety", "config": {"rules": [{"id": "s", "kind": "secrets", "apply_to": ["output"]}]}},
         {"name": "routing"}],
    ],
    ids=["passed-through", "parsed-by-a-plugin"],
)  # fmt: skip
def test_a_workers_refusal_midway_reads_the_same_whether_a_plugin_parsed_the_stream(
    gateway_factory: GatewayFactory, plugins: list[dict[str, object]]
) -> None:
    """A worker's error event with a client error's ``code`` (vLLM's 400) is the client's error, with the
    worker's message, also when a plugin reads the stream (the gateway then ends it with that error in its
    own words, which is not read back as a worker's failure of its own)."""
    worker = ScriptedWorker()
    refusal = {"message": "This model's maximum context length is 2048 tokens.", "type": "BadRequestError",
               "param": None, "code": 400}  # fmt: skip
    worker.events = [HELLO, orjson.dumps({"error": refusal}), STOP, b"[DONE]"]
    with ServerThread(worker) as server, gateway_factory(base_config([server.url], plugins=plugins)) as (_, gateway):
        reply = httpx.post(gateway.url + "/v1/messages", json={**ASK, "stream": True})
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "error" and "message_stop" not in kinds, kinds
    assert events[-1]["error"] == {"type": "invalid_request_error", "message": refusal["message"]}


def test_a_workers_cached_count_over_its_prompt_count_is_not_a_negative_input(
    scripted: tuple[ScriptedWorker, str],
) -> None:
    """Anthropic counts cached prompt tokens apart from ``input_tokens``; a worker that reports more cached
    tokens than prompt tokens gives neither a negative count nor more cached tokens than the prompt had."""
    worker, url = scripted
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 50}}
    worker.events = [HELLO, STOP, chunk(None, usage=usage), b"[DONE]"]
    with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.stream(**ASK) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (0, 1)
    worker.events = []
    worker.body = completion(usage=usage)
    message = httpx.post(url + "/v1/messages", json=ASK).json()
    assert message["usage"] == {"input_tokens": 0, "output_tokens": 1, "cache_read_input_tokens": 1}


def test_a_well_formed_stream_still_translates(scripted: tuple[ScriptedWorker, str]) -> None:
    worker, url = scripted
    worker.events = [HELLO, STOP, chunk(None, usage={"prompt_tokens": 4, "completion_tokens": "1"}), b"[DONE]"]
    with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.stream(**ASK) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.content[0].text == "Hello" and final.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (4, 0)


@pytest.mark.parametrize(
    "bad",
    [chunk({"index": 0, "delta": {"content": 42}}), b"[1]", b"{not json"],
    ids=["content-number", "array", "not-json"],
)
def test_the_events_of_the_chunks_before_a_malformed_one_come_before_the_error(
    scripted: tuple[ScriptedWorker, str], bad: bytes
) -> None:
    """The worker's chunks before the malformed one arrive with it (one read): their events are sent, so
    the client has the text so far when the error ends the stream."""
    worker, url = scripted
    worker.events = [HELLO, bad, STOP, b"[DONE]"]
    reply = httpx.post(url + "/v1/messages", json={**ASK, "stream": True})
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and "message_stop" not in [event["type"] for event in events]
    deltas = [event["delta"] for event in events if event["type"] == "content_block_delta"]
    assert deltas == [{"type": "text_delta", "text": "Hello"}]


COUNT = {"model": "m1", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    "body",
    [b"<html>Internal Server Error</html>", b"null", b"[1, 2]", b"{}", b'{"count": "7"}', b'{"count": -1}',
     b'{"count": true}', b'{"count": 7.5}'],
    ids=["not-json", "null", "array", "no-count", "count-string", "count-negative", "count-bool", "count-float"],
)  # fmt: skip
def test_a_tokenize_answer_without_a_count_is_a_502_in_anthropics_shape(
    scripted: tuple[ScriptedWorker, str], body: bytes
) -> None:
    worker, url = scripted
    worker.body = body
    reply = httpx.post(url + "/v1/messages/count_tokens", json=COUNT)
    assert reply.status_code == 502, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "api_error"
    assert "/tokenize" in reply.json()["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as caught:
        anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.count_tokens(**COUNT)  # type: ignore[arg-type]
    assert caught.value.status_code == 502


def test_a_tokenize_answer_with_a_count_is_the_input_tokens(scripted: tuple[ScriptedWorker, str]) -> None:
    worker, url = scripted
    worker.body = b'{"count": 7, "max_model_len": 2048, "tokens": [1, 2, 3, 4, 5, 6, 7]}'
    counted = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.count_tokens(**COUNT)  # type: ignore[arg-type]
    assert counted.input_tokens == 7


def _calls(*calls: dict[str, object]) -> bytes:
    return chunk({"index": 0, "delta": {"tool_calls": list(calls)}, "finish_reason": None})


def _named(index: int, name: str, arguments: str) -> dict[str, object]:
    """A tool call's first delta, with its id and name."""
    return {
        "index": index,
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def test_arguments_of_a_call_after_the_next_call_began_are_the_workers_failure(
    scripted: tuple[ScriptedWorker, str],
) -> None:
    """A call's block ends once the next call begins (its ``input_json_delta`` already gave the client the
    call whole): more arguments for it afterwards end the stream with the worker's error event, rather than
    a third ``tool_use`` block for the same call without its id and name. An empty delta of that call
    changes nothing and is let through."""
    worker, url = scripted
    first, second = _named(0, "get_weather", '{"city": "Paris"}'), _named(1, "get_time", "{}")
    ending = [chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}), b"[DONE]"]
    client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)

    worker.events = [_calls(first), _calls(second), _calls({"index": 0, "function": {}}), *ending]
    with client.messages.stream(**ASK) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert [(block.type, block.id, block.name, block.input) for block in final.content] == [  # type: ignore[union-attr]
        ("tool_use", "call_0", "get_weather", {"city": "Paris"}),
        ("tool_use", "call_1", "get_time", {}),
    ]
    assert final.stop_reason == "tool_use"

    worker.events = [_calls(first), _calls(second), _calls({"index": 0, "function": {"arguments": " "}}), *ending]
    with pytest.raises(anthropic.APIStatusError) as caught, client.messages.stream(**ASK) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "tool call 0" in caught.value.message
    reply = httpx.post(url + "/v1/messages", json={**ASK, "stream": True})
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    starts = [event["content_block"]["name"] for event in events if event["type"] == "content_block_start"]
    assert starts == ["get_weather", "get_time"] and events[-1]["type"] == "error"
    assert "message_delta" not in [event["type"] for event in events]
