"""Worker errors in every dialect a worker may answer with (vLLM's, OpenAI's, FastAPI's, plain text,
pydantic dumps) reach the client in OpenAI's shape with the worker's status and meaning, and nothing
of the worker's internals; plus the status -> error class table itself."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.wire.errors import (
    BadGateway,
    GatewayError,
    InvalidRequest,
    NotFound,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    error_for_status,
    from_upstream,
    model_not_on_worker,
)
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.wire.test_error_shape import assert_error_shape

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}

PYDANTIC_DUMP = (
    "[{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', "
    "'input': {'model': 'm1'}, 'url': 'https://errors.pydantic.dev/2.9/v/missing'}]"
)


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        pytest.param(
            400,
            {
                "error": {
                    "message": "too long",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            },
            {
                "message": "too long",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            },
            id="openai-dialect-keeps-a-string-code",
        ),
        pytest.param(
            400,
            {
                "object": "error",
                "message": "bad",
                "type": "BadRequestError",
                "param": "body -> temperature",
                "code": "400",
            },
            {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": None},
            id="numeric-string-code-dropped-arrow-param-named",
        ),
        pytest.param(
            404,
            {"detail": "Not Found"},
            {
                "message": "The model 'm1' does not support /v1/chat/completions: none of its workers serves that"
                " endpoint.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "unsupported_endpoint",
            },
            id="fastapi-detail-is-an-unserved-endpoint",
        ),
        pytest.param(
            400,
            {"error": "the prompt is empty"},
            {"message": "the prompt is empty", "type": "invalid_request_error", "param": None, "code": None},
            id="error-as-a-plain-string",
        ),
        pytest.param(
            400,
            {"object": "error", "message": PYDANTIC_DUMP, "type": "BadRequestError", "param": None, "code": 400},
            {"message": "Field required", "type": "invalid_request_error", "param": None, "code": None},
            id="pydantic-dump-reduced-to-its-first-msg",
        ),
        pytest.param(
            400,
            {"object": "error", "message": "   ", "type": "BadRequestError", "param": "", "code": 400},
            {
                "message": "The model worker rejected the request.",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
            id="blank-message",
        ),
        pytest.param(
            429,
            {"object": "error", "message": "queue full", "type": "TooManyRequests", "code": 429},
            {"message": "queue full", "type": "rate_limit_error", "param": None, "code": None},
            id="429-is-a-rate-limit-error",
        ),
    ],
)
def test_worker_4xx_dialects_become_openai_errors(
    gateway: ServerThread, upstream: FakeUpstream, status: int, body: dict[str, Any], expected: dict[str, Any]
) -> None:
    upstream.behavior.status = status
    upstream.behavior.error_body = orjson.dumps(body)
    error = assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), status)
    assert error == expected
    assert len(upstream.requests) == 1  # a client error is never retried


def test_worker_4xx_that_is_not_json_is_summarised_not_echoed(gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.status = 400
    upstream.behavior.error_body = b"<html><body>internal path /srv/vllm/secret</body></html>"
    error = assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), 400)
    assert error["message"] == "The model worker answered HTTP 400."
    assert "secret" not in error["message"]


def test_unusual_worker_4xx_keeps_its_status_as_an_invalid_request(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.status = 422
    upstream.behavior.error_body = orjson.dumps({"detail": "Unprocessable"})
    error = assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), 422)
    assert error["type"] == "invalid_request_error" and error["message"] == "Unprocessable"


def test_worker_503_is_retried_then_answered_502_naming_the_status(
    gateway: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.behavior.status = 503
    upstream.behavior.error_body = orjson.dumps({"object": "error", "message": "engine dead", "code": 503})
    error = assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), 502)
    assert error["type"] == "server_error"
    assert "(HTTP 503)" in error["message"] and "engine dead" in error["message"]


def test_long_worker_messages_are_bounded(gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.status = 400
    upstream.behavior.error_body = orjson.dumps({"message": "x" * 10_000})
    assert len(assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), 400)["message"]) == 2000
    upstream.behavior.status = 500
    upstream.behavior.error_body = orjson.dumps({"message": "y" * 10_000})
    assert len(assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), 502)["message"]) == 500


# -- the vocabulary itself -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls", "type_"),
    [
        (400, InvalidRequest, "invalid_request_error"),
        (404, NotFound, "invalid_request_error"),
        (409, InvalidRequest, "invalid_request_error"),
        (429, RateLimited, "rate_limit_error"),
        (500, ServerError, "server_error"),
        (501, ServerError, "server_error"),
        (502, BadGateway, "server_error"),
        (503, ServiceUnavailable, "server_error"),
    ],
)
def test_error_for_status_picks_openais_class_and_keeps_the_status(
    status: int, cls: type[GatewayError], type_: str
) -> None:
    error = error_for_status(status, "m", param="p", code="c")
    assert type(error) is cls
    assert error.status_code == status
    assert error.body() == {"error": {"message": "m", "type": type_, "param": "p", "code": "c"}}


def test_an_error_after_sse_headers_is_one_event_then_done() -> None:
    error = ServiceUnavailable("gone", code="x")
    events = error.to_sse().split(b"\n\n")
    assert events[0] == b"data: " + error.to_json()
    assert events[1:] == [b"data: [DONE]", b""]
    assert orjson.loads(events[0][6:])["error"]["code"] == "x"


def test_from_upstream_5xx_never_keeps_the_worker_status_or_code() -> None:
    error = from_upstream(500, orjson.dumps({"error": {"message": "boom", "code": "oom", "param": "messages"}}))
    assert isinstance(error, BadGateway) and error.status_code == 502
    assert (error.param, error.code) == (None, None)
    assert error.message == "The model worker failed (HTTP 500): boom"


def test_from_upstream_without_a_body_names_the_status() -> None:
    error = from_upstream(403, b"")
    assert error.status_code == 403 and error.type == "permission_error"
    assert error.message == "The model worker answered HTTP 403."


def _vllm_404(message: str, param: str | None) -> bytes:
    """vLLM's ErrorResponse (vllm/entrypoints/serve/engine/protocol.py) for a model it does not serve."""
    return orjson.dumps({"error": {"message": message, "type": "NotFoundError", "param": param, "code": 404}})


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        # OpenAIServing._check_model, before the request is scheduled (vllm/entrypoints/serve/engine/serving.py)
        (404, _vllm_404("The model `sql` does not exist. Valid aliases: smollm2.", "model"), True),
        # OpenAIServing._maybe_get_adapters, and OpenAIServingModels.check_model
        (404, _vllm_404("The model `sql` does not exist.", None), True),
        # older vLLM: the error's fields at the top level
        (404, orjson.dumps({"object": "error", "message": "The model `sql` does not exist.", "code": 404}), True),
        (404, _vllm_404("The model `sql-v2` does not exist.", "model"), False),  # another model
        (404, _vllm_404("The model `sq` does not exist.", "model"), False),
        (400, _vllm_404("The model `sql` does not exist.", "model"), False),
        (404, _vllm_404("LoRA adapter sql does not exist", None), False),  # the unload route's answer
        (404, orjson.dumps({"detail": "Not Found"}), False),  # no such route
        (404, b"The model `sql` does not exist.", False),
        (404, b"", False),
    ],
)
def test_a_workers_404_for_a_model_it_does_not_serve_is_told_from_any_other(
    status: int, body: bytes, expected: bool
) -> None:
    assert model_not_on_worker(status, body, "sql") is expected


def test_a_worker_error_answer_longer_than_the_bound_is_not_read_whole(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    """A worker's error answer is read for the gateway to parse (its message, its status): as the answers to
    the gateway's own calls, at most ``upstream.max_small_answer_bytes`` of it. A longer one is the worker's
    failure, a 502 that says so; the client never gets a part of it."""
    bound = 64 << 10
    config = base_config([upstream_url], upstream={**base_config([])["upstream"], "max_small_answer_bytes": bound})
    upstream.behavior.status = 400
    upstream.behavior.error_body = orjson.dumps({"message": "x" * (2 * bound)})
    with gateway_factory(config) as (_, server):
        error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 502)
        assert error["code"] == "upstream_answer_too_large" and "x" * 100 not in error["message"]
        upstream.behavior.error_body = orjson.dumps({"message": "y" * (bound // 2)})  # within it: read as before
        error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 400)
        assert error["type"] == "invalid_request_error"
