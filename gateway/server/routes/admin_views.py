"""What the operator console reads, on the admin API (admin token required, like every ``/admin`` route).

- ``GET /admin/stats``: live figures by model over the last seconds (``gateway.ops.stats``).
- ``GET /admin/series``: the last minutes of those figures by model, and of each worker's in-flight
  requests and errors, sampled on a timer into bounded rings (``gateway.ops.series``).
- ``GET /admin/workers``: each model's requests in flight and queued, and its workers: health, in
  flight, ejections, the last error, the upstream failures counted per worker and kind since start, and
  the KV blocks indexed from its events and its recent prefix-cache hit rate as its responses reported it
  (None when its events are not followed), the LoRA adapters it holds (``adapters``: name, pinned, requests
  using it, seconds since last use, or ``loading``).
- ``GET /admin/versions``: the gateway's version and, per model, the vLLM version its workers report
  (the public ``/version`` names the gateway's only).
- ``GET /admin/reloads``: the running version and the last reloads, newest first (when, who, source,
  accepted/unchanged/refused, reason).
- ``POST /admin/config/diff``: a candidate config (YAML or JSON body) validated without going live
  (the config models and every plugin's config) and compared with the running one, both redacted. A
  candidate that fails validation answers 200 with ``valid: false`` and the problems: checking is the
  point of the call. ``PUT /admin/config`` then loads it.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from gateway.pipeline.config import ConfigError, GatewayConfig, parse_config
from gateway.pipeline.config_diff import config_diff
from gateway.pipeline.reload import Reloader
from gateway.pipeline.validate import resolve_plugins
from gateway.server.admin_auth import require_admin
from gateway.server.routes import JSON
from gateway.server.routes.admin import describe, redact
from gateway.server.routes.utility import gateway_version
from gateway.server.state import AppState
from gateway.server.worker_versions import model_versions
from gateway.upstream.workers import WorkerTable
from gateway.wire.errors import InvalidRequest, PayloadTooLarge, ServiceUnavailable

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], include_in_schema=False)


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.gateway
    return state


@router.get("/stats")
async def stats(request: Request) -> JSON:
    state = _state(request)
    body = state.live_stats.sample()
    body["config_version"] = state.holder.current.version if state.holder.loaded else None
    return JSON(body)


@router.get("/series")
async def series(request: Request) -> JSON:
    live = _state(request).live_series
    return JSON(live.as_json())


_GAUGES = {"gateway_in_flight_requests": "in_flight", "gateway_queued_requests": "queued"}


def _read_metrics(state: AppState) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(worker -> upstream failures by kind since start, model -> in flight and queued now)."""
    errors: dict[str, dict[str, float]] = {}
    load: dict[str, dict[str, float]] = {}
    for family in state.services.metrics.collect():
        if family.name.removesuffix("_total") == "gateway_upstream_errors":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    kinds = errors.setdefault(sample.labels["worker"], {})
                    kinds[sample.labels["kind"]] = kinds.get(sample.labels["kind"], 0.0) + sample.value
        elif family.name in _GAUGES:
            field = _GAUGES[family.name]
            for sample in family.samples:
                row = load.setdefault(sample.labels["model"], {})
                row[field] = row.get(field, 0.0) + sample.value
    return errors, load


def _hit_rate(table: WorkerTable, url: str) -> float | None:
    """The worker's recent share of prompt tokens reported cached (checked precise_prefix requests)."""
    state = table.kv.workers.get(url) if "kv" in table.__dict__ else None
    return state.hit_rate if state is not None else None


@router.get("/workers")
async def workers(request: Request) -> JSON:
    state = _state(request)
    if not state.holder.loaded:
        raise ServiceUnavailable("The gateway has no config loaded yet.", code="not_ready")
    snapshot = state.holder.current
    table = state.services.workers
    errors, load = _read_metrics(state)
    now = time.monotonic()
    models = []
    for model in snapshot.models.models:
        rows = []
        for url in table.expand(snapshot.models.worker_urls[model.name]):
            worker = table.get(url)
            rows.append(
                {
                    "url": url,
                    "healthy": worker.healthy,
                    "available": worker.available(now),
                    "in_flight": worker.in_flight,
                    "ejections": worker.ejections,
                    "ejected_for_s": max(worker.ejected_until - now, 0.0),
                    "consecutive_failures": worker.consecutive_failures,
                    "last_error": worker.last_error,
                    "checked_ago_s": now - worker.checked_at if worker.checked_at else None,
                    "errors": errors.get(url, {}),
                    # KV blocks indexed from the worker's events (routing's precise_prefix follows them)
                    "kv_blocks": table.kv_blocks(url),
                    "kv_hit_rate": _hit_rate(table, url),
                    "adapters": worker.adapters.describe(now),
                }
            )
        now_load = load.get(model.name, {})
        models.append(
            {
                "model": model.name,
                "in_flight": int(now_load.get("in_flight", 0)),
                "queued": int(now_load.get("queued", 0)),
                "workers": rows,
            }
        )
    return JSON({"models": models})


def _reloader(request: Request) -> Reloader:
    return _state(request).reloader


@router.get("/versions")
async def versions(request: Request) -> JSON:
    """``{"version": <gateway>, "vllm": {<model>: <version or null>}}``."""
    return JSON({"version": gateway_version(), "vllm": await model_versions(_state(request))})


@router.get("/reloads")
async def reloads(request: Request) -> JSON:
    state = _state(request)
    reloader = _reloader(request)
    running = describe(state.holder.current, reloader.source) if state.holder.loaded else None
    return JSON(
        {
            "version": running["version"] if running else None,
            "loaded_at": running["loaded_at"] if running else None,
            "source": reloader.source,
            "reloads": [event.as_json() for event in reloader.history.latest()],
        }
    )


def candidate_view(config: GatewayConfig, validated: dict[int, BaseModel]) -> dict[str, Any]:
    """The candidate as ``describe`` shows the running config: plugin sections by their validated
    models (secret fields masked), then redacted."""
    tree = config.model_dump(mode="json")
    for index, entry in enumerate(tree.get("plugins", [])):
        if index in validated:
            entry["config"] = validated[index].model_dump(mode="json")
    redacted: dict[str, Any] = redact(tree)
    return redacted


@router.post("/config/diff")
async def diff(request: Request) -> JSON:
    state = _state(request)
    if not state.holder.loaded:
        raise ServiceUnavailable("The gateway has no config loaded yet.", code="not_ready")
    limit = state.holder.current.config.limits.max_body_bytes
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise PayloadTooLarge(f"A config larger than {limit} bytes is not accepted.", code="request_too_large")
    if not body.strip():
        raise InvalidRequest("Send the candidate config (YAML or JSON) as the request body.", code="config_invalid")
    running = describe(state.holder.current, _reloader(request).source)
    try:
        candidate = parse_config(body, source="candidate")
        resolved = resolve_plugins(candidate, state.registry)
    except ConfigError as exc:
        return JSON({"valid": False, "problems": exc.problems, "running_version": running["version"], "diff": []})
    view = candidate_view(candidate, {item.index: item.config for item in resolved})
    return JSON(
        {
            "valid": True,
            "problems": [],
            "running_version": running["version"],
            "diff": config_diff(running["config"], view),
        }
    )
