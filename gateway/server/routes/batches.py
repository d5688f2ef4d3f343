"""The Batch API (``/v1/batches``): create, retrieve, list (``after``/``limit``) and cancel, in OpenAI's
shapes, per caller scope: another caller's batch is a 404 exactly like an unknown one. Each call is metered
first, as the Files API's are (``gateway.server.routes.files``); the lines a batch runs are metered as
inference requests, by the runner (``gateway.batch``), whose work it is."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from gateway.batch.service import batch_not_found
from gateway.server.routes import JSON
from gateway.server.routes.files import limit_of, metered, page, scope_of, service_of
from gateway.wire.batch_openapi import BATCH_ID_PATTERN, BATCHES_CREATE_DOC
from gateway.wire.errors import PayloadTooLarge
from gateway.wire.protocol import parse_body

router = APIRouter()
_MAX_CREATE_BYTES = 64 * 1024
BatchId = Annotated[str, Path(json_schema_extra={"pattern": BATCH_ID_PATTERN})]


@router.post("/v1/batches", openapi_extra=BATCHES_CREATE_DOC)
async def create_batch(request: Request) -> JSON:
    service = service_of(request)
    headers = await metered(request, "batches.create")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > _MAX_CREATE_BYTES:
            raise PayloadTooLarge(f"A batch creation body is at most {_MAX_CREATE_BYTES} bytes.",
                                  code="request_too_large")  # fmt: skip
    return JSON(await service.create_batch(headers, parse_body(raw)))


@router.get("/v1/batches")
async def list_batches(request: Request) -> JSON:
    service, scope = await scope_of(request, "batches.list")
    data, more = await service.jobs.listing(scope, after=request.query_params.get("after"),
                                         limit=limit_of(request, 20, 100))  # fmt: skip
    return page(data, more)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: BatchId) -> JSON:
    service, scope = await scope_of(request, "batches.retrieve")
    batch = await service.jobs.get(scope, batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    return JSON(batch)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: BatchId) -> JSON:
    service = service_of(request)
    return JSON(await service.cancel_batch(await metered(request, "batches.cancel"), batch_id))
