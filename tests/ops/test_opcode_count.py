"""bench/opcode_count.py: bytecodes per request by Python function, counted by a tracer, exactly the same
from run to run, and read back per request and by area for peers side by side."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def opcodes() -> Any:
    return load_script(REPO / "bench" / "opcode_count.py")


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _count(opcodes: Any, n: int) -> tuple[int, int]:
    """(bytecodes, calls) of ``_loop(n)`` called twice under a counter."""
    counter = opcodes.OpcodeCounter()
    counter.enable()
    _loop(n)
    _loop(n)
    counter.disable()
    key = (_loop.__code__.co_filename, "_loop")
    return counter.opcodes[key], counter.calls[key]


def test_counts_repeat_exactly_and_grow_with_the_work(opcodes: Any) -> None:
    small, calls = _count(opcodes, 10)
    assert calls == 2
    assert _count(opcodes, 10) == (small, 2), "no timing in a count: the same work, the same number"
    larger, _ = _count(opcodes, 20)
    per_iteration = (larger - small) / 20  # ten more iterations in each of the two calls
    assert per_iteration >= 2 and per_iteration == int(per_iteration)


def test_threads_started_while_counting_are_counted_and_disable_stops_it(opcodes: Any) -> None:
    counter = opcodes.OpcodeCounter()
    counter.enable()
    worker = threading.Thread(target=_loop, args=(50,))
    worker.start()
    worker.join()
    counter.disable()
    key = (_loop.__code__.co_filename, "_loop")
    counted = counter.opcodes[key]
    assert counted > 50
    _loop(50)
    assert counter.opcodes[key] == counted, "nothing is counted once disabled"


def test_the_dump_reads_back_per_request_by_function_and_by_area(opcodes: Any, tmp_path: Path) -> None:
    counter = opcodes.OpcodeCounter()
    counter.opcodes.update(
        {
            ("/repo/plugins/cache/keys.py", "canonical_request"): 300,
            ("/repo/plugins/cache/plugin.py", "CachePlugin.on_request"): 100,
            (
                "/venv/lib/python3.11/site-packages/uvicorn/protocols/http/httptools_impl.py",
                "RequestResponseCycle.send",
            ): 50,
            ("/usr/lib/python3.11/asyncio/locks.py", "Event.wait"): 10,
        }
    )
    counter.dump(tmp_path / "opc.production.json", requests=10)
    by_function = opcodes.per_request(str(tmp_path / "opc"), "production")
    assert by_function == {
        "plugins/cache/keys.py:canonical_request": 30.0,
        "plugins/cache/plugin.py:CachePlugin.on_request": 10.0,
        "uvicorn/protocols/http/httptools_impl.py:RequestResponseCycle.send": 5.0,
        "asyncio/locks.py:Event.wait": 1.0,
    }
    by_area = opcodes.per_request(str(tmp_path / "opc"), "production", by="area")
    assert by_area == {"plugins/cache": 40.0, "uvicorn": 5.0, "asyncio": 1.0}
    assert json.loads((tmp_path / "opc.production.json").read_text())["requests"] == 10


def test_the_table_puts_the_largest_difference_first_and_names_a_missing_dump(
    opcodes: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for peer, counts in (("production", (400, 70)), ("routing", (0, 60))):
        counter = opcodes.OpcodeCounter()
        counter.opcodes.update(
            {("/r/plugins/tenancy/limits.py", "Decision.headers"): counts[0], ("/r/gateway/a/b.py", "f"): counts[1]}
        )
        counter.dump(tmp_path / f"opc.{peer}.json", requests=2)
    monkeypatch.setattr("sys.argv", ["opcode_count.py", str(tmp_path / "opc"), "production", "routing"])
    opcodes.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["200.0", "|", "0.0", "|", "plugins/tenancy/limits.py:Decision.headers"]
    assert lines[-1].split() == ["235.0", "|", "30.0", "|", "all"]
    with pytest.raises(SystemExit, match=r"opc\.safety\.json"):
        opcodes.per_request(str(tmp_path / "opc"), "safety")
