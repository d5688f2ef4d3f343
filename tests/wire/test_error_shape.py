"""Every failure path a client can hit answers in OpenAI's error shape, with the right status."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics


def assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] is None or isinstance(error["code"], str)
    assert "Traceback" not in error["message"]
    return error


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (b"", None, "invalid_json"),
        (b'{"model": "m1", "messages": [], "temperature": NaN}', None, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model", "missing_required_parameter"),
        (b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', "model", None),
        (b'{"model": "m1"}', "messages", "missing_required_parameter"),
        (b'{"model": "m1", "messages": "hi"}', "messages", None),
        (b'{"model": "m1", "messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role", None),
        (b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream", None),
        (b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "n": -1}', "n", None),
        (b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens", None),
        (
            b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream_options": {}}',
            "stream_options",
            None,
        ),
    ],
)
def test_bad_chat_bodies_are_400(
    gateway: ServerThread, upstream: FakeUpstream, body: bytes, param: str | None, code: str | None
) -> None:
    response = httpx.post(gateway.url + "/v1/chat/completions", content=body)
    error = assert_error_shape(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code
    assert upstream.requests == []


def test_bad_completions_prompt_is_400(gateway: ServerThread) -> None:
    response = httpx.post(gateway.url + "/v1/completions", json={"model": "m1", "prompt": [1, "a"]})
    assert assert_error_shape(response, 400)["param"] == "prompt"


def test_unknown_model_is_404_model_not_found(gateway: ServerThread, upstream: FakeUpstream) -> None:
    response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    error = assert_error_shape(response, 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "gpt-9" in error["message"]
    assert upstream.requests == []


def test_unknown_route_is_404(gateway: ServerThread) -> None:
    error = assert_error_shape(httpx.get(gateway.url + "/v1/nothing-here"), 404)
    assert error["type"] == "invalid_request_error"


def test_wrong_method_is_405(gateway: ServerThread) -> None:
    assert_error_shape(httpx.get(gateway.url + "/v1/chat/completions"), 405)


def test_body_over_the_limit_is_413(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> None:
    config = base_config([upstream_url], limits={"max_body_bytes": 2048})
    with gateway_factory(config) as (_, server):
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=big), 413)
        assert error["code"] == "request_too_large"
        # Without a content-length (chunked upload) the limit holds too.
        chunks = iter([orjson.dumps(big)[:1500], orjson.dumps(big)[1500:]])
        assert_error_shape(httpx.post(server.url + "/v1/chat/completions", content=chunks), 413)
    assert upstream.requests == []


def test_worker_errors_are_translated(gateway: ServerThread, upstream: FakeUpstream) -> None:
    # vLLM's dialect: type "BadRequestError", integer code, param "body.messages".
    upstream.behavior.status = 400
    upstream.behavior.error_body = orjson.dumps(
        {
            "object": "error",
            "message": "messages too long",
            "type": "BadRequestError",
            "param": "body.messages",
            "code": 400,
        }
    )
    error = assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), 400)
    assert error == {"message": "messages too long", "type": "invalid_request_error", "param": "messages", "code": None}


def test_worker_5xx_is_502_without_its_internals(gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.status = 500
    upstream.behavior.error_body = b"Traceback (most recent call last): secret internals"
    error = assert_error_shape(httpx.post(gateway.url + "/v1/chat/completions", json=CHAT), 502)
    assert "secret internals" not in error["message"]
    assert error["type"] == "server_error"


def test_unreachable_worker_is_503(gateway_factory: GatewayFactory) -> None:
    with gateway_factory(base_config([f"http://127.0.0.1:{free_port()}"])) as (_, server):
        error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 503)
        # Either the first try fails to connect, or the health check has already marked it down.
        assert error["code"] in {"upstream_unavailable", "no_healthy_worker"}


def test_hanging_worker_is_504_within_the_first_byte_timeout(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    config["upstream"]["first_byte_timeout_s"] = 0.5
    upstream.behavior.hang = True
    with gateway_factory(config) as (_, server):
        error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10), 504)
        assert error["code"] == "upstream_timeout"


def test_request_id_is_kept_when_sane_and_made_otherwise(gateway: ServerThread) -> None:
    kept = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc-123"})
    assert kept.headers["x-request-id"] == "abc-123"
    made = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "bad id\twith space"})
    assert made.headers["x-request-id"] != "bad id\twith space" and len(made.headers["x-request-id"]) == 32
    assert httpx.get(gateway.url + "/health").headers["x-request-id"]
    assert httpx.get(gateway.url + "/nope", headers={"x-request-id": "r1"}).headers["x-request-id"] == "r1"


def test_health_ready_and_metrics(gateway: ServerThread) -> None:
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(gateway.url + "/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}  # models only for the admin
    httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    public = httpx.get(gateway.url + "/metrics").text
    assert 'gateway_requests_total{route="chat/completions",status="200"}' in public  # no model named here
    text = admin_metrics(gateway)
    assert 'gateway_requests_total{model="m1",route="chat/completions",status="200"}' in text
    assert "gateway_in_flight_requests" in text
    assert "gateway_request_duration_seconds_bucket" in text


def test_ready_is_503_when_no_worker_is_healthy(gateway_factory: GatewayFactory) -> None:
    import time

    with gateway_factory(base_config([f"http://127.0.0.1:{free_port()}"]), admin_token="adm") as (_, server):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ready = httpx.get(server.url + "/ready")
            if ready.status_code == 503:
                break
            time.sleep(0.1)
        assert ready.status_code == 503 and ready.json() == {"status": "not ready"}
        detail = httpx.get(server.url + "/ready", headers={"authorization": "Bearer adm"})
        assert detail.status_code == 503 and detail.json()["models"]["m1"]["healthy"] == 0
