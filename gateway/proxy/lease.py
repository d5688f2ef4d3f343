"""A worker attempt as one object: ``WorkerLease``.

Taking a lease counts the request on its worker (``Worker.in_flight``); releasing it gives the count back,
closes the worker's response if one is still open
and tells the route plan how the attempt went (``RoutePlan.finished``; a side route without a plan has
none), and the worker table when it was a success. Every way an attempt ends goes through exactly one
release, whichever comes first:

- ``ok()``: the worker answered well (an answer read, a stream that ended with ``[DONE]``); a success
  for the worker's outlier detection unless its first byte was slow (``slow_first_byte_s``).
- ``failed(error)``: the worker failed this attempt (the caller blames it, or not, separately).
- ``declined()``: the worker answered, but with the client's own problem (a 4xx): neither a success nor
  a failure of the worker's.

Later calls do nothing, so a relay's ``finally`` can always release: ``async with lease`` (or ``with``)
fails a lease that is still held when its block ends, e.g. when the client went away.
"""

from __future__ import annotations

from types import TracebackType

from gateway.pipeline.context import RoutePlan
from gateway.upstream.client import UpstreamResponse
from gateway.upstream.workers import Worker, WorkerTable
from gateway.wire.errors import GatewayError


class WorkerLease:
    """One attempt of one request on one worker; see the module docstring."""

    __slots__ = ("_plan", "_source", "_table", "held", "response", "slow_first_byte_s", "worker")

    def __init__(self, worker: Worker, plan: RoutePlan | None, table: WorkerTable, source: str | None) -> None:
        self.worker = worker
        self._plan = plan
        self._table = table
        self._source = source  # the tenant, for the table's view of who uses the worker
        #: Set when the stream's first byte was far slower than the model's usual: then ``ok()`` does not
        #: clear the worker's failures (the slow start already counted as one).
        self.slow_first_byte_s: float | None = None
        #: The worker's answer once its headers came: released with the lease (closed unless read to its
        #: end), so a stream that never began to relay still lets go of its connection.
        self.response: UpstreamResponse | None = None
        self.held = True
        worker.in_flight += 1

    def ok(self) -> None:
        if self._release():
            if self.slow_first_byte_s is None:
                self._table.report_success(self.worker, self._source)
            if self._plan is not None:
                self._plan.finished(self.worker, ok=True)

    def failed(self, error: GatewayError | None = None) -> None:
        if self._release() and self._plan is not None:
            self._plan.finished(self.worker, ok=False, error=error)

    def declined(self) -> None:
        if self._release() and self._plan is not None:
            self._plan.finished(self.worker, ok=True)

    def _release(self) -> bool:
        if not self.held:
            return False
        self.held = False
        self.worker.in_flight -= 1
        if self.response is not None:
            self.response.close()
        return True

    def __enter__(self) -> WorkerLease:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.failed()

    async def __aenter__(self) -> WorkerLease:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.failed()
