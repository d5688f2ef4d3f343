"""Structured logs: one JSON object per line, with the request fields passed as ``extra={"fields": ...}``."""

from __future__ import annotations

import logging
import sys
import time

import orjson

from gateway.config import LoggingConfig


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
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


def configure_logging(level: str = "INFO", *, access_log: bool = True) -> None:
    """Route every logger (ours, uvicorn's) to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
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
