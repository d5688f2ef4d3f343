"""Weighted targets (a canary: 90% of a model's traffic to itself, 10% to a new version) and fallback
chains (the models tried, in order, when one has no healthy worker or fails before the first byte)."""

from __future__ import annotations

import bisect
import itertools
import random
from typing import TYPE_CHECKING

from plugins.routing.config import RoutingConfig

if TYPE_CHECKING:
    from gateway.pipeline.config import ModelConfig
    from gateway.pipeline.context import RequestContext


class WeightedTargets:
    """Picks a model name with probability proportional to its weight (one random draw, one bisect)."""

    __slots__ = ("_bounds", "_names", "_rng", "_total")

    def __init__(self, weights: dict[str, float], rng: random.Random) -> None:
        items = [(name, w) for name, w in weights.items() if w > 0]
        self._names = [name for name, _ in items]
        self._bounds = list(itertools.accumulate(w for _, w in items))
        self._total = self._bounds[-1] if self._bounds else 0.0
        self._rng = rng

    def pick(self) -> str:
        if len(self._names) == 1:
            return self._names[0]
        index = bisect.bisect_right(self._bounds, self._rng.random() * self._total)
        return self._names[min(index, len(self._names) - 1)]


def fallback_chain(model: str, config: RoutingConfig, known: set[str]) -> list[str]:
    """``model`` followed by its configured fallbacks that exist, each once, never itself."""
    chain = [model]
    for name in config.for_model(model).fallbacks:
        if name in known and name not in chain:
            chain.append(name)
    return chain


def unknown_references(config: RoutingConfig, known: set[str]) -> list[str]:
    """Model names the routing config mentions that the model table does not define."""
    problems = []
    for model, routing in config.models.items():
        where = f"routing.models.{model}"
        if model not in known:
            problems.append(f"{where}: no model named '{model}' in models:")
        problems += [f"{where}.targets: unknown model '{t}'" for t in routing.targets if t not in known]
        problems += [f"{where}.fallbacks: unknown model '{f}'" for f in routing.fallbacks if f not in known]
    return problems


def retarget(ctx: RequestContext, model: ModelConfig) -> None:
    """Serve ``ctx`` with ``model`` from now on: the body names the model its workers know."""
    ctx.model = model
    if ctx.body.get("model") != model.upstream_name:
        ctx.body["model"] = model.upstream_name
        ctx.mark_body_changed()
