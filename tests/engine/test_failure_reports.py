"""A failed test that used the real engine carries each managed worker's last output lines in its report
(``tests/conftest.py``'s ``pytest_runtest_makereport``): a worker's own error behind an HTTP 500 is
otherwise only in its log, which no report shows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests import conftest
from tests.support.gateways import RealEngine


class _Worker:
    def __init__(self, lines: list[str]) -> None:
        self._lines = lines

    def last_lines(self) -> list[str]:
        return list(self._lines)


def _engine(workers: dict[str, _Worker] | None) -> RealEngine:
    manager = SimpleNamespace(workers=workers) if workers is not None else None
    app: Any = SimpleNamespace(state=SimpleNamespace(engine=manager))
    return RealEngine(gateway_url="http://gateway", url="http://worker", app=app)


def _report(item: Any, failed: bool) -> Any:
    """Drive the hook as pytest does: the report the other hooks made goes in, the one to keep comes out."""
    report = SimpleNamespace(failed=failed, sections=[])
    hook = conftest.pytest_runtest_makereport(item, SimpleNamespace())  # type: ignore[arg-type]
    next(hook)
    with pytest.raises(StopIteration) as done:
        hook.send(report)  # type: ignore[arg-type]
    assert done.value.value is report
    return report


def test_a_failed_test_reports_every_workers_last_lines() -> None:
    engine = _engine({"cpu-1": _Worker([]), "cpu-0": _Worker(["INFO ready", "ERROR grammar rejected tokens"])})
    report = _report(SimpleNamespace(funcargs={"real_engine": engine, "real_worker": engine}), failed=True)
    assert report.sections == [
        ("worker cpu-0: last output lines", "INFO ready\nERROR grammar rejected tokens"),
        ("worker cpu-1: last output lines", "(no output)"),
    ]


def test_a_passed_test_or_one_without_the_engine_reports_nothing() -> None:
    engine = _engine({"cpu-0": _Worker(["INFO ready"])})
    assert _report(SimpleNamespace(funcargs={"real_engine": engine}), failed=False).sections == []
    assert _report(SimpleNamespace(funcargs={"upstream": object()}), failed=True).sections == []
    assert _report(SimpleNamespace(), failed=True).sections == []  # a collector, not a function
    assert _report(SimpleNamespace(funcargs={"real_engine": _engine(None)}), failed=True).sections == []
