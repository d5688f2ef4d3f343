"""GET /v1/models under tenancy: a key is needed to list models, and a key sees only what it may use."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

WIDE = "sk-models-wide-key"
NARROW = "sk-models-narrow-key"


def two_models(prefix: str, upstream_url: str, **tenancy: Any) -> dict[str, Any]:
    keys = [
        {"id": "wide", "tenant": "t", "hash": hash_key(WIDE, PEPPER.encode()), "models": ["*"]},
        {"id": "narrow", "tenant": "t", "hash": hash_key(NARROW, PEPPER.encode()), "models": ["m2"]},
    ]
    config = base_config(
        [upstream_url],
        plugins=[{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys, **tenancy}}, {"name": "routing"}],
    )
    config["models"].append({"name": "m2", "aliases": ["alias-2"], "workers": [upstream_url]})
    return config


def listed(client: openai.OpenAI) -> set[str]:
    return {m.id for m in client.models.list()}


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_each_key_lists_only_the_models_it_may_use(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(two_models(prefix, upstream_url)) as (_, server):
        assert listed(client(server.url, WIDE)) == {"m1", "alias-1", "m2", "alias-2"}
        assert listed(client(server.url, NARROW)) == {"m2", "alias-2"}  # an alias of an allowed model too
        assert client(server.url, NARROW).models.retrieve("alias-2").id == "alias-2"
        with pytest.raises(openai.NotFoundError) as hidden:
            client(server.url, NARROW).models.retrieve("m1")
        assert hidden.value.code == "model_not_found"


def test_listing_models_needs_a_valid_key(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(two_models(prefix, upstream_url)) as (_, server):
        missing = httpx.get(server.url + "/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(server.url, "sk-not-a-key").models.list()
        assert httpx.get(server.url + "/v1/models/m1").status_code == 401


def test_with_auth_off_every_model_is_listed_to_anyone(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(two_models(prefix, upstream_url, auth=False)) as (_, server):
        ids = {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert ids == {"m1", "alias-1", "m2", "alias-2"}
