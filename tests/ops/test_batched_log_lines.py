"""gateway/ops/logs.py BatchedLineHandler: JSON lines written in batches of whole lines, never torn."""

from __future__ import annotations

import io
import logging
import os
import time
from typing import Any

import orjson
import pytest

from gateway.ops import logs
from gateway.ops.logs import ATOMIC_WRITE_BYTES, BatchedLineHandler, JSONFormatter


def record(msg: str, level: int = logging.INFO, **fields: Any) -> logging.LogRecord:
    rec = logging.LogRecord("gateway.access", level, __file__, 0, msg, (), None)
    rec.fields = fields
    return rec


@pytest.fixture
def pipe() -> Any:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    writer = os.fdopen(write_fd, "w")
    yield read_fd, writer
    writer.close()
    os.close(read_fd)


def read_available(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def handler_for(stream: Any, **kwargs: Any) -> BatchedLineHandler:
    handler = BatchedLineHandler(stream, **kwargs)
    handler.setFormatter(JSONFormatter())
    return handler


def test_info_lines_wait_for_the_batch_and_arrive_within_the_interval(pipe: Any) -> None:
    read_fd, writer = pipe
    handler = handler_for(writer, interval_s=0.3)
    handler.emit(record("request", request_id="a"))
    handler.emit(record("request", request_id="b"))
    assert read_available(read_fd) == b""  # batched, not written per line
    deadline = time.monotonic() + 5
    data = b""
    while data.count(b"\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
        data += read_available(read_fd)
    lines = [orjson.loads(line) for line in data.splitlines()]
    assert [line["request_id"] for line in lines] == ["a", "b"]
    assert lines[0]["logger"] == "gateway.access" and lines[0]["msg"] == "request"


def test_a_warning_is_written_at_once_with_what_was_waiting(pipe: Any) -> None:
    read_fd, writer = pipe
    handler = handler_for(writer, interval_s=60)
    handler.emit(record("request", request_id="first"))
    handler.emit(record("worker ejected", logging.WARNING))
    lines = [orjson.loads(line) for line in read_available(read_fd).splitlines()]
    assert [line["msg"] for line in lines] == ["request", "worker ejected"]
    assert lines[1]["level"] == "warning"


def test_a_full_buffer_is_written_without_waiting(pipe: Any) -> None:
    read_fd, writer = pipe
    handler = handler_for(writer, interval_s=60, max_bytes=1000)
    for i in range(20):
        handler.emit(record("request", request_id=f"r{i}", pad="x" * 100))
    assert read_available(read_fd).count(b"\n") >= 5


def test_writes_are_whole_lines_of_at_most_the_atomic_size(pipe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, writer = pipe
    writes: list[bytes] = []
    monkeypatch.setattr(logs.os, "write", lambda fd, data: writes.append(bytes(data)) or len(data))
    handler = handler_for(writer, interval_s=60)
    for i in range(100):
        handler.emit(record("request", request_id=f"r{i}", pad="y" * (50 + i * 3)))
    handler.flush()
    assert len(writes) > 1
    assert all(len(w) <= ATOMIC_WRITE_BYTES and w.endswith(b"\n") for w in writes)
    ids = [orjson.loads(line)["request_id"] for w in writes for line in w.splitlines()]
    assert ids == [f"r{i}" for i in range(100)]


def test_a_line_longer_than_the_atomic_size_is_written_whole(pipe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, writer = pipe
    writes: list[bytes] = []
    monkeypatch.setattr(logs.os, "write", lambda fd, data: writes.append(bytes(data)) or len(data))
    handler = handler_for(writer, interval_s=60)
    handler.emit(record("request", request_id="small"))
    handler.emit(record("request", request_id="big", pad="z" * 10_000))
    handler.flush()
    assert [orjson.loads(w)["request_id"] for w in writes] == ["small", "big"]


def test_a_stream_without_a_file_descriptor_gets_text() -> None:
    stream = io.StringIO()
    handler = handler_for(stream, interval_s=60)
    handler.emit(record("request", request_id="s"))
    handler.flush()
    assert orjson.loads(stream.getvalue())["request_id"] == "s"


def test_the_timestamp_is_utc_with_milliseconds_and_changes_with_the_second() -> None:
    formatter = JSONFormatter()
    first = record("a")
    first.created, first.msecs = 0.25, 250.0
    later = record("b")
    later.created, later.msecs = 3661.5, 500.0
    assert orjson.loads(formatter.format(first))["ts"] == "1970-01-01T00:00:00.250Z"
    assert orjson.loads(formatter.format(later))["ts"] == "1970-01-01T01:01:01.500Z"
