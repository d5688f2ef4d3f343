"""The interface plugins use for hot-path Redis commands, and what every implementation promises.

Two implementations: ``gateway.infra.redis_autopipe.AutoPipeline`` (the project's own pipelining on
hiredis, the default) and ``gateway.infra.redis_py.RedisPyPipeline`` (redis-py's pipeline on a dedicated
connection), selected by the ``GATEWAY_REDIS_CLIENT`` setting. ``tests/infra/conformance/`` runs the same
cases against both.

The contract:

- Commands issued in the same event-loop turn go to Redis together; each caller gets its own reply.
- Replies are Redis's own: bytes, integers, lists, None (``SET`` answers ``b"OK"``, not ``True``).
- An error reply (``WRONGTYPE``, ``NOSCRIPT``, a script's error) is raised to that command's caller only,
  as redis-py's exception for it (``ResponseError``, ``NoScriptError``, ...); the other commands of the
  batch get their replies.
- No connection (refused, unreachable): ``redis.exceptions.ConnectionError``; none within the client's
  connect timeout: ``redis.exceptions.TimeoutError``. No reply within the client's socket timeout:
  ``TimeoutError`` for the commands waiting. A connection lost with commands in flight fails them with
  ``ConnectionError``; they are not sent again (Redis may have run them). The next command connects
  afresh.
- ``evalsha(script, keys, args)`` runs a registered ``redis.commands.core.AsyncScript`` by its SHA and,
  when Redis does not know it (``NOSCRIPT``: restarted, flushed), loads it and runs it once more.
  ``run_script(call, varying)`` is the same for a ``gateway.infra.redis_script.ScriptCall``: its keys,
  ``varying``, then its fixed arguments, the fixed part packed once. ``submit_script(call, varying)``
  queues the same command for a caller that does not wait for it: its future fails with
  ``NoScriptError`` when Redis does not know the script, and the caller runs it again with ``run_script``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from gateway.infra.redis_script import ScriptCall


class RedisPipeline(Protocol):
    async def execute(self, *args: Any) -> Any:
        """Run one command in this turn's batch; its reply, or its error raised."""
        ...

    def submit(self, *args: Any) -> asyncio.Future[Any]:
        """Queue one command for this turn's batch; the future gets its reply or error (for work nobody
        awaits, a callback on the future spares a task)."""
        ...

    async def evalsha(self, script: Any, keys: list[Any], args: list[Any]) -> Any: ...

    async def run_script(self, call: ScriptCall, varying: Sequence[Any]) -> Any:
        """``evalsha(call.script, call.keys, [*varying, *call.fixed])``."""
        ...

    def submit_script(self, call: ScriptCall, varying: Sequence[Any]) -> asyncio.Future[Any]:
        """``run_script`` queued in this turn's batch like ``submit``: the future gets the script's reply or
        error, ``NoScriptError`` included (nothing is loaded: the caller loads and runs it with
        ``run_script``)."""
        ...

    async def aclose(self) -> None:
        """Send what is queued, wait for the replies due (bounded by the socket timeout), close."""
        ...
