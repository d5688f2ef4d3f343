"""The Responses API through the gateway, against the fake worker and the real Redis, driven by the
official ``openai`` SDK: create (plain and streamed, with the SDK's ``stream()`` helper), retrieve,
delete, input_items, cancel, ``previous_response_id`` chains, tool round trips, ``text.format``, and
what is refused (with OpenAI-shaped errors naming the field)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics
from tests.support.scripted_worker import ScriptedWorker, completion, text_in_a_calls_last_chunk

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"test:responses:{uuid.uuid4().hex}"
    yield name
    client = redis.Redis()
    keys = list(client.scan_iter(match=f"{name}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def server(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> Iterator[ServerThread]:
    with gateway_factory(base_config([upstream_url], responses={"redis_prefix": prefix, "ttl_s": 120})) as (_, srv):
        yield srv


def sdk(server: ServerThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def last_chat(upstream: FakeUpstream) -> dict[str, Any]:
    seen = [r for r in upstream.requests if r.path == "/v1/chat/completions"]
    return seen[-1].body


def test_create_translates_to_chat_and_back(server: ServerThread, upstream: FakeUpstream, prefix: str) -> None:
    client = sdk(server)
    response = client.responses.create(
        model="alias-1",
        instructions="Be brief.",
        input="hi there",
        max_output_tokens=50,
        temperature=0.2,
        metadata={"topic": "greeting"},
    )
    assert response.output_text == "Hello from the fake worker."
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.model == "alias-1" and response.metadata == {"topic": "greeting"}
    assert response.usage is not None and response.usage.input_tokens == 5 and response.usage.output_tokens == 3
    chat = last_chat(upstream)
    assert chat["model"] == "m1"
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    assert chat["max_tokens"] == 50 and chat["temperature"] == 0.2
    # stored under this gateway's prefix, with a TTL from the config
    keys = list(redis.Redis().scan_iter(match=f"{prefix}:*resp_*"))
    assert len(keys) == 1 and 0 < redis.Redis().ttl(keys[0]) <= 120
    again = client.responses.retrieve(response.id)
    assert again.output_text == response.output_text and again.id == response.id


def test_stream_event_sequence_and_sdk_helper(server: ServerThread, upstream: FakeUpstream) -> None:
    client = sdk(server)
    events = list(client.responses.create(model="m1", input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") == 3
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello from the fake worker."
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "Hello from the fake worker." and final.usage.output_tokens == 3
    assert last_chat(upstream)["stream_options"] == {"include_usage": True}

    with client.responses.stream(model="m1", input="hi") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        done = stream.get_final_response()
    assert "".join(texts) == done.output_text == "Hello from the fake worker."
    assert client.responses.retrieve(done.id).output_text == done.output_text


def test_three_turn_chain_carries_the_whole_conversation(server: ServerThread, upstream: FakeUpstream) -> None:
    client = sdk(server)
    first = client.responses.create(model="m1", input="one", instructions="Old instructions.")
    upstream.behavior.text = "second answer"
    second = client.responses.create(model="m1", input="two", previous_response_id=first.id)
    upstream.behavior.text = "third answer"
    with client.responses.stream(model="m1", input="three", previous_response_id=second.id) as stream:
        third = stream.get_final_response()
    assert third.output_text == "third answer" and third.previous_response_id == second.id
    # instructions are not carried over (as OpenAI); every earlier turn is
    assert last_chat(upstream)["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "Hello from the fake worker."},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second answer"},
        {"role": "user", "content": "three"},
    ]
    items = client.responses.input_items.list(third.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 5
    assert [i.role for i in items.data] == ["user", "assistant", "user", "assistant", "user"]  # type: ignore[union-attr]
    newest_first = client.responses.input_items.list(third.id, limit=2)
    assert newest_first.has_more and [i.content[0].text for i in newest_first.data] == ["three", "second answer"]  # type: ignore[union-attr]
    paged = [i.id for i in client.responses.input_items.list(third.id, limit=2, order="asc")]  # auto-paginates
    assert paged == [i.id for i in items.data]


def test_tool_round_trip_plain_and_streamed(server: ServerThread, upstream: FakeUpstream) -> None:
    client = sdk(server)
    upstream.behavior.tool_calls = [{"id": "call_abc", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    call = client.responses.create(model="m1", input="weather in Paris?", tools=[TOOL], tool_choice="required")
    chat = last_chat(upstream)
    assert chat["tools"][0] == {
        "type": "function",
        "function": {"name": "get_weather", "description": TOOL["description"], "parameters": TOOL["parameters"]},
    }
    assert chat["tool_choice"] == "required"
    [item] = call.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id == "call_abc"
    assert orjson.loads(item.arguments) == {"city": "Paris"}

    upstream.behavior.tool_calls = None
    upstream.behavior.text = "It is sunny in Paris."
    answer = client.responses.create(
        model="m1",
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": "call_abc", "output": '{"sky": "sunny"}'}],
        tools=[TOOL],
    )
    assert answer.output_text == "It is sunny in Paris."
    messages = last_chat(upstream)["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "call_abc", "content": '{"sky": "sunny"}'}

    # streamed: function_call_arguments deltas, then done, then the item
    upstream.behavior.tool_calls = [{"id": "call_xyz", "name": "get_weather", "arguments": '{"city": "Rome"}'}]
    events = list(
        client.responses.create(
            model="m1",
            input="Rome?",
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
        )
    )
    assert last_chat(upstream)["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[5].arguments == '{"city": "Rome"}'  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output[0].call_id == "call_xyz" and final.output[0].status == "completed"


def test_a_call_is_done_when_the_next_call_starts(server: ServerThread, upstream: FakeUpstream) -> None:
    """Two calls streamed one after the other: the first call's arguments.done and output_item.done come
    as the second starts, as OpenAI streams them (an item is done before the next is added), each at its
    own output_index; the stored Response holds the same two calls the SDK accumulated."""
    upstream.behavior.tool_calls = [
        {"id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    client = sdk(server)
    with client.responses.stream(model="m1", input="Paris and Rome?", tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    stored = client.responses.retrieve(final.id)
    placed = [(e.type, e.output_index) for e in events if hasattr(e, "output_index")]
    one_call = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert placed == [(kind, 0) for kind in one_call] + [(kind, 1) for kind in one_call]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.item.call_id, e.item.arguments, e.item.status) for e in done] == [  # type: ignore[union-attr]
        ("call_a", '{"city": "Paris"}', "completed"),
        ("call_b", '{"city": "Rome"}', "completed"),
    ]
    assert [e.sequence_number for e in events] == sorted(e.sequence_number for e in events)

    def calls(output: Any) -> list[tuple[Any, ...]]:
        return [(item.id, item.status, item.call_id, item.name, item.arguments) for item in output]

    streamed = calls(e.item for e in done)  # type: ignore[union-attr]
    assert calls(final.output) == calls(stored.output) == calls(events[-1].response.output) == streamed  # type: ignore[union-attr]


def test_text_in_the_same_chunk_as_a_calls_arguments_does_not_cut_the_call(
    gateway_factory: GatewayFactory, prefix: str
) -> None:
    """A worker that sends several tokens per chunk (speculative decoding, --stream-interval) can put the
    newline after a call in the delta that carries the call's last arguments: the call stays one whole
    function_call item, and the text is a message item after it, as vLLM's entrypoint streams it; the
    stored Response holds the same items."""

    worker = ScriptedWorker()
    worker.events = text_in_a_calls_last_chunk()
    with (
        ServerThread(worker) as upstream,
        gateway_factory(base_config([upstream.url], responses={"redis_prefix": prefix})) as (_, gateway),
    ):
        client = sdk(gateway)
        with client.responses.stream(model="m1", input="Weather and time in Paris?", tools=[TOOL]) as stream:
            events = list(stream)
            final = stream.get_final_response()
        stored = client.responses.retrieve(final.id)
    placed = [(e.type, e.output_index, getattr(e, "item", None)) for e in events if hasattr(e, "output_index")]
    assert [(kind, index, item and item.type) for kind, index, item in placed] == [
        ("response.output_item.added", 0, "function_call"),
        ("response.function_call_arguments.delta", 0, None),
        ("response.function_call_arguments.delta", 0, None),
        ("response.function_call_arguments.done", 0, None),
        ("response.output_item.done", 0, "function_call"),
        ("response.output_item.added", 1, "message"),
        ("response.content_part.added", 1, None),
        ("response.output_text.delta", 1, None),
        ("response.output_text.done", 1, None),
        ("response.content_part.done", 1, None),
        ("response.output_item.done", 1, "message"),
        ("response.output_item.added", 2, "function_call"),
        ("response.function_call_arguments.delta", 2, None),
        ("response.function_call_arguments.done", 2, None),
        ("response.output_item.done", 2, "function_call"),
    ]

    def items(output: Any) -> list[tuple[Any, ...]]:
        def fields(item: Any) -> tuple[Any, ...]:
            if item.type == "message":
                return tuple((part.type, part.text) for part in item.content)
            return item.call_id, item.name, item.arguments

        return [(item.type, item.id, item.status, *fields(item)) for item in output]

    accumulated = items(final.output)  # what the SDK made of the deltas
    assert [item[:1] + item[3:] for item in accumulated] == [
        ("function_call", "call_0", "get_weather", '{"city": "Paris"}'),
        ("message", ("output_text", "\n")),
        ("function_call", "call_1", "get_time", '{"zone": "UTC"}'),
    ]
    assert all(status == "completed" for _, _, status, *_ in accumulated) and final.status == "completed"
    assert items(events[-1].response.output) == items(stored.output) == accumulated  # type: ignore[union-attr]


def test_a_turn_of_calls_and_text_is_replayed_as_one_assistant_message(
    gateway_factory: GatewayFactory, prefix: str
) -> None:
    """A stored output of [function_call, message, function_call] reaches the worker's next chat request as
    one assistant message holding the text and both calls, whether the turn is continued by
    previous_response_id or its items are sent back as input: as vLLM's own Responses entrypoint builds
    it (construct_chat_messages_with_tool_call), and as the chat templates expect a tool-calling turn."""

    worker = ScriptedWorker()
    worker.events = text_in_a_calls_last_chunk()
    worker.body = completion()
    question = "Weather and time in Paris?"
    outputs = [
        {"type": "function_call_output", "call_id": "call_0", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    ]
    with (
        ServerThread(worker) as upstream,
        gateway_factory(base_config([upstream.url], responses={"redis_prefix": prefix})) as (_, gateway),
    ):
        client = sdk(gateway)
        with client.responses.stream(model="m1", input=question, tools=[TOOL]) as stream:
            first = stream.get_final_response()
        assert [item.type for item in first.output] == ["function_call", "message", "function_call"]
        client.responses.create(model="m1", previous_response_id=first.id, input=outputs, tools=[TOOL])  # type: ignore[arg-type]
        sent_back = [item.model_dump(exclude_none=True) for item in first.output]
        client.responses.create(
            model="m1",
            input=[{"role": "user", "content": question}, *sent_back, *outputs],  # type: ignore[list-item]
            tools=[TOOL],
            store=False,
        )
    chained, resent = (request["messages"] for request in worker.requests[-2:])
    calls = [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
    ]
    turn = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "\n", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    assert chained == resent == turn


def test_text_format_json_schema_becomes_response_format(server: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.text = '{"name": "Ada"}'
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    response = sdk(server).responses.create(
        model="m1",
        input="a name",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )
    assert orjson.loads(response.output_text) == {"name": "Ada"}
    assert last_chat(upstream)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_max_output_tokens_cut_is_incomplete(server: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.finish_reason = "length"
    response = sdk(server).responses.create(model="m1", input="hi", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    events = list(sdk(server).responses.create(model="m1", input="hi", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"


def test_store_false_keeps_nothing(server: ServerThread, prefix: str) -> None:
    client = sdk(server)
    response = client.responses.create(model="m1", input="hi", store=False)
    assert response.store is False
    assert list(redis.Redis().scan_iter(match=f"{prefix}:*resp_*")) == []
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="m1", input="again", previous_response_id=response.id)
    assert caught.value.body["code"] == "not_found" and caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_delete_then_everything_is_not_found(server: ServerThread) -> None:
    client = sdk(server)
    response = client.responses.create(model="m1", input="hi")
    client.responses.delete(response.id)
    for call in (
        lambda: client.responses.retrieve(response.id),
        lambda: client.responses.delete(response.id),
        lambda: client.responses.input_items.list(response.id),
        lambda: client.responses.cancel(response.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body == {  # type: ignore[comparison-overlap]
            "message": f"Response with id '{response.id}' not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
        }


def test_cancel_explains_background_is_not_supported(server: ServerThread) -> None:
    client = sdk(server)
    response = client.responses.create(model="m1", input="hi")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(response.id)
    assert caught.value.code == "not_cancellable" and "background" in caught.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0].type",
        ),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"kv_transfer_params": {}}, "kv_transfer_params"),
        ({"top_k": 3}, "top_k"),
    ],
)
def test_unsupported_is_a_400_naming_it(
    server: ServerThread, upstream: FakeUpstream, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(server.url + "/v1/responses", json={"model": "m1", "input": "hi", **body})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["code"] == "unsupported_parameter"
    assert upstream.requests == []


def test_bad_requests_and_unknown_ids(server: ServerThread, upstream: FakeUpstream) -> None:
    url = server.url + "/v1/responses"
    assert httpx.post(url, json={"input": "hi"}).json()["error"]["code"] == "missing_required_parameter"
    assert httpx.post(url, json={"model": "m1"}).json()["error"]["param"] == "input"
    reply = httpx.post(url, json={"model": "nope", "input": "hi"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    reply = httpx.post(url, content=b"{not json")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    for rid in ("resp_" + "0" * 48, "nope", "resp_../../x", "a" * 300):
        for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")):
            reply = httpx.request(method, f"{url}/{rid}{path}")
            assert reply.status_code == 404, (method, rid, path)
            assert reply.json()["error"]["code"] == "not_found"
    assert upstream.requests == []


def test_worker_error_is_passed_in_openai_shape(server: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.status = 400
    reply = httpx.post(server.url + "/v1/responses", json={"model": "m1", "input": "hi"})
    assert reply.status_code == 400 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    reply = httpx.post(server.url + "/v1/responses", json={"model": "m1", "input": "hi", "stream": True})
    assert reply.status_code == 400 and set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_stream_cut_by_the_worker_ends_with_an_error_event_and_stores_nothing(
    server: ServerThread, upstream: FakeUpstream, prefix: str
) -> None:
    upstream.behavior.cut_after = 2
    with pytest.raises(openai.APIError):
        list(sdk(server).responses.create(model="m1", input="hi", stream=True))
    assert list(redis.Redis().scan_iter(match=f"{prefix}:*resp_*")) == []


def test_store_unreachable_is_a_503_and_store_false_still_works(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url], responses={"redis_timeout_ms": 200})
    with gateway_factory(config, redis_url="redis://127.0.0.1:1/0") as (_, server):
        client = sdk(server)
        assert client.responses.create(model="m1", input="hi", store=False).output_text
        with pytest.raises(openai.InternalServerError) as caught:
            client.responses.create(model="m1", input="hi")
        assert caught.value.status_code == 503 and caught.value.body["code"] == "store_unavailable"  # type: ignore[index]
        with pytest.raises(openai.APIError) as streamed:
            list(client.responses.create(model="m1", input="hi", stream=True))
        assert "store" in streamed.value.message
        reply = httpx.get(server.url + "/v1/responses/resp_" + "0" * 48)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "store_unavailable"


def test_client_leaving_a_stream_closes_the_worker_and_releases_everything(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.chunks = 200
    upstream.behavior.pace_s = 0.05
    with gateway_factory(base_config([upstream_url], responses={"redis_prefix": prefix})) as (app, server):
        body = {"model": "m1", "input": "a long story", "stream": True}
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=10) as reply:
            seen = ""
            for text in reply.iter_text():
                seen += text
                if "response.output_text.delta" in seen:
                    break  # leave mid-stream
        deadline = time.monotonic() + 10
        while upstream.disconnects < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert upstream.disconnects == 1 and upstream.completed_streams == 0
        while app.state.holder.current.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.holder.current.in_flight == 0  # the pinned snapshot was released
        assert app.state.services.workers.get(upstream_url).in_flight == 0
        assert list(redis.Redis().scan_iter(match=f"{prefix}:*resp_*")) == []  # an unfinished response is not stored
        line = 'gateway_requests_total{model="m1",route="responses",status="499"} 1.0'
        while line not in admin_metrics(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = [x for x in admin_metrics(server).splitlines() if "requests_total{" in x]
        assert line in found, found  # recorded as the client closing it


def test_client_leaving_before_the_answer_closes_the_worker(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    upstream.behavior.hang = True  # the worker never answers; it counts the connection being closed
    with gateway_factory(base_config([upstream_url], responses={"redis_prefix": prefix})) as (app, server):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/responses", json={"model": "m1", "input": "hi"}, timeout=0.5)
        deadline = time.monotonic() + 10
        line = 'gateway_requests_total{model="m1",route="responses",status="499"} 1.0'
        while (upstream.disconnects < 1 or line not in admin_metrics(server)) and (time.monotonic() < deadline):
            time.sleep(0.05)
        assert upstream.disconnects == 1
        assert line in admin_metrics(server)
        assert app.state.holder.current.in_flight == 0


def test_input_items_and_retrieve_parameters(server: ServerThread) -> None:
    response = sdk(server).responses.create(model="m1", input="hi")
    url = f"{server.url}/v1/responses/{response.id}"
    for query, param in (
        ("order=sideways", "order"),
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=%C2%B2", "limit"),  # a digit to str.isdigit (superscript two), not to int()
        ("after=x", "after"),
    ):
        reply = httpx.get(f"{url}/input_items?{query}")
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, query
    reply = httpx.get(f"{url}?stream=true")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "unsupported_parameter"
    assert httpx.put(url).status_code == 405


def test_an_item_id_already_in_the_conversation_is_refused(server: ServerThread, upstream: FakeUpstream) -> None:
    """Ids name the items input_items pages by: an input repeating an item of the previous response (or
    one of its own) is a 400, as on OpenAI, so listing the conversation can never page in a loop."""
    client = sdk(server)
    first = client.responses.create(model="m1", input="one")
    before = len(upstream.requests)
    again = first.output[0].model_dump(exclude_none=True)
    for items, param in (
        ([again, {"role": "user", "content": "two"}], "input[0].id"),
        (
            [{"id": "msg_1", "role": "user", "content": "a"}, {"id": "msg_1", "role": "user", "content": "b"}],
            "input[1].id",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="m1", input=items, previous_response_id=first.id)  # type: ignore[arg-type]
        assert caught.value.param == param and "Duplicate item" in caught.value.message
    assert len(upstream.requests) == before
    second = client.responses.create(model="m1", input="two", previous_response_id=first.id)
    paged = [item.id for item in client.responses.input_items.list(second.id, limit=1)]  # auto-paginates
    assert len(paged) == len(set(paged)) == 3


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_sdk_agent_calls_its_tool_through_the_gateway(
    server: ServerThread, upstream: FakeUpstream, streamed: bool
) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    upstream.behavior.tool_calls = [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="Use the tool.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model="m1", openai_client=client),
            tool_use_behavior="stop_on_first_tool",
        )
        try:
            if not streamed:
                return await agents.Runner.run(agent, "Weather in Oslo?")
            result = agents.Runner.run_streamed(agent, "Weather in Oslo?")
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert ran == ["Oslo"] and result.final_output == "sunny in Oslo"
    chat = last_chat(upstream)
    assert chat["messages"][0] == {"role": "system", "content": "Use the tool."}
    assert chat["tools"][0]["function"]["name"] == "get_weather" and bool(chat.get("stream")) is streamed
