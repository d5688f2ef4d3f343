"""What the app holds for its lifetime, passed explicitly to every route (``app.state.gateway``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.ops.series import LiveSeries
from gateway.ops.settings import Settings
from gateway.ops.stats import LiveStats
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.reload import Reloader
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services


@dataclass
class AppState:
    settings: Settings
    services: Services
    registry: PluginRegistry
    holder: RuntimeHolder
    #: Config reloads (admin API, SIGHUP, the file watcher, the pub/sub channel) and their history.
    reloader: Reloader
    #: The live figures the console's dashboard samples (``/admin/stats``).
    live_stats: LiveStats
    #: The last minutes of those figures, per model and worker, for the console's charts (``/admin/series``).
    live_series: LiveSeries
    draining: bool = False
    #: Managed engine workers (``gateway.engine``), when the gateway starts its own.
    engine: Any = None
    #: Services a route makes on first use (the Responses store, worker versions), by the route's own key.
    extras: dict[str, Any] = field(default_factory=dict)
