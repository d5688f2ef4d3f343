"""Finds plugin classes by name through the entry-point group ``gateway.plugins``.

Built-in plugins are registered in this project's ``pyproject.toml`` exactly like third-party ones, so
the core never imports ``plugins/`` itself. Only names listed in ``config.yaml`` are ever loaded: a
request body can never name a plugin or an import path.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from gateway.pipeline.plugin import Plugin

GROUP = "gateway.plugins"


class PluginRegistry:
    """Name -> plugin class, loaded lazily from entry points (plus explicit registrations for tests)."""

    def __init__(self, extra: dict[str, type[Plugin]] | None = None, *, discover: bool = True) -> None:
        self._entry_points: dict[str, EntryPoint] = (
            {ep.name: ep for ep in entry_points(group=GROUP)} if discover else {}
        )
        self._loaded: dict[str, type[Plugin]] = dict(extra or {})

    def names(self) -> list[str]:
        return sorted({*self._entry_points, *self._loaded})

    def register(self, name: str, cls: type[Plugin]) -> None:
        self._loaded[name] = cls

    def get(self, name: str) -> type[Plugin]:
        cls = self._loaded.get(name)
        if cls is not None:
            return cls
        ep = self._entry_points.get(name)
        if ep is None:
            known = ", ".join(self.names()) or "none installed"
            raise KeyError(f"unknown plugin '{name}' (installed: {known})")
        loaded = ep.load()
        if not (isinstance(loaded, type) and issubclass(loaded, Plugin)):
            raise TypeError(f"entry point '{name}' ({ep.value}) is not a gateway Plugin subclass")
        self._loaded[name] = loaded
        return loaded
