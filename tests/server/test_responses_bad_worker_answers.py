"""A worker whose chat answer is not what the Responses translation reads: a 502 in OpenAI's shape (as the
OpenAI routes answer a worker's body that is not JSON), never the gateway's own 500 nor a Response made of
what could be read, and nothing stored that a later ``previous_response_id`` could chain on; a stream whose
chunk is malformed midway ends with one ``error`` event of that kind, which the ``openai`` SDK raises. A
scripted worker sends the exact bytes; the store is the real Redis, under a prefix of the test's own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.scripted_worker import GOOD_CHOICE, ScriptedWorker, chunk, completion


class Scripted:
    def __init__(self, worker: ScriptedWorker, url: str, prefix: str) -> None:
        self.worker, self.url, self.prefix = worker, url, prefix

    def stored(self) -> list[bytes]:
        """The Responses store's keys of this test (empty: nothing was stored)."""
        with redis.Redis() as client:
            return list(client.scan_iter(match=f"{self.prefix}*"))

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0)


@pytest.fixture
def scripted(gateway_factory: GatewayFactory) -> Iterator[Scripted]:
    worker = ScriptedWorker()
    prefix = f"test:responses-bad-worker:{uuid.uuid4().hex}"
    try:
        with (
            ServerThread(worker) as server,
            gateway_factory(base_config([server.url], responses={"redis_prefix": prefix})) as (_, gateway),
        ):
            yield Scripted(worker, gateway.url, prefix)
    finally:
        with redis.Redis() as client:
            keys = list(client.scan_iter(match=f"{prefix}*"))
            if keys:
                client.delete(*keys)


ASK: dict[str, Any] = {"model": "m1", "input": "Hi", "max_output_tokens": 16}
STORE = pytest.mark.parametrize("store", [True, False], ids=["store", "no-store"])


def assert_worker_error(error: dict[str, Any]) -> None:
    """The OpenAI error of a worker's failure, as the OpenAI routes give it for a body that is not JSON."""
    assert error["type"] == "server_error" and error["code"] == "upstream_error"
    assert "model worker" in error["message"]  # the worker's fault, not "the gateway failed"


def call(name: str = "get_weather", arguments: Any = '{"city": "Paris"}', **members: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}, **members}


def answer(**message: Any) -> bytes:
    return completion(choices=[{**GOOD_CHOICE, "message": {"role": "assistant", "content": None, **message}}])


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
        completion(choices=[{**GOOD_CHOICE, "finish_reason": ["length"]}]),
        answer(content=42),
        answer(tool_calls="get_weather"),
        answer(tool_calls=["get_weather"]),
        answer(tool_calls=[{"id": "call_1", "function": "get_weather"}]),
        answer(tool_calls=[call(arguments={"city": "Paris"})]),
        answer(tool_calls=[call(name=7)]),
        completion(choices=[{**GOOD_CHOICE, "logprobs": {"content": [{"token": "Hello", "logprob": "low"}]}}]),
        completion(choices=[{**GOOD_CHOICE, "logprobs": {"content": "Hello"}}]),
        b"[1, 2]",
        b"null",
        b"<html>Internal Server Error</html>",  # not JSON at all: already a 502 before
    ],
    ids=["no-choices", "choices-string", "choices-object", "choices-empty", "choice-string", "no-message",
         "message-string", "finish-reason-number", "finish-reason-array", "content-number", "tool-calls-string",
         "tool-call-string", "function-string", "arguments-object", "name-number", "logprob-string",
         "logprobs-content-string", "array", "null", "not-json"],
)  # fmt: skip
@STORE
def test_a_malformed_answer_is_a_502_and_nothing_is_stored(scripted: Scripted, body: bytes, store: bool) -> None:
    scripted.worker.body = body
    reply = httpx.post(scripted.url + "/v1/responses", json={**ASK, "store": store})
    assert reply.status_code == 502, reply.text
    assert set(reply.json()) == {"error"}
    assert_worker_error(reply.json()["error"])
    with pytest.raises(openai.APIStatusError) as caught:
        scripted.sdk().responses.create(**ASK, store=store)
    assert caught.value.status_code == 502
    assert scripted.stored() == []


HELLO = chunk({"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": None})
STOP = chunk({"index": 0, "delta": {}, "finish_reason": "stop"})


def delta(**members: Any) -> bytes:
    return chunk({"index": 0, "delta": members, "finish_reason": None})


def call_delta(**function: Any) -> dict[str, Any]:
    return {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", **function}}


@pytest.mark.parametrize(
    "bad",
    [
        chunk(None, choices="none"),
        chunk(None, choices={"0": {"delta": {"content": "x"}}}),
        chunk("Hello"),
        chunk({"index": 0, "delta": "Hello"}),
        delta(content=42),
        delta(tool_calls="get_weather"),
        delta(tool_calls=["get_weather"]),
        delta(tool_calls=[{"index": 0, "function": "get_weather"}]),
        delta(tool_calls=[call_delta(arguments=7)]),
        delta(tool_calls=[call_delta(name=["get_weather"])]),
        delta(tool_calls=[{**call_delta(), "index": [0]}]),
        chunk({"index": 0, "delta": {}, "finish_reason": 1}),
        chunk({"index": 0, "delta": {}, "finish_reason": ["length"]}),
        chunk({"index": 0, "delta": {"content": "!"}, "logprobs": {"content": [{"token": "!", "logprob": "low"}]}}),
        chunk({"index": "0", "delta": {"content": "lost"}}),  # not skipped as another choice's: its text is lost
        b"[1]",
        b"null",
    ],
    ids=["choices-string", "choices-object", "choice-string", "delta-string", "content-number", "tool-calls-string",
         "tool-call-string", "function-string", "arguments-number", "name-array", "index-array",
         "finish-reason-number", "finish-reason-array", "logprob-string", "choice-index-string", "array", "null"],
)  # fmt: skip
@STORE
def test_a_malformed_chunk_midway_ends_the_stream_with_an_error_event(
    scripted: Scripted, bad: bytes, store: bool
) -> None:
    scripted.worker.events = [HELLO, bad, STOP, b"[DONE]"]
    reply = httpx.post(scripted.url + "/v1/responses", json={**ASK, "store": store, "stream": True})
    assert reply.status_code == 200
    data = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in data, data[-2:]  # the Responses API's own events, not a chat stream's error
    events = [orjson.loads(each) for each in data]
    kinds = [event["type"] for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "error", kinds
    assert "response.completed" not in kinds and "response.incomplete" not in kinds
    assert_worker_error(events[-1]["error"])
    assert events[-1]["code"] == "upstream_error" and events[-1]["message"] == events[-1]["error"]["message"]
    # nothing was stored: the id the stream announced is unknown, and no later turn can chain on it
    response_id = events[0]["response"]["id"]
    assert scripted.stored() == []
    assert httpx.get(f"{scripted.url}/v1/responses/{response_id}").status_code == 404
    chained = httpx.post(scripted.url + "/v1/responses", json={**ASK, "previous_response_id": response_id})
    assert chained.status_code == 404 and chained.json()["error"]["param"] == "previous_response_id"

    client = scripted.sdk()
    with pytest.raises(openai.APIError) as caught, client.responses.stream(**ASK, store=store) as stream:
        for _ in stream:
            pass
    assert caught.value.body["code"] == "upstream_error"  # type: ignore[index]
    assert scripted.stored() == []


@pytest.mark.parametrize(
    "error",
    ["boom", None, [1], {"message": 5, "type": 7, "code": {"x": 1}}],
    ids=["string", "null", "array", "fields-not-strings"],
)
def test_a_workers_error_event_of_any_shape_ends_the_stream_as_the_workers_failure(
    scripted: Scripted, error: object
) -> None:
    """vLLM fails a stream after its headers with an ``error`` event; one whose ``error`` is not the object
    it should be is still the worker's failure (read as the chat route reads it): the Responses API's own
    ``error`` event, its fields strings as the API types them, never the gateway's own failure nor a chat
    stream's ``[DONE]``; nothing is stored."""
    scripted.worker.events = [HELLO, orjson.dumps({"error": error}), STOP, b"[DONE]"]
    reply = httpx.post(scripted.url + "/v1/responses", json={**ASK, "stream": True})
    data = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in data, data[-2:]
    events = [orjson.loads(each) for each in data]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] == "error" and isinstance(last["message"], str) and "model worker" in last["message"]
    assert last["code"] is None or isinstance(last["code"], str)
    assert last["error"]["type"] == "server_error"
    assert scripted.stored() == []


def test_a_workers_counts_of_parts_over_their_totals_are_not_passed_on(scripted: Scripted) -> None:
    """Cached tokens are part of the input tokens, reasoning tokens part of the output tokens: a worker that
    reports more of a part than its total gives the total."""
    usage = {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 50},
        "completion_tokens_details": {"reasoning_tokens": 9},
    }
    scripted.worker.body = completion(usage=usage)
    response = scripted.sdk().responses.create(**ASK)
    assert response.usage is not None
    assert (response.usage.input_tokens_details.cached_tokens, response.usage.input_tokens) == (1, 1)
    assert (response.usage.output_tokens_details.reasoning_tokens, response.usage.output_tokens) == (2, 2)


def test_a_well_formed_answer_with_odd_usage_is_still_a_response(scripted: Scripted) -> None:
    """``usage`` is read leniently (as the proxy counts it): a count that is not a number counts 0."""
    scripted.worker.body = completion(usage={"prompt_tokens": "5", "completion_tokens": 3})
    response = scripted.sdk().responses.create(**ASK)
    assert response.output_text == "Hello" and response.status == "completed"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (0, 3, 3)
    assert len(scripted.stored()) > 0  # a whole answer is stored as usual


def test_a_well_formed_stream_with_odd_usage_still_translates(scripted: Scripted) -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": "1", "total_tokens": None}
    scripted.worker.events = [HELLO, STOP, chunk(None, usage=usage), b"[DONE]"]
    with scripted.sdk().responses.stream(**ASK) as stream:
        final = stream.get_final_response()
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (4, 0, 4)


@pytest.mark.parametrize("bad", [delta(content=42), b"[1]", b"{not json"], ids=["content-number", "array", "not-json"])
def test_the_events_of_the_chunks_before_a_malformed_one_come_before_the_error(scripted: Scripted, bad: bytes) -> None:
    """The worker's chunks before the malformed one arrive with it (one read): their events are sent, so
    the client has the text so far and ``sequence_number`` counts without a gap up to the error."""
    scripted.worker.events = [HELLO, bad, STOP, b"[DONE]"]
    reply = httpx.post(scripted.url + "/v1/responses", json={**ASK, "stream": True})
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "error" and "response.completed" not in kinds
    assert [event["delta"] for event in events if event["type"] == "response.output_text.delta"] == ["Hello"]


def test_arguments_of_a_call_after_the_next_call_began_are_the_workers_failure(scripted: Scripted) -> None:
    """A call's item is done once the next call begins (its arguments.done already gave the client the call
    whole): more arguments for it afterwards end the stream with the worker's error, and nothing is stored,
    rather than a second item for the same call without its id and name. An empty delta of that call changes
    nothing and is let through."""
    second = {**call_delta(arguments="{}", name="get_time"), "index": 1, "id": "call_2"}
    first_again: dict[str, Any] = {"index": 0, "function": {}}
    opening = [delta(tool_calls=[call_delta(arguments='{"city": ')]), delta(tool_calls=[second])]
    ending = [chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}), b"[DONE]"]
    client = scripted.sdk()

    scripted.worker.events = [*opening, delta(tool_calls=[first_again]), *ending]
    with client.responses.stream(**ASK, store=False) as stream:
        final = stream.get_final_response()
    assert [(item.call_id, item.arguments) for item in final.output] == [("call_1", '{"city": '), ("call_2", "{}")]  # type: ignore[union-attr]

    late = {**first_again, "function": {"arguments": '"Paris"}'}}
    scripted.worker.events = [*opening, delta(tool_calls=[late]), *ending]
    with pytest.raises(openai.APIError) as caught, client.responses.stream(**ASK) as stream:
        for _ in stream:
            pass
    assert caught.value.body["code"] == "upstream_error"  # type: ignore[index]
    assert "tool call 0" in caught.value.message
    assert scripted.stored() == []


def test_the_gateways_own_failure_midway_ends_the_stream_with_a_responses_error_event(
    scripted: Scripted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the gateway's own while it translates (a bug, here made to happen) is logged and ends the
    stream with the Responses API's ``error`` event, in sequence, not a chat stream's error and ``[DONE]``;
    the turn is counted as a 500, not as a client that went away."""
    from gateway.wire.responses_events import EventStream

    def fail(self: EventStream, chunk: dict[str, Any]) -> list[bytes]:
        raise RuntimeError("a translation bug")

    monkeypatch.setattr(EventStream, "feed", fail)
    scripted.worker.events = [HELLO, STOP, b"[DONE]"]
    reply = httpx.post(scripted.url + "/v1/responses", json={**ASK, "stream": True})
    data = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in data, data[-2:]
    events = [orjson.loads(each) for each in data]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-1]["type"] == "error" and events[-1]["code"] == "internal_error"
    assert scripted.stored() == []
    counted = [line for line in httpx.get(scripted.url + "/metrics").text.splitlines() if "requests_total{" in line]
    assert counted == ['gateway_requests_total{route="responses",status="500"} 1.0']
