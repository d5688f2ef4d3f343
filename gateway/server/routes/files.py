"""The Files API (``/v1/files``): upload (multipart, ``purpose: "batch"``), list, retrieve, content and
delete, in OpenAI's shapes, per caller scope (``gateway.batch.service``): another caller's file is a 404
exactly like an unknown one.

An upload is streamed to the file store as it arrives, bounded by ``batches.max_file_bytes`` while it is
read (a 413 ``file_too_large``, and nothing kept), and by what the caller's tenant may store
(``batches.max_tenant_bytes`` and ``max_tenant_files``: a 400 ``stored_bytes_exceeded`` or
``stored_files_exceeded``, and nothing kept); the caller is authenticated before a byte is read.

Every call, of this API and the Batch API, is metered first like any other route without inference (the
plugins' ``on_side_request``: tenancy counts it against the key's and the tenant's request limits, a 429
past them, and answers 401 without a valid key).

A file's content is served as ``application/octet-stream`` with ``X-Content-Type-Options: nosniff``: what a
tenant wrote is never run as a script nor shown as a page of the gateway's origin.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from starlette.responses import StreamingResponse

from gateway.batch.files import UPLOAD_PURPOSES, FileTooLarge
from gateway.batch.service import BatchService, file_not_found
from gateway.pipeline.plugin import SideCall, SideRoute
from gateway.pipeline.runtime import RuntimeHolder
from gateway.server.multipart import FormReader
from gateway.server.routes import JSON
from gateway.wire.batch_openapi import FILE_ID_PATTERN, FILES_CREATE_DOC
from gateway.wire.errors import InvalidRequest, NotFound
from gateway.wire.protocol import decimal, header_dict

router = APIRouter()
SERVICE_KEY = "batches"
_FORM_SLACK = 64 * 1024  # multipart framing and small fields beside the file itself
FileId = Annotated[str, Path(json_schema_extra={"pattern": FILE_ID_PATTERN})]
#: A file's content is a tenant's bytes: a browser must not sniff them into a script or a page of this origin
#: (where the operator console may be served, whose policy allows this origin's scripts).
_BYTES_ONLY = {"x-content-type-options": "nosniff"}


def service_of(request: Request) -> BatchService:
    service: BatchService | None = request.app.state.gateway.extras.get(SERVICE_KEY)
    if service is None:
        raise NotFound("The Files and Batch APIs are not enabled on this gateway (batches.enabled).",
                       code="not_enabled")  # fmt: skip
    return service


async def metered(request: Request, route: SideRoute) -> dict[str, str]:
    """The request's headers, once the plugins' ``on_side_request`` metered it as ``route`` (a 401 or a
    429 from tenancy), before anything is read, stored or listed."""
    headers = header_dict(request.scope["headers"])
    holder: RuntimeHolder = request.app.state.gateway.holder
    if holder.loaded:
        with holder.pin() as snapshot:
            await snapshot.pipeline.run_side(SideCall(route, headers))
    return headers


async def scope_of(request: Request, route: SideRoute) -> tuple[BatchService, str]:
    """The service and the caller's scope, once the call was metered as ``route``."""
    service = service_of(request)
    caller = await service.caller_of(await metered(request, route))
    return service, service.scope(caller)


def page(data: list[dict[str, Any]], has_more: bool) -> JSON:
    return JSON(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def limit_of(request: Request, default: int, most: int) -> int:
    limit = decimal(request.query_params.get("limit", str(default)))
    if limit is None or not 1 <= limit <= most:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {most}.", param="limit")
    return limit


@router.post("/v1/files", openapi_extra=FILES_CREATE_DOC)
async def create_file(request: Request) -> JSON:
    service, scope = await scope_of(request, "files.create")
    limit = service.config.max_file_bytes
    declared = decimal(request.headers.get("content-length", ""))
    if declared is not None and declared > limit + _FORM_SLACK:
        raise FileTooLarge(limit)
    form = FormReader(request.headers.get("content-type", ""))
    stored = await service.files.store(form.file_pieces(request.stream()), scope=scope, declared=declared)
    purpose = form.fields.get("purpose")
    problem = None
    if form.filename is None:
        problem = InvalidRequest("The upload has no 'file' part.", param="file")
    elif purpose not in UPLOAD_PURPOSES:
        problem = InvalidRequest(f"'purpose' must be one of {', '.join(UPLOAD_PURPOSES)}.", param="purpose")
    if problem is not None:
        await service.files.discard(stored)
        raise problem
    assert form.filename is not None and purpose is not None
    return JSON(await service.files.register(scope, stored, form.filename, purpose))


@router.get("/v1/files")
async def list_files(request: Request) -> JSON:
    service, scope = await scope_of(request, "files.list")
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
    limit = limit_of(request, 10000, 10000)
    data, more = await service.files.listing(
        scope, purpose=query.get("purpose"), limit=limit, after=query.get("after"), order=order
    )
    return page(data, more)


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: FileId) -> JSON:
    service, scope = await scope_of(request, "files.retrieve")
    obj = await service.files.get(scope, file_id)
    if obj is None:
        raise file_not_found(file_id)
    return JSON(obj)


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: FileId) -> StreamingResponse:
    service, scope = await scope_of(request, "files.content")
    if await service.files.get(scope, file_id) is None:
        raise file_not_found(file_id)
    pieces = service.files.content(file_id)
    try:
        first = await anext(pieces, b"")  # a file missing from the store is a 404 before headers go out
    except FileNotFoundError:
        raise file_not_found(file_id) from None

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="application/octet-stream", headers=_BYTES_ONLY)


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: FileId) -> JSON:
    service, scope = await scope_of(request, "files.delete")
    if not await service.files.delete(scope, file_id):
        raise file_not_found(file_id)
    return JSON({"id": file_id, "object": "file", "deleted": True})
