"""A reasoning model's thinking (a worker started with a reasoning parser writes it apart from the text, as
``reasoning`` or, in earlier vLLM releases, ``reasoning_content``) reaches the translated APIs as their
own APIs give it: a ``reasoning`` output item of the Responses API, a ``thinking`` block of the Messages
API, before the text and tool calls, whole or streamed, read by the real SDKs. An earlier turn's
reasoning, stored or sent back in ``input``, never reaches the worker. A scripted worker sends the
answers; the Responses store is the real Redis, under a prefix of the test's own."""

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

from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.responses_schema import check_event, check_response
from tests.support.scripted_worker import ScriptedWorker, chunk, completion

FIELD = pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
#: vLLM's usage with a reasoning parser: the thinking is counted among the completion tokens, and apart
USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 5,
    "total_tokens": 12,
    "completion_tokens_details": {"reasoning_tokens": 3},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


@pytest.fixture
def scripted(gateway_factory: GatewayFactory) -> Iterator[tuple[ScriptedWorker, str]]:
    worker = ScriptedWorker()
    prefix = f"test:responses-reasoning:{uuid.uuid4().hex}"
    try:
        with (
            ServerThread(worker) as server,
            gateway_factory(base_config([server.url], responses={"redis_prefix": prefix})) as (_, gateway),
        ):
            yield worker, gateway.url
    finally:
        with redis.Redis() as client:
            keys = list(client.scan_iter(match=f"{prefix}*"))
            if keys:
                client.delete(*keys)


def answer(field: str, finish_reason: str = "stop", **message: Any) -> bytes:
    message = {"role": "assistant", field: "Let me think", **message}
    return completion(choices=[{"index": 0, "message": message, "finish_reason": finish_reason}], usage=USAGE)


def stream(field: str) -> list[bytes]:
    """A worker's stream: thinking in two pieces, then the text, the finish, the usage."""

    def delta(**members: Any) -> bytes:
        return chunk({"index": 0, "delta": members, "finish_reason": None})

    return [
        delta(role="assistant", content=""),
        delta(**{field: "Let me "}),
        delta(**{field: "think"}),
        delta(content="4"),
        delta(content="2"),
        chunk({"index": 0, "delta": {}, "finish_reason": "stop"}),
        chunk(usage=USAGE),
        b"[DONE]",
    ]


def openai_sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)


def anthropic_sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)


def words(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body.get("messages"))


# -- Responses API ---------------------------------------------------------------------------------------


@FIELD
def test_a_response_holds_the_reasoning_item_before_the_message(
    scripted: tuple[ScriptedWorker, str], field: str
) -> None:
    worker, url = scripted
    worker.body = answer(field, content="42")
    response = openai_sdk(url).responses.create(model="m1", input="Hi")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert reasoning.summary == [] and reasoning.content is not None
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Let me think")]
    assert response.output_text == "42"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (7, 5, 12)
    assert response.usage.output_tokens_details.reasoning_tokens == 3


def test_the_reasoning_item_comes_before_the_function_calls(scripted: tuple[ScriptedWorker, str]) -> None:
    worker, url = scripted
    worker.body = answer("reasoning", finish_reason="tool_calls", content=None, tool_calls=[CALL])
    response = openai_sdk(url).responses.create(model="m1", input="Weather?", tools=[TOOL])
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[1].type == "function_call" and response.output[1].name == "get_weather"


@FIELD
def test_a_streamed_response_streams_the_reasoning_text(scripted: tuple[ScriptedWorker, str], field: str) -> None:
    worker, url = scripted
    worker.events = stream(field)
    with openai_sdk(url).responses.stream(model="m1", input="Hi") as events:
        seen = list(events)
        final = events.get_final_response()
    kinds = [event.type for event in seen]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    deltas = [e.delta for e in seen if e.type == "response.reasoning_text.delta"]
    assert deltas == ["Let me ", "think"]
    done = next(e for e in seen if e.type == "response.reasoning_text.done")
    assert done.type == "response.reasoning_text.done" and done.text == "Let me think" and done.output_index == 0
    added = seen[2]
    assert added.type == "response.output_item.added" and added.item.type == "reasoning"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Let me think")]
    assert final.output_text == "42"
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (7, 5)
    assert final.usage.output_tokens_details.reasoning_tokens == 3


def test_a_response_with_reasoning_and_its_events_validate_against_openais_spec(
    scripted: tuple[ScriptedWorker, str],
) -> None:
    worker, url = scripted
    worker.body = answer("reasoning", content="42")
    reply = httpx.post(url + "/v1/responses", json={"model": "m1", "input": "Hi"})
    assert reply.status_code == 200 and reply.json()["output"][0]["type"] == "reasoning"
    check_response(reply.json())
    check_response(httpx.get(f"{url}/v1/responses/{reply.json()['id']}").json())
    worker.events = stream("reasoning")
    with httpx.stream("POST", url + "/v1/responses", json={"model": "m1", "input": "Hi", "stream": True}) as streamed:
        raw = streamed.read()
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert "response.reasoning_text.done" in [event["type"] for event in events]
    for event in events:
        check_event(event)


def test_a_stored_response_is_continued_without_its_reasoning(scripted: tuple[ScriptedWorker, str]) -> None:
    worker, url = scripted
    client = openai_sdk(url)
    worker.body = answer("reasoning", content="42")
    first = client.responses.create(model="m1", input="Hi", store=True)
    assert [item.type for item in first.output] == ["reasoning", "message"]
    worker.body = completion(usage=USAGE)
    second = client.responses.create(model="m1", input="And then?", previous_response_id=first.id)
    assert second.output_text == "Hello"
    messages = worker.requests[-1]["messages"]
    assert messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "And then?"},
    ]


def test_reasoning_items_sent_back_in_input_are_accepted_and_not_given_to_the_worker(
    scripted: tuple[ScriptedWorker, str],
) -> None:
    worker, url = scripted
    client = openai_sdk(url)
    worker.body = answer("reasoning", content="42")
    first = client.responses.create(model="m1", input="Hi", store=False)
    worker.body = completion(usage=USAGE)
    sent_back = [item.model_dump(exclude_none=True) for item in first.output]
    assert sent_back[0]["type"] == "reasoning"
    second = client.responses.create(
        model="m1",
        input=[{"role": "user", "content": "Hi"}, *sent_back, {"role": "user", "content": "And then?"}],
        store=True,
    )
    assert second.output_text == "Hello"
    assert b"Let me think" not in words(worker.requests[-1])
    assert worker.requests[-1]["messages"][1] == {"role": "assistant", "content": "42"}
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in listed.data] == ["message", "message", "message"]


def test_an_input_of_reasoning_items_only_is_a_400(scripted: tuple[ScriptedWorker, str]) -> None:
    worker, url = scripted
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    before = len(worker.requests)
    reply = httpx.post(url + "/v1/responses", json={"model": "m1", "input": [reasoning]})
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error" and reply.json()["error"]["param"] == "input"
    assert len(worker.requests) == before


# -- Messages API ----------------------------------------------------------------------------------------


@FIELD
def test_a_message_holds_the_thinking_block_before_the_text(scripted: tuple[ScriptedWorker, str], field: str) -> None:
    worker, url = scripted
    worker.body = answer(field, content="42")
    message = anthropic_sdk(url).messages.create(
        model="m1", max_tokens=16, messages=[{"role": "user", "content": "Hi"}]
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think" and thinking.signature
    assert text.type == "text" and text.text == "42"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 5)
    assert message.stop_reason == "end_turn"


def test_a_thinking_block_sent_back_is_not_given_to_the_worker(scripted: tuple[ScriptedWorker, str]) -> None:
    worker, url = scripted
    client = anthropic_sdk(url)
    worker.body = answer("reasoning", content="42")
    first = client.messages.create(model="m1", max_tokens=16, messages=[{"role": "user", "content": "Hi"}])
    assert first.content[0].type == "thinking"
    worker.body = completion(usage=USAGE)
    turns: list[Any] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": "And then?"},
    ]
    second = client.messages.create(model="m1", max_tokens=16, messages=turns)
    assert second.content[0].type == "text" and second.content[0].text == "Hello"
    assert b"Let me think" not in words(worker.requests[-1])
    assert worker.requests[-1]["messages"][1] == {"role": "assistant", "content": "42"}


def test_the_thinking_block_comes_before_the_tool_use(scripted: tuple[ScriptedWorker, str]) -> None:
    worker, url = scripted
    worker.body = answer("reasoning", finish_reason="tool_calls", content=None, tool_calls=[CALL])
    message = anthropic_sdk(url).messages.create(
        model="m1",
        max_tokens=16,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.stop_reason == "tool_use"


@FIELD
def test_a_streamed_message_streams_the_thinking(scripted: tuple[ScriptedWorker, str], field: str) -> None:
    worker, url = scripted
    worker.events = stream(field)
    with anthropic_sdk(url).messages.stream(
        model="m1", max_tokens=16, messages=[{"role": "user", "content": "Hi"}]
    ) as events:
        seen = list(events)
        final = events.get_final_message()
    raw = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in seen]
    thinking_deltas = [i for i, kind in enumerate(raw) if kind == ("content_block_delta", "thinking_delta")]
    signature = raw.index(("content_block_delta", "signature_delta"))
    first_text = raw.index(("content_block_delta", "text_delta"))
    assert len(thinking_deltas) == 2 and thinking_deltas[-1] < signature < first_text
    assert [e.thinking for e in seen if e.type == "thinking"] == ["Let me ", "think"]
    assert [block.type for block in final.content] == ["thinking", "text"]
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think" and thinking.signature
    assert text.type == "text" and text.text == "42"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 5)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_reasoning_that_is_not_a_string_is_the_workers_failure(scripted: tuple[ScriptedWorker, str], api: str) -> None:
    worker, url = scripted
    worker.body = answer("reasoning", content="42").replace(b'"Let me think"', b'["Let me think"]')
    if api == "responses":
        reply = httpx.post(url + "/v1/responses", json={"model": "m1", "input": "Hi"})
        error = reply.json()["error"]
    else:
        ask = {"model": "m1", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
        reply = httpx.post(url + "/v1/messages", json=ask)
        error = reply.json()["error"]
    assert reply.status_code == 502
    assert "model worker" in error["message"] and "reasoning" in error["message"]


# -- Messages API: thinking and effort ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "sent"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"thinking_token_budget": 1024}),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": "omitted"}},
         {"thinking_token_budget": 2000}),
        ({"thinking": {"type": "disabled"}}, {"reasoning_effort": "none"}),
        ({"thinking": {"type": "adaptive"}}, {}),
        ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}, {"reasoning_effort": "low"}),
        ({"output_config": {"effort": "max"}}, {"reasoning_effort": "max"}),
        # disabled wins over an effort, as on vLLM's own entrypoint
        ({"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}, {"reasoning_effort": "none"}),
    ],
)  # fmt: skip
def test_thinking_and_effort_reach_the_worker_as_vllm_takes_them(
    scripted: tuple[ScriptedWorker, str], options: dict[str, Any], sent: dict[str, Any]
) -> None:
    """vLLM's own Anthropic entrypoint: ``enabled`` is a ``thinking_token_budget``, ``disabled`` a
    ``reasoning_effort`` of ``none`` (the chat template's ``enable_thinking`` false), ``adaptive`` nothing,
    ``output_config.effort`` the ``reasoning_effort``."""
    worker, url = scripted
    worker.body = answer("reasoning", content="42")
    message = anthropic_sdk(url).messages.create(
        model="m1", max_tokens=4096, messages=[{"role": "user", "content": "Hi"}], **options
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    chat = worker.requests[-1]
    assert {k: chat[k] for k in ("thinking_token_budget", "reasoning_effort") if k in chat} == sent
    assert "thinking" not in chat and "output_config" not in chat


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "thinking.budget_tokens"),  # = max_tokens
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": "2000"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"thinking": {"type": "adaptive", "budget_tokens": 2000}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "disabled", "display": "omitted"}}, "thinking.display"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": "full"}}, "thinking.display"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ],
)  # fmt: skip
def test_thinking_the_worker_cannot_honour_is_a_400(
    scripted: tuple[ScriptedWorker, str], options: dict[str, Any], param: str
) -> None:
    worker, url = scripted
    before = len(worker.requests)
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_sdk(url).messages.create(
            model="m1", max_tokens=4096, messages=[{"role": "user", "content": "Hi"}], **options
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert param.split(".")[0] in caught.value.body["error"]["message"]  # type: ignore[index]
    assert len(worker.requests) == before
