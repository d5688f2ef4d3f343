"""The admin API's edges: a gateway with no config yet, bodies that are too large, empty or not JSON,
plugin actions that crash, the debug and engine listings, a second process on the same admin port,
and the redaction of credentials anywhere in a config."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import GatewayApp, create_app
from gateway.server.routes.admin import REDACTED, redact
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.wire.test_error_shape import CHAT, assert_error_shape

TOKEN = "cover-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


class CrashingActions(Plugin):
    """Admin actions that fail the way a plugin bug would: with a plain exception."""

    name = "crashing"

    async def on_request(self, ctx: RequestContext) -> None:
        return None

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        if action == "crash":
            raise RuntimeError("plugin bug with a secret detail")
        return {"action": action, "body": body}


@pytest.fixture
def admin_gateway(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> Iterator[ServerThread]:
    config = base_config([upstream_url], plugins=[{"name": "crashing"}, {"name": "routing"}])
    with gateway_factory(config, plugins={"crashing": CrashingActions}, admin_token=TOKEN) as (_, server):
        yield server


@pytest.fixture
def unloaded(upstream_url: str) -> Iterator[tuple[GatewayApp, ServerThread, dict[str, Any]]]:
    """A gateway whose lifespan never ran: no config is loaded until one is PUT."""
    config = base_config([upstream_url])
    app = create_app(
        Settings(admin_token=TOKEN),
        registry=PluginRegistry(),
        config=GatewayConfig.model_validate(config),
        engine_factory=None,
    )
    with ServerThread(app, lifespan="off") as server:
        yield app, server, config


# -- no config loaded yet -------------------------------------------------------------------------


def test_without_a_config_inference_and_admin_answer_503_not_ready(
    unloaded: tuple[GatewayApp, ServerThread, dict[str, Any]], upstream: FakeUpstream
) -> None:
    _, server, _ = unloaded
    error = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 503)
    assert (error["type"], error["code"]) == ("server_error", "not_ready")
    assert assert_error_shape(httpx.get(server.url + "/admin/config", headers=ADMIN), 503)["code"] == "not_ready"
    action = httpx.post(server.url + "/admin/plugins/routing/x", headers=ADMIN, json={})
    assert assert_error_shape(action, 503)["code"] == "not_ready"
    ready = httpx.get(server.url + "/ready")
    assert (ready.status_code, ready.json()) == (503, {"status": "no config"})
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # liveness never depends on config
    assert upstream.requests == []


def test_a_refused_first_config_says_nothing_was_loaded_and_a_valid_one_goes_live(
    unloaded: tuple[GatewayApp, ServerThread, dict[str, Any]], upstream: FakeUpstream
) -> None:
    app, server, config = unloaded
    refused = httpx.put(server.url + "/admin/config", headers=ADMIN, content=b"models: []\n")
    error = assert_error_shape(refused, 400)
    assert error["code"] == "config_invalid" and error["param"] == "models"
    assert "nothing was loaded" in error["message"]
    assert not app.state.holder.loaded

    accepted = httpx.put(server.url + "/admin/config", headers=ADMIN, content=yaml.safe_dump(config).encode())
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["changed"] is True and accepted.json()["source"] == "api"
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert len(upstream.requests) == 1


# -- PUT /admin/config bodies ------------------------------------------------------------------------


def test_a_config_larger_than_the_body_limit_is_413(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url], limits={"max_body_bytes": 2048})
    with gateway_factory(config, admin_token=TOKEN) as (app, server):
        version = app.state.holder.current.version
        big = yaml.safe_dump({**config, "limits": {"max_body_bytes": 4096, "extra_params": ["p" * 40] * 100}})
        assert len(big) > 2048
        error = assert_error_shape(httpx.put(server.url + "/admin/config", headers=ADMIN, content=big.encode()), 413)
        assert error["code"] == "request_too_large"
        assert app.state.holder.current.version == version


@pytest.mark.parametrize("body", [b"", b"   \n\t "])
def test_an_empty_config_body_is_refused(admin_gateway: ServerThread, body: bytes) -> None:
    error = assert_error_shape(httpx.put(admin_gateway.url + "/admin/config", headers=ADMIN, content=body), 400)
    assert error["code"] == "config_invalid" and "request body" in error["message"]


def test_a_config_that_is_not_yaml_names_line_and_column(admin_gateway: ServerThread) -> None:
    response = httpx.put(admin_gateway.url + "/admin/config", headers=ADMIN, content=b"models:\n  - name: [unclosed\n")
    error = assert_error_shape(response, 400)
    assert error["code"] == "config_invalid"
    assert "not valid YAML at line" in error["message"]


# -- plugin actions ---------------------------------------------------------------------------------


def test_plugin_action_body_must_be_a_json_object(admin_gateway: ServerThread) -> None:
    url = admin_gateway.url + "/admin/plugins/crashing/echo"
    for body in (b"{broken", b'"text"', b"3"):
        error = assert_error_shape(httpx.post(url, headers=ADMIN, content=body), 400)
        assert error["code"] == "invalid_json"
    empty = httpx.post(url, headers=ADMIN, content=b"  ")
    assert empty.json() == {"plugin": "crashing", "action": "echo", "result": {"action": "echo", "body": {}}}


def test_a_crashing_plugin_action_is_a_500_in_openai_shape_without_its_details(admin_gateway: ServerThread) -> None:
    response = httpx.post(admin_gateway.url + "/admin/plugins/crashing/crash", headers=ADMIN, json={})
    error = assert_error_shape(response, 500)
    assert error["type"] == "server_error"
    assert "secret detail" not in error["message"]
    # the gateway keeps serving
    assert httpx.post(admin_gateway.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_unknown_plugin_lists_the_enabled_ones(admin_gateway: ServerThread) -> None:
    response = httpx.post(admin_gateway.url + "/admin/plugins/cache/purge", headers=ADMIN, json={})
    error = assert_error_shape(response, 404)
    assert (error["param"], error["code"]) == ("name", "plugin_not_found")
    assert "enabled: crashing, routing" in error["message"]


def test_default_on_admin_names_the_missing_action(admin_gateway: ServerThread) -> None:
    response = httpx.post(admin_gateway.url + "/admin/plugins/routing/rebalance", headers=ADMIN, json={})
    error = assert_error_shape(response, 404)
    assert error["param"] == "action" and "'rebalance'" in error["message"]


# -- listings ---------------------------------------------------------------------------------------


def test_debug_tasks_counts_this_process_tasks_by_folded_name(admin_gateway: ServerThread) -> None:
    body = httpx.get(admin_gateway.url + "/admin/debug/tasks", headers=ADMIN).json()
    assert body["pid"] == os.getpid()  # the in-process test server
    assert body["tasks"] == sum(body["by_name"].values()) >= 1
    assert "worker-health" in body["by_name"]  # the health loop the lifespan started
    assert not any(ch.isdigit() for name in body["by_name"] for ch in name)  # numbers folded to N
    assert sum(body["by_coroutine"].values()) == body["tasks"]
    assert any("start_health_checks" in name for name in body["by_coroutine"])  # the coroutine behind the name
    assert assert_error_shape(httpx.get(admin_gateway.url + "/admin/debug/tasks"), 401)["code"] == "missing_admin_token"


def test_engine_listing_without_managed_workers(admin_gateway: ServerThread) -> None:
    assert httpx.get(admin_gateway.url + "/admin/engine", headers=ADMIN).json() == {"managed": False, "workers": []}


def test_a_second_process_on_the_same_admin_port_starts_and_leaves_it_to_the_first(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    admin_port = free_port()
    config = base_config([upstream_url])
    with (
        gateway_factory(config, admin_token=TOKEN, admin_port=admin_port) as (first, _),
        gateway_factory(config, admin_token=TOKEN, admin_port=admin_port) as (_, second),
    ):
        assert httpx.post(second.url + "/v1/chat/completions", json=CHAT).status_code == 200
        shown = httpx.get(f"http://127.0.0.1:{admin_port}/admin/config", headers=ADMIN)
        assert shown.json()["version"] == first.state.holder.current.version


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn exits its thread
def test_an_admin_port_that_cannot_be_bound_stops_start_up(gateway_factory: GatewayFactory, upstream_url: str) -> None:
    # 192.0.2.1 (TEST-NET-1) is no local address: binding it fails with something other than "in use".
    with (
        pytest.raises(RuntimeError, match="died during start-up"),
        gateway_factory(base_config([upstream_url]), admin_token=TOKEN, admin_port=free_port(), host="192.0.2.1"),
    ):
        pass


def test_model_cards_carry_the_context_length_and_an_alias_its_parent(
    gateway_factory: GatewayFactory, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    config["models"][0]["max_model_len"] = 4096
    with gateway_factory(config) as (_, server):
        card = httpx.get(server.url + "/v1/models/alias-1").json()
        assert card["id"] == "alias-1" and card["parent"] == "m1" and card["max_model_len"] == 4096
        listed = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
        assert "parent" not in listed["m1"] and listed["m1"]["max_model_len"] == 4096


# -- redaction --------------------------------------------------------------------------------------


def test_redact_masks_credential_keys_at_any_depth_and_keeps_the_rest() -> None:
    config = {
        "plugins": [
            {
                "name": "x",
                "config": {
                    "password": "p1",
                    "db": {"passwd": "p2", "Secret_Value": "p3", "host": "h"},
                    "api-key": "k1",
                    "ApiKeys": ["k2"],
                    "auth": {"user": "u"},
                    "private": "pk",
                    "token": None,
                    "credential": "",
                    "threshold": 3,
                    "labels": ["a", "b"],
                },
            }
        ]
    }
    out = redact(config)
    cfg = out["plugins"][0]["config"]
    assert cfg["password"] == cfg["api-key"] == cfg["ApiKeys"] == cfg["auth"] == cfg["private"] == REDACTED
    assert cfg["db"] == {"passwd": REDACTED, "Secret_Value": REDACTED, "host": "h"}
    assert cfg["token"] is None and cfg["credential"] == ""  # nothing to hide: shown as unset
    assert cfg["threshold"] == 3 and cfg["labels"] == ["a", "b"]
    assert config["plugins"][0]["config"]["password"] == "p1"  # a copy; the input is untouched


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@redis:6379/0", "redis://:***@redis:6379/0"),
        ("https://user:pa%24s@host/path", "https://user:***@host/path"),
        ("http://user@host:8000", "http://user@host:8000"),
        ("http://host:8000/v1", "http://host:8000/v1"),
    ],
)
def test_redact_cuts_passwords_out_of_urls_in_any_string(url: str, shown: str) -> None:
    assert redact({"models": [{"workers": [url]}]}) == {"models": [{"workers": [shown]}]}


def test_get_config_masks_credentials_but_shows_token_limits(
    gateway_factory: GatewayFactory, upstream_url: str
) -> None:
    safety = {"limits": {"max_tokens": 2048}, "tokenizer": "/models/m1/tokenizer.json"}
    config = base_config([upstream_url], plugins=[{"name": "safety", "config": safety}, {"name": "routing"}])
    config["models"][0]["workers"] = [upstream_url, "http://user:hunter2@10.0.0.9:8000"]
    with gateway_factory(config, admin_token=TOKEN) as (_, server):
        shown = httpx.get(server.url + "/admin/config", headers=ADMIN).json()["config"]
    assert "http://user:***@10.0.0.9:8000" in shown["models"][0]["workers"]  # the credential is masked
    section = shown["plugins"][0]["config"]
    assert section["limits"]["max_tokens"] == 2048
    assert section["tokenizer"] == "/models/m1/tokenizer.json"
