"""Liveness, readiness and metrics.

What the public port shows is what a load balancer, an HPA or Prometheus needs, and nothing about who
calls or what is served: ``/ready`` answers its status only, ``/metrics`` leaves out the series marked
private (per-tenant and per-key). The admin view (the models in ``/ready``, every series in
``/metrics``) is served on the admin port (``GATEWAY_ADMIN_PORT``) and, on the public port, to a caller
with the admin token; a caller presenting any other credential gets the admin API's 401/403.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.server.admin_auth import check_admin, presented_token
from gateway.server.routes import JSON
from gateway.server.state import AppState

router = APIRouter()

#: Set on the admin app's state: everything it serves is the admin view.
ADMIN_VIEW = "admin_view"


def admin_view(request: Request) -> bool:
    """Whether this caller gets the admin view (see the module docstring)."""
    if getattr(request.app.state, ADMIN_VIEW, False):
        return True
    token = presented_token(request)
    if token is None:
        return False
    state: AppState = request.app.state.gateway
    check_admin(state.settings.admin_token, token)
    return True


@router.get("/health", include_in_schema=True)
async def health() -> JSON:
    """Liveness: the process answers. Never depends on workers or Redis."""
    return JSON({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSON:
    """Readiness: a config is loaded, the gateway is not draining, and every model has a healthy worker."""
    state: AppState = request.app.state.gateway
    full = admin_view(request)
    if state.draining:
        return JSON({"status": "draining"}, status_code=503)
    if not state.holder.loaded:
        return JSON({"status": "no config"}, status_code=503)
    snapshot = state.holder.current
    workers = state.services.workers
    models = {}
    ready = True
    for model in snapshot.models.models:
        urls = workers.expand(snapshot.models.worker_urls[model.name])
        healthy = [u for u in urls if workers.get(u).available()]
        models[model.name] = {"workers": len(urls), "healthy": len(healthy)}
        ready = ready and bool(healthy)
    body: dict[str, object] = {"status": "ready" if ready else "not ready"}
    if full:
        body.update(config_version=snapshot.version, models=models)
    return JSON(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.gateway
    full = admin_view(request)
    return Response(render_metrics(state, private=full), media_type=state.services.metrics.content_type)


def render_metrics(state: AppState, *, private: bool) -> bytes:
    """The exposition text, worker health as of now; ``private``: the admin view (every series)."""
    state.services.metrics.set_worker_health({w.url: w.available() for w in state.services.workers.all()})
    return state.services.metrics.render(private=private)
