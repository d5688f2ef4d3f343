"""The batch lane as one service with the app's lifetime: files, jobs, the shared work and this
replica's runner, built from the config the gateway started with (``batches:``; its store settings take
effect on restart, its capacity settings at once) and the process-wide services.

Callers are told apart by ``services.shared[CALLER_OF]`` (the access-control plugin's, e.g. tenancy),
else by ``TENANT_OF``; without either every caller is one anonymous scope. A scope sees only its own
files and batches.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.batch.blobs import BlobStore, DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import InputsFull, Jobs, TooManyActive
from gateway.batch.lifecycle import DEFAULT_MAX_BODY_BYTES, Lifecycle
from gateway.batch.lines import ENDPOINTS
from gateway.batch.metrics import BatchMetrics
from gateway.batch.runner import Runner, replica_id
from gateway.batch.submit import Submitter
from gateway.batch.work import Work
from gateway.pipeline.batch_config import CALLER_OF, BatchesConfig, Caller
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import TENANT_OF, Services
from gateway.proxy.forward import Proxy
from gateway.wire.errors import InvalidRequest, NotFound, RateLimited


def file_not_found(file_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param=param, code="not_found")


def batch_not_found(batch_id: str) -> NotFound:
    return NotFound(f"No such Batch object: {batch_id}", param="batch_id", code="not_found")


class BatchService:
    def __init__(
        self, holder: RuntimeHolder, services: Services, config: BatchesConfig, blobs: BlobStore | None = None
    ) -> None:
        self.services, self.config = services, config
        timeout_s = config.redis_timeout_ms / 1000
        redis = services.redis(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
        self.files = Files(redis, blobs or DirectoryStore(config.files_dir), config)
        self.jobs = Jobs(redis, config)
        self.work = Work(redis, config, self.jobs.key)
        self.metrics = BatchMetrics(services.metrics)
        self.lifecycle = Lifecycle(
            self.jobs, self.files, self.work, config, replica_id(), self.metrics, lambda: _max_body_bytes(holder)
        )
        submitter = Submitter(holder, Proxy(services), services.metrics, config.engine_priority)
        self.runner = Runner(holder, services, self.jobs, self.work, self.lifecycle, submitter, self.metrics)

    async def caller_of(self, headers: dict[str, str]) -> Caller:
        """Who is calling (the plugin's 401 for bad credentials)."""
        caller_of = self.services.shared.get(CALLER_OF)
        if caller_of is not None:
            caller: Caller = await caller_of(headers)
            return caller
        tenant_of = self.services.shared.get(TENANT_OF)
        return Caller(await tenant_of(headers)) if tenant_of is not None else Caller("")

    @staticmethod
    def scope(caller: Caller) -> str:
        return "t:" + caller.tenant if caller.tenant else "shared"

    async def create_batch(self, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        caller = await self.caller_of(headers)
        scope = self.scope(caller)
        input_file_id, endpoint, metadata = _create_fields(body)
        source = await self.files.get(scope, input_file_id)
        if source is None:
            raise file_not_found(input_file_id, param="input_file_id")
        if source["purpose"] != "batch":
            raise InvalidRequest(
                f"The file '{input_file_id}' was not uploaded with purpose 'batch'.", param="input_file_id"
            )
        await self._check_storage(scope)
        most = self.config.max_active_batches
        bounds: dict[str, Any] = {
            "most": most,
            "input_bytes": int(source["bytes"]),  # its lines in Redis take at most that
            "most_bytes": self.config.max_tenant_batch_bytes,
        }
        try:
            batch = await self.jobs.create(scope, caller, input_file_id, endpoint, metadata, **bounds)
        except TooManyActive:
            raise RateLimited(
                f"This tenant has {most} batches that are not finished, the most it may have; wait for one "
                "to finish or cancel one.",
                code="batch_limit_reached",
            ) from None
        except InputsFull as full:
            raise RateLimited(
                f"This tenant's unfinished batches hold {full.held} bytes of input in the gateway's work queue "
                f"and this one's input has {source['bytes']}: more than the "
                f"{self.config.max_tenant_batch_bytes} it may (batches.max_tenant_batch_bytes); wait for a "
                "batch to finish or cancel one.",
                code="batch_bytes_limit_reached",
            ) from None
        self.runner.wake()
        return batch

    async def _check_storage(self, scope: str) -> None:
        """Refuse a batch to a scope whose files fill its storage bound: the output and error files a batch
        writes are counted but never refused (``gateway.batch.usage``), so without this check batch after
        batch over one small input (each writing a large error file, for free) would store without limit.
        Checked here, a scope stores at most its bound plus the results of the batches it had running when
        it reached it (at most ``max_active_batches``). A 400, as an upload past the bound is: a retry
        gets the same answer until files are deleted or expire."""
        stored, files = await self.files.usage.stored(scope)
        if stored >= self.config.max_tenant_bytes:
            raise InvalidRequest(
                f"This tenant's files hold {stored} bytes, the most it may store (batches.max_tenant_bytes: "
                f"{self.config.max_tenant_bytes}), and a batch writes its results there; delete files it no "
                "longer needs (batch output files also expire on their own).",
                code="stored_bytes_exceeded",
            )
        if files >= self.config.max_tenant_files:
            raise InvalidRequest(
                f"This tenant stores {files} files, the most it may (batches.max_tenant_files: "
                f"{self.config.max_tenant_files}), and a batch writes its results as files; delete files it no "
                "longer needs (batch output files also expire on their own).",
                code="stored_files_exceeded",
            )

    async def cancel_batch(self, headers: dict[str, str], batch_id: str) -> dict[str, Any]:
        scope = self.scope(await self.caller_of(headers))
        if await self.jobs.get(scope, batch_id) is None:
            raise batch_not_found(batch_id)
        await self.cancel(batch_id, by_operator=False)
        batch = await self.jobs.get(scope, batch_id)
        assert batch is not None
        return batch

    async def cancel(self, batch_id: str, *, by_operator: bool) -> None:
        """Ask the runners to cancel the batch (its owner was checked, or an operator asks). Who asked is
        kept on the record (``_cancelled_by``): the owner's cancel bills the lines it cuts as a client
        that hung up, an operator's does not (``gateway.batch.runner``)."""
        record = await self.jobs.load(batch_id)
        if record is None:
            raise batch_not_found(batch_id)
        status = record["status"]
        if status in ("validating", "in_progress"):
            by = "operator" if by_operator else "owner"
            await self.jobs.move(
                batch_id, ("validating", "in_progress"), "cancelling", cancelling_at=int(time.time()), _cancelled_by=by
            )
            self.runner.wake()
        elif status not in ("cancelling", "cancelled"):
            raise InvalidRequest(
                f"Batch '{batch_id}' is {status} and can no longer be cancelled.",
                param="batch_id",
                code="batch_not_cancellable",
            )


def _max_body_bytes(holder: RuntimeHolder) -> int:
    """The live requests' body bound now (batch lines are held to it before they are parsed)."""
    return holder.current.config.limits.max_body_bytes if holder.loaded else DEFAULT_MAX_BODY_BYTES


def _create_fields(body: dict[str, Any]) -> tuple[str, str, dict[str, str] | None]:
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise InvalidRequest("'input_file_id' is required: the id of a file uploaded with purpose 'batch'.",
                             param="input_file_id")  # fmt: skip
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    if body.get("completion_window") != "24h":
        raise InvalidRequest("'completion_window' must be '24h'.", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None:
        ok = isinstance(metadata, dict) and len(metadata) <= 16
        ok = ok and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                        for k, v in metadata.items())  # fmt: skip
        if not ok:
            raise InvalidRequest("'metadata' holds at most 16 string pairs (keys up to 64, values up to 512 "
                                 "characters).", param="metadata")  # fmt: skip
    return input_file_id, endpoint, metadata
