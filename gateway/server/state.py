"""What the app holds for its lifetime, passed explicitly to every route (``app.state.gateway``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.ops.settings import Settings
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services


@dataclass
class AppState:
    settings: Settings
    services: Services
    registry: PluginRegistry
    holder: RuntimeHolder
    draining: bool = False
    #: Managed engine workers (``gateway.engine``), when the gateway starts its own.
    engine: Any = None
    extras: dict[str, Any] = field(default_factory=dict)
