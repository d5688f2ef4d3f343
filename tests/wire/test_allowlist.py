"""The pass-through allow-list: a client cannot pick an engine-internal option through the gateway.

Every refusal is a 400 in OpenAI's shape naming the field, and the worker never sees the request.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.wire.allowlist import ALLOWED
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m1", "prompt": "hi"}
EMBEDDING = {"model": "m1", "input": "hi"}
ADMIN = "admin-token-for-allow-list-tests"

# Fields vLLM 0.32 accepts that a client must not choose (see gateway/wire/allowlist.py for why each).
REFUSED_CHAT = [
    ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 5557}),
    ("ec_transfer_params", {"remote_host": "10.0.0.5"}),
    ("vllm_xargs", {"custom": "x"}),
    ("mm_processor_kwargs", {"num_crops": 10000}),
    ("media_io_kwargs", {"image": {"max_size": 1}}),
    ("chat_template", "{% for i in range(10**9) %}x{% endfor %}"),
    ("priority", -100),
    ("request_id", "chatcmpl-someone-elses-id"),
    ("session_id", "s"),
    ("return_prompt_text", True),
    ("return_token_offsets", True),
    ("mm_payload", "tensors"),
    ("return_mm_kwargs", True),
    ("routed_experts_prompt_start", 0),
    ("x_not_a_field", 1),
]


def _error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert "x-request-id" in response.headers
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    return dict(error)


@pytest.mark.parametrize(("name", "value"), REFUSED_CHAT)
def test_engine_internal_fields_are_refused_by_name_and_never_reach_the_worker(
    gateway: Any, upstream: FakeUpstream, name: str, value: Any
) -> None:
    response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, name: value})
    error = _error(response, 400, name)
    assert error["code"] == "unsupported_parameter"
    assert name in error["message"]
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/v1/completions", COMPLETION, "prompt_embeds"),
        ("/v1/completions", COMPLETION, "kv_transfer_params"),
        ("/v1/completions", COMPLETION, "vllm_xargs"),
        ("/v1/embeddings", EMBEDDING, "chat_template"),
        ("/v1/embeddings", EMBEDDING, "mm_processor_kwargs"),
        ("/v1/embeddings", EMBEDDING, "priority"),
        ("/v1/embeddings", EMBEDDING, "temperature"),  # a sampling field means nothing to an embedding
    ],
)
def test_each_endpoint_has_its_own_list(
    gateway: Any, upstream: FakeUpstream, path: str, body: dict[str, Any], name: str
) -> None:
    _error(httpx.post(gateway.url + path, json={**body, name: "x"}), 400, name)
    assert upstream.requests == []


def test_chat_template_cannot_be_swapped_through_chat_template_kwargs(gateway: Any, upstream: FakeUpstream) -> None:
    body = {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}}
    error = _error(
        httpx.post(gateway.url + "/v1/chat/completions", json=body), 400, "chat_template_kwargs.chat_template"
    )
    assert error["code"] == "unsupported_parameter"
    ok = httpx.post(
        gateway.url + "/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert ok.status_code == 200
    assert upstream.requests[-1].body["chat_template_kwargs"] == {"enable_thinking": False}


def test_documented_fields_pass_through_untouched(gateway: Any, upstream: FakeUpstream) -> None:
    """Every OpenAI field the SDK sends, plus vLLM's sampling extras, reach the worker byte for byte."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logit_bias={"1": 1},
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=5,
        n=2,
        seed=1,
        stop=["x"],
        temperature=0.5,
        top_p=0.9,
        user="u",
        metadata={"a": "b"},
        store=False,
        parallel_tool_calls=False,
        response_format={"type": "text"},
        reasoning_effort="low",
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "ignore_eos": False,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
            "include_stop_str_in_output": False,
            "return_token_ids": True,
            "cache_salt": "tenant-chosen-salt",
            "structured_outputs": {"choice": ["a", "b"]},
        },
    )
    seen = upstream.requests[-1]
    assert seen.body["top_k"] == 5 and seen.body["cache_salt"] == "tenant-chosen-salt"
    assert seen.body["metadata"] == {"a": "b"}


def test_prompt_cache_key_is_accepted_on_chat_and_completions(gateway: Any, upstream: FakeUpstream) -> None:
    """OpenAI's routing hint (chat and Responses) is accepted on completions too, for multi-turn clients of
    vLLM's completions API; the worker gets it as sent (vLLM ignores it)."""
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        reply = httpx.post(gateway.url + path, json={**body, "prompt_cache_key": "conversation-7"})
        assert reply.status_code == 200, reply.text
        assert upstream.requests[-1].body["prompt_cache_key"] == "conversation-7"
    _error(
        httpx.post(gateway.url + "/v1/embeddings", json={**EMBEDDING, "prompt_cache_key": "k"}), 400, "prompt_cache_key"
    )
    sent = len(upstream.requests)
    for value in (7, ["a"], {"k": 1}):  # not a string: refused as OpenAI does, before any worker sees it
        bad = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "prompt_cache_key": value})
        assert _error(bad, 400, "prompt_cache_key")["code"] == "invalid_type"
    assert httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "prompt_cache_key": None}).status_code == 200
    assert len(upstream.requests) == sent + 1


def test_n_is_bounded_like_openai(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> None:
    with gateway_factory(base_config([upstream_url], limits={"max_n": 4})) as (_, server):
        _error(httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "n": 5}), 400, "n")
        _error(httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "n": 2**63}), 400, "n")
        assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "n": 4}).status_code == 200
    assert len(upstream.requests) == 1


def test_operator_adds_an_extension_field_and_a_reload_changes_the_list(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url], limits={"extra_params": ["my_extension"]})
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "my_extension": 1}).status_code == 200
        assert upstream.requests[-1].body["my_extension"] == 1
        _error(httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "vllm_xargs": {}}), 400, "vllm_xargs")
        # The allow-list follows the live config: after a reload without the extension, it is refused.
        reload = httpx.put(
            server.url + "/admin/config",
            content=orjson.dumps(base_config([upstream_url])),
            headers={"authorization": f"Bearer {ADMIN}"},
            timeout=10,
        )
        assert reload.status_code == 200, reload.text
        _error(httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "my_extension": 1}), 400, "my_extension")


def test_allow_lists_cover_what_the_openai_sdk_sends() -> None:
    """The SDK's own parameter names (chat and completions) are all allowed."""
    import inspect

    from openai.resources.chat.completions import Completions as ChatCompletions
    from openai.resources.completions import Completions
    from openai.resources.embeddings import Embeddings

    transport = {"extra_headers", "extra_query", "extra_body", "timeout", "self"}
    for method, endpoint in (
        (ChatCompletions.create, "chat/completions"),
        (Completions.create, "completions"),
        (Embeddings.create, "embeddings"),
    ):
        params = set(inspect.signature(method).parameters) - transport
        missing = params - ALLOWED[endpoint]
        assert not missing, f"{endpoint}: the SDK sends {sorted(missing)}"
