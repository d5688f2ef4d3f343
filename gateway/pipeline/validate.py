"""Resolves and validates a config's plugin sections: every enabled plugin exists, its ``config:``
validates against the plugin's own ``Config`` model, and the order of the list keeps what the contract
needs (``Plugin.replaces_answers``, ``Plugin.identifies_callers``). Used by reload (before anything is built) and by
``gateway check-config``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from gateway.pipeline.config import ConfigError, GatewayConfig, PluginEntry, format_validation_error
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.registry import PluginRegistry


@dataclass(frozen=True, slots=True)
class ResolvedPlugin:
    index: int
    entry: PluginEntry
    cls: type[Plugin]
    config: BaseModel


def resolve_plugins(config: GatewayConfig, registry: PluginRegistry) -> list[ResolvedPlugin]:
    """The enabled plugins with validated configs, or ConfigError listing every problem found."""
    problems: list[str] = []
    resolved: list[ResolvedPlugin] = []
    for index, entry in enumerate(config.plugins):
        if not entry.enabled:
            continue
        try:
            cls = registry.get(entry.name)
        except (KeyError, TypeError, ImportError, AttributeError) as exc:
            problems.append(f"plugins[{index}].name: {exc.args[0] if exc.args else exc}")
            continue
        plain, awaitable = cls.plain_hooks(), cls.async_hooks()
        if plain or awaitable:
            problems += [f"plugins[{index}].name: {cls.__name__}.{hook} must be an 'async def'" for hook in plain]
            problems += [f"plugins[{index}].name: {cls.__name__}.{hook} must be a plain 'def'" for hook in awaitable]
            continue
        try:
            resolved.append(ResolvedPlugin(index, entry, cls, cls.Config.model_validate(entry.config)))
        except ValidationError as exc:
            problems.extend(format_validation_error(exc, prefix=f"plugins[{index}].config"))
    problems += _order_problems(resolved)
    if problems:
        raise ConfigError(problems)
    return resolved


def _order_problems(resolved: list[ResolvedPlugin]) -> list[str]:
    """A plugin that keeps answers listed after one that replaces them (``on_response`` runs in reverse
    order, so it would keep an answer before it was replaced or refused on the way back), or before one
    that identifies callers (it would answer from what it kept before the caller was known)."""
    problems = [
        f"plugins[{identifier.index}].name: '{identifier.entry.name}' must come before '{keeper.entry.name}'"
        f" (plugins[{keeper.index}]) in plugins: it decides who is calling, and '{keeper.entry.name}' answers"
        " requests from what it kept before that is known (no key check, no limits, one scope of answers"
        " for every caller)"
        for keeper, identifier in _listed_before(resolved, "keeps_answers", "identifies_callers")
    ]
    problems += [
        f"plugins[{keeper.index}].name: '{keeper.entry.name}' must come before '{replacer.entry.name}'"
        f" (plugins[{replacer.index}]) in plugins: it keeps answers for later requests, and"
        f" '{replacer.entry.name}' may replace or refuse an answer on the way back, which runs in reverse order"
        for replacer, keeper in _listed_before(resolved, "replaces_answers", "keeps_answers")
    ]
    return problems


def _listed_before(
    resolved: list[ResolvedPlugin], earlier: str, later: str
) -> Iterator[tuple[ResolvedPlugin, ResolvedPlugin]]:
    """Each pair (a, b) of plugins, a listed before b, whose classes set the contract attribute ``earlier``
    (a) and ``later`` (b)."""
    for at, first in enumerate(resolved):
        if getattr(first.cls, earlier):
            for second in resolved[at + 1 :]:
                if getattr(second.cls, later):
                    yield first, second
