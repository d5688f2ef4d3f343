"""vLLM's utility routes through the gateway (POST /tokenize, /detokenize, GET /version) and the model
cards' ``root`` / ``owned_by``, against fake workers on real sockets; tenancy with real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.server.routes.utility import gateway_version
from plugins.tenancy.keys import hash_key
from tests.support.fakes import ServerThread, free_port, running
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix
from tests.support.vllm_extras_fake import ExtrasWorker

__all__ = ["prefix"]  # the fixture, used by name

KEY_ALL = "sk-utility-all-models"
KEY_M2 = "sk-utility-only-m2"


@pytest.fixture
def workers() -> Iterator[tuple[ExtrasWorker, ServerThread, ExtrasWorker, ServerThread]]:
    one, two = ExtrasWorker(name="w1"), ExtrasWorker(name="w2", version="0.31.1-fake")
    with running(one) as s1, running(two) as s2:
        yield one, s1, two, s2


def two_models(url1: str, url2: str, plugins: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    config = base_config([url1], plugins=plugins)
    config["models"][0]["served_name"] = "m1-served"
    config["models"][0]["owned_by"] = "team-a"
    config["models"].append({"name": "m2", "aliases": ["alias-2"], "workers": [url2]})
    return config


def post(server: ServerThread, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=10, **kw)


def test_tokenize_and_detokenize_go_to_a_worker_of_the_named_model(
    gateway_factory: GatewayFactory, workers: tuple[Any, ...]
) -> None:
    one, s1, two, s2 = workers
    with gateway_factory(two_models(s1.url, s2.url)) as (_, server):
        r = post(server, "/tokenize", {"model": "alias-1", "prompt": "hello big world"})
        assert r.status_code == 200, r.text
        assert r.json() == {"count": 3, "max_model_len": 2048, "tokens": [5, 3, 5]}
        r = post(server, "/detokenize", {"model": "alias-2", "tokens": [2, 1]})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": "w2:xx x"}
    # Each went to its model's worker, the alias rewritten to the name the worker serves.
    assert [(s.path, s.body["model"]) for s in one.requests if s.path != "/health"] == [("/tokenize", "m1-served")]
    assert [(s.path, s.body["model"]) for s in two.requests if s.path != "/health"] == [("/detokenize", "m2")]


def test_bad_requests_get_openai_shaped_errors_before_any_worker_is_called(
    gateway_factory: GatewayFactory, workers: tuple[Any, ...]
) -> None:
    one, s1, _, s2 = workers
    with gateway_factory(two_models(s1.url, s2.url)) as (_, server):
        cases: list[tuple[str, Any, int, str | None, str | None]] = [
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model_not_found", "model"),
            ("/detokenize", {"tokens": [1]}, 400, "missing_required_parameter", "model"),
            ("/tokenize", {"model": 7, "prompt": "x"}, 400, None, "model"),
            ("/tokenize", [1, 2], 400, "invalid_json", None),
            # a client-written template, or processor kwargs, are the operator's choice, as on chat
            ("/tokenize", {"model": "m1", "prompt": "x", "chat_template": "{{ 1 }}"}, 400, "unsupported_parameter",
             "chat_template"),
            ("/tokenize", {"model": "m1", "messages": [], "mm_processor_kwargs": {}}, 400, "unsupported_parameter",
             "mm_processor_kwargs"),
            ("/tokenize", {"model": "m1", "messages": [{"role": "user", "content": "x"}],
                           "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, "unsupported_parameter",
             "chat_template_kwargs.chat_template"),
            # the worker would fetch an image URL to tokenize it: one inside the network is refused
            ("/tokenize", {"model": "m1", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}]},
             400, None, None),
        ]  # fmt: skip
        for path, body, status, code, param in cases:
            r = post(server, path, body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            if code is not None:
                assert error["code"] == code, (body, error)
            if param is not None:
                assert error["param"] == param, (body, error)
        not_json = httpx.post(server.url + "/tokenize", content=b"{oops", timeout=10)
        assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
        too_big = post(server, "/tokenize", {"model": "m1", "prompt": "x" * (5 * 1024 * 1024)})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
        assert httpx.get(server.url + "/tokenize", timeout=10).status_code == 405
    assert [s for s in one.requests if s.path != "/health"] == []


def test_a_worker_error_is_relayed_in_openai_shape(gateway_factory: GatewayFactory, workers: tuple[Any, ...]) -> None:
    _, s1, _, s2 = workers
    with gateway_factory(two_models(s1.url, s2.url)) as (_, server):
        r = post(server, "/detokenize", {"model": "m1", "tokens": ["not", "ids"]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "non-negative" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_no_reachable_worker_is_a_503_not_a_hang(gateway_factory: GatewayFactory, workers: tuple[Any, ...]) -> None:
    _, s1, _, _ = workers
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway_factory(two_models(s1.url, dead)) as (_, server):
        r = post(server, "/tokenize", {"model": "m2", "prompt": "x"})
    assert r.status_code in (502, 503), r.text
    assert r.json()["error"]["type"] == "server_error"


def tenancy_config(prefix: str, url1: str, url2: str) -> dict[str, Any]:
    keys = [
        {"id": "all", "tenant": "t1", "hash": hash_key(KEY_ALL, PEPPER.encode()), "models": ["*"]},
        {"id": "m2", "tenant": "t2", "hash": hash_key(KEY_M2, PEPPER.encode()), "models": ["m2"]},
    ]
    plugins = [{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}}, {"name": "routing"}]
    return two_models(url1, url2, plugins)


def test_with_tenancy_a_key_is_needed_and_only_its_models_can_be_tokenized(
    gateway_factory: GatewayFactory, workers: tuple[Any, ...], prefix: str
) -> None:
    one, s1, two, s2 = workers
    with gateway_factory(tenancy_config(prefix, s1.url, s2.url)) as (_, server):
        body = {"model": "m1", "prompt": "a b"}
        missing = post(server, "/tokenize", body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        wrong = post(server, "/detokenize", {"model": "m1", "tokens": [1]}, headers={"authorization": "Bearer sk-no"})
        assert wrong.status_code == 401
        # A key limited to m2 cannot reach m1's workers, nor learn that m1 exists.
        narrow = {"authorization": f"Bearer {KEY_M2}"}
        hidden = post(server, "/tokenize", body, headers=narrow)
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
        assert post(server, "/tokenize", {"model": "alias-2", "prompt": "a"}, headers=narrow).status_code == 200
        ok = post(server, "/tokenize", body, headers={"authorization": f"Bearer {KEY_ALL}"})
        assert ok.status_code == 200 and ok.json()["count"] == 2
    assert [s.path for s in one.requests if s.path != "/health"] == ["/tokenize"]  # only the authorised one
    assert [s.path for s in two.requests if s.path != "/health"] == ["/tokenize"]


def test_the_admin_api_names_each_models_vllm_and_version_the_gateway_only(
    gateway_factory: GatewayFactory, workers: tuple[Any, ...]
) -> None:
    one, s1, two, s2 = workers
    two.version = None  # a worker that does not say: its model's version is unknown, not an error
    admin = {"authorization": "Bearer utility-admin"}
    with gateway_factory(two_models(s1.url, s2.url), admin_token="utility-admin") as (_, server):
        public = httpx.get(server.url + "/version", timeout=10)
        first = httpx.get(server.url + "/admin/versions", headers=admin, timeout=10)
        again = httpx.get(server.url + "/admin/versions", headers=admin, timeout=10)
    assert public.status_code == 200 and public.json() == {"version": gateway_version()}
    assert first.status_code == 200
    assert first.json() == {"version": gateway_version(), "vllm": {"m1": "0.32.0-fake", "m2": None}}
    assert again.json() == first.json()
    assert gateway_version() != "unknown"
    # Kept for a while: polling does not turn into one worker request each.
    assert [s.path for s in one.requests].count("/version") == 1
    assert s1.url not in first.text  # worker addresses are not shown


def test_model_cards_carry_owned_by_and_the_root_an_alias_points_to(
    gateway_factory: GatewayFactory, workers: tuple[Any, ...]
) -> None:
    _, s1, _, s2 = workers
    with gateway_factory(two_models(s1.url, s2.url)) as (_, server):
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        cards = {m.id: m.model_dump() for m in sdk.models.list()}
        alias = sdk.models.retrieve("alias-1").model_dump()
    assert cards["alias-1"]["root"] == "m1" and cards["alias-1"]["owned_by"] == "team-a"
    assert cards["m1"]["root"] == "m1" and cards["alias-2"]["root"] == "m2"
    assert cards["m2"]["owned_by"] == "vllm-gateway"
    assert alias["root"] == "m1" and alias["id"] == "alias-1"
