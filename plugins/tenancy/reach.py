"""Which models a request for a model may end up on: the routing section's canary targets and
fallbacks, followed transitively. Tenancy reserves for the longest context among them."""

from __future__ import annotations

from typing import Any

from gateway.pipeline.config import GatewayConfig


def reachable(config: GatewayConfig, models: list[str]) -> dict[str, set[str]]:
    """Each model and every model a request for it may be moved to by the routing section (canary
    targets and fallbacks, followed transitively). Read from the raw section: routing owns its schema."""
    section: dict[str, Any] = next((p.config for p in config.plugins if p.name == "routing" and p.enabled), {})
    default = section.get("default") or {}
    per_model = section.get("models") or {}
    moves: dict[str, set[str]] = {}
    for name in models:
        routing = per_model.get(name) or default
        moves[name] = set(routing.get("targets") or {}) | set(routing.get("fallbacks") or [])
    out: dict[str, set[str]] = {}
    for name in models:
        seen, todo = {name}, [name]
        while todo:
            for nxt in moves.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        out[name] = seen
    return out
