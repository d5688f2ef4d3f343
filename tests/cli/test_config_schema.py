"""``gateway config schema``: the JSON Schema editors use to check config.yaml as users type. It accepts
every config file in the repository and refuses what ``gateway check-config`` refuses (wrong types,
unknown keys, values out of range, a misspelt plugin, a plugin section that does not fit its model)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from pydantic import ValidationError

from gateway.cli import main
from gateway.pipeline.config import ConfigError, GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.validate import resolve_plugins
from tests.support.gateways import REPO

CONFIG_FILES = [
    "config.yaml",
    "examples/config.gpu.yaml",
    "deploy/compose/gateway.yaml",
    "deploy/k8s/base/config.yaml",
    "deploy/k8s/overlays/gpu/config.yaml",
]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    result = CliRunner().invoke(main, ["config", "schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def gateway_accepts(data: dict[str, Any]) -> bool:
    """What ``gateway check-config`` decides: the core models, then every enabled plugin's section."""
    try:
        config = GatewayConfig.model_validate(data)
        resolve_plugins(config, PluginRegistry())
    except (ConfigError, ValidationError):
        return False
    return True


def root_config() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "config.yaml").read_text())
    assert isinstance(data, dict)
    return data


def plugin(data: dict[str, Any], name: str) -> dict[str, Any]:
    entry = next(p for p in data["plugins"] if p["name"] == name)
    assert isinstance(entry, dict)
    return entry


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_every_config_in_the_repository_is_valid(validator: jsonschema.Draft202012Validator, path: str) -> None:
    data = yaml.safe_load((REPO / path).read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]
    assert errors == []
    assert gateway_accepts(data)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value

    return change


WRONG: dict[str, Callable[[dict[str, Any]], None]] = {
    "timeout of the wrong type": _set("upstream.connect_timeout_s", "soon"),
    "timeout out of range": _set("upstream.idle_timeout_s", 0),
    "workers not a list": _set("models.0.workers", "smollm2-cpu"),
    "no models": _set("models", []),
    "unknown top-level key": _set("modles", []),
    "unknown key in a model": _set("models.0.worker", ["http://127.0.0.1:8100"]),
    "managed worker device": _set("engine.workers.0.device", "tpu"),
    "misspelt plugin": lambda d: d["plugins"].append({"name": "cahce"}),
    "cache timeout of the wrong type": lambda d: plugin(d, "cache")["config"].update(timeout_ms="fast"),
    "safety rule action": lambda d: plugin(d, "safety")["config"]["rules"][0].update(action="shout"),
    "unknown safety key": lambda d: plugin(d, "safety")["config"].update(rulez=[]),
    "routing policy": lambda d: plugin(d, "routing")["config"]["default"].update(policy="random"),
    "guided_json on_invalid": lambda d: plugin(d, "guided_json")["config"].update(on_invalid="ignore"),
    "plugin on_error": lambda d: plugin(d, "cache").update(on_error="fail_sometimes"),
    "third-party plugin's section": lambda d: d["plugins"].insert(
        0, {"name": "example_header", "config": {"value": 3}}
    ),
}


@pytest.mark.parametrize("change", WRONG.values(), ids=WRONG.keys())
def test_the_schema_refuses_what_the_gateway_refuses(
    validator: jsonschema.Draft202012Validator, change: Callable[[dict[str, Any]], None]
) -> None:
    data = copy.deepcopy(root_config())
    change(data)
    assert not gateway_accepts(data)
    assert not validator.is_valid(data)


RIGHT: dict[str, Callable[[dict[str, Any]], None]] = {
    "a disabled plugin is not checked": lambda d: d["plugins"].append(
        {"name": "not_installed", "enabled": False, "config": {"anything": 1}}
    ),
    "a third-party plugin": lambda d: d["plugins"].insert(0, {"name": "example_header", "config": {"value": "yes"}}),
    "a plugin without a section": lambda d: plugin(d, "guided_json").pop("config"),
    "tenancy with a key": lambda d: d["plugins"].insert(
        0, {"name": "tenancy", "config": {"keys": [{"id": "k1", "tenant": "t1", "hash": "ab" * 32}]}}
    ),
}


@pytest.mark.parametrize("change", RIGHT.values(), ids=RIGHT.keys())
def test_the_schema_accepts_what_the_gateway_accepts(
    validator: jsonschema.Draft202012Validator, change: Callable[[dict[str, Any]], None]
) -> None:
    data = copy.deepcopy(root_config())
    change(data)
    assert gateway_accepts(data)
    assert [e.message for e in validator.iter_errors(data)] == []


def test_a_config_file_names_its_schema_for_the_editor(tmp_path: Path) -> None:
    """The comment the docs tell users to add changes nothing for the gateway (it is a YAML comment)."""
    text = "# yaml-language-server: $schema=./config.schema.json\n" + (REPO / "config.yaml").read_text()
    path = tmp_path / "config.yaml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["check-config", str(path)])
    assert result.exit_code == 0, result.output
