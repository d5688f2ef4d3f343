"""vLLM's utility routes, which tools call against a base URL: ``POST /tokenize``, ``POST /detokenize``
and ``GET /version``.

Tokenize and detokenize are answered by a worker of the model the body names (aliases resolved to the
served name, as on every endpoint; an unknown model is a 404 ``model_not_found``). They do not run the
request pipeline: they generate nothing, so there is nothing for tenancy to charge, for the cache to
keep, for guided JSON to enforce or for output safety to check, and the plugins' ``on_request`` hooks
assume an inference body. What does apply is who may call, how often and how much: the caller goes
through the plugins' ``on_models`` hook, the one through which tenancy authenticates a key and decides
which models it may use, exactly as ``GET /v1/models/{id}`` does (with tenancy on, a request without a
valid key is a 401 and a model the key may not use is a 404), then through ``on_side_request``, where
tenancy counts the request against the key's and tenant's request limits (a 429, no token charge) and
safety applies the model's size and count bounds (messages, prompt characters and tokens, body bytes).
A model the caller may not see is bounded by the default limits, as an unknown one, so the bounds tell
nothing about which models exist. The body passes the same allow-list as the inference endpoints (no
client-written ``chat_template``, no processor kwargs) and, for chat messages, the same media URL
check, since the worker would fetch those URLs to tokenize them.

``/version`` tells the gateway's version only: which models it serves is for callers who may list
them, and the vLLM version of each model's workers is on the admin API (``GET /admin/versions``,
``gateway.server.worker_versions``).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.pipeline.config import AdapterModel
from gateway.pipeline.plugin import SideCall, SideRoute
from gateway.pipeline.services import Services
from gateway.proxy.lease import WorkerLease
from gateway.server.routes import JSON
from gateway.server.routes.models import model_card
from gateway.server.state import AppState
from gateway.upstream.client import UpstreamFailure
from gateway.wire.allowlist import ParamAllowList
from gateway.wire.errors import (
    InvalidRequest,
    PayloadTooLarge,
    ServerError,
    ServiceUnavailable,
    from_upstream,
    model_not_found,
)
from gateway.wire.media_urls import check_media_urls
from gateway.wire.openapi import DetokenizeRequest, TokenizeRequest, documented_body
from gateway.wire.protocol import header_dict, parse_body

router = APIRouter()


def gateway_version() -> str:
    try:
        return importlib.metadata.version("vllm-gateway")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@router.post("/tokenize", openapi_extra=documented_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    return await _relay(request, "tokenize")


@router.post("/detokenize", openapi_extra=documented_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    return await _relay(request, "detokenize")


async def _relay(request: Request, route: SideRoute) -> Response:
    state: AppState = request.app.state.gateway
    if not state.holder.loaded:
        raise ServerError("The gateway has no config loaded yet.", code="not_ready", status=503)
    raw = await _read_body(request, state.holder.current.config.limits.max_body_bytes)
    payload = parse_body(raw)
    name = payload.get("model")
    if name is None:
        raise InvalidRequest("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("'model' must be a non-empty string.", param="model")
    with state.holder.pin() as snapshot:
        limits = snapshot.config.limits
        ParamAllowList(limits.extra_params, max_n=limits.max_n).check(route, payload)
        messages = payload.get("messages")
        if route == "tokenize" and isinstance(messages, list):
            check_media_urls(messages)
        headers = header_dict(request.scope["headers"])
        model = snapshot.models.resolve(name)
        cards = [] if model is None else [model_card(name, model, int(snapshot.loaded_at))]
        visible = await snapshot.pipeline.run_models(headers, cards)  # the caller first (401 without a key)
        seen = model.name if model is not None and visible else None
        await snapshot.pipeline.run_side(SideCall(route, headers, seen, payload, raw))
        if model is None or not visible:
            raise model_not_found(name)  # unknown, or this caller may not use it: the same answer
        base = snapshot.models.resolve(model.base) if isinstance(model, AdapterModel) else None
        # An adapter tokenizes as its base model: any worker has that, loaded adapter or not.
        payload["model"] = (base or model).upstream_name
        urls = snapshot.models.worker_urls[model.name]
        status, body = await call_worker(state.services, state.services.workers.expand(urls), f"/{route}", payload)
    if status != 200:
        raise from_upstream(status, body)
    return Response(body, media_type="application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` (never read whole first)."""
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(
                f"The request body is larger than this gateway accepts ({limit} bytes).", code="request_too_large"
            )
        parts.append(part)
    return b"".join(parts)


async def call_worker(services: Services, urls: list[str], path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
    """POST to the least busy available worker; on a failure before any answer, the next one."""
    table = services.workers
    candidates = sorted((table.get(url) for url in urls), key=lambda w: w.in_flight)
    candidates = [w for w in candidates if w.available()]
    if not candidates:
        raise ServiceUnavailable(
            "No healthy worker serves this model right now; try again shortly.",
            code="no_healthy_worker",
            headers={"retry-after": "1"},
        )
    body = orjson.dumps(payload)
    error: UpstreamFailure | None = None
    for worker in candidates:
        with WorkerLease(worker, None, table, None) as lease:  # no verdict on success: it generates nothing
            try:
                upstream = await services.upstream.open(worker.url, path, body)
                answer = await upstream.read()
            except UpstreamFailure as failure:
                table.report_failure(worker, failure.kind)
                error = failure
                if failure.retryable:
                    continue
                raise failure.error from None
            lease.declined()
        return upstream.status, answer
    assert error is not None
    raise error.error


@router.get("/version")
async def version() -> JSON:
    """``{"version": <gateway>}``: the gateway's own version, nothing about its models or workers (the
    workers' vLLM versions are on the admin API, ``GET /admin/versions``)."""
    return JSON({"version": gateway_version()})
