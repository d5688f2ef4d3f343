"""Model routing across workers: load-aware policies, prefix and session affinity, health-aware
retries with a budget, canary weights and fallbacks, admission control, and DNS discovery.

The entry point ``plugins.routing:RoutingPlugin`` is the plugin; the modules are its parts:
``config`` (its config section), ``policies`` (choosing a worker), ``plan`` (the core's RoutePlan),
``admission`` (limits and the priority queue), ``canary`` (weighted targets and fallbacks),
``discovery`` (``dns://`` refs), ``workerload`` (optional /metrics scraping), ``telemetry`` (state
and metrics shared across reloads).
"""

from plugins.routing.plugin import RoutingPlugin

__all__ = ["RoutingPlugin"]
