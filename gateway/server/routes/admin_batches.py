"""Batches for operators, on the admin API (admin token required): what ``gateway batches`` and the
console show. Every tenant's batches, with their progress and throughput.

- ``GET /admin/batches?limit=N``: the newest batches (default 50), each as ``describe`` shows it.
- ``GET /admin/batches/{id}``: one batch.
- ``POST /admin/batches/{id}/cancel``: cancel it (as its owner's ``POST /v1/batches/{id}/cancel``, except
  that the lines it cuts midway are not charged to the owner).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request

from gateway.batch.jobs import public
from gateway.batch.service import BatchService, batch_not_found
from gateway.server.admin_auth import require_admin
from gateway.server.routes import JSON
from gateway.server.routes.files import limit_of, service_of

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], include_in_schema=False)


def describe(record: dict[str, Any], now: float) -> dict[str, Any]:
    """The OpenAI object with its owner (scope, and the key that created it when tenancy knows one), the
    models its lines name (None until it is validated), share done, lines waiting to run (``queued``, while
    it is in progress), and output tokens per second since it started."""
    obj = public(record)
    counts = obj["request_counts"]
    done = counts["completed"] + counts["failed"]
    caller = record.get("_caller") or {}
    started = record.get("in_progress_at")
    ended = record.get("completed_at") or record.get("expired_at") or record.get("cancelled_at") or now
    elapsed = max(ended - started, 1) if started else None  # whole seconds: a batch done within one counts one
    obj["owner"] = record["_scope"]
    obj["key_id"] = caller.get("key_id")
    obj["models"] = record.get("_models")
    obj["progress"] = round(done / counts["total"], 4) if counts["total"] else 0.0
    obj["queued"] = max(counts["total"] - done, 0) if obj["status"] == "in_progress" else 0
    obj["output_tokens_per_s"] = round(record.get("n_output_tokens", 0) / elapsed, 2) if elapsed else None
    return obj


async def _record(service: BatchService, batch_id: str) -> dict[str, Any]:
    record = await service.jobs.load(batch_id)
    if record is None:
        raise batch_not_found(batch_id)
    return record


@router.get("/batches")
async def list_batches(request: Request) -> JSON:
    service = service_of(request)
    now = time.time()
    records = await service.jobs.recent(limit_of(request, 50, 1000))
    return JSON({"object": "list", "data": [describe(r, now) for r in records]})


@router.get("/batches/{batch_id}")
async def show_batch(request: Request, batch_id: str) -> JSON:
    return JSON(describe(await _record(service_of(request), batch_id), time.time()))


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> JSON:
    service = service_of(request)
    await service.cancel(batch_id, by_operator=True)
    return JSON(describe(await _record(service, batch_id), time.time()))
