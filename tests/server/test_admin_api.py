"""The admin API: auth, config inspection with secrets redacted, plugin actions, the separate admin port,
and that nothing in a request body can make the gateway run code or read files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, SecretStr

from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.wire.errors import InvalidRequest
from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "admin-secret-token-123"
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def admin(token: str | None = TOKEN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class KeyedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: SecretStr = SecretStr("")
    label: str = "x"


class ActionPlugin(Plugin):
    """A plugin with admin actions: ``count`` (how many requests it saw) and ``echo``."""

    name = "actions"
    Config = KeyedConfig

    def __init__(self, config: KeyedConfig, services: Any) -> None:
        super().__init__(config, services)
        self.seen = 0

    async def on_request(self, ctx: RequestContext) -> None:
        self.seen += 1

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        if action == "count":
            return {"seen": self.seen, "label": self.config.label}
        if action == "echo":
            if "fail" in body:
                raise InvalidRequest("echo refuses 'fail'", param="fail")
            return {"body": body}
        return await super().on_admin(action, body)


def _config(upstream_url: str, label: str = "x", **extra: Any) -> dict[str, Any]:
    plugins = [{"name": "actions", "config": {"api_key": "sk-plugin-secret", "label": label}}, {"name": "routing"}]
    return base_config([upstream_url], plugins=plugins, **extra)


def _assert_openai_error(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert response.headers.get("x-request-id")
    return dict(error)


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/admin/config"), ("POST", "/admin/reload"), ("PUT", "/admin/config"), ("POST", "/admin/plugins/a/b")],
)
def test_auth_on_every_admin_route(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, method: str, path: str
) -> None:
    with gateway_factory(_config(upstream_url), plugins={"actions": ActionPlugin}, admin_token=TOKEN) as (_, server):
        url = server.url + path
        missing = httpx.request(method, url, content=b"models: []")
        assert _assert_openai_error(missing, 401, "authentication_error")["code"] == "missing_admin_token"
        wrong = httpx.request(method, url, headers=admin("not-the-token"), content=b"models: []")
        assert _assert_openai_error(wrong, 403, "permission_error")["code"] == "invalid_admin_token"
        client_key = httpx.request(method, url, headers=admin("sk-client-api-key"), content=b"models: []")
        _assert_openai_error(client_key, 403, "permission_error")
        prefix = httpx.request(method, url, headers=admin(TOKEN[:-1]), content=b"models: []")
        _assert_openai_error(prefix, 403, "permission_error")


def test_admin_disabled_without_a_token(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(_config(upstream_url), plugins={"actions": ActionPlugin}) as (_, server):
        for token in (None, "", "anything"):
            response = httpx.get(server.url + "/admin/config", headers=admin(token))
            error = _assert_openai_error(response, 403, "permission_error")
            assert error["code"] == "admin_disabled" and "GATEWAY_ADMIN_TOKEN" in error["message"]


def test_get_config_shows_version_load_time_and_redacts_secrets(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = _config(upstream_url)
    config["models"][0]["workers"] = [upstream_url, "http://user:hunter2@10.0.0.9:8000"]
    with gateway_factory(config, plugins={"actions": ActionPlugin}, admin_token=TOKEN) as (app, server):
        response = httpx.get(server.url + "/admin/config", headers={"x-admin-token": TOKEN})
        assert response.status_code == 200
        body = response.json()
        assert body["version"] == app.state.holder.current.version
        assert body["loaded_at"].endswith("+00:00") and body["loaded_at_unix"] > 0
        assert body["source"] == "initial"
        text = response.text
        assert "sk-plugin-secret" not in text and "hunter2" not in text
        assert TOKEN not in text
        plugin = body["config"]["plugins"][0]
        assert plugin["name"] == "actions" and plugin["config"]["api_key"] == "***"
        assert plugin["config"]["label"] == "x"
        assert "http://user:***@10.0.0.9:8000" in body["config"]["models"][0]["workers"]


def test_plugin_actions_reach_the_live_instance(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(_config(upstream_url), plugins={"actions": ActionPlugin}, admin_token=TOKEN) as (_, server):
        for _ in range(3):
            r = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
        count = httpx.post(server.url + "/admin/plugins/actions/count", headers=admin())
        assert count.json() == {"plugin": "actions", "action": "count", "result": {"seen": 3, "label": "x"}}
        echo = httpx.post(server.url + "/admin/plugins/actions/echo", headers=admin(), json={"a": [1, 2]})
        assert echo.json()["result"] == {"body": {"a": [1, 2]}}
        refused = httpx.post(server.url + "/admin/plugins/actions/echo", headers=admin(), json={"fail": 1})
        assert _assert_openai_error(refused, 400, "invalid_request_error")["param"] == "fail"
        unknown_action = httpx.post(server.url + "/admin/plugins/actions/nope", headers=admin())
        _assert_openai_error(unknown_action, 404, "invalid_request_error")
        unknown_plugin = httpx.post(server.url + "/admin/plugins/cache/purge", headers=admin())
        assert _assert_openai_error(unknown_plugin, 404, "invalid_request_error")["code"] == "plugin_not_found"
        not_object = httpx.post(server.url + "/admin/plugins/actions/echo", headers=admin(), content=b"[1]")
        _assert_openai_error(not_object, 400, "invalid_request_error")

        # After a reload the action reaches the new instance (fresh counter, new label).
        new = _config(upstream_url, label="y")
        assert httpx.put(server.url + "/admin/config", headers=admin(), json=new).status_code == 200
        count = httpx.post(server.url + "/admin/plugins/actions/count", headers=admin())
        assert count.json()["result"] == {"seen": 0, "label": "y"}


def test_request_bodies_never_load_code_or_files(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    with gateway_factory(_config(upstream_url), plugins={"actions": ActionPlugin}, admin_token=TOKEN) as (app, server):
        version = app.state.holder.current.version
        attempts = [
            # A YAML tag that would run a command under an unsafe loader.
            f"!!python/object/apply:os.system ['touch {marker}']\n".encode(),
            f"models: !!python/object/apply:os.system ['touch {marker}']\n".encode(),
            # Import paths and entry-point strings are not plugin names.
            b"models: [{name: m1, workers: [http://127.0.0.1:1]}]\nplugins: [{name: 'os:system'}]\n",
            b"models: [{name: m1, workers: [http://127.0.0.1:1]}]\n"
            b"plugins: [{name: 'plugins.routing:RoutingPlugin'}]\n",
            # A config section naming a file to include is just an unknown field.
            f"include: {tmp_path}/other.yaml\nmodels: [{{name: m1, workers: [http://127.0.0.1:1]}}]\n".encode(),
        ]
        for body in attempts:
            response = httpx.put(server.url + "/admin/config", headers=admin(), content=body)
            error = _assert_openai_error(response, 400, "invalid_request_error")
            assert error["code"] == "config_invalid"
            assert version in error["message"]  # the running config is named as still live
        # Plugin action bodies are data handed to the plugin, never interpreted by the core.
        echo = httpx.post(
            server.url + "/admin/plugins/actions/echo",
            headers=admin(),
            json={"module": "os", "call": "system", "args": [f"touch {marker}"], "file": "/etc/passwd"},
        )
        assert echo.status_code == 200
        assert app.state.holder.current.version == version
        assert not marker.exists()


def test_admin_port_keeps_admin_routes_off_the_public_port(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    admin_port = free_port()
    with gateway_factory(
        _config(upstream_url), plugins={"actions": ActionPlugin}, admin_token=TOKEN, admin_port=admin_port
    ) as (_, server):
        admin_url = f"http://127.0.0.1:{admin_port}"
        assert httpx.get(admin_url + "/admin/config", headers=admin()).status_code == 200
        r = httpx.get(admin_url + "/admin/config")
        _assert_openai_error(r, 401, "authentication_error")
        for host in (f"127.0.0.1:{admin_port}", "localhost", "admin.internal"):
            headers = {**admin(), "host": host, "x-forwarded-port": str(admin_port), "x-forwarded-host": host}
            public = httpx.get(server.url + "/admin/config", headers=headers)
            _assert_openai_error(public, 404, "invalid_request_error")
            public = httpx.post(server.url + "/admin/reload", headers=headers)
            _assert_openai_error(public, 404, "invalid_request_error")
        # ... and the admin port serves nothing but admin.
        inference = httpx.post(admin_url + "/v1/chat/completions", json=CHAT)
        assert inference.status_code in (404, 405)
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
