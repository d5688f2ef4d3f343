"""Structured logs: one JSON object per line, with the request fields passed as ``extra={"fields": ...}``."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Literal, TextIO

import orjson
from pydantic import BaseModel, ConfigDict, Field

#: A write of at most this many bytes to a pipe is atomic (POSIX PIPE_BUF on Linux): several uvicorn
#: worker processes share one stderr, so a batch is written in pieces of whole lines up to this size.
ATOMIC_WRITE_BYTES = 4096


class LoggingConfig(BaseModel):
    """The ``logging`` section of config.yaml (reloadable)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="log level (GATEWAY_LOG_LEVEL overrides it)"
    )
    access_log: bool = Field(True, description="one JSON line per request")
    log_content: bool = Field(False, description="include prompts and completions in logs (off: never)")


class JSONFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._second_text = ""

    def _timestamp(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # strftime once per second, not once per line
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        return f"{self._second_text}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": self._timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,  # several uvicorn worker processes write to one stream
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class BatchedLineHandler(logging.Handler):
    """JSON lines to a stream, written in batches instead of one write and flush per line.

    An access line per request made the per-line write and flush about a quarter of what logging cost
    a request. Lines are buffered and written when ``max_bytes`` are waiting, at once for WARNING and
    above, within ``interval_s`` otherwise (a daemon thread per process), and at exit (logging's own
    shutdown flushes every handler). Each write is whole lines of at most ``ATOMIC_WRITE_BYTES``, so
    lines from several processes sharing the stream never interleave.
    """

    def __init__(self, stream: TextIO, *, interval_s: float = 0.1, max_bytes: int = 16384) -> None:
        super().__init__()
        self.stream = stream
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self._lines: list[bytes] = []
        self._size = 0
        self._flusher_pid = 0  # the process whose flusher thread runs (none yet, or forked since)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record).encode("utf-8", "backslashreplace") + b"\n"
        except Exception:
            self.handleError(record)
            return
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            self._lines.append(line)
            self._size += len(line)
            if record.levelno >= logging.WARNING or self._size >= self.max_bytes:
                self._write_locked()
            elif self._flusher_pid != os.getpid():
                self._flusher_pid = os.getpid()
                threading.Thread(target=self._flush_periodically, name="log-flush", daemon=True).start()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write_locked()

    def _flush_periodically(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.flush()

    def _write_locked(self) -> None:
        if not self._lines:
            return
        lines, self._lines, self._size = self._lines, [], 0
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file (a test's StringIO)
            self.stream.write(b"".join(lines).decode("utf-8", "replace"))
            self.stream.flush()
            return
        self.stream.flush()  # anything written to the stream directly goes first
        piece: list[bytes] = []
        size = 0
        for line in lines:
            if piece and size + len(line) > ATOMIC_WRITE_BYTES:
                _write_all(fd, b"".join(piece))
                piece, size = [], 0
            piece.append(line)
            size += len(line)
        _write_all(fd, b"".join(piece))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # stderr is gone (closed pipe): there is nowhere left to log to
        view = view[written:]


def configure_logging(level: str = "INFO", *, access_log: bool = True) -> None:
    """Route every logger (ours, uvicorn's) to stderr as JSON lines, written in batches."""
    handler = BatchedLineHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("gateway.access").setLevel(logging.INFO if access_log else logging.WARNING)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # the gateway writes its own access line


def apply_logging(config: LoggingConfig, *, override: str | None = None) -> None:
    """Levels from ``config.yaml`` (``logging:``), applied at start and after every reload.

    ``override`` is the restart-only ``GATEWAY_LOG_LEVEL``; when set, config changes leave the level alone.
    """
    logging.getLogger().setLevel(override or config.level)
    logging.getLogger("gateway.access").setLevel(logging.INFO if config.access_log else logging.WARNING)
