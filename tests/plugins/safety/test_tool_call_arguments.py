"""Output rules see the arguments of the tool calls a model makes, whole and streamed (held back and
checked per call like text), against a fake worker that answers with a tool call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import orjson
import pytest
import yaml

from tests.support import scripted_worker
from tests.support.cache import namespace, redis_client
from tests.support.fakes import ServerThread, running
from tests.support.gateways import REPO, GatewayFactory, base_config
from tests.support.vllm_extras_fake import ExtrasWorker

__all__ = ["namespace", "redis_client"]  # fixtures used by name below

SECRET = "AKIAIOSFODNN7EXAMPLE"
ARGUMENTS = '{"city": "Paris", "note": "key ' + SECRET + ' end"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture
def worker() -> Iterator[tuple[ExtrasWorker, ServerThread]]:
    fake = ExtrasWorker(arguments=ARGUMENTS, pieces=9)  # the secret is split over several deltas
    with running(fake) as server:
        yield fake, server


def gateway(factory: GatewayFactory, url: str, action: str, hold_back: int = 64) -> Any:
    rule = {"id": "secrets", "kind": "secrets", "action": action, "apply_to": ["output"]}
    config = {"rules": [rule], "output": {"hold_back_chars": hold_back}}
    return factory(base_config([url], plugins=[{"name": "safety", "config": config}, {"name": "routing"}]))


def ask(server: ServerThread, *, stream: bool) -> tuple[str, str | None, str]:
    """(the tool call's arguments as the client assembles them, the finish reason, what went over the wire)"""
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "weather?"}]
    if not stream:
        response = sdk.chat.completions.create(model="m1", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        calls = choice.message.tool_calls or []
        return calls[0].function.arguments, choice.finish_reason, response.model_dump_json()
    arguments, finish, wire = "", None, []
    for chunk in sdk.chat.completions.create(model="m1", messages=messages, tools=TOOLS, stream=True):
        wire.append(chunk.model_dump_json())
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                arguments += (call.function.arguments if call.function else None) or ""
            finish = choice.finish_reason or finish
    return arguments, finish, "".join(wire)


@pytest.mark.parametrize("stream", [False, True])
def test_a_secret_in_tool_call_arguments_is_redacted(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread], stream: bool
) -> None:
    with gateway(gateway_factory, worker[1].url, "redact") as (_, server):
        arguments, finish, wire = ask(server, stream=stream)
    assert SECRET not in wire
    assert finish == "tool_calls"
    # Only the secret changed: the arguments are still the JSON the model wrote.
    assert orjson.loads(arguments) == {"city": "Paris", "note": "key [SECRET] end"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_secret_in_tool_call_arguments_is_blocked(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread], stream: bool
) -> None:
    with gateway(gateway_factory, worker[1].url, "block") as (_, server):
        arguments, finish, wire = ask(server, stream=stream)
    assert SECRET not in wire and SECRET[:8] not in wire
    assert finish == "content_filter"
    assert arguments == '{"city": "Paris", "note": "key '  # what came before the secret


def test_arguments_without_a_secret_pass_unchanged_when_streamed_with_a_short_hold_back(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread]
) -> None:
    worker[0].arguments = '{"city": "Paris", "unit": "celsius", "days": 3}'
    with gateway(gateway_factory, worker[1].url, "redact", hold_back=8) as (_, server):
        arguments, finish, _ = ask(server, stream=True)
    assert arguments == '{"city": "Paris", "unit": "celsius", "days": 3}' and finish == "tool_calls"


def default_stack(url: str, namespace: str) -> dict[str, Any]:
    """config.yaml's plugin list as shipped (safety, cache, guided_json, routing), in front of ``url``."""
    shipped = yaml.safe_load((REPO / "config.yaml").read_text())
    plugins = shipped["plugins"]
    for plugin in plugins:
        if plugin["name"] == "cache":
            plugin["config"]["namespace"] = namespace  # this test's own keys, deleted afterwards
        if plugin["name"] == "safety":
            plugin["config"].pop("models", None)  # per-model tokenizer paths name the shipped model
        if plugin["name"] == "routing":
            plugin["config"]["models"] = {}
    return base_config([url], plugins=plugins)


@pytest.mark.parametrize("stream", [False, True])
def test_the_default_plugin_stack_passes_every_tool_choice(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread], namespace: str, stream: bool
) -> None:
    """No plugin of the shipped stack refuses tools or tool_choice, or loses a call on the way back."""
    fake, server_url = worker[0], worker[1].url
    fake.arguments = '{"city": "Paris", "days": 3}'
    with gateway_factory(default_stack(server_url, namespace)) as (_, server):
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
            fake.requests.clear()
            messages: Any = [{"role": "user", "content": f"weather? {choice}"}]
            arguments = ""
            if stream:
                chunks = sdk.chat.completions.create(
                    model="m1", messages=messages, tools=TOOLS, tool_choice=choice, stream=True, temperature=0
                )
                for chunk in chunks:
                    for c in chunk.choices:
                        for call in c.delta.tool_calls or ():
                            arguments += (call.function.arguments if call.function else None) or ""
            else:
                reply = sdk.chat.completions.create(
                    model="m1", messages=messages, tools=TOOLS, tool_choice=choice, temperature=0
                )
                arguments = (reply.choices[0].message.tool_calls or [])[0].function.arguments
            sent = [s.body for s in fake.requests if s.path == "/v1/chat/completions"]
            assert sent and sent[0]["tools"] == TOOLS and sent[0]["tool_choice"] == choice
            assert json.loads(arguments) == {"city": "Paris", "days": 3}


def _delta(**fields: Any) -> bytes:
    return scripted_worker.chunk({"index": 0, "delta": fields, "finish_reason": None})


def test_each_part_of_a_streamed_answer_comes_whole_before_the_next(gateway_factory: GatewayFactory) -> None:
    """Output rules hold back the end of each part of a stream (thinking, text, each call's arguments); the
    part that follows releases it, so a reasoning model's thinking, then its text, then its call reach the
    Messages and Responses streams in the model's order (short parts are held whole until then): their
    translations end a block or item as the next begins, and thinking after a call would cut it."""
    worker = scripted_worker.ScriptedWorker()
    call = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": ""}}
    worker.events = [
        _delta(role="assistant", reasoning="The key is " + SECRET + "."),
        _delta(content="Let me look it up."),
        _delta(tool_calls=[call]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": '{"key": "' + SECRET + '"}'}}]),
        scripted_worker.chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}),
        b"[DONE]",
    ]
    ask: Any = [{"role": "user", "content": "look it up"}]
    with running(worker) as upstream, gateway(gateway_factory, upstream.url, "redact") as (_, server):
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        with claude.messages.stream(model="m1", max_tokens=64, messages=ask) as stream:
            message = stream.get_final_message()
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with sdk.responses.stream(model="m1", input="look it up", store=False) as events:
            response = events.get_final_response()
    blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or b.input) for b in message.content]  # type: ignore[union-attr]
    assert blocks == [
        ("thinking", "The key is [SECRET]."),
        ("text", "Let me look it up."),
        ("tool_use", {"key": "[SECRET]"}),
    ]
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[2].arguments == '{"key": "[SECRET]"}'  # type: ignore[union-attr]
