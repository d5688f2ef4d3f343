"""The Responses API end to end: the official openai SDK (and the OpenAI Agents SDK) -> gateway -> the
real vLLM CPU worker, with stored responses in the real Redis.

- the SDK's ``responses.create`` / ``stream()`` / ``retrieve`` / ``input_items`` / ``delete``;
- a tool round trip (a ``function_call`` item, a ``function_call_output`` turn, an answer), plain and
  streamed (``tool_choice`` "required" or a named function makes the 135M model call reliably);
- a three-turn ``previous_response_id`` chain whose turns two gateways answer with two different vLLM
  workers (one manages its own, the other fronts one of the package's two): the conversation lives in
  Redis, not in a worker;
- an agent (``openai-agents``) with one function tool, pointed at the gateway, runs to completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import create_app
from tests.e2e.conftest import TwoWorkers
from tests.support.fakes import ServerThread
from tests.support.gateways import ENGINE_MODEL, RealEngine
from tests.support.responses_schema import check_event, check_response

pytestmark = pytest.mark.engine

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name"}},
        "required": ["city"],
    },
}


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def served(worker_url: str) -> float:
    """How many requests this vLLM worker has finished (its own Prometheus counter)."""
    total = 0.0
    for line in httpx.get(worker_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[-1])
    return total


def test_create_stream_retrieve_input_items_delete(real_engine: RealEngine) -> None:
    client = sdk(real_engine.gateway_url)
    first = client.responses.create(
        model="default", instructions="Answer in one short sentence.", input="What is the capital of France?",
        temperature=0, max_output_tokens=24,
    )  # fmt: skip
    try:
        assert first.status in ("completed", "incomplete") and first.output_text.strip()
        assert first.usage is not None and first.usage.input_tokens > 5 and 0 < first.usage.output_tokens <= 24
        assert client.responses.retrieve(first.id).output_text == first.output_text

        with client.responses.stream(
            model="default", input="And of Italy?", previous_response_id=first.id, temperature=0, max_output_tokens=24
        ) as stream:
            events = list(stream)
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        # the last lifecycle event: response.incomplete when max_output_tokens cut the answer, which
        # the SDK's get_final_response() does not accept
        second = events[-1].response  # type: ignore[union-attr]
        assert events[-1].type in ("response.completed", "response.incomplete")
        # (vLLM merges tokens into fewer deltas when its reader falls behind: on a loaded machine, maybe one)
        assert deltas and "".join(deltas) == second.output_text
        assert client.responses.retrieve(second.id).output_text == second.output_text
        items = client.responses.input_items.list(second.id, order="asc").data
        assert [i.type for i in items] == ["message", "message", "message"]
        assert [i.role for i in items] == ["user", "assistant", "user"]  # type: ignore[union-attr]
    finally:
        client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    client.responses.delete(second.id)


def test_tool_round_trip_in_the_responses_api(real_engine: RealEngine) -> None:
    client = sdk(real_engine.gateway_url)
    call_turn = client.responses.create(
        model="default", input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    calls = [item for item in call_turn.output if item.type == "function_call"]
    assert calls, call_turn.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments).get("city"), str)

    answer = client.responses.create(
        model="default",
        previous_response_id=call_turn.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees Celsius."}],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=60,
    )
    assert not [item for item in answer.output if item.type == "function_call"], answer.output
    assert answer.output_text.strip()
    kinds = [i.type for i in client.responses.input_items.list(answer.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]

    # streamed, with a named function: the call arrives as function_call_arguments events
    events = list(
        client.responses.create(
            model="default", input="Weather in Rome?", tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=60, stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and isinstance(json.loads(done[0].arguments).get("city"), str)  # type: ignore[union-attr]
    for response_id in (call_turn.id, answer.id, events[-1].response.id):  # type: ignore[union-attr]
        client.responses.delete(response_id)


@pytest.fixture(scope="module")
def second_gateway(two_workers: TwoWorkers) -> Iterator[tuple[str, str]]:
    """Another gateway replica, in front of another vLLM worker than ``real_engine``'s: (gateway url,
    worker url). The worker is one of the package's two (already running for the routing tests), so this
    module starts no worker of its own."""
    worker = two_workers[0]
    model = {"name": ENGINE_MODEL, "aliases": ["default"], "workers": [worker], "max_model_len": 2048}
    config = {"models": [model], "plugins": [{"name": "routing"}], "upstream": {"first_byte_timeout_s": 300}}
    app = create_app(Settings(), registry=PluginRegistry(), config=GatewayConfig.model_validate(config))
    with ServerThread(app) as server:
        yield server.url, worker


def test_three_turn_chain_answered_by_two_workers(real_engine: RealEngine, second_gateway: tuple[str, str]) -> None:
    gateway_b, worker_b = second_gateway
    worker_a = real_engine.url
    assert worker_a != worker_b
    turns = [
        (real_engine.gateway_url, worker_a, "My name is Ada. Remember it."),
        (gateway_b, worker_b, "I live in Paris."),
        (real_engine.gateway_url, worker_a, "What is my name?"),
    ]
    previous: str | None = None
    ids: list[str] = []
    for gateway_url, worker_url, text in turns:
        before_a, before_b = served(worker_a), served(worker_b)
        response = sdk(gateway_url).responses.create(
            model="smollm2", input=text, previous_response_id=previous, temperature=0, max_output_tokens=16
        )
        assert response.output_text.strip()
        answered_a, answered_b = served(worker_a) - before_a, served(worker_b) - before_b
        assert (answered_a, answered_b) == ((1, 0) if worker_url == worker_a else (0, 1)), (
            text,
            answered_a,
            answered_b,
        )
        previous = response.id
        ids.append(response.id)
    # the last turn saw every earlier turn, whichever worker answered it
    items = sdk(gateway_b).responses.input_items.list(ids[-1], order="asc", limit=100).data
    texts = [i.content[0].text for i in items]  # type: ignore[union-attr]
    assert [i.role for i in items] == ["user", "assistant", "user", "assistant", "user"]  # type: ignore[union-attr]
    assert texts[0] == turns[0][2] and texts[2] == turns[1][2] and texts[4] == turns[2][2]
    for response_id in ids:
        sdk(gateway_b).responses.delete(response_id)


def test_an_agents_sdk_agent_runs_to_completion(real_engine: RealEngine) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append(city)
        return f"The weather in {city} is sunny, 21 degrees Celsius."

    async def run() -> Any:
        client = AsyncOpenAI(base_url=real_engine.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather with the get_weather tool.",
            tools=[get_weather],
            model=agents.OpenAIResponsesModel(model="smollm2", openai_client=client),
            # SmolLM2-135M does not decide to call a tool by itself: the first turn must call it; the
            # agent then resets tool_choice, feeds the result back, and the model answers in text.
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
        )
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert ran and isinstance(ran[0], str) and ran[0]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    client = sdk(real_engine.gateway_url)
    for response in result.raw_responses:  # the agent stored its turns (store defaults to true): clean up
        if response.response_id:
            client.responses.delete(response.response_id)


def test_options_and_the_spec_schema_against_vllm(real_engine: RealEngine) -> None:
    """Logprobs, reasoning effort and verbosity reach vLLM and come back; every object and event
    validates against OpenAI's schema; truncation "auto" fits a conversation longer than the 2048-token
    context that vLLM refuses whole."""
    client = sdk(real_engine.gateway_url)
    made = client.responses.create(
        model="default", input="Say hi.", temperature=0, max_output_tokens=6,
        include=["message.output_text.logprobs"], top_logprobs=2, reasoning={"effort": "low"},
        text={"verbosity": "low"},
    )  # fmt: skip
    ids = [made.id]
    try:
        part = made.output[0].content[0]  # type: ignore[union-attr]
        assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text  # type: ignore[union-attr]
        assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)  # type: ignore[union-attr]
        check_response(httpx.get(f"{real_engine.gateway_url}/v1/responses/{made.id}", timeout=30).json())
        body = {"model": "default", "input": "Count to twenty.", "max_output_tokens": 4, "stream": True}
        with httpx.stream("POST", real_engine.gateway_url + "/v1/responses", json=body, timeout=300) as reply:
            lines = reply.read().split(b"\n")
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: ")]
        for event in events:
            check_event(event)
        assert events[-1]["type"] == "response.incomplete"
        ids.append(events[-1]["response"]["id"])

        previous = None
        for turn in range(3):  # about 600 tokens each: three fit in 2048, four do not
            previous = client.responses.create(
                model="default", input=f"Note {turn}: " + "apple " * 600, max_output_tokens=2, temperature=0,
                previous_response_id=previous.id if previous else None,
            )  # fmt: skip
            ids.append(previous.id)
        assert previous is not None
        fourth = {
            "model": "default",
            "input": "apple " * 600,
            "max_output_tokens": 2,
            "previous_response_id": previous.id,
        }
        with pytest.raises(openai.BadRequestError):  # the whole conversation is longer than the context
            client.responses.create(**fourth)  # type: ignore[arg-type]
        raw = client.responses.with_raw_response.create(**fourth, truncation="auto")  # type: ignore[arg-type]
        fitted = raw.parse()
        ids.append(fitted.id)
        assert int(raw.headers["x-gateway-truncated-items"]) >= 1 and fitted.truncation == "auto"  # whole turns
        assert fitted.usage is not None and fitted.usage.input_tokens + 2 <= 2048
    finally:
        for response_id in ids:
            with contextlib.suppress(openai.NotFoundError):
                client.responses.delete(response_id)
