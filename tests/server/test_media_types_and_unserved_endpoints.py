"""Bodies that are not JSON get a 415 in OpenAI's shape; an endpoint a model's workers do not serve
(embeddings on a generative model) gets a 404 that names the model, with a code, not a bare "Not Found"."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from tests.support.fakes import FakeUpstream, ServerThread

BODY = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})


def _error(reply: httpx.Response) -> dict[str, object]:
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, object] = body["error"]
    return error


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml", ""],
)
def test_a_body_declared_as_not_json_is_refused(
    gateway: ServerThread, upstream: FakeUpstream, content_type: str
) -> None:
    reply = httpx.post(
        gateway.url + "/v1/chat/completions", content=BODY, headers={"content-type": content_type}, timeout=30
    )
    assert reply.status_code == 415
    error = _error(reply)
    assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"
    assert "application/json" in str(error["message"])
    assert not upstream.requests  # refused before anything reached a worker


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"],
)
def test_json_content_types_pass(gateway: ServerThread, content_type: str) -> None:
    reply = httpx.post(
        gateway.url + "/v1/chat/completions", content=BODY, headers={"content-type": content_type}, timeout=30
    )
    assert reply.status_code == 200, reply.text


def test_a_body_without_a_content_type_is_read_as_json(gateway: ServerThread) -> None:
    with httpx.Client(timeout=30) as client:
        request = client.build_request("POST", gateway.url + "/v1/chat/completions", content=BODY)
        assert "content-type" not in request.headers  # raw content: httpx declares no type
        reply = client.send(request)
    assert reply.status_code == 200, reply.text


def test_the_sdk_sends_json_on_every_proxied_route(gateway: ServerThread, upstream: FakeUpstream) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    client.completions.create(model="m1", prompt="hi")
    client.embeddings.create(model="m1", input="hi")
    assert [r.headers["content-type"] for r in upstream.requests] == ["application/json"] * 3


@pytest.mark.parametrize(
    ("status", "body"), [(404, b'{"detail":"Not Found"}'), (501, b'{"detail":"Not Implemented"}')], ids=["404", "501"]
)
def test_embeddings_on_a_model_without_an_embeddings_worker(
    gateway: ServerThread, upstream: FakeUpstream, status: int, body: bytes
) -> None:
    upstream.behavior.status = status
    upstream.behavior.error_body = body
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=2)
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="alias-1", input="hello")
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_endpoint" and error["param"] == "model"
    assert "'alias-1'" in error["message"] and "/v1/embeddings" in error["message"]
    assert len(upstream.requests) == 1  # a 404 is not retried, by the gateway or by the SDK


def test_a_workers_own_model_not_found_keeps_its_message(gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.status = 404
    upstream.behavior.error_body = orjson.dumps(
        {"error": {"message": "The model `m1` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}
    )
    reply = httpx.post(gateway.url + "/v1/chat/completions", content=BODY, headers={"content-type": "application/json"})
    assert reply.status_code == 404
    assert _error(reply)["message"] == "The model `m1` does not exist."
