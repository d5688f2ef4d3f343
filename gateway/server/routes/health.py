"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.server.routes import JSON
from gateway.server.state import AppState

router = APIRouter()


@router.get("/health", include_in_schema=True)
async def health() -> JSON:
    """Liveness: the process answers. Never depends on workers or Redis."""
    return JSON({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSON:
    """Readiness: a config is loaded, the gateway is not draining, and every model has a healthy worker."""
    state: AppState = request.app.state.gateway
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
    body = {"status": "ready" if ready else "not ready", "config_version": snapshot.version, "models": models}
    return JSON(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.gateway
    state.services.metrics.set_worker_health({w.url: w.available() for w in state.services.workers.all()})
    return Response(state.services.metrics.render(), media_type=state.services.metrics.content_type)
