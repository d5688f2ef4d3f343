"""Redis unreachable is a clear 503 for the Files and Batch APIs, never a silent loss."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from redis.exceptions import RedisError

from gateway.wire.errors import ServiceUnavailable

REDIS_ERRORS = (RedisError, OSError, TimeoutError)


def text(value: Any) -> str:
    """A Redis reply item as text (the clients here do not decode replies)."""
    return value.decode() if isinstance(value, bytes) else str(value)


@asynccontextmanager
async def guarded(action: str) -> AsyncIterator[None]:
    """Turn a Redis failure inside into ``ServiceUnavailable`` naming ``action``."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise ServiceUnavailable(
            f"The gateway could not {action}: its store (Redis) is unavailable ({type(exc).__name__}); retry shortly.",
            code="store_unavailable",
            headers={"retry-after": "1"},
        ) from None
