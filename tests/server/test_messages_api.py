"""Anthropic's Messages API through the gateway, driven by the real ``anthropic`` SDK against the fake worker:
``messages.create`` and ``messages.stream`` (text and a tool round trip), ``count_tokens``, and the errors
in Anthropic's shape (wrong method, bad input, unknown model, a worker's failure, a stream cut midway).
What the worker receives is the chat completions request the translation promises."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.scripted_worker import ScriptedWorker, chunk, completion, text_in_a_calls_last_chunk

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def sdk(server: ServerThread, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=20)


def chats(upstream: FakeUpstream) -> list[dict[str, Any]]:
    return [r.body for r in upstream.requests if r.path == "/v1/chat/completions"]


def test_create_translates_the_request_and_the_answer(gateway: ServerThread, upstream: FakeUpstream) -> None:
    message = sdk(gateway).messages.create(
        model="alias-1",
        max_tokens=64,
        system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
            {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
        ],
        stop_sequences=["END"],
        metadata={"user_id": "u-42"},
        # sampling options: no longer arguments of the SDK's create(), still sent by other clients
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "alias-1"
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "Hello from the fake worker."  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 3)
    sent = chats(upstream)[-1]
    assert sent["model"] == "m1"  # the alias resolved, as on every endpoint
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief. Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    assert {k: sent[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stop", "user")} == {
        "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop": ["END"], "user": "u-42",
    }  # fmt: skip
    assert "stream" not in sent


def test_stop_reasons(gateway: ServerThread, upstream: FakeUpstream) -> None:
    client = sdk(gateway)
    upstream.behavior.finish_reason = "length"
    cut = client.messages.create(model="m1", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert cut.stop_reason == "max_tokens"
    upstream.behavior.finish_reason = "stop"
    with client.messages.stream(model="m1", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 2


def test_stream_sends_anthropics_event_sequence(gateway: ServerThread, upstream: FakeUpstream) -> None:
    client = sdk(gateway)
    with client.messages.stream(model="m1", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == "Hello from the fake worker."  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and (final.usage.input_tokens, final.usage.output_tokens) == (5, 3)
    raw = [e for e in kinds if e not in ("text",)]  # the SDK adds "text" events of its own
    assert raw == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    sent = chats(upstream)[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}

    # the wire itself: each event named in its `event:` line, a ping after message_start
    reply = httpx.post(
        gateway.url + "/v1/messages",
        json={"model": "m1", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
    )
    names = [line[7:] for line in reply.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    assert reply.headers["content-type"].startswith("text/event-stream")


def test_tool_round_trip_plain_and_streamed(gateway: ServerThread, upstream: FakeUpstream) -> None:
    client = sdk(gateway)
    upstream.behavior.tool_calls = [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    first = client.messages.create(
        model="m1", max_tokens=64, tools=[WEATHER], tool_choice={"type": "any"},  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    call = first.content[0]
    assert call.type == "tool_use" and call.id == "call_1" and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    sent = chats(upstream)[-1]
    assert sent["tool_choice"] == "required"
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]

    # streamed, with a named tool: the arguments arrive as one input_json_delta when the call's block ends
    # (held until they are known to be an object; the worker sent them in two pieces)
    with client.messages.stream(
        model="m1", max_tokens=64, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:  # fmt: skip
        partials = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
        streamed = stream.get_final_message()
    assert len(partials) == 1 and json.loads(partials[0]) == {"city": "Paris"}
    assert streamed.stop_reason == "tool_use" and streamed.content[0].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert chats(upstream)[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}

    # the result goes back as a tool_result block: a tool message the chat template reads
    upstream.behavior.tool_calls = None
    answer = client.messages.create(
        model="m1", max_tokens=64, tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True},  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                {"type": "text", "text": "Thanks."},
            ]},
        ],
    )  # fmt: skip
    assert answer.stop_reason == "end_turn"
    sent = chats(upstream)[-1]
    assert sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        {"role": "user", "content": "Thanks."},
    ]
    assert sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is False


def test_a_tool_result_with_images_reaches_the_worker_as_vllm_sends_it(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    """A tool that returns an image (a screenshot, an image file it read) is answered with image blocks in
    its tool_result: the tool message keeps the text, the images follow it in a user message."""
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    call = {"type": "tool_use", "id": "call_1", "name": "screenshot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "call_1", "content": [
        {"type": "text", "text": "The screen:"}, {"type": "image", "source": png},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"}},
    ]}  # fmt: skip
    conversation: list[Any] = [
        {"role": "user", "content": "What is on my screen?"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result, {"type": "text", "text": "Describe it."}]},
    ]
    message = sdk(gateway).messages.create(model="m1", max_tokens=64, messages=conversation)
    assert message.stop_reason == "end_turn"
    assert chats(upstream)[-1]["messages"][2:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "The screen:"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
        ]},
        {"role": "user", "content": "Describe it."},
    ]  # fmt: skip

    # an image URL inside a tool result passes the media URL checks any image part does
    result["content"] = [{"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/latest/"}}]
    upstream.requests.clear()
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk(gateway).messages.create(model="m1", max_tokens=64, messages=conversation)
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert chats(upstream) == []
    # a block a tool result cannot hold is still a 400 naming it
    result["content"] = [{"type": "text", "text": 42}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.2\.content\.0\.content\.0"):
        sdk(gateway).messages.create(model="m1", max_tokens=64, messages=conversation)


def test_text_in_the_same_chunk_as_a_tool_calls_arguments_does_not_cut_the_call(
    gateway_factory: GatewayFactory,
) -> None:
    """A worker that sends several tokens per chunk (speculative decoding, --stream-interval) can put the
    newline after a call in the delta that carries the call's last arguments: the call stays one whole
    tool_use block, and the text comes after it, as vLLM's entrypoint streams it."""

    worker = ScriptedWorker()
    worker.events = text_in_a_calls_last_chunk()
    ask = {"model": "m1", "max_tokens": 64, "tools": [WEATHER], "messages": [{"role": "user", "content": "Weather?"}]}
    with (
        ServerThread(worker) as server,
        gateway_factory(base_config([server.url])) as (_, gateway),
        sdk(gateway).messages.stream(**ask) as stream,  # type: ignore[arg-type]
    ):
        final = stream.get_final_message()
    blocks = [block.to_dict() for block in final.content]
    assert blocks == [
        {"type": "tool_use", "id": "call_0", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "text", "text": "\n"},
        {"type": "tool_use", "id": "call_1", "name": "get_time", "input": {"zone": "UTC"}},
    ]
    assert final.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("arguments", "reason", "sequence"),
    [('{"city": "Pa', "stop_sequence", "END"), ('{"city": "Paris"}', "tool_use", None)],
    ids=["call-cut-short", "call-whole"],
)
def test_a_stop_sequence_that_cut_a_tool_call_short_is_the_stop_reason(
    gateway_factory: GatewayFactory, arguments: str, reason: str, sequence: str | None
) -> None:
    """A client runs the tools of a tool_use answer; a call its stop sequence cut short must not run, so
    the answer says stop_sequence (as vLLM's entrypoint answers), whole and streamed. A whole call that a
    stop string followed is still tool_use."""
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    worker = ScriptedWorker()
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    worker.body = completion(
        choices=[{"index": 0, "message": message, "finish_reason": "tool_calls", "stop_reason": "END"}]
    )
    worker.events = [
        chunk(
            {"index": 0, "delta": {"role": "assistant", "tool_calls": [{"index": 0, **call}]}, "finish_reason": None}
        ),
        chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": "END"}),
        b"[DONE]",
    ]
    ask: dict[str, Any] = {
        "model": "m1", "max_tokens": 64, "tools": [WEATHER], "stop_sequences": ["END"],
        "messages": [{"role": "user", "content": "Weather?"}],
    }  # fmt: skip
    with ServerThread(worker) as server, gateway_factory(base_config([server.url])) as (_, gateway):
        client = sdk(gateway)
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            streamed = stream.get_final_message()
    for answer in (whole, streamed):
        assert (answer.stop_reason, answer.stop_sequence) == (reason, sequence)
        assert answer.content[0].type == "tool_use"


@pytest.mark.parametrize(
    "arguments",
    ["{city: Paris}", '{"city": "Paris"}}', '["Paris"]', '"Paris"', '{"city": "Par'],
    ids=["not-json", "trailing-brace", "array", "string", "cut-short"],
)
def test_tool_arguments_that_are_no_json_object_are_an_empty_input_whole_and_streamed(
    gateway: ServerThread, upstream: FakeUpstream, arguments: str
) -> None:
    """Anthropic's ``input`` is always an object. A model that wrote arguments that are not one gets the
    tool_use block with ``{}`` (the client's tool check then answers it), whole or streamed: the stream
    holds a call's arguments until its block ends and sends them only as an object, so the SDK's stream
    helper, which parses every input_json_delta, never raises on them and keeps the answer."""
    upstream.behavior.tool_calls = [{"id": "call_1", "name": "get_weather", "arguments": arguments}]
    client = sdk(gateway)
    ask: dict[str, Any] = {
        "model": "m1", "max_tokens": 64, "tools": [WEATHER], "messages": [{"role": "user", "content": "Weather?"}],
    }  # fmt: skip
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas == []
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        assert [(b.type, b.id, b.name, b.input) for b in message.content] == [  # type: ignore[union-attr]
            ("tool_use", "call_1", "get_weather", {})
        ]


def test_claude_codes_attribution_block_is_left_out_of_the_prompt(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    """Claude Code's first system block carries a hash that changes with every request; the prompt the worker
    reads is the same on every turn without it (as vLLM's entrypoint renders it), so its prefix cache hits."""
    client = sdk(gateway)
    for cch in ("eb6c6", "0aaa9"):
        system = [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={cch};",
            },
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ]
        client.messages.create(model="m1", max_tokens=8, system=system, messages=[{"role": "user", "content": "Hi"}])  # type: ignore[arg-type]
        client.messages.count_tokens(model="m1", system=system, messages=[{"role": "user", "content": "Hi"}])  # type: ignore[arg-type]
    prompts = [chat["messages"] for chat in chats(upstream)] + [body["messages"] for body in upstream.tokenized]
    expected = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Hi"}]
    assert prompts == [expected] * 4


def test_count_tokens_asks_a_worker_to_tokenize_the_conversation(gateway: ServerThread, upstream: FakeUpstream) -> None:
    counted = sdk(gateway).messages.count_tokens(
        model="alias-1", system="Be brief.", tools=[WEATHER],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Hi"}],
    )  # fmt: skip
    assert counted.input_tokens == 5
    sent = upstream.tokenized[-1]
    assert sent["model"] == "m1" and sent["add_generation_prompt"] is True
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert chats(upstream) == []  # nothing generated

    upstream.behavior.tokenize = "missing"
    with pytest.raises(anthropic.NotFoundError) as caught:
        sdk(gateway).messages.count_tokens(model="m1", messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_count_tokens_renders_thinking_as_the_answer_will(gateway: ServerThread, upstream: FakeUpstream) -> None:
    """A worker renders a chat body's ``reasoning_effort`` into the chat template (with ``enable_thinking``);
    ``/tokenize`` has no such field, so the count passes the same template arguments. A thinking budget
    changes no prompt, and counting without thinking passes none."""
    client = sdk(gateway)
    hi: Any = [{"role": "user", "content": "Hi"}]
    client.messages.count_tokens(model="m1", messages=hi, thinking={"type": "disabled"})
    assert upstream.tokenized[-1]["chat_template_kwargs"] == {"reasoning_effort": "none", "enable_thinking": False}
    client.messages.create(model="m1", max_tokens=8, messages=hi, thinking={"type": "disabled"})
    assert chats(upstream)[-1]["reasoning_effort"] == "none"
    client.messages.count_tokens(model="m1", messages=hi, output_config={"effort": "high"})
    assert upstream.tokenized[-1]["chat_template_kwargs"] == {"reasoning_effort": "high", "enable_thinking": True}
    for thinking in ({"type": "enabled", "budget_tokens": 5000}, {"type": "adaptive"}, None):
        options: Any = {"thinking": thinking} if thinking else {}
        client.messages.count_tokens(model="m1", messages=hi, **options)
        assert "chat_template_kwargs" not in upstream.tokenized[-1]


def test_context_management_that_clears_thinking_is_accepted(gateway: ServerThread, upstream: FakeUpstream) -> None:
    """Claude Code sends ``context_management`` clearing earlier turns' thinking (beta client, as it does):
    accepted, since the prompt never holds that thinking; an edit that would change what the model reads
    (clearing tool results) is a 400 naming it."""
    client = sdk(gateway)
    clear = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    thought: Any = {"type": "thinking", "thinking": "Greet back.", "signature": "s"}
    turns: Any = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [thought, {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"},
    ]
    beta = ["context-management-2025-06-27"]
    message = client.beta.messages.create(
        model="m1",
        max_tokens=8,
        messages=turns,
        context_management=clear,
        betas=beta,  # type: ignore[arg-type]
    )
    assert message.stop_reason == "end_turn"
    sent = chats(upstream)[-1]
    assert "context_management" not in sent and sent["messages"][1] == {"role": "assistant", "content": "Hello!"}
    counted = client.beta.messages.count_tokens(model="m1", messages=turns, context_management=clear, betas=beta)  # type: ignore[arg-type]
    assert counted.input_tokens == 5

    upstream.requests.clear()
    clear_tools: Any = {"edits": [clear["edits"][0], {"type": "clear_tool_uses_20250919"}]}
    with pytest.raises(anthropic.BadRequestError, match=r"context_management\.edits\.1\.type"):
        client.beta.messages.create(
            model="m1", max_tokens=8, messages=turns, context_management=clear_tools, betas=beta
        )
    assert chats(upstream) == []


def test_count_tokens_takes_speed_as_create_does(gateway: ServerThread, upstream: FakeUpstream) -> None:
    """``speed`` is a count_tokens field of Anthropic's API too: a client that counts with the options it
    sends is not refused for it; "fast" is refused on both, naming the field."""
    client = sdk(gateway)
    hi: Any = [{"role": "user", "content": "Hi"}]
    assert client.messages.count_tokens(model="m1", messages=hi, speed="standard").input_tokens == 5
    assert client.messages.create(model="m1", max_tokens=8, messages=hi, speed="standard").stop_reason == "end_turn"
    for call in (
        lambda: client.messages.count_tokens(model="m1", messages=hi, speed="fast"),
        lambda: client.messages.create(model="m1", max_tokens=8, messages=hi, speed="fast"),
    ):
        with pytest.raises(anthropic.BadRequestError, match="speed: only 'standard'"):
            call()


def test_a_final_assistant_turn_is_continued(gateway: ServerThread, upstream: FakeUpstream) -> None:
    """Anthropic's prefill: a final assistant turn is the start of the answer, so the worker is asked to
    continue it (``continue_final_message``, no generation prompt), and count_tokens counts it that way.
    An assistant turn before a user turn, or one that ends in a tool call, is an ordinary turn."""
    client = sdk(gateway)
    prefill = [
        {"role": "user", "content": "Give me JSON"},
        {"role": "assistant", "content": [{"type": "text", "text": "{"}]},
    ]
    client.messages.create(model="m1", max_tokens=8, messages=prefill)  # type: ignore[arg-type]
    sent = chats(upstream)[-1]
    assert sent["messages"][-1] == {"role": "assistant", "content": "{"}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    client.messages.count_tokens(model="m1", messages=prefill)  # type: ignore[arg-type]
    counted = upstream.tokenized[-1]
    assert counted["continue_final_message"] is True and counted["add_generation_prompt"] is False

    client.messages.create(model="m1", max_tokens=8, messages=[*prefill, {"role": "user", "content": "again"}])  # type: ignore[list-item]
    sent = chats(upstream)[-1]
    assert "continue_final_message" not in sent and "add_generation_prompt" not in sent
    tool_use = {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}
    client.messages.create(
        model="m1", max_tokens=8, tools=[WEATHER],  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [tool_use]}],  # type: ignore[list-item]
    )  # fmt: skip
    assert "continue_final_message" not in chats(upstream)[-1]


@pytest.mark.parametrize("media_type", [{"type": "image/png"}, "image/png;charset=x,", "text/html", "image/svg+xml", 7])
def test_an_image_of_a_media_type_anthropic_does_not_take_is_a_400(
    gateway: ServerThread, upstream: FakeUpstream, media_type: object
) -> None:
    """Anthropic takes JPEG, PNG, GIF and WebP; any other media type was written into the data URL the
    worker reads as it came (a dict's repr, a comma that ends the URL's header)."""
    image = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": "iVBORw0KGgo="}}
    body = {"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]}
    reply = httpx.post(gateway.url + "/v1/messages", json=body)
    assert _error(reply) == (400, "invalid_request_error")
    assert "messages.0.content.0.source.media_type" in reply.json()["error"]["message"]
    assert chats(upstream) == []


def _error(reply: httpx.Response) -> tuple[int, str]:
    body = reply.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["message"]
    return reply.status_code, body["error"]["type"]


USER = [{"role": "user", "content": "x"}]
TOOL_ROLE = {"role": "tool", "content": "x"}


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": "m1", "messages": USER}, 400, "invalid_request_error"),  # no max_tokens
        ({"model": "m1", "max_tokens": 8, "messages": []}, 400, "invalid_request_error"),
        ({"model": "m1", "max_tokens": 8, "messages": [TOOL_ROLE]}, 400, "invalid_request_error"),
        ({"model": "m1", "max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 2000}},
         400, "invalid_request_error"),
        ({"model": "m1", "max_tokens": 8, "messages": USER, "priority": 5}, 400, "invalid_request_error"),
        ({"model": "m1", "max_tokens": 8, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "w"}]},
         400, "invalid_request_error"),
        ({"model": "m1", "max_tokens": 8, "messages": USER, "tools": [WEATHER],
          "tool_choice": {"type": "tool", "name": ["get_weather"]}}, 400, "invalid_request_error"),
        ({"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": {"city": "Paris"}}]},
        ]}]}, 400, "invalid_request_error"),
        # a prefill that ends with whitespace: Anthropic refuses it
        ({"model": "m1", "max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": "Sure, "}]},
         400, "invalid_request_error"),
        ({"model": "nope", "max_tokens": 8, "messages": USER}, 404, "not_found_error"),
    ],
)  # fmt: skip
def test_errors_have_anthropics_shape(
    gateway: ServerThread, upstream: FakeUpstream, body: dict[str, Any], status: int, kind: str
) -> None:
    assert _error(httpx.post(gateway.url + "/v1/messages", json=body)) == (status, kind)
    assert chats(upstream) == []


def test_a_field_anthropics_servers_handle_is_refused_unless_it_is_null(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    """``container``, ``mcp_servers`` and the like ask for what only Anthropic's servers do: a 400 naming
    the field. Sent as null they ask for nothing (a client that sends every field it knows, unset ones as
    null): the request is answered."""
    fields = ("container", "mcp_servers", "inference_geo", "diagnostics", "user_profile_id", "workspace_id")
    for name in fields:
        refused = httpx.post(gateway.url + "/v1/messages", json={"model": "m1", "max_tokens": 8, "messages": USER,
                                                                 name: "x"})  # fmt: skip
        assert _error(refused) == (400, "invalid_request_error"), name
        assert name in refused.json()["error"]["message"]
    assert chats(upstream) == []
    nulls = {name: None for name in fields}
    answer = httpx.post(gateway.url + "/v1/messages", json={"model": "m1", "max_tokens": 8, "messages": USER, **nulls})
    assert answer.status_code == 200, answer.text
    assert answer.json()["type"] == "message"
    assert not set(fields) & set(chats(upstream)[0])  # nothing of them reaches the worker


def test_transport_errors_and_worker_failures_have_anthropics_shape(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    url = gateway.url + "/v1/messages"
    assert _error(httpx.get(url)) == (405, "invalid_request_error")
    assert _error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})) == (
        400,
        "invalid_request_error",
    )
    assert _error(httpx.post(url, content=b"x", headers={"content-type": "text/plain"}))[0] == 415
    assert _error(httpx.post(url, content=b"x" * (5 * 1024 * 1024))) == (413, "request_too_large")
    body = {"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    upstream.behavior.status = 400
    assert _error(httpx.post(url, json=body)) == (400, "invalid_request_error")
    upstream.behavior.status = 500
    assert _error(httpx.post(url, json=body)) == (502, "api_error")
    upstream.behavior.status = 200

    # a stream cut midway (no other worker to continue it) ends with one error event, which the SDK raises
    upstream.behavior.cut_after = 2
    with pytest.raises(anthropic.APIStatusError) as caught, sdk(gateway).messages.stream(**body) as stream:  # type: ignore[arg-type]
        for _ in stream:
            pass
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_anthropic_version_and_key_headers_are_accepted(gateway: ServerThread) -> None:
    body = {"model": "m1", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04", "x-api-key": "k"}
    assert httpx.post(gateway.url + "/v1/messages", json=body, headers=headers).status_code == 200
    # two different keys in the two headers, or the key header twice: refused, never one checked and another used
    headers["authorization"] = "Bearer other"
    reply = httpx.post(gateway.url + "/v1/messages", json=body, headers=headers)
    assert _error(reply) == (400, "invalid_request_error")
    twice = [("x-api-key", "k1"), ("x-api-key", "k2"), ("content-type", "application/json")]
    reply = httpx.post(gateway.url + "/v1/messages", content=orjson.dumps(body), headers=twice)
    assert _error(reply) == (400, "invalid_request_error") and "x-api-key" in reply.json()["error"]["message"]


def test_a_stream_cut_by_a_failing_worker_is_resumed_on_another(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    text = "The quick brown fox jumps over the lazy dog, again and again."
    survivor = FakeUpstream(name="survivor")
    with ServerThread(survivor) as other:
        for fake in (upstream, survivor):
            fake.behavior.text, fake.behavior.chunks = text, 12
        upstream.behavior.die_after = 4  # the connection breaks after the role chunk and three pieces
        # round robin sends the first request to the first worker listed: the doomed one
        with gateway_factory(base_config([upstream_url, other.url])) as (_, server):
            ask = [{"role": "user", "content": "tell me"}]
            with sdk(server).messages.stream(model="m1", max_tokens=64, messages=ask) as stream:
                deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
                final = stream.get_final_message()
    assert "".join(deltas) == final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert chats(upstream) and chats(survivor)[-1]["continue_final_message"] is True
