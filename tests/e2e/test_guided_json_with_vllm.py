"""guided_json end to end: the official openai SDK -> gateway -> a real vLLM CPU worker (outlines
backend) serving the default model. Every request form is enforced; cut answers never pass as success."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from plugins.guided_json import GuidedJSONPlugin
from tests.support.gateways import GatewayFactory

pytestmark = pytest.mark.engine

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "Give me a person with a name and an age as JSON."}]


class Person(BaseModel):
    name: str
    age: int


def _config(worker_url: str, **plugin: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "smollm2", "workers": [worker_url], "max_model_len": 2048}],
        "plugins": [{"name": "guided_json", "config": plugin}, {"name": "routing"}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 120},
    }


@pytest.fixture
def gateway_url(gateway_factory: GatewayFactory, real_worker: Any) -> Iterator[str]:
    with gateway_factory(_config(real_worker.url), plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        yield server.url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(url: str, **fields: Any) -> str:
    reply = _client(url).chat.completions.create(model="smollm2", messages=ASK, max_tokens=120, temperature=0, **fields)
    content = reply.choices[0].message.content
    assert content is not None
    return content


def test_parse_with_a_pydantic_model(gateway_url: str) -> None:
    completion = _client(gateway_url).chat.completions.parse(
        model="smollm2", messages=ASK, response_format=Person, max_tokens=120, temperature=0
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
        {"extra_body": {"structured_outputs": {"json": PERSON}}},
        {"extra_body": {"guided_json": PERSON}},
    ],
    ids=["response_format", "structured_outputs", "legacy"],
)
def test_json_schema_forms_are_enforced(gateway_url: str, fields: dict[str, Any]) -> None:
    value = json.loads(_chat(gateway_url, **fields))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}},
        {"extra_body": {"structured_outputs": {"json_object": True}}},
    ],
    ids=["json_object", "free_form_schema", "structured_outputs_json_object"],
)
def test_free_form_json_objects_work(gateway_url: str, fields: dict[str, Any]) -> None:
    assert isinstance(json.loads(_chat(gateway_url, **fields)), dict)


@pytest.mark.parametrize("field", ["structured_outputs", "legacy"])
def test_regex_is_enforced(gateway_url: str, field: str) -> None:
    pattern = r"[A-Z][a-z]{2,8} is [0-9]{1,2}"
    extra = {"structured_outputs": {"regex": pattern}} if field == "structured_outputs" else {"guided_regex": pattern}
    assert re.fullmatch(pattern, _chat(gateway_url, extra_body=extra))


@pytest.mark.parametrize("field", ["structured_outputs", "legacy"])
def test_choice_is_enforced(gateway_url: str, field: str) -> None:
    choices = ["lavender", "turquoise", "vermilion"]
    extra = {"structured_outputs": {"choice": choices}} if field == "structured_outputs" else {"guided_choice": choices}
    assert _chat(gateway_url, extra_body=extra) in choices


def test_grammar_is_refused_clearly(gateway_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(gateway_url, extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert "grammar" in str(info.value)


def test_too_small_max_tokens_never_passes_as_success(gateway_factory: GatewayFactory, real_worker: Any) -> None:
    schema = {"name": "p", "schema": PERSON, "strict": True}
    for policy in ("error", "retry"):
        config = _config(real_worker.url, on_invalid=policy, retry_max_tokens=4)
        with (
            gateway_factory(config, plugins={"guided_json": GuidedJSONPlugin}) as (_, server),
            pytest.raises(openai.BadRequestError) as info,
        ):
            _client(server.url).chat.completions.create(
                model="smollm2",
                messages=ASK,
                max_tokens=3,
                response_format={"type": "json_schema", "json_schema": schema},
            )
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "guided_output_truncated" and body["param"] == "max_tokens"
        assert "finish_reason: length" in body["message"]


def test_retry_policy_recovers_a_cut_answer(gateway_factory: GatewayFactory, real_worker: Any) -> None:
    config = _config(real_worker.url, on_invalid="retry", retry_max_tokens=400)
    with gateway_factory(config, plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        reply = _client(server.url).chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=6,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        )
    # 6 tokens cannot hold the object; after one retry with max_tokens=70 the answer is complete and valid
    # or the request failed above (never a cut "success").
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_streaming_with_a_schema_assembles_to_valid_json(gateway_url: str) -> None:
    stream = _client(gateway_url).chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=120,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert set(json.loads(text)) == {"name", "age"}


def test_probe_records_the_worker_as_capable(gateway_factory: GatewayFactory, real_worker: Any) -> None:
    with gateway_factory(_config(real_worker.url), plugins={"guided_json": GuidedJSONPlugin}) as (app, server):
        _chat(server.url, extra_body={"guided_choice": ["a", "b"]})
        shared = app.state.services.shared["guided_json"]
        capability = shared.capabilities.get(real_worker.url)
    assert capability is not None and capability.honours
