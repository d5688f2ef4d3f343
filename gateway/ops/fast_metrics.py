"""Labelled metrics on the request path without prometheus_client's per-call overhead: ``CachedLabels``
looks each label set's child up once, and the children it hands out (``fast_child``) do ``inc`` /
``dec`` / ``observe`` without the checks and calls prometheus_client makes each time. In one process they
take the value's lock themselves (written out in each method rather than shared through a helper: a
call is what they save; a histogram's values share one lock); with ``PROMETHEUS_MULTIPROC_DIR`` they call
the memory-mapped value's ``inc``.
``tests/ops/test_fast_metrics.py`` compares the exposition with prometheus_client's own operations."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.values import MutexValue


class CachedLabels:
    """A labelled metric whose ``labels(*values)`` looks each child up once: prometheus_client's
    ``labels()`` validates the values, builds a key and takes a lock on every call, which adds up on
    the request path. Use only where label values come from a small set (model names, reasons,
    outcomes). Everything else is the wrapped metric's.

    The children it hands out are ``fast_child``'s: their ``inc`` / ``observe`` go straight to the
    child's value objects."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = fast_child(self.metric.labels(*values))
        return child

    def remove(self, *values: str) -> None:
        """Stop exporting the ``values`` label set: the cached child is forgotten with the metric's, so
        a later ``labels(*values)`` starts a new series in the registry rather than counting into the
        removed child, which no scrape reads."""
        self._children.pop(values, None)
        self.metric.remove(*values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)


class _FastChild:
    """A child's hot operations without prometheus_client's per-call checks, which cannot fail for a
    child obtained from ``labels()`` (it is observable; exemplars are not used here). Every other
    attribute is the child's. ``tests/ops/test_fast_metrics.py`` checks that the exposition matches
    prometheus_client's own operations, so a change of its internals fails there."""

    __slots__ = ("child",)

    def __init__(self, child: Any) -> None:
        self.child = child

    def __getattr__(self, name: str) -> Any:
        return getattr(self.child, name)


class _FastValue(_FastChild):
    """A counter's or gauge's child: one value, added to through its ``inc`` (a memory-mapped value in
    multiprocess mode, which writes its file)."""

    __slots__ = ("_inc",)

    def __init__(self, child: Any) -> None:
        super().__init__(child)
        self._inc = child._value.inc


class _FastCounter(_FastValue):
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._inc(amount)


class _FastGauge(_FastValue):
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        self._inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._inc(-amount)


class _InProcessValue(_FastChild):
    """A counter's or gauge's child whose value is prometheus_client's in-process ``MutexValue``: its
    ``inc`` written out here (the value's lock taken, the float added), a third less than calling it.
    One attribute of this object is read per call: a class with ``__getattr__`` reads each through a
    slower hook."""

    __slots__ = ("_value",)

    def __init__(self, child: Any) -> None:
        super().__init__(child)
        self._value = child._value


class _InProcessCounter(_InProcessValue):
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        value = self._value
        lock = value._lock
        lock.acquire()
        try:
            value._value += amount
        finally:
            lock.release()


class _InProcessGauge(_InProcessValue):
    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        value = self._value
        lock = value._lock
        lock.acquire()
        try:
            value._value += amount
        finally:
            lock.release()

    def dec(self, amount: float = 1) -> None:
        self.inc(-amount)


class _FastHistogram(_FastChild):
    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Any) -> None:
        super().__init__(child)
        self._sum = child._sum.inc
        self._bounds = list(child._upper_bounds)  # ascending, the last +Inf
        self._buckets = [bucket.inc for bucket in child._buckets]

    def observe(self, amount: float) -> None:
        self._sum(amount)
        bounds = self._bounds
        index = bisect_left(bounds, amount)  # the first bound >= amount, as prometheus_client's loop finds
        if index < len(bounds) and amount <= bounds[index]:  # False for NaN: no bucket, as there
            self._buckets[index](1)


class _InProcessHistogram(_FastChild):
    """A histogram's child with ``MutexValue`` values: an observation adds to the sum and to its bucket
    under one lock. The child's values are given one lock between them when it is wrapped (each had its
    own): one acquire a call instead of two, 0.34 against 0.58 µs, and a request observes a hook's time
    for each plugin hook it calls. prometheus_client's own reads take each value's lock in turn, never two
    at once, so sharing it cannot deadlock; a reader sees an observation whole or not at all."""

    __slots__ = ("_parts",)

    def __init__(self, child: Any) -> None:
        super().__init__(child)
        lock = child._sum._lock
        for bucket in child._buckets:
            bucket._lock = lock
        # the sum's value, the bounds (ascending, the last +Inf), each bucket's value, their one lock
        self._parts = (child._sum, list(child._upper_bounds), list(child._buckets), lock)

    def observe(self, amount: float) -> None:
        value, bounds, buckets, lock = self._parts  # one read of this object (see _InProcessValue)
        index = bisect_left(bounds, amount)  # the first bound >= amount, as prometheus_client's loop finds
        lock.acquire()
        try:
            value._value += amount
            if index < len(bounds) and amount <= bounds[index]:  # False for NaN: no bucket, as there
                buckets[index]._value += 1
        finally:
            lock.release()


def fast_child(child: Any) -> Any:
    """``child`` (from a Counter's, Gauge's or Histogram's ``labels()``) with fast ``inc`` / ``dec`` /
    ``observe``; other metric types, and gauges in the multiprocess ``mostrecent`` mode, as they are."""
    if isinstance(child, Counter):
        return _InProcessCounter(child) if type(child._value) is MutexValue else _FastCounter(child)
    if isinstance(child, Histogram):
        return _InProcessHistogram(child) if type(child._sum) is MutexValue else _FastHistogram(child)
    if isinstance(child, Gauge) and not child._is_most_recent:
        return _InProcessGauge(child) if type(child._value) is MutexValue else _FastGauge(child)
    return child
