"""A batch's two one-off steps, each safe to run again by another replica if the first one died:

- ``validate``: read the input file, write its lines into the shared work (``gateway.batch.work``) in run
  order, write malformed lines off to the error results, and move the batch to ``in_progress`` (or
  ``failed`` with ``errors`` for an input that is no batch); the models its lines name are kept on it
  (``_models``, for operators).
- ``finalize``: write off what was not done (``batch_expired``, ``batch_cancelled``), write the output
  and error files, and move the batch to its final status. The files' ids are derived from the batch
  id, so a finalization taken over writes the same files again rather than new ones.

Each holds a lock in Redis (``gateway.batch.step_lock``: ``lease_s``, renewed while the step runs) so
replicas do not both do it at once; a step that lost its lock (its replica stalled past the lease) stops
before its next write: loading the lines, writing a file, moving the batch. The steps are idempotent all the
same (lines are loaded once, results written once, files replaced), so a step run twice costs only
repeated work.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from gateway.batch.files import Files
from gateway.batch.jobs import FINAL, Jobs
from gateway.batch.lines import Parsed, error_line, line_bound, parse_input
from gateway.batch.metrics import BatchMetrics
from gateway.batch.step_lock import StepLock, hold
from gateway.batch.work import ResultsGone, Work
from gateway.pipeline.batch_config import BatchesConfig

_LEFTOVER = {
    "expired": ("batch_expired", "This line was not run before the batch's completion window ended."),
    "cancelled": ("batch_cancelled", "This line was not run before the batch was cancelled."),
}
MODELS_SHOWN = 16
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # limits.max_body_bytes's default, before a config is loaded
_INPUT_GONE = {"code": "invalid_input_file", "message": "The input file is gone.", "param": None, "line": None}


def result_file_id(batch_id: str, part: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}:{part}".encode()).hexdigest()[:24]


class Lifecycle:
    def __init__(
        self,
        jobs: Jobs,
        files: Files,
        work: Work,
        config: BatchesConfig,
        owner: str,
        metrics: BatchMetrics,
        max_body_bytes: Callable[[], int] = lambda: DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        """``max_body_bytes``: the live config's ``limits.max_body_bytes`` now; a line longer than its
        ``line_bound`` is never parsed (``gateway.batch.lines``)."""
        self.jobs, self.files, self.work, self.config, self.owner = jobs, files, work, config, owner
        self.metrics, self.max_body_bytes = metrics, max_body_bytes

    def _hold(self, batch_id: str, step: str) -> contextlib.AbstractAsyncContextManager[StepLock | None]:
        return hold(self.jobs.redis, self.work.key(batch_id, step + "-lock"), self.config.lease_s, self.owner)

    async def validate(self, batch_id: str, record: dict[str, Any]) -> None:
        async with self._hold(batch_id, "validate") as lock:
            if lock is not None:
                await self._validate(batch_id, record, lock)

    async def _validate(self, batch_id: str, record: dict[str, Any], lock: StepLock) -> None:
        now = int(time.time())
        source = await self.files.get(record["_scope"], record["input_file_id"])
        if source is None or source["purpose"] != "batch":
            await self.jobs.move(batch_id, ("validating",), "failed", errors=_errors([_INPUT_GONE]), failed_at=now)
            return
        try:
            pieces, endpoint = self.files.content(source["id"]), record["endpoint"]
            parsed = await parse_input(pieces, endpoint, self.config.max_lines, self.max_body_bytes())
        except FileNotFoundError:  # deleted as it was read, or missing from this replica's file store
            parsed = None
        if not await lock.held():  # taken over while the input was read: the replica holding it validates
            return
        if parsed is None or parsed.errors:
            errors = parsed.errors if parsed is not None else [_INPUT_GONE]
            await self.jobs.move(batch_id, ("validating",), "failed", errors=_errors(errors), failed_at=now)
            return
        # The total is counted before any line can be written off: a cancel (or the window passing) while
        # this validation ran finalizes the lines loaded here, and the counts never show more lines
        # failed than the batch has. Once the batch is final, it is too late to load any.
        if not await self.jobs.update(batch_id, ("validating", "cancelling"), n_total=len(parsed.lines)):
            return
        await self.work.load_lines(batch_id, parsed.lines, parsed.run_order())
        for index, custom_id, code, message in parsed.malformed:
            line = error_line(custom_id, code, f"Line {index + 1}: {message}")
            await self.work.record(batch_id, index, line, ok=False, tokens=(0, 0), owner="")
        if not await lock.held():
            return
        moved = await self.jobs.move(
            batch_id,
            ("validating",),
            "in_progress",
            in_progress_at=int(time.time()),
            _models=models_of(parsed),
        )
        if not moved:  # cancelled or expired meanwhile; if it was finalized too, nobody else drops this work
            current = await self.jobs.load(batch_id)
            if current is None or current["status"] in FINAL:
                await self.work.drop(batch_id)

    async def finalize(self, batch_id: str, record: dict[str, Any], final: str) -> bool:
        """Move the batch to ``final`` (completed, expired or cancelled); False when another replica
        holds the step or the batch moved on meanwhile."""
        async with self._hold(batch_id, "finalize") as lock:
            return lock is not None and await self._finalize(batch_id, record, final, lock)

    async def _finalize(self, batch_id: str, record: dict[str, Any], final: str, lock: StepLock) -> bool:
        if final == "completed":
            moved = await self.jobs.move(batch_id, ("in_progress",), "finalizing", finalizing_at=int(time.time()))
            if not moved and record["status"] != "finalizing":
                return False
        else:
            if final == "expired":  # still in_progress: no other replica's run may change a result from here
                await self.jobs.seal(batch_id)
            code, message = _LEFTOVER[final]
            bound = line_bound(self.max_body_bytes())
            for index, raw in await self.work.remaining(batch_id):
                # a line is loaded only within the bound; one past today's (the limit lowered since) is not
                # parsed for its custom_id: written off under its place in the file
                custom_id = orjson.loads(raw)["custom_id"] if len(raw) <= bound else None
                line = error_line(custom_id, code, message)
                await self.work.record(batch_id, index, line, ok=False, tokens=(0, 0), owner="")
        scope = record["_scope"]
        fields: dict[str, Any] = {f"{final}_at": int(time.time())}
        for part, name in (("out", "output"), ("err", "error")):
            count = await self.work.count(batch_id, part)  # nothing replaces a result from here: it holds
            if not await lock.held():  # taken over: the replica holding it writes the files and moves on
                return False
            if count:
                file_id = result_file_id(batch_id, part)
                filename = f"{batch_id}_{name}.jsonl"
                pieces = _jsonl(self.work.results(batch_id, part, count))
                try:
                    await self.files.create(scope, filename, "batch_output", pieces, file_id=file_id)
                except ResultsGone:  # finalized meanwhile by a replica that took the step over: its files stand
                    return False
                fields[f"{name}_file_id"] = file_id
        allowed = ("validating", "in_progress", "finalizing", "cancelling")
        if not await lock.held():
            return False
        await self.work.expire(batch_id, self.config.output_ttl_s)  # a final batch's work is nobody's to drop
        moved = await self.jobs.move(batch_id, allowed, final, **fields)
        if moved:  # once final, no run replaces an error any more: the ones a run could have are final now
            self.metrics.line_final("failed", await self.work.unsettled(batch_id))
            await self.work.drop(batch_id)
        return moved


def models_of(parsed: Parsed, most: int = MODELS_SHOWN) -> list[str]:
    """The models the batch's lines name, as written (sorted, at most ``most``, each cut to 200 characters):
    what operators see of a batch's model. Not part of the OpenAI object."""
    return sorted({model[:200] for model, _ in parsed.keys if model})[:most]


def _errors(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": data}


async def _jsonl(lines: AsyncIterator[bytes], per_piece: int = 256) -> AsyncIterator[bytes]:
    """The lines as JSONL, ``per_piece`` lines to a write."""
    piece: list[bytes] = []
    async for line in lines:
        piece.append(line + b"\n")
        if len(piece) >= per_piece:
            yield b"".join(piece)
            piece = []
    if piece:
        yield b"".join(piece)
