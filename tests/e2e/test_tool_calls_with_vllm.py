"""Function calling and the utility routes end to end: the official openai SDK -> gateway -> the real
vLLM CPU worker the gateway manages with config.yaml's tool settings (xlam parser, the shipped SmolLM2
tools template). At temperature 0 the answers are deterministic; the tests assert on structure.

SmolLM2-135M does not decide on its own to call a tool, so the "auto" tests show it three earlier turns
that did (few-shot); "required" and a named function are enforced by vLLM's structured outputs."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateways import ENGINE_ADMIN_TOKEN, RealEngine

pytestmark = pytest.mark.engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def earlier_calls() -> list[dict[str, Any]]:
    """Three turns in which the assistant called get_weather and got an answer."""
    messages: list[dict[str, Any]] = []
    for i, city in enumerate(["London", "Berlin", "Madrid"]):
        function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
        call = {"id": f"call_{i}", "type": "function", "function": function}
        messages += [
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny"},
        ]
    return messages


def client(engine: RealEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(engine: RealEngine, messages: list[dict[str, Any]], tool_choice: Any, tools: list[Any]) -> Any:
    return client(engine).chat.completions.create(
        model="default", messages=messages, tools=tools, tool_choice=tool_choice, temperature=0, max_tokens=60
    )


def ask_streamed(
    engine: RealEngine, messages: list[dict[str, Any]], tool_choice: Any, tools: list[Any]
) -> tuple[dict[int, dict[str, str]], str, str | None]:
    """The tool calls assembled from the deltas (index -> id, name, arguments), the text, the finish."""
    calls: dict[int, dict[str, str]] = {}
    text, finish = "", None
    stream = client(engine).chat.completions.create(
        model="default", messages=messages, tools=tools, tool_choice=tool_choice, temperature=0, max_tokens=60,
        stream=True,
    )  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                slot = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += delta.id or ""
                if delta.function is not None:
                    slot["name"] += delta.function.name or ""
                    slot["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, text, finish


CHOICES = {"auto": "auto", "required": "required", "named": NAMED}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_tool_choice_calls_the_tool(real_engine: RealEngine, choice: str) -> None:
    prior = earlier_calls() if choice == "auto" else []
    messages = [*prior, {"role": "user", "content": "Weather in Paris?"}]
    reply = ask(real_engine, messages, CHOICES[choice], [WEATHER, TIME])
    message = reply.choices[0].message
    assert message.tool_calls, (choice, message)
    call = message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments).get("city"), str)
    # vLLM reports a named call as "stop" (the client asked for that one function), the others as tool_calls
    assert reply.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")


@pytest.mark.parametrize("choice", list(CHOICES))
def test_tool_call_deltas_stream_through(real_engine: RealEngine, choice: str) -> None:
    prior = earlier_calls() if choice == "auto" else []
    messages = [*prior, {"role": "user", "content": "Weather in Paris?"}]
    calls, text, finish = ask_streamed(real_engine, messages, CHOICES[choice], [WEATHER, TIME])
    assert list(calls) == [0], calls
    assert calls[0]["id"] and calls[0]["name"] == "get_weather"
    assert isinstance(json.loads(calls[0]["arguments"]).get("city"), str)
    assert "get_weather" not in text and "[" not in text  # the call is not also streamed as text
    assert finish in ("tool_calls", "stop")


def test_tool_round_trip_call_result_answer(real_engine: RealEngine) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = ask(real_engine, [question], "required", [WEATHER])
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    follow = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."},
    ]
    answer = ask(real_engine, follow, "auto", [WEATHER])
    message = answer.choices[0].message
    assert not message.tool_calls
    assert message.content and message.content.strip()
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_tokenize_detokenize_round_trip_through_the_gateway(real_engine: RealEngine) -> None:
    text = "Hello from the gateway!"
    tokenized = httpx.post(
        real_engine.gateway_url + "/tokenize", json={"model": "default", "prompt": text}, timeout=60
    )  # an alias, resolved to the served name
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) > 1 and body["max_model_len"] == 2048
    back = httpx.post(real_engine.gateway_url + "/detokenize", json={"model": "smollm2", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == text
    chat = httpx.post(
        real_engine.gateway_url + "/tokenize",
        json={"model": "smollm2", "messages": [{"role": "user", "content": text}], "tools": [WEATHER]},
        timeout=60,
    )  # the chat template with the tools in it: more tokens than the text alone
    assert chat.status_code == 200 and chat.json()["count"] > body["count"] + 50
    unknown = httpx.post(real_engine.gateway_url + "/tokenize", json={"model": "gpt-4o", "prompt": text})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_version_reports_the_workers_vllm(real_engine: RealEngine) -> None:
    vllm = pytest.importorskip("vllm")
    admin = {"authorization": f"Bearer {ENGINE_ADMIN_TOKEN}"}
    answer = httpx.get(real_engine.gateway_url + "/admin/versions", headers=admin, timeout=30).json()
    assert answer["vllm"] == {"smollm2": vllm.__version__}
    public = httpx.get(real_engine.gateway_url + "/version", timeout=30).json()
    assert set(public) == {"version"}  # a caller without a key learns no model
