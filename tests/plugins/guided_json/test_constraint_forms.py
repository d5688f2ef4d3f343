"""guided_json paths the gateway tests leave alone: malformed constraint fields of every form, the
whitespace options, legacy completions, the retry's budget against the model's context and the retry's
own outcomes, and the capability probe's verdicts on workers that refuse, fail or answer oddly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from plugins.guided_json import GuidedJSONPlugin
from plugins.guided_json.probe import PROBE_CHOICES
from tests.server.test_app_lifecycle import read_body
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics
from tests.wire.test_error_shape import assert_error_shape

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PLUGINS = {"guided_json": GuidedJSONPlugin}


def guided_config(worker_url: str, **plugin: Any) -> dict[str, Any]:
    settings = {"probe": False, **plugin}
    return base_config([worker_url], plugins=[{"name": "guided_json", "config": settings}, {"name": "routing"}])


@pytest.fixture
def guided(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    with gateway_factory(guided_config(upstream_url), plugins=PLUGINS) as (_, server):
        yield server


def chat(server: ServerThread, **fields: Any) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


class ScriptedWorker:
    """A worker that answers request N with ``answers[N]`` (status, JSON body); records what it got."""

    def __init__(self, answers: list[tuple[int, Any]]) -> None:
        self.answers = answers
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            status, payload = 200, b"{}"
        else:
            self.bodies.append(orjson.loads(await read_body(receive)))
            status, answer = self.answers[min(len(self.bodies), len(self.answers)) - 1]
            payload = answer if isinstance(answer, bytes) else orjson.dumps(answer)
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": payload})


def answer(
    text: str, finish_reason: str = "stop", prompt_tokens: int = 5, completion_tokens: int = 3
) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


# -- malformed constraints --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": "json"}, "response_format", "must be an object such as"),
        (
            {"response_format": {"type": "json_schema", "json_schema": "PERSON"}},
            "response_format",
            "with 'name' and 'schema'",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format",
            "not list",
        ),
        ({"structured_outputs": ["json"]}, "structured_outputs", "must be an object such as"),
        (
            {"structured_outputs": {}},
            "structured_outputs",
            "exactly one of json, regex, choice, grammar, json_object (got none)",
        ),
        ({"structured_outputs": {"json": PERSON, "regex": "a"}}, "structured_outputs", "(got json, regex)"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": 5}},
            "structured_outputs",
            "whitespace_pattern' must be a string",
        ),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty regular expression string"),
        ({"structured_outputs": {"regex": 7}}, "structured_outputs.regex", "non-empty regular expression string"),
        ({"structured_outputs": {"grammar": "   "}}, "structured_outputs.grammar", "non-empty grammar string"),
        ({"guided_json": [PERSON]}, "guided_json", "must be a JSON schema object, not list"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty list of non-empty strings"),
    ],
)
def test_malformed_constraints_are_400_naming_the_field(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any], param: str, words: str
) -> None:
    error = assert_error_shape(chat(guided, **fields), 400)
    assert (error["param"], error["code"]) == (param, "invalid_guided_request")
    assert words in error["message"]
    assert upstream.requests == []


def test_whitespace_options_shape_the_compiled_constraint(guided: ServerThread, upstream: FakeUpstream) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    upstream.behavior.text = '{"a": 1}'
    assert chat(guided, structured_outputs={"json": schema}).status_code == 200
    assert upstream.requests[-1].body["structured_outputs"] == {"regex": r'\{[ ]?"a"[ ]?:[ ]?(-)?(0|[1-9][0-9]*)[ ]?\}'}
    upstream.behavior.text = '{"a":1}'
    assert chat(guided, structured_outputs={"json": schema, "disable_any_whitespace": True}).status_code == 200
    assert upstream.requests[-1].body["structured_outputs"] == {"regex": r'\{"a":(-)?(0|[1-9][0-9]*)\}'}


@pytest.mark.parametrize("fields", [{"guided_json": True}, {"structured_outputs": {"json_object": True}}])
def test_any_json_forms_accept_any_json_object(
    guided: ServerThread, upstream: FakeUpstream, fields: dict[str, Any]
) -> None:
    upstream.behavior.text = '{"anything": [1, {"nested": true}]}'
    assert chat(guided, **fields).status_code == 200
    assert list(upstream.requests[-1].body["structured_outputs"]) == ["regex"]
    upstream.behavior.text = "plain words"
    error = assert_error_shape(chat(guided, **fields), 422)
    assert error["code"] == "guided_output_invalid"


def test_legacy_completions_answers_are_checked_too(guided: ServerThread, upstream: FakeUpstream) -> None:
    body = {"model": "m1", "prompt": "Is it?", "guided_choice": ["yes", "no"]}
    upstream.behavior.text = "yes"
    assert httpx.post(guided.url + "/v1/completions", json=body).status_code == 200
    assert upstream.requests[-1].body["structured_outputs"] == {"choice": ["yes", "no"]}
    upstream.behavior.text = "perhaps"
    error = assert_error_shape(httpx.post(guided.url + "/v1/completions", json=body), 422)
    assert "not one of the choices" in error["message"]


def test_embeddings_are_never_constrained(guided: ServerThread, upstream: FakeUpstream) -> None:
    response = httpx.post(guided.url + "/v1/embeddings", json={"model": "m1", "input": "x"})
    assert response.status_code == 200
    assert "structured_outputs" not in upstream.requests[-1].body


# -- a truncated answer: returned as it is, retried only without a client limit ------------------------


@pytest.fixture
def scripted(gateway_factory: GatewayFactory) -> Any:
    """``scripted(answers, **model_fields)`` -> (worker, gateway server), both running for the test."""
    stack = contextlib.ExitStack()

    def start(answers: list[tuple[int, Any]], **model: Any) -> tuple[ScriptedWorker, ServerThread]:
        worker = ScriptedWorker(answers)
        worker_server = stack.enter_context(ServerThread(worker, lifespan="off"))
        config = guided_config(worker_server.url, **model.pop("plugin", {}))
        config["models"][0].update(model)
        _, gateway = stack.enter_context(gateway_factory(config, plugins=PLUGINS))
        return worker, gateway

    with stack:
        yield start


def test_without_a_client_limit_a_cut_answer_is_retried_within_the_models_context(scripted: Any) -> None:
    """A worker whose own default limit cut the answer early (8 of the 30 tokens the context has left):
    one retry, with the rest of the context (40 - 10 prompt), not more."""
    cut = answer('{"name": "a", "ag', "length", prompt_tokens=10, completion_tokens=8)
    worker, gateway = scripted([(200, cut), (200, answer('{"name": "a", "age": 4}'))], max_model_len=40)
    response = chat(gateway, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == '{"name": "a", "age": 4}'
    assert [b.get("max_tokens") for b in worker.bodies] == [None, 30]
    assert all(b["stream"] is False for b in worker.bodies[1:])
    metrics = admin_metrics(gateway)
    assert (
        'gateway_guided_json_invalid_answers_total{action="retry_ok",finish_reason="length",model="m1"} 1.0' in metrics
    )


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("policy", ["retry", "error"])
def test_a_client_limit_is_never_exceeded(scripted: Any, field: str, policy: str) -> None:
    """The cut answer goes back as OpenAI sends it: 200, the partial text, finish_reason "length"."""
    worker, gateway = scripted([(200, answer('{"na', "length")), (200, answer('{"name": "b", "age": 1}'))],
                               plugin={"on_invalid": policy})  # fmt: skip
    response = chat(gateway, guided_json=PERSON, **{field: 10})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("length", '{"na')
    assert [b.get(field) for b in worker.bodies] == [10]


def test_an_answer_cut_at_the_end_of_the_context_is_returned_cut(scripted: Any) -> None:
    cut = answer('{"na', "length", prompt_tokens=10, completion_tokens=30)  # 10 + 30 = the whole context
    worker, gateway = scripted([(200, cut)], max_model_len=40)
    response = chat(gateway, guided_json=PERSON)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert len(worker.bodies) == 1


def test_the_error_policy_never_retries(scripted: Any) -> None:
    cut = answer('{"na', "length", prompt_tokens=10, completion_tokens=8)
    worker, gateway = scripted([(200, cut)], max_model_len=40, plugin={"on_invalid": "error"})
    assert chat(gateway, guided_json=PERSON).json()["choices"][0]["finish_reason"] == "length"
    assert len(worker.bodies) == 1


def test_a_retry_cut_again_is_returned_cut_and_an_invalid_one_refused(scripted: Any) -> None:
    cut = answer('{"na', "length", prompt_tokens=10, completion_tokens=8)
    worker, gateway = scripted([(200, cut), (200, answer('{"name": "a", "ag', "length"))], max_model_len=40)
    response = chat(gateway, guided_json=PERSON)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == '{"name": "a", "ag'
    assert [b.get("max_tokens") for b in worker.bodies] == [None, 30]
    _, gateway = scripted([(200, cut), (200, answer('{"name": "a"}'))], max_model_len=40)
    error = assert_error_shape(chat(gateway, guided_json=PERSON), 422)
    assert error["code"] == "guided_output_invalid" and "'age' is a required property" in error["message"]


def test_a_retry_that_the_worker_fails_is_answered_with_the_workers_error(scripted: Any) -> None:
    failure = {"object": "error", "message": "out of KV cache", "type": "ServiceUnavailable", "code": 503}
    cut = answer('{"na', "length", prompt_tokens=10, completion_tokens=8)
    worker, gateway = scripted([(200, cut), (503, failure)], max_model_len=40)
    error = assert_error_shape(chat(gateway, guided_json=PERSON), 502)
    assert "out of KV cache" in error["message"]
    assert len(worker.bodies) == 2


# -- the capability probe ---------------------------------------------------------------------------


def test_a_worker_that_refuses_the_probe_is_not_sent_guided_requests(scripted: Any) -> None:
    refusal = {"object": "error", "message": "unknown field structured_outputs", "code": 400}
    worker, gateway = scripted([(400, refusal)], plugin={"probe": True})
    error = assert_error_shape(chat(gateway, guided_choice=["a", "b"]), 503)
    assert error["code"] == "guided_decoding_unsupported"
    assert "refused a structured_outputs request (HTTP 400)" in error["message"]
    assert [b["structured_outputs"] for b in worker.bodies] == [{"choice": PROBE_CHOICES}]


def test_a_probe_answered_with_an_odd_body_counts_as_not_enforcing(scripted: Any) -> None:
    _, gateway = scripted([(200, b"[]")], plugin={"probe": True})
    error = assert_error_shape(chat(gateway, guided_choice=["a", "b"]), 503)
    assert "answered a structured_outputs request with an unexpected body" in error["message"]


def test_a_probe_the_worker_fails_teaches_nothing_and_is_tried_again(scripted: Any) -> None:
    worker, gateway = scripted(
        [(500, {"message": "busy"}), (200, answer("a")), (200, answer(PROBE_CHOICES[0])), (200, answer("b"))],
        plugin={"probe": True},
    )
    assert chat(gateway, guided_choice=["a", "b"]).status_code == 200  # unknown worker: the request goes on
    assert chat(gateway, guided_choice=["a", "b"]).status_code == 200  # probed again, now it honours
    kinds = [b["structured_outputs"] for b in worker.bodies]
    assert kinds == [
        {"choice": PROBE_CHOICES},
        {"choice": ["a", "b"]},
        {"choice": PROBE_CHOICES},
        {"choice": ["a", "b"]},
    ]


def test_the_probe_of_a_completions_request_uses_a_prompt(scripted: Any) -> None:
    completion = {"id": "c", "object": "text_completion", "created": 1, "model": "m1",
                  "choices": [{"index": 0, "text": PROBE_CHOICES[1], "finish_reason": "stop"}]}  # fmt: skip
    worker, gateway = scripted(
        [(200, completion), (200, {**completion, "choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]})],
        plugin={"probe": True},
    )
    response = httpx.post(gateway.url + "/v1/completions", json={"model": "m1", "prompt": "x", "guided_choice": ["a"]})
    assert response.status_code == 200, response.text
    probe = worker.bodies[0]
    assert probe["prompt"] == "Answer:" and "messages" not in probe and probe["max_tokens"] == 12
