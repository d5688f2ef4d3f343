"""guided_json end to end: the official openai SDK -> gateway -> a real vLLM CPU worker (outlines
backend) serving the default model. Every request form is enforced; a cut answer comes back as OpenAI
sends it (finish_reason "length", within the client's limit); an answer no retry can fix is not retried."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

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


def _counting_client(url: str, sent: list[httpx.Request], max_retries: int = 2) -> openai.OpenAI:
    """The SDK with its default retries, counting every HTTP request it makes (its own retries too)."""
    hooks = {"request": [sent.append]}
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="unused",
        max_retries=max_retries,
        timeout=300,
        http_client=httpx.Client(event_hooks=hooks, timeout=300),
    )


@pytest.mark.parametrize("policy", ["error", "retry"])
def test_max_tokens_is_a_hard_cap_and_parse_raises_length_finish_reason(
    gateway_factory: GatewayFactory, real_worker: Any, policy: str
) -> None:
    schema = {"name": "p", "schema": PERSON, "strict": True}
    sent: list[httpx.Request] = []
    config = _config(real_worker.url, on_invalid=policy, retry_max_tokens=400)
    with gateway_factory(config, plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        client = _counting_client(server.url, sent)
        reply = client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=6,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": schema},
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 6
        assert reply.choices[0].message.content  # the partial text, as OpenAI returns it
        with pytest.raises(openai.LengthFinishReasonError):
            client.chat.completions.parse(
                model="smollm2", messages=ASK, response_format=Person, max_tokens=6, temperature=0
            )
        with pytest.raises(openai.LengthFinishReasonError):
            client.chat.completions.parse(
                model="smollm2", messages=ASK, response_format=Person, max_completion_tokens=6, temperature=0
            )
    assert len(sent) == 3  # one HTTP request per call: no SDK retry, and the gateway kept the limit


def test_a_streamed_cut_answer_ends_with_finish_reason_length(gateway_url: str) -> None:
    sent: list[httpx.Request] = []
    client = _counting_client(gateway_url, sent)
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        )
    )
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6
    with (
        pytest.raises(openai.LengthFinishReasonError),
        client.chat.completions.stream(
            model="smollm2", messages=ASK, response_format=Person, max_tokens=6, temperature=0
        ) as stream,
    ):
        for _ in stream:
            pass
    assert len(sent) == 2


class Bounded(BaseModel):
    code: int = Field(ge=1000, le=1005)


def test_numeric_bounds_are_enforced_by_the_engine(gateway_url: str) -> None:
    """The report's retry storm: bounds outlines ignores made every answer invalid. Pushed into the
    grammar, the engine keeps them: one request, a valid answer."""
    sent: list[httpx.Request] = []
    completion = _counting_client(gateway_url, sent).chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Give a code as JSON."}],
        response_format=Bounded,
        max_tokens=60,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Bounded) and 1000 <= parsed.code <= 1005
    assert len(sent) == 1


# Only satisfiable with two different items, but the grammar allows only "a": uniqueItems is a
# keyword checked after generation, so every answer fails it.
IMPOSSIBLE = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["a"]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    },
    "required": ["tags"],
}


@pytest.mark.parametrize("strict", [True, False])
def test_an_answer_no_retry_can_fix_is_not_retried_by_the_sdk(gateway_url: str, strict: bool) -> None:
    sent: list[httpx.Request] = []
    client = _counting_client(gateway_url, sent, max_retries=2)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=40,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": IMPOSSIBLE, "strict": strict},
            },
        )
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "guided_output_invalid" and "non-unique" in body["message"]
    assert info.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1  # the SDK's max_retries=2 did not turn one failure into three generations


def test_a_streamed_answer_no_retry_can_fix_ends_with_an_error_event(gateway_url: str) -> None:
    sent: list[httpx.Request] = []
    client = _counting_client(gateway_url, sent, max_retries=2)
    with pytest.raises(openai.APIError) as info:
        for _ in client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=40,
            temperature=0,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": IMPOSSIBLE}},
        ):
            pass
    assert info.value.code == "guided_output_invalid"
    assert len(sent) == 1


def test_a_schema_no_answer_can_satisfy_is_refused_before_generation(gateway_url: str) -> None:
    sent: list[httpx.Request] = []
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 4}}, "required": ["n"]}
    with pytest.raises(openai.BadRequestError) as info:
        _counting_client(gateway_url, sent).chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_guided_request" and "no integer" in body["message"]
    assert len(sent) == 1


def test_embeddings_on_the_generative_model_name_the_model(gateway_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _client(gateway_url).embeddings.create(model="smollm2", input="hello")
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "unsupported_endpoint" and "'smollm2'" in body["message"]


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
