"""Tenancy paths the other tenancy tests leave alone: the hash-key command feeding a config key that
then authenticates, the admin actions' refusals (bad bodies, duplicates, config keys, usage queries,
Redis away), config validation, and the token estimates admission charges before usage is known."""

from __future__ import annotations

import io
import sys
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from plugins.tenancy.__main__ import main as tenancy_cli
from plugins.tenancy.config import MediaTokens, TenancyConfig
from plugins.tenancy.estimate import prompt_tokens, reported_usage, reserved_completion
from plugins.tenancy.keys import hash_key
from tests.plugins.tenancy.test_keys import ADMIN, admin, chat, tenancy
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory
from tests.support.tenancy import PEPPER, prefix
from tests.wire.test_error_shape import assert_error_shape

__all__ = ["prefix"]  # the fixture, used by name


# -- python -m plugins.tenancy hash-key ------------------------------------------------------------


def test_hash_key_digest_authenticates_the_key_as_a_config_key(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = "sk-gw-cover-key-from-a-vault-0001"
    monkeypatch.setattr(sys, "stdin", io.StringIO(key + "\n"))
    assert tenancy_cli(["hash-key"]) == 0
    out = capsys.readouterr().out
    assert key not in out  # never echoed
    digest = out.strip().removeprefix("hash: ")
    assert digest == hash_key(key, PEPPER.encode())

    keys = [{"id": "vault-key", "tenant": "team-v", "hash": f"sha256:{digest.upper()}", "models": ["m1"]}]
    config = tenancy(prefix, upstream_url, keys=keys, redis_timeout_ms=2000)  # a busy test machine is slow
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        assert chat(server, key).status_code == 200
        assert assert_error_shape(chat(server, key + "x"), 401)["code"] == "invalid_api_key"
        listed = admin(server, "list_keys", {}).json()["result"]["keys"]
        assert listed == [{"id": "vault-key", "tenant": "team-v", "source": "config"}]
        refused = assert_error_shape(admin(server, "revoke_key", {"id": "vault-key"}), 400)
        assert refused["code"] == "config_key" and "config.yaml" in refused["message"]


def test_hash_key_new_prints_a_fresh_key_once_with_its_digest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTHER_PEPPER", "p2")
    assert tenancy_cli(["hash-key", "--new", "--pepper-env", "OTHER_PEPPER"]) == 0
    key_line, hash_line = capsys.readouterr().out.splitlines()
    key = key_line.removeprefix("key:  ")
    assert len(key) > 20 and hash_line == f"hash: {hash_key(key, b'p2')}"
    assert tenancy_cli(["hash-key", "--new"]) == 0
    assert capsys.readouterr().out.splitlines()[0] != key_line  # a new key each time


def test_hash_key_without_a_key_on_stdin_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    with pytest.raises(SystemExit) as exited:
        tenancy_cli(["hash-key"])
    assert exited.value.code == 2 and "no key on stdin" in capsys.readouterr().err


# -- admin actions --------------------------------------------------------------------------------


@pytest.fixture
def tenancy_gateway(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str) -> Any:
    config = tenancy(prefix, upstream_url, tenants={"team-a": {"tokens_per_day": 10_000}}, redis_timeout_ms=2000)
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        yield server


@pytest.mark.parametrize(
    ("action", "body", "param", "words"),
    [
        ("create_key", {}, "tenant", "Field required"),
        ("create_key", {"tenant": "has space"}, "tenant", "String should match pattern"),
        ("create_key", {"tenant": "t", "models": []}, "models", "at least 1 item"),
        ("create_key", {"tenant": "t", "limits": {"requests_per_minute": 0}}, "limits.requests_per_minute", "greater"),
        ("create_key", {"tenant": "t", "owner": "me"}, "owner", "Extra inputs are not permitted"),
        ("revoke_key", {}, "id", "Field required"),
        ("usage", {}, "key_id", "exactly one of 'key_id' or 'tenant'"),
        ("usage", {"key_id": "a", "tenant": "b"}, "key_id", "exactly one of 'key_id' or 'tenant'"),
    ],
)
def test_admin_action_bodies_are_validated_naming_the_field(
    tenancy_gateway: Any, action: str, body: dict[str, Any], param: str, words: str
) -> None:
    error = assert_error_shape(admin(tenancy_gateway, action, body), 400)
    assert error["param"] == param and words in error["message"]


def test_a_duplicate_key_id_is_refused_and_the_first_key_keeps_working(tenancy_gateway: Any) -> None:
    first = admin(tenancy_gateway, "create_key", {"tenant": "team-a", "id": "dup"}).json()["result"]
    again = assert_error_shape(admin(tenancy_gateway, "create_key", {"tenant": "team-b", "id": "dup"}), 400)
    assert (again["param"], again["code"]) == ("id", "key_exists")
    assert chat(tenancy_gateway, first["key"]).status_code == 200


def test_created_keys_get_an_id_and_the_default_limits(tenancy_gateway: Any) -> None:
    created = admin(tenancy_gateway, "create_key", {"tenant": "team-a"}).json()["result"]
    assert created["id"].startswith("key_") and created["models"] == ["*"]
    assert created["limits"] == {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "tokens_per_day": None,
        "tokens_per_month": None,
    }
    assert "cannot show it again" in created["note"]


def test_usage_of_a_tenant_and_of_unknown_keys(tenancy_gateway: Any) -> None:
    created = admin(tenancy_gateway, "create_key", {"tenant": "team-a", "id": "u1"}).json()["result"]
    assert chat(tenancy_gateway, created["key"]).status_code == 200
    report = admin(tenancy_gateway, "usage", {"tenant": "team-a"}).json()["result"]
    assert (report["scope"], report["name"], report["tenant"]) == ("tenant", "team-a", "team-a")
    day = report["day"]
    assert day["budget_tokens"] == 10_000 and day["resets_at"].endswith("T00:00:00Z")
    assert day["requests"] == 1 and day["tokens"] > 0  # the request above, charged to its tenant
    unknown = assert_error_shape(admin(tenancy_gateway, "usage", {"key_id": "nobody"}), 404)
    assert (unknown["param"], unknown["code"]) == ("key_id", "key_not_found")
    revoke = assert_error_shape(admin(tenancy_gateway, "revoke_key", {"id": "nobody"}), 404)
    assert revoke["code"] == "key_not_found"


def test_unknown_admin_action_lists_the_known_ones(tenancy_gateway: Any) -> None:
    error = assert_error_shape(admin(tenancy_gateway, "rotate_key", {}), 404)
    assert error["param"] == "action"
    assert "known: create_key, revoke_key, list_keys, usage" in error["message"]


def test_admin_actions_answer_503_while_redis_is_unreachable(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url, redis_timeout_ms=100)
    with gateway_factory(config, admin_token=ADMIN, redis_url="redis://127.0.0.1:1/0") as (_, server):
        for action, body in [("create_key", {"tenant": "t"}), ("list_keys", {}), ("usage", {"tenant": "t"})]:
            error = assert_error_shape(admin(server, action, body), 503)
            assert error["code"] == "tenancy_unavailable"
        # client requests follow redis_down (fail_closed by default)
        assert assert_error_shape(chat(server, "sk-anything"), 503)["code"] == "tenancy_unavailable"


def test_without_auth_every_request_is_the_anonymous_tenant(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(
        prefix, upstream_url, auth=False, anonymous_tenant="lab", tenants={"lab": {"requests_per_minute": 2}}
    )
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        assert [chat(server, None).status_code for _ in range(3)] == [200, 200, 429]
        metrics = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
        assert 'tenant="lab"' in metrics
        public = httpx.get(server.url + "/metrics").text  # per-tenant series are the admin's
        assert "tenant=" not in public
        assert 'gateway_tenancy_refusals_total{reason="requests_per_minute"} 1.0' in public


# -- config -----------------------------------------------------------------------------------------

DIGEST = "ab" * 32


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"keys": [{"id": "k", "tenant": "t", "hash": "deadbeef"}]}, "must be a 64-character hex digest"),
        ({"keys": [{"id": "k", "tenant": "t", "hash": "zz" * 32}]}, "must be a 64-character hex digest"),
        ({"tenants": {"bad name": {}}}, "tenant names may use letters, digits and _.:- only: bad name"),
        (
            {"keys": [{"id": "k", "tenant": "t", "hash": DIGEST}, {"id": "k", "tenant": "u", "hash": "cd" * 32}]},
            "keys: id used twice: k",
        ),
        (
            {"keys": [{"id": "a", "tenant": "t", "hash": DIGEST}, {"id": "b", "tenant": "t", "hash": DIGEST.upper()}]},
            "keys: hash used twice: abababab...",
        ),
        ({"redis_timeout_ms": 0}, "greater than 0"),
        ({"fail_open_share": 1.5}, "less than or equal to 1"),
        ({"key_cache_ttl_s": 2}, "less than or equal to 1"),
        ({"media_tokens": {"image": -1}}, "greater than or equal to 0"),
    ],
)
def test_tenancy_config_refusals(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace(".", r"\.")):
        TenancyConfig.model_validate(config)


# -- token estimates ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "tokens"),
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "x" * 40}]}, 10 + 4),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 8}]}]}, 2 + 4),
        ("chat/completions", {"messages": ["junk", {"role": "user", "content": None}]}, 4),
        # tool definitions and an assistant's tool calls are rendered into the prompt: their JSON counts
        ("chat/completions", {"messages": [], "tools": [{"d": "x" * 390}]}, 100),  # 400 JSON characters
        (
            "chat/completions",
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"a": "x" * 30}]}]},
            10 + 4,
        ),
        # documents (vLLM renders them into a chat template) count as their JSON too
        ("chat/completions", {"messages": [], "documents": [{"text": "x" * 390}]}, 101),  # 403 JSON characters
        ("completions", {"prompt": "x" * 9}, 3),
        ("completions", {"prompt": [[1, 2, 3], [4, 5]]}, 5),  # token ids count one each
        ("completions", {"prompt": [7, 8, 9, 10]}, 4),
        ("embeddings", {"input": ["abcd", "efgh"]}, 2),
        ("embeddings", {"input": {"weird": True}}, 1),  # at least one
        # the pooling routes' chat form: the messages are the prompt
        ("classify", {"messages": [{"role": "user", "content": "x" * 40}]}, 10 + 4),
        ("pooling", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 8}]}]}, 2 + 4),
    ],
)
def test_prompt_token_estimates(endpoint: str, body: dict[str, Any], tokens: int) -> None:
    assert prompt_tokens(endpoint, body) == tokens


_BIG_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4_000_000, "detail": "low"}}


def _user(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


@pytest.mark.parametrize(
    ("endpoint", "body", "tokens"),
    [
        # an image is 2048 tokens whatever its URL's size or detail (vLLM ignores detail); + 4 for the message
        ("chat/completions", _user({"type": "text", "text": "x" * 8}, _BIG_IMAGE), 2 + 2048 + 4),
        ("chat/completions", _user({"type": "image_url", "image_url": {"url": "https://a.example/i.png"}}), 2052),
        ("chat/completions", _user({"type": "input_image", "image_url": "https://a.example/i.png"}), 2052),
        ("chat/completions", _user({"type": "image_embeds", "image_embeds": "AAAA"}), 2052),
        ("chat/completions", _user({"image_url": {"url": "https://a.example/i.png"}, "uuid": "u"}), 2052),  # untyped
        ("chat/completions", _user({"type": "file", "file": {"file_data": "JVBERi0" * 1000}}), 2052),
        ("chat/completions", _user({"type": "some_future_part", "x": 1}), 2052),  # unknown: vLLM refuses it
        ("chat/completions", _user({"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}), 754),
        ("chat/completions", _user({"type": "audio_url", "audio_url": {"url": "https://a.example/a.mp3"}}), 754),
        ("chat/completions", _user({"audio_embeds": "AAAA"}), 754),
        ("chat/completions", _user({"type": "video_url", "video_url": {"url": "https://a.example/v.mp4"}}), 4100),
        ("chat/completions", _user({"type": "video_embeds", "video_embeds": "AAAA"}), 4100),
        # text in the parts vLLM reads as text; an untyped part with nothing vLLM reads is nothing
        (
            "chat/completions",
            _user({"type": "thinking", "thinking": "x" * 8}, {"type": "refusal", "refusal": "abcd"}),
            7,
        ),
        ("chat/completions", _user({"type": "tool_reference", "name": "x" * 8}, {"what": "ever"}), 6),
        # prompt embeddings: a row of at least 1024 bytes per token (4096 base64 characters: 3072 bytes)
        ("chat/completions", _user({"type": "prompt_embeds", "data": "A" * 4096}), 3 + 4),
        ("completions", {"prompt_embeds": ["A" * 4096, "A" * 8]}, 3 + 1),
        # multimodal scoring items, and the pooling routes' conversations in input
        ("score", {"data_1": "abcd", "data_2": {"content": [_BIG_IMAGE]}}, 1 + 2048),
        ("rerank", {"query": "abcd", "documents": [{"content": [_BIG_IMAGE]}, "efgh"]}, 1 + 2048 + 1),
        ("embeddings", {"input": [{"role": "user", "content": [_BIG_IMAGE, {"type": "text", "text": "abcd"}]}]}, 2049),
        (
            "embeddings",
            {"input": [[{"role": "user", "content": [_BIG_IMAGE]}], [{"role": "user", "content": "ab"}]]},
            2049,
        ),
        ("classify", _user({"type": "video_url", "video_url": {"url": "https://a.example/v.mp4"}}), 4100),
    ],
)
def test_media_parts_count_a_per_part_estimate(endpoint: str, body: dict[str, Any], tokens: int) -> None:
    assert prompt_tokens(endpoint, body) == tokens


def test_media_part_estimates_are_given_by_the_caller() -> None:
    media = MediaTokens(image=85, audio=10, video=0)
    parts = [_BIG_IMAGE, _BIG_IMAGE, {"type": "input_audio", "input_audio": {}}, {"video_url": {"url": "v"}}]
    assert prompt_tokens("chat/completions", _user(*parts), media) == 85 * 2 + 10 + 4


def test_reserved_completion_is_the_budget_times_n() -> None:
    assert reserved_completion("chat/completions", {"max_tokens": 100, "n": 3}) == 300
    assert reserved_completion("chat/completions", {"max_completion_tokens": 50, "max_tokens": 999}) == 50
    assert reserved_completion("chat/completions", {}) == 0
    assert reserved_completion("chat/completions", {"max_tokens": True}) == 0  # a bool is not a budget


def test_reported_usage_from_usage_or_estimated_from_the_text() -> None:
    assert reported_usage({"usage": {"prompt_tokens": 7, "completion_tokens": 3}}) == (7, 3)
    assert reported_usage({"usage": {"prompt_tokens": 7, "completion_tokens": None}}) == (7, 0)
    chat_answer = {"choices": [{"message": {"content": "x" * 10}}, {"message": {"content": "y" * 6}}]}
    assert reported_usage(chat_answer) == (None, 4)
    assert reported_usage({"choices": [{"text": "abcdefgh"}]}) == (None, 2)
    assert reported_usage({"choices": []}) is None
    assert reported_usage({"data": []}) is None
