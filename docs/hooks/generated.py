"""MkDocs hook: the pages that are generated from the code, so that they cannot drift from it.

- ``reference/configuration.md``: every field of ``config.yaml`` (``GatewayConfig`` and the models under
  it), every ``GATEWAY_*`` process setting (``Settings``), and the ``config:`` section of each built-in
  plugin (the plugins registered under ``[project.entry-points."gateway.plugins"]`` in pyproject.toml),
  with types, defaults, constraints and descriptions, read from the pydantic models themselves.
- ``assets/latency-vs-concurrency.png``: the plot of the benchmark run quoted on the performance page,
  taken from ``bench/`` where ``bench/run.py`` writes it.

Registered in mkdocs.yml under ``hooks:``; ``tests/docs`` renders the reference on its own as well.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import tomllib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_URI = "reference/configuration.md"
ASSETS = {"assets/latency-vs-concurrency.png": ROOT / "bench" / "latency-vs-concurrency.png"}


def _import_root() -> None:
    # The project's own code, not whatever checkout an editable install in the venv points at.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def builtin_plugins() -> dict[str, Any]:
    """Name -> plugin class for the plugins this project registers in pyproject.toml's entry points."""
    _import_root()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entries: dict[str, str] = project["project"]["entry-points"]["gateway.plugins"]
    plugins = {}
    for name, target in entries.items():
        module_name, _, attr = target.partition(":")
        plugins[name] = getattr(importlib.import_module(module_name), attr)
    return plugins


# -- rendering ---------------------------------------------------------------------------------------


def _doc(obj: Any) -> str:
    text = inspect.getdoc(obj) or ""
    if obj.__doc__ is None or text == inspect.getdoc(obj.__mro__[1]):
        return ""  # inherited from BaseModel: says nothing about this model
    return text.replace("``", "`")


def _qualified(model: type) -> str:
    return f"{model.__module__}.{model.__qualname__}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass
class _Page:
    """Sections rendered so far; each model is described once and linked from every other place."""

    lines: list[str] = field(default_factory=list)
    anchors: dict[type, str] = field(default_factory=dict)
    pending: list[tuple[type, str, str]] = field(default_factory=list)

    def link(self, model: type, path: str, prefix: str) -> str:
        if model not in self.anchors:
            anchor = prefix + "-" + "".join(c if c.isalnum() else "-" for c in path.lower()).strip("-")
            while "--" in anchor:
                anchor = anchor.replace("--", "-")
            self.anchors[model] = anchor
            self.pending.append((model, path, anchor))
        return f"[{model.__name__}](#{self.anchors[model]})"


def _type(annotation: Any, link: Callable[[type, str], str], path: str) -> str:
    from pydantic import BaseModel, SecretStr

    origin = get_origin(annotation)
    args = get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Annotated:
        return _type(args[0], link, path)
    if origin is Literal:
        return " or ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a, link, path) for a in args)
    if origin in (list, set, frozenset) or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"list of {_type(args[0], link, path + '[]')}"
    if origin is tuple:
        return "list of " + ", ".join(_type(a, link, path + "[]") for a in args)
    if origin is dict:
        return f"map of {_type(args[0], link, path)} to {_type(args[1], link, path + '.<key>')}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return link(annotation, path)
    if annotation is SecretStr:
        return "string (secret)"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path", Any: "any"}
    if annotation in names:
        return names[annotation]
    return f"`{getattr(annotation, '__name__', annotation)}`"


def _default(info: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if info.is_required():
        return "**required**"
    value = info.default_factory() if info.default_factory is not None else info.default
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "see its section"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{json.dumps(value)}`"


def _constraints(info: Any) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "min length", "max_length": "max length"}
    found = []
    for meta in info.metadata:
        for attr, word in words.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{word} {value}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            found.append(f"pattern `{pattern}`")
    return ", ".join(found)


def _model_table(page: _Page, model: type, path: str, prefix: str, key_name: Callable[[str], str]) -> None:
    from pydantic import BaseModel

    assert issubclass(model, BaseModel)
    page.lines += ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        child = f"{path}.{name}" if path else name
        type_text = _type(info.annotation, lambda m, p: page.link(m, p, prefix), child)
        cells = [f"`{key_name(name)}`", type_text, _default(info), _constraints(info), info.description or ""]
        page.lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    page.lines.append("")


def _drain(page: _Page, prefix: str, level: str) -> None:
    while page.pending:
        model, path, anchor = page.pending.pop(0)
        page.lines += [f"{level} `{path}` {{#{anchor}}}", "", f"Model: `{_qualified(model)}`."]
        doc = _doc(model)
        if doc:
            page.lines += ["", doc]
        page.lines.append("")
        _model_table(page, model, path, prefix, str)


def render_reference() -> str:
    """The configuration reference page (markdown)."""
    _import_root()
    from gateway.ops.settings import Settings
    from gateway.pipeline.config import GatewayConfig

    page = _Page()
    page.lines += [
        "# Configuration reference",
        "",
        "Generated from the pydantic models by `docs/hooks/generated.py` each time the site is built, so it",
        "says what the code accepts. How the two layers fit together, with examples: [Configuration]"
        "(../configuration.md). Check a file with `gateway check-config config.yaml`; let an editor check it as"
        " you type with the JSON Schema from `gateway config schema` ([how](../configuration.md#editor-validation)).",
        "",
        "## Process settings (`GATEWAY_*`) {#settings}",
        "",
        "Read once from the environment at start (restart to change). Each key is the environment variable "
        "`GATEWAY_` + its name in upper case; a list is written as JSON (`GATEWAY_GC_THRESHOLDS='[10000, 10, 10]'`).",
        "",
    ]
    _model_table(page, Settings, "", "settings", lambda name: f"GATEWAY_{name.upper()}")
    _drain(page, "settings", "###")

    page.lines += [
        "## config.yaml {#config-yaml}",
        "",
        "Reloadable (`gateway reload`, `SIGHUP`, the file watcher, `PUT /admin/config`). Unknown keys are "
        "refused everywhere, so a typo is an error, not a silently ignored setting.",
        "",
        "### Top level {#config-top-level}",
        "",
    ]
    _model_table(page, GatewayConfig, "", "config", str)
    _drain(page, "config", "###")

    page.lines += [
        "## Plugin sections {#plugins}",
        "",
        "Each entry of `plugins:` is validated against the `PluginEntry` model above, and its `config:` against "
        "the plugin's own `Config` model below (when the plugin is enabled). The built-in plugins, as registered "
        "in pyproject.toml:",
        "",
    ]
    plugins = builtin_plugins()
    for name, cls in plugins.items():
        page.lines.append(f"- [`{name}`](#plugin-{name}): `{cls.__module__}.{cls.__qualname__}`")
    page.lines.append("")
    for name, cls in plugins.items():
        timeout = cls.default_timeout_ms
        page.lines += [
            f"### `{name}` {{#plugin-{name}}}",
            "",
            f"`plugins: [{{name: {name}, config: {{...}}}}]`. Defaults of the entry: "
            f"`on_error: {cls.default_on_error}`, `timeout_ms: {'null' if timeout is None else timeout}`"
            f" (no budget when null). The plugin's page: [{name}](../plugins/{name}.md).",
            "",
            f"Model: `{_qualified(cls.Config)}`.",
            "",
        ]
        doc = _doc(cls.Config)
        if doc:
            page.lines += [doc, ""]
        _model_table(page, cls.Config, "config", f"plugin-{name}", str)
        _drain(page, f"plugin-{name}", "####")
    return "\n".join(page.lines) + "\n"


# -- MkDocs events -----------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, REFERENCE_URI, content=render_reference()))
    for uri, source in ASSETS.items():
        files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files


def plugin_contract() -> str:
    """The contract section of ``gateway/pipeline/plugin.py``'s docstring, as markdown."""
    _import_root()
    import gateway.pipeline.plugin as plugin_module

    doc = inspect.getdoc(plugin_module) or ""
    marker = "The contract\n============\n"
    if marker not in doc:
        raise ValueError("gateway/pipeline/plugin.py's docstring has no 'The contract' section to include")
    return doc.split(marker, 1)[1].strip().replace("``", "`") + "\n"


PAGE_MARKERS: dict[str, Callable[[], str]] = {"<!-- generated: plugin-contract -->": plugin_contract}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for marker, render in PAGE_MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown


LAYER_ORDER = ["cli", "server", "proxy", "pipeline", "upstream", "wire", "ops", "infra", "engine"]


def package_table() -> str:
    """One section per layer of ``gateway/``, top to bottom, with its package docstring."""
    _import_root()
    parts = []
    for name in LAYER_ORDER:
        module = importlib.import_module(f"gateway.{name}")
        doc = (inspect.getdoc(module) or "").replace("``", "`")
        parts.append(f"### `gateway.{name}`\n\n{doc}\n")
    return "\n".join(parts)


PAGE_MARKERS["<!-- generated: packages -->"] = package_table
