"""The documentation site: the generated configuration reference covers every config field, and the
strict build fails on a broken link or anchor (so `make test`, which builds the site, fails too)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from pydantic import BaseModel

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generated_hook", ROOT / "docs" / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as MkDocs does with a hook: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def nested_models(model: type[BaseModel]) -> set[type[BaseModel]]:
    """``model`` and every model reachable through its fields' annotations."""
    found: set[type[BaseModel]] = set()
    todo: list[object] = [model]
    while todo:
        item = todo.pop()
        if isinstance(item, type) and issubclass(item, BaseModel):
            if item in found:
                continue
            found.add(item)
            todo.extend(info.annotation for info in item.model_fields.values())
        else:
            todo.extend(getattr(item, "__args__", ()))
    return found


def section_rows(page: str) -> dict[str, set[str]]:
    """Model (module.qualname) -> the keys listed in its table (the first column), from the rendered page."""
    rows: dict[str, set[str]] = {}
    current = None
    for line in page.splitlines():
        if line.startswith("#"):
            current = None
        named = re.match(r"^Model: `([\w.]+)`\.$", line)
        if named:
            current = named.group(1)
            rows.setdefault(current, set())
        key = re.match(r"^\| `([^`]+)` \|", line)
        if key and current is not None:
            rows[current].add(key.group(1))
    return rows


def test_reference_lists_every_field_of_every_config_model() -> None:
    hook = load_hook()
    page = hook.render_reference()
    rows = section_rows(page)
    models = nested_models(GatewayConfig) - {GatewayConfig}
    plugins = hook.builtin_plugins()
    assert set(plugins) == {"tenancy", "safety", "cache", "guided_json", "routing"}
    for cls in plugins.values():
        models |= nested_models(cls.Config)
    for model in models:
        name = f"{model.__module__}.{model.__qualname__}"
        assert rows.get(name) == set(model.model_fields), name
    for name in Settings.model_fields:
        assert f"| `GATEWAY_{name.upper()}` |" in page
    for name in GatewayConfig.model_fields:
        assert f"| `{name}` |" in page
    # The cache's timeout is documented with its default and its description, as the model says.
    assert "| `timeout_ms` | number | `50.0` | > 0, ≤ 5000 | bound on each Redis call on the request path |" in page


def test_every_config_field_says_what_it_does() -> None:
    """The reference (and an editor's hover, through the JSON Schema) shows each field's description: a new
    field without one leaves a blank in both."""
    models = nested_models(GatewayConfig) | nested_models(Settings)
    for cls in load_hook().builtin_plugins().values():
        models |= nested_models(cls.Config)
    blank = sorted(
        f"{model.__module__}.{model.__qualname__}.{name}"
        for model in models
        for name, info in model.model_fields.items()
        if not info.description
    )
    assert blank == []


def test_the_readme_links_to_files_that_exist() -> None:
    """README.md is read on the repository's page, outside the site: its relative links point at files."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    relative = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/") for t in relative)
    missing = [t for t in relative if not (ROOT / t).is_file()]
    assert missing == []


def build(tmp_path: Path, extra_page: str | None = None) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the repository's site, optionally with one more page in nav."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    config["site_dir"] = str(tmp_path / "site")
    config["hooks"] = [str(ROOT / hook) for hook in config["hooks"]]
    if extra_page is not None:
        (docs / "extra.md").write_text(extra_page)
        config["nav"].append({"Extra": "extra.md"})
    config_file = tmp_path / "mkdocs.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "-f", str(config_file)],
        cwd=ROOT,  # snippets (--8<--) resolve repository paths from here
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = build(tmp_path)
    assert result.returncode == 0, result.stderr
    reference = (tmp_path / "site" / "reference" / "configuration.html").read_text()
    assert "first_byte_timeout_s" in reference and "GATEWAY_KEEPALIVE_TIMEOUT_S" in reference
    contract = (tmp_path / "site" / "writing-a-plugin.html").read_text()
    assert "step_aside" in contract and "generated: plugin-contract" not in contract


@pytest.mark.parametrize(
    ("page", "warning"),
    [
        ("[gone](no-such-page.md)", "no-such-page.md"),
        ("[gone](engine.md#no-such-section)", "does not contain an anchor '#no-such-section'"),
        ('--8<-- "no/such/file.md"', "no/such/file.md"),
    ],
    ids=["missing-page", "missing-anchor", "missing-included-file"],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, page: str, warning: str) -> None:
    result = build(tmp_path, f"# Extra\n\n{page}\n")
    assert result.returncode != 0
    assert warning in result.stderr
