"""The official openai SDK, sync and async, stream and non-stream, against the gateway and a fake worker."""

from __future__ import annotations

import openai
import pytest

from tests.support.fakes import FakeUpstream, ServerThread


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_non_stream(gateway: ServerThread, upstream: FakeUpstream) -> None:
    reply = client(gateway).chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "Hello from the fake worker."
    assert reply.usage is not None and reply.usage.prompt_tokens == 5
    assert upstream.requests[-1].body["messages"][0]["content"] == "hi"


def test_chat_stream_with_usage(gateway: ServerThread, upstream: FakeUpstream) -> None:
    stream = client(gateway).chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == "Hello from the fake worker."
    assert usage is not None and usage.completion_tokens == 3


def test_legacy_completions(gateway: ServerThread) -> None:
    reply = client(gateway).completions.create(model="m1", prompt="Once upon", max_tokens=5)
    assert reply.choices[0].text == "Hello from the fake worker."


def test_alias_is_rewritten_to_the_served_name(gateway: ServerThread, upstream: FakeUpstream) -> None:
    client(gateway).chat.completions.create(model="alias-1", messages=[{"role": "user", "content": "hi"}])
    assert upstream.requests[-1].body["model"] == "m1"


def test_embeddings_pass_through(gateway: ServerThread, upstream: FakeUpstream) -> None:
    reply = client(gateway).embeddings.create(model="m1", input="hello")
    assert reply.data[0].embedding == [0.1, 0.2]
    assert upstream.requests[-1].path == "/v1/embeddings"


def test_models_list_and_retrieve(gateway: ServerThread) -> None:
    c = client(gateway)
    ids = [m.id for m in c.models.list()]
    assert ids == ["m1", "alias-1"]
    assert c.models.retrieve("alias-1").id == "alias-1"
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("nope")
    assert info.value.code == "model_not_found"


def test_unknown_model_raises_not_found(gateway: ServerThread, upstream: FakeUpstream) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(gateway).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"
    assert upstream.requests == []


def test_worker_400_becomes_bad_request(gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.status = 400
    with pytest.raises(openai.BadRequestError) as info:
        client(gateway).chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    body = info.value.body
    assert isinstance(body, dict)
    assert body["type"] == "invalid_request_error"
    assert body["code"] is None


def test_worker_500_becomes_api_status_error(gateway: ServerThread, upstream: FakeUpstream) -> None:
    upstream.behavior.status = 500
    with pytest.raises(openai.APIStatusError) as info:
        client(gateway).chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 502


async def test_async_client_stream_and_non_stream(gateway: ServerThread) -> None:
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as c:
        reply = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "Hello from the fake worker."
        stream = await c.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text == "Hello from the fake worker."
