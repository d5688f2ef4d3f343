"""What a candidate config would change: the running config and the candidate, both as redacted JSON
trees, compared leaf by leaf.

Each difference is ``{"path", "change", "running", "candidate"}`` with ``change`` one of ``added``,
``removed``, ``changed``; a path is dotted for mappings and ``[i]`` for list items (``plugins[1].name``).
A list of named entries (models, plugins, engine workers) is compared by name rather than by position, so
putting a plugin in front of another shows as a move of names, not as every field of both changing.
"""

from __future__ import annotations

from typing import Any

_MISSING = object()


def config_diff(running: Any, candidate: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    _walk("", running, candidate, out)
    return out


def _named(items: list[Any]) -> dict[str, Any] | None:
    names = [item.get("name") for item in items if isinstance(item, dict)]
    if len(names) != len(items) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        return None
    return {item["name"]: item for item in items}


def _walk(path: str, old: Any, new: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            _walk(f"{path}.{key}" if path else str(key), old.get(key, _MISSING), new.get(key, _MISSING), out)
        return
    if isinstance(old, list) and isinstance(new, list):
        old_named, new_named = _named(old), _named(new)
        if old_named is not None and new_named is not None:
            if list(old_named) != list(new_named):
                _leaf(f"{path}[].name", list(old_named), list(new_named), out)
            for name in [*old_named, *(n for n in new_named if n not in old_named)]:
                _walk(f"{path}[{name}]", old_named.get(name, _MISSING), new_named.get(name, _MISSING), out)
            return
        for i in range(max(len(old), len(new))):
            _walk(f"{path}[{i}]", old[i] if i < len(old) else _MISSING, new[i] if i < len(new) else _MISSING, out)
        return
    if old != new:
        _leaf(path, old, new, out)


def _leaf(path: str, old: Any, new: Any, out: list[dict[str, Any]]) -> None:
    change = "added" if old is _MISSING else "removed" if new is _MISSING else "changed"
    out.append(
        {
            "path": path,
            "change": change,
            "running": None if old is _MISSING else old,
            "candidate": None if new is _MISSING else new,
        }
    )
