"""Small helpers for the background tasks that services and plugins own."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has finished unwinding."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` when the current task was asked to stop. A loop that catches a library's
    errors and goes on calls this after catching one: a library that turns the cancellation it received
    into an error of its own (a Redis client whose read was cut) would otherwise leave the loop running
    and whoever cancelled it (``cancel_and_wait``, at shutdown) waiting for ever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
