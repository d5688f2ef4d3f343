"""Batch lines (``gateway.batch``) as tenancy sees them: who is asking, and at what price.

A line carries no headers: the runner marks its context with the core's ``BatchLine`` (the key id and
tenant that created the batch). The key is looked up again by its id for every line, so a key revoked
while its batch runs has its remaining lines refused (401 in the error file), and the key's allow-list
and limits apply to each line as to a live request. A line is charged ``batch_price_factor`` of its
tokens (rounded up), reservations included, and waits behind every live request in routing's queue.
"""

from __future__ import annotations

import math

from gateway.pipeline.batch_config import LINE_PRIORITY, BatchLine, Caller
from gateway.pipeline.context import RequestContext
from gateway.wire.errors import AuthenticationFailed
from plugins.tenancy.keys import KeyInfo, KeyStore

__all__ = ["LINE_PRIORITY", "batch_line", "caller", "line_key", "priced", "priced_pair"]


def batch_line(ctx: RequestContext) -> BatchLine | None:
    line = ctx.batch_line
    return line if isinstance(line, BatchLine) else None


async def line_key(keys: KeyStore, line: BatchLine) -> KeyInfo:
    """The key that created the line's batch, still valid and still the same tenant's; else a 401."""
    key_id = line.caller.key_id
    info = await keys.by_id(key_id) if key_id is not None else None
    if info is None or info.tenant != line.caller.tenant:
        raise AuthenticationFailed(
            "The API key that created this batch is no longer valid; create the batch again with a valid key.",
            code="invalid_api_key",
        )
    return info


def caller(info: KeyInfo | None, anonymous: str) -> Caller:
    return Caller(info.tenant, info.id) if info is not None else Caller(anonymous)


def priced(tokens: int, factor: float) -> int:
    """Tokens as charged: ``factor`` of them, rounded up (a line's cost is never 0 when it used some)."""
    return tokens if factor == 1.0 else math.ceil(tokens * factor)


def priced_pair(pair: tuple[int, int], factor: float) -> tuple[int, int]:
    return priced(pair[0], factor), priced(pair[1], factor)
