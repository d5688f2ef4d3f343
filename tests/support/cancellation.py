"""A library call that turns the cancellation it receives into an error of its own, for tests of loops that
catch a library's errors and go on (``gateway.ops.tasks.stop_if_cancelled``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class CutAwait:
    """Stands in for a library's awaitable call (a Redis read, an HTTP request): ``entered`` is set when it
    is called, it waits until cancelled and answers the first cancellation with ``error()``, as a client
    whose read was cut raises its own error instead of ``CancelledError``. A later cancellation goes
    through, so a loop that swallowed the first still ends when the test tears it down. Accepts any
    arguments: it may replace a function, a bound method or a class's method."""

    def __init__(self, error: Callable[[], BaseException]) -> None:
        self.entered = asyncio.Event()
        self.converted = False  # the first cancellation came and was turned into ``error()``
        self._error = error

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if self.converted:
                raise
            self.converted = True
            raise self._error() from None
        raise AssertionError("not reached: the call waits until cancelled")


async def stopped_when_cancelled(task: asyncio.Task[Any], timeout_s: float) -> bool:
    """Cancel ``task`` (what shutdown does) and say whether it finished within ``timeout_s``."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    return bool(done)
