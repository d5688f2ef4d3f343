"""The ``gateway`` command beyond the happy path: admin calls that find their gateway and token from
GATEWAY_* settings, gateways that cannot be reached or answer through a proxy's error page, JSON
output, ``model prepare`` for hub ids and local directories, and ``serve`` refusing a broken config
before it binds anything."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from click.testing import CliRunner, Result

from gateway.cli import main
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "cover-cli-token"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No GATEWAY_* variable from the outside; whatever a command sets is undone after the test.

    ``gateway serve`` writes its options into os.environ (GATEWAY_PORT, GATEWAY_MANAGED_WORKERS=false,
    ...) for uvicorn's factory; monkeypatch only undoes what it set itself, so the whole environment
    is restored here (a leaked GATEWAY_MANAGED_WORKERS=false once kept a later test's gateway from
    starting its worker)."""
    saved = dict(os.environ)
    for name in ("HOST", "PORT", "ADMIN_PORT", "ADMIN_TOKEN", "CONFIG_PATH", "WORKERS", "MANAGED_WORKERS"):
        monkeypatch.delenv(f"GATEWAY_{name}", raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def admin_gateway(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> Iterator[tuple[Any, ServerThread]]:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (app, server):
        yield app, server


def test_admin_calls_find_the_gateway_and_token_in_the_settings(
    admin_gateway: tuple[Any, ServerThread], clean_env: pytest.MonkeyPatch
) -> None:
    app, server = admin_gateway
    clean_env.setenv("GATEWAY_HOST", "0.0.0.0")  # a wildcard bind is called on loopback
    clean_env.setenv("GATEWAY_PORT", str(server.port))
    clean_env.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    result = run("config", "show", "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["version"] == app.state.holder.current.version
    assert shown["config"]["models"][0]["name"] == "m1" and shown["source"] == "initial"


def test_the_admin_port_setting_wins_over_the_public_port(
    gateway_factory: GatewayFactory, upstream_url: str, clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    admin_port = free_port()
    config = base_config([upstream_url])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = {"admin_token": TOKEN, "admin_port": admin_port, "config_path": path}
    with gateway_factory(config, **settings) as (app, server):
        clean_env.setenv("GATEWAY_PORT", str(server.port))  # has no admin routes
        clean_env.setenv("GATEWAY_ADMIN_PORT", str(admin_port))
        result = run("reload", "--token", TOKEN)
        assert result.exit_code == 0, result.output
        assert result.output.strip() == f"config {app.state.holder.current.version} unchanged (same content)"


def test_an_unreachable_gateway_is_a_clear_error(clean_env: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run("reload", "--url", url, "--token", TOKEN)
    assert result.exit_code == 1
    assert f"cannot reach the gateway admin API at {url}" in result.output
    assert "Traceback" not in result.output


async def _proxy_error_page(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What a reverse proxy in front of a stopped gateway answers: an HTML error page."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 502, "headers": [(b"content-type", b"text/html")]})
    await send({"type": "http.response.body", "body": b"<html><h1>502 Bad Gateway</h1></html>"})


def test_an_error_page_that_is_not_json_is_quoted(clean_env: pytest.MonkeyPatch) -> None:
    with ServerThread(_proxy_error_page, lifespan="off") as proxy:
        result = run("config", "show", "--url", proxy.url, "--token", TOKEN)
    assert result.exit_code == 1
    assert "GET /admin/config answered 502: <html><h1>502 Bad Gateway</h1></html>" in result.output


def test_missing_token_is_reported_with_the_gateways_message(
    admin_gateway: tuple[Any, ServerThread], clean_env: pytest.MonkeyPatch
) -> None:
    _, server = admin_gateway
    result = run("reload", "--url", server.url + "/")  # a trailing slash is fine
    assert result.exit_code == 1
    assert "POST /admin/reload answered 401: The admin API needs the admin token" in result.output


def test_reload_from_a_pushed_file_that_is_refused_keeps_the_running_config(
    admin_gateway: tuple[Any, ServerThread], clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    app, server = admin_gateway
    version = app.state.holder.current.version
    pushed = tmp_path / "pushed.yaml"
    pushed.write_text(yaml.safe_dump({"models": [{"name": "m1", "workers": ["nowhere"]}]}))
    result = run("reload", "--url", server.url, "--token", TOKEN, "--file", str(pushed))
    assert result.exit_code == 1
    assert "PUT /admin/config answered 400" in result.output and f"(version {version}) stays live" in result.output
    assert app.state.holder.current.version == version


# -- gateway model prepare --------------------------------------------------------------------------


def test_model_prepare_passes_a_hub_id_through(tmp_path: Path) -> None:
    result = run("model", "prepare", "HuggingFaceTB/SmolLM2-135M-Instruct", "--models-dir", str(tmp_path))
    assert result.exit_code == 0
    assert result.stdout.strip() == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "[model] HuggingFaceTB/SmolLM2-135M-Instruct: hub id, vLLM will fetch it" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing downloaded or created


def test_model_prepare_checks_a_local_directory(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    (model / "tokenizer.json").write_text("{}")
    ok = run("model", "prepare", str(model), "--models-dir", str(tmp_path / "models"))
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.strip() == str(model) and "local model directory, ok" in ok.stderr

    (model / "tokenizer.json").unlink()
    (model / "config.json").write_text("{not json")
    refused = run("model", "prepare", str(model), "--models-dir", str(tmp_path / "models"))
    assert refused.exit_code == 1
    assert "is not a Hugging Face model: config.json missing or unreadable (JSONDecodeError)" in refused.output
    assert "no tokenizer (tokenizer.json, tokenizer.model, vocab.json)" in refused.output


def test_model_prepare_of_a_missing_path_explains_the_three_accepted_forms(tmp_path: Path) -> None:
    result = run("model", "prepare", str(tmp_path / "absent"), "--models-dir", str(tmp_path))
    assert result.exit_code == 1
    assert "Name 'smollm2', an existing Hugging Face model directory, or a hub id" in result.output


# -- gateway serve ----------------------------------------------------------------------------------


def test_serve_refuses_a_broken_config_before_starting(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "workers": []}], "plugins": "routing"}))
    result = run("serve", "--config", str(path), "--port", str(free_port()), "--no-managed-workers")
    assert result.exit_code == 1
    assert "config is not valid:\n  models[0].workers: List should have at least 1 item" in result.output
    assert "plugins: Input should be a valid list" in result.output


def test_serve_of_a_missing_config_names_the_file(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    result = run("serve", "--config", str(path))
    assert result.exit_code == 1
    assert f"{path}: cannot read the config file" in result.output


def test_config_show_prints_yaml_that_loads_back(
    admin_gateway: tuple[Any, ServerThread], clean_env: pytest.MonkeyPatch
) -> None:
    app, server = admin_gateway
    result = run("config", "show", "--url", server.url, "--token", TOKEN)
    assert result.exit_code == 0
    header, _, body = result.output.partition("\n")
    assert header.startswith(f"# version {app.state.holder.current.version}, loaded ")
    assert header.endswith(" from initial")
    shown = yaml.safe_load(body)
    assert (
        orjson.loads(orjson.dumps(shown["models"])) == app.state.holder.current.config.model_dump(mode="json")["models"]
    )
