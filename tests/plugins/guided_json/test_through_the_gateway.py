"""guided_json at the gateway, against a fake worker on a real socket: refusals before any upstream
call, the rewrite into the form vLLM 0.32 enforces, answer validation and its policies, the probe."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from plugins.guided_json import GuidedJSONPlugin
from plugins.guided_json.probe import PROBE_CHOICES
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _config(upstream_url: str, **plugin: Any) -> dict[str, Any]:
    settings = {"probe": False, **plugin}
    return base_config([upstream_url], plugins=[{"name": "guided_json", "config": settings}, {"name": "routing"}])


@pytest.fixture
def guided(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    with gateway_factory(_config(upstream_url), plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        yield server


def _chat(server: ServerThread, **fields: Any) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": _schema_format({"type": "object", "properties": 5})}, "response_format", "not a valid"),
        ({"response_format": _schema_format({"type": "strnig"})}, "response_format", "not a valid"),
        (
            {
                "response_format": _schema_format(
                    {
                        "$ref": "#/$defs/n",
                        "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                    }
                )
            },
            "response_format",
            "recursive",
        ),
        (
            {
                "response_format": _schema_format(
                    {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)},
                    }
                )
            },
            "response_format",
            "too large",
        ),
        ({"guided_json": {"$ref": "http://example.com/s.json"}}, "guided_json", "local"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "not a valid regular expression"),
        ({"guided_regex": "[a-z]{1000}" * 6}, "guided_regex", "states"),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", "does not run (invalid perl operator"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "grammar"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "Only one"),
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ],
)
def test_refused_before_any_upstream_call(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any], param: str, words: str
) -> None:
    reply = _chat(guided, **fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]
    assert upstream.requests == []


def test_a_refused_schema_is_refused_again_from_the_cache(guided: ServerThread, upstream: FakeUpstream) -> None:
    bad = {"response_format": _schema_format({"type": "object", "required": "name"})}
    first, second = _chat(guided, **bad), _chat(guided, **bad)
    assert first.status_code == second.status_code == 400
    assert first.json() == second.json()
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({"response_format": _schema_format(PERSON)}, "regex"),
        ({"response_format": {"type": "json_object"}}, "regex"),
        ({"structured_outputs": {"json": PERSON}}, "regex"),
        ({"guided_json": orjson.dumps(PERSON).decode(), "guided_decoding_backend": "outlines"}, "regex"),
        ({"guided_regex": r"\{.*\}"}, "regex"),
        ({"guided_choice": ['{"name": "a", "age": 1}', "x"]}, "choice"),
    ],
)
def test_every_form_goes_upstream_as_structured_outputs(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any], kind: str
) -> None:
    upstream.behavior.text = '{"name": "a", "age": 1}'
    reply = _chat(guided, **fields)
    assert reply.status_code == 200, reply.text
    sent = upstream.requests[-1].body
    assert list(sent["structured_outputs"]) == [kind]
    for gone in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_decoding_backend"):
        assert gone not in sent


def test_free_form_object_is_bounded_for_decoding(guided: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.text = '{"k": [1, "two"], "n": {"x": null}}'
    reply = _chat(guided, response_format=_schema_format({"type": "object"}))
    assert reply.status_code == 200, reply.text
    regex = upstream.requests[-1].body["structured_outputs"]["regex"]
    assert len(regex) < 5_000  # outlines' own free-form regex is ~6,900 chars and takes ~6 s to compile


def test_text_response_format_is_left_alone(guided: ServerThread, upstream: FakeUpstream) -> None:
    reply = _chat(guided, response_format={"type": "text"})
    assert reply.status_code == 200
    assert upstream.requests[-1].body["response_format"] == {"type": "text"}
    assert "structured_outputs" not in upstream.requests[-1].body


def test_answer_that_does_not_match_is_a_422_the_sdk_does_not_retry(
    guided: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.text = '{"name": "a"}'
    reply = _chat(guided, response_format=_schema_format(PERSON))
    assert reply.status_code == 422
    assert reply.headers["x-should-retry"] == "false"
    error = reply.json()["error"]
    assert error["code"] == "guided_output_invalid" and error["type"] == "invalid_request_error"
    assert "'age' is a required property" in error["message"]
    assert "finish_reason: stop" in error["message"]
    sent: list[httpx.Request] = []
    client = openai.OpenAI(
        base_url=guided.url + "/v1",
        api_key="unused",
        max_retries=3,
        http_client=httpx.Client(event_hooks={"request": [sent.append]}),
    )
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], response_format=_schema_format(PERSON)
        )
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "guided_output_invalid"
    assert len(sent) == 1  # the SDK's own retries: none


def test_choice_answer_outside_the_choices_is_refused(guided: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.text = "maybe"
    reply = _chat(guided, guided_choice=["yes", "no"])
    assert reply.status_code == 422
    assert "not one of the choices" in reply.json()["error"]["message"]


@pytest.mark.parametrize("policy", ["error", "retry"])
def test_a_truncated_answer_comes_back_as_openai_sends_it(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, policy: str
) -> None:
    config = _config(upstream_url, on_invalid=policy)
    with gateway_factory(config, plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        upstream.behavior.text, upstream.behavior.finish_reason = '{"name": "a", "ag', "length"
        reply = _chat(server, response_format=_schema_format(PERSON), max_tokens=5)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("length", '{"name": "a", "ag')
    assert [r.body["max_tokens"] for r in upstream.requests] == [5]  # the client's limit: never raised


def test_a_truncated_stream_ends_normally_with_finish_reason_length(
    guided: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.text, upstream.behavior.finish_reason = '{"name": "a", "ag', "length"
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 5,
        "response_format": _schema_format(PERSON),
    }
    with httpx.stream("POST", guided.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == '{"name": "a", "ag'


def test_stream_with_invalid_assembled_answer_ends_with_an_error_event(
    guided: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.text = '{"name": "a", "age": "old"}'
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "response_format": _schema_format(PERSON),
    }
    with httpx.stream("POST", guided.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "guided_output_invalid" and "at age" in error["message"]


def test_stream_with_valid_answer_ends_normally(guided: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.text = '{"name": "a", "age": 3}'
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True, "guided_json": PERSON}
    with httpx.stream("POST", guided.url + "/v1/chat/completions", json=body, timeout=30) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all("error" not in orjson.loads(e) for e in events[:-1])


def test_worker_that_ignores_constraints_is_never_sent_a_guided_request(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(_config(upstream_url, probe=True), plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        first = _chat(server, response_format=_schema_format(PERSON))
        second = _chat(server, guided_choice=["a", "b"])
        plain = _chat(server)
    assert first.status_code == second.status_code == 503
    assert first.json()["error"]["code"] == "guided_decoding_unsupported"
    assert plain.status_code == 200
    # One probe (remembered), no guided request, then the unconstrained one.
    assert [r.body.get("structured_outputs") for r in upstream.requests] == [{"choice": PROBE_CHOICES}, None]


def test_worker_that_honours_the_probe_gets_guided_requests(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    upstream.behavior.text = PROBE_CHOICES[1]
    with gateway_factory(_config(upstream_url, probe=True), plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        reply = _chat(server, guided_choice=PROBE_CHOICES)
        again = _chat(server, guided_choice=PROBE_CHOICES)
    assert reply.status_code == again.status_code == 200
    assert len(upstream.requests) == 3  # probe once, then both requests


def test_a_repeated_schema_is_served_from_the_compile_cache(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    upstream.behavior.text = '{"name": "a", "age": 1}'
    with gateway_factory(_config(upstream_url), plugins={"guided_json": GuidedJSONPlugin}) as (_, server):
        _chat(server, response_format=_schema_format(PERSON))
        _chat(server, response_format=_schema_format(dict(reversed(PERSON.items()))))  # same schema, other order
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
    assert 'gateway_guided_json_constraints_total{outcome="compiled"} 1.0' in metrics
    assert 'gateway_guided_json_constraints_total{outcome="cached"} 1.0' in metrics


def test_a_worker_s_own_finish_reasons_do_not_grow_the_metric_s_series(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    """A finish_reason is the worker's word: a hostile or broken worker answering a new one each time
    adds no series (every refused answer's reason is one of OpenAI's, or "other")."""
    upstream.behavior.text = '{"name": "a"}'
    with gateway_factory(_config(upstream_url), plugins={"guided_json": GuidedJSONPlugin}) as (app, server):
        for i in range(60):
            upstream.behavior.finish_reason = f"made-up-{i}"
            reply = _chat(server, response_format=_schema_format(PERSON))
            assert reply.status_code == 422, (i, reply.text)
        upstream.behavior.finish_reason = "stop"
        assert _chat(server, response_format=_schema_format(PERSON)).status_code == 422
        registry = app.state.services.metrics.registry
        family = next(f for f in registry.collect() if f.name == "gateway_guided_json_invalid_answers")
    reasons = {s.labels["finish_reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert reasons == {"other": 60.0, "stop": 1.0}
