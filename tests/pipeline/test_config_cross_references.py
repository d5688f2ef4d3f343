"""config.yaml validation beyond field types: cross-references (aliases, worker refs, managed worker
names and ports, plugins listed twice), managed worker specs, every problem reported at once with its
field path, the content hash, and ``gateway check-config`` on valid and invalid files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gateway.cli import main
from gateway.pipeline.config import ConfigError, config_version, load_config, parse_config


def problems_of(config: dict[str, Any] | bytes) -> list[str]:
    text = config if isinstance(config, bytes) else yaml.safe_dump(config).encode()
    with pytest.raises(ConfigError) as refused:
        parse_config(text, source="test.yaml")
    assert str(refused.value) == "; ".join(refused.value.problems)
    return refused.value.problems


def managed(name: str, port: int, **spec: Any) -> dict[str, Any]:
    return {"name": name, "model": "smollm2", "port": port, **spec}


def with_engine(*workers: dict[str, Any], refs: list[str] | None = None) -> dict[str, Any]:
    return {
        "models": [{"name": "m", "workers": refs or [workers[0]["name"]]}],
        "engine": {"workers": list(workers)},
    }


URL = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param(
            with_engine(managed("a", 8001), managed("a", 8002)),
            "engine.workers: managed worker names must be unique; repeated: a",
            id="managed-names-twice",
        ),
        pytest.param(
            with_engine(managed("a", 8001), managed("b", 8001)),
            "engine.workers: managed workers share a port: 8001",
            id="managed-ports-shared",
        ),
        pytest.param(
            {"models": [{"name": "m", "workers": [URL]}, {"name": "n", "aliases": ["m"], "workers": [URL]}]},
            "(top level): model name or alias 'm' is used twice (m, n)",
            id="alias-shadows-a-name",
        ),
        pytest.param(
            {"models": [{"name": "m", "workers": ["w9"]}]},
            "(top level): model 'm': worker 'w9' is neither a URL (http://host:port, dns://name:port) nor a managed"
            " worker under engine.workers (none)",
            id="unknown-worker-ref",
        ),
        pytest.param(
            with_engine(managed("b", 8001), managed("a", 8002), refs=["w9"]),
            "(top level): model 'm': worker 'w9' is neither a URL (http://host:port, dns://name:port) nor a managed"
            " worker under engine.workers (a, b)",
            id="unknown-worker-ref-lists-the-managed-ones",
        ),
        pytest.param(
            {"models": [{"name": "m", "workers": ["ftp://host:21"]}]},
            "(top level): model 'm': worker 'ftp://host:21' is neither a URL (http://host:port, dns://name:port)"
            " nor a managed worker under engine.workers (none)",
            id="unsupported-scheme",
        ),
        pytest.param(
            {"models": [{"name": "m", "workers": [URL]}], "plugins": [{"name": "routing"}, {"name": "routing"}]},
            "(top level): plugin listed twice: routing",
            id="plugin-twice",
        ),
        pytest.param(
            with_engine(managed("a", 8001, device="gpu", speculative={"method": "eagle"})),
            "engine.workers[0].speculative: speculative method 'eagle' needs `model` (the draft model or EAGLE head,"
            " a path or hub id); only 'ngram' works without one",
            id="eagle-without-a-head",
        ),
        pytest.param(
            with_engine(managed("a", 8001, speculative={"method": "draft_model", "model": "org/draft"})),
            "engine.workers[0]: speculative method 'draft_model' needs a GPU worker (device: gpu); on the CPU use"
            " method: ngram",
            id="draft-model-on-the-cpu",
        ),
        pytest.param(
            with_engine(managed("a", 8001, max_model_len=8)),
            "engine.workers[0].max_model_len: Input should be greater than or equal to 16",
            id="tiny-context",
        ),
        pytest.param(
            with_engine(managed("a", 70000)),
            "engine.workers[0].port: Input should be less than or equal to 65535",
            id="port-out-of-range",
        ),
        pytest.param(
            with_engine(managed("a", 8001, speculative={"num_speculative_tokens": 64})),
            "engine.workers[0].speculative.num_speculative_tokens: Input should be less than or equal to 16",
            id="too-many-speculative-tokens",
        ),
    ],
)
def test_cross_references_and_specs_are_refused_naming_the_field(config: dict[str, Any], expected: str) -> None:
    assert problems_of(config) == [expected]


def test_every_field_problem_is_reported_at_once() -> None:
    config = {
        "models": [{"name": "", "workers": [], "colour": "red"}],
        "upstream": {"connect_timeout_s": 0},
        "limits": {"max_body_bytes": 10},
        "logging": {"level": "LOUD"},
        "include": "other.yaml",
    }
    problems = problems_of(config)
    fields = [p.split(": ", 1)[0] for p in problems]
    assert fields == [
        "models[0].name",
        "models[0].workers",
        "models[0].colour",
        "upstream.connect_timeout_s",
        "limits.max_body_bytes",
        "logging.level",
        "include",
    ]


def test_a_plugin_listed_twice_is_fine_when_one_entry_is_disabled() -> None:
    config = parse_config(
        yaml.safe_dump(
            {
                "models": [{"name": "m", "workers": [URL]}],
                "plugins": [{"name": "routing"}, {"name": "routing", "enabled": False}],
            }
        )
    )
    assert [p.enabled for p in config.plugins] == [True, False]


@pytest.mark.parametrize("text", [b"", b"- a\n- b\n", b"just a string\n", b"42\n"])
def test_a_document_that_is_not_a_mapping_is_refused(text: bytes) -> None:
    assert problems_of(text) == ["test.yaml: the top level must be a mapping (models:, plugins:, ...)"]


def test_json_is_accepted_as_the_yaml_subset_it_is() -> None:
    config = parse_config(b'{"models": [{"name": "m", "workers": ["http://127.0.0.1:9"]}]}')
    assert config.models[0].workers == [URL]


def test_unreadable_config_files_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        load_config(tmp_path / "absent.yaml")
    assert missing.value.problems[0].startswith(f"{tmp_path / 'absent.yaml'}: cannot read the config file: ")
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path)  # a directory


def test_version_is_a_hash_of_the_validated_content() -> None:
    plain = b"models: [{name: m, workers: ['http://127.0.0.1:9']}]\n"
    commented = b"# the one model\nmodels:\n  - workers: ['http://127.0.0.1:9']  # a worker\n    name: m\n"
    explicit_defaults = plain + b"upstream: {connect_timeout_s: 3.0}\nlogging: {level: INFO}\nplugins: []\n"
    versions = {config_version(parse_config(t)) for t in (plain, commented, explicit_defaults)}
    assert len(versions) == 1 and len(versions.pop()) == 16
    changed = parse_config(plain + b"upstream: {connect_timeout_s: 4.0}\n")
    assert config_version(changed) != config_version(parse_config(plain))


def test_managed_worker_urls_use_loopback_for_wildcard_hosts() -> None:
    config = parse_config(
        yaml.safe_dump(
            with_engine(managed("a", 8001, host="0.0.0.0"), managed("b", 8002, host="10.1.2.3"), refs=["a", "b"])
        )
    )
    assert [w.url for w in config.engine.workers] == ["http://127.0.0.1:8001", "http://10.1.2.3:8002"]


# -- gateway check-config ---------------------------------------------------------------------------


def check(path: Path) -> Any:
    return CliRunner().invoke(main, ["check-config", str(path)])


def test_check_config_accepts_a_valid_file_and_summarises_it(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    config = {
        "models": [{"name": "m", "workers": [URL]}, {"name": "n", "workers": [URL]}],
        "plugins": [{"name": "safety"}, {"name": "routing"}, {"name": "cache", "enabled": False}],
    }
    path.write_text(yaml.safe_dump(config))
    result = check(path)
    assert result.exit_code == 0, result.output
    version = config_version(load_config(path))
    assert result.output.strip() == f"{path}: ok (version {version}, 2 models, 2 plugins)"


def test_check_config_lists_every_plugin_problem_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    config = {
        "models": [{"name": "m", "workers": [URL]}],
        "plugins": [
            {"name": "no_such_plugin"},
            {"name": "routing", "config": {"default": {"policy": "random"}, "max_attempts": 0}},
            {"name": "cache", "config": {"namespace": "has:colon"}},
        ],
    }
    path.write_text(yaml.safe_dump(config))
    result = check(path)
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == f"{path}: not valid"
    assert lines[1].startswith("  plugins[0].name: unknown plugin 'no_such_plugin' (installed: ")
    assert "routing" in lines[1]
    assert lines[2].startswith("  plugins[1].config.default.policy: Input should be 'round_robin'")
    assert lines[3] == "  plugins[1].config.max_attempts: Input should be greater than or equal to 1"
    assert lines[4].startswith("  plugins[2].config.namespace: String should match pattern")


def test_check_config_reports_yaml_errors_with_their_position(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("models:\n  - name: m\n    workers: [http://x:1\n")
    result = check(path)
    assert result.exit_code == 1
    assert f"  {path}: not valid YAML at line" in result.output


def test_check_config_of_a_missing_file_fails_cleanly(tmp_path: Path) -> None:
    result = check(tmp_path / "nope.yaml")
    assert result.exit_code == 1
    assert "cannot read the config file" in result.output and "Traceback" not in result.output
