"""Shared by the batch tests: a unique Redis prefix and files directory per test, the ``batches:``
section for them, input files as JSONL, a batch in progress made directly, and waiting for a batch to
reach a status through the SDK."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis

from gateway.batch.jobs import Jobs
from gateway.batch.work import Work
from gateway.pipeline.batch_config import Caller


@pytest.fixture
def batch_names(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``{"prefix": <Redis prefix>, "dir": <files directory>}``; the prefix's keys are deleted afterwards."""
    prefix = f"test:batch:{uuid.uuid4().hex[:12]}"
    yield {"prefix": prefix, "dir": tmp_path / "files"}
    client = redis.Redis()
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def batches_section(names: dict[str, Any], **extra: Any) -> dict[str, Any]:
    section = {
        "files_dir": str(names["dir"]),
        "redis_prefix": names["prefix"],
        "poll_interval_s": 0.05,
        "lease_s": 2,
        "worker_max_in_flight": 8,
    }
    section.update(extra)
    return section


async def batch_in_progress(jobs: Jobs, work: Work, lines: list[bytes]) -> str:
    """A new batch whose ``lines`` are loaded (to run in their order) and which is in progress: its id."""
    batch = await jobs.create("shared", Caller(""), "file-x", "/v1/chat/completions", None)
    await work.load_lines(batch["id"], lines, list(range(len(lines))))
    assert await jobs.move(batch["id"], ("validating",), "in_progress", n_total=len(lines))
    return str(batch["id"])


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines)


def chat_line(custom_id: str, text: str, model: str = "m1", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": text}], **body},
    }


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 60) -> Any:
    """Poll ``batches.retrieve`` until the batch is in one of ``statuses`` (a bound, not an assertion of speed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} (waiting for {statuses}): {batch}")
        time.sleep(0.05)


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def start(client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions") -> Any:
    """Upload ``lines`` as a batch input file and create a batch of them (24 h window)."""
    source = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
