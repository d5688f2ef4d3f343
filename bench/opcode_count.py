"""Bytecodes per request by Python function, for peers side by side: where the interpreter's own work goes
by function and by plugin, which valgrind's counts (``bench/callgrind_diff.py``) cannot tell apart (every
Python function runs inside ``_PyEval_EvalFrameDefault``).

``bench/bench_request_path.py --opcodes PREFIX`` runs each peer's measured requests under ``OpcodeCounter``
(a ``sys.settrace`` tracer with per-opcode events) and writes ``PREFIX.<peer>.json``; this script reads
them. A function's count is its own bytecodes (exclusive), over the run's requests. There is no timing in
a count: two runs of one tree differ by a few dozen bytecodes per request (how Redis replies batch, how
often an event is waited for), so a change of a hundred is readable in one run of about a minute.

Work in C (regular expressions, hashing, JSON, Redis packing) is not counted: an opcode that calls it counts
as one; ``--instructions`` counts everything. So fewer bytecodes is not always less time: a header list built
by ``map`` with an ``operator.methodcaller`` ran 110 fewer bytecodes a request than the comprehension it was to
replace, and took twice as long. Time a change too. Over the whole request path the two measures agree: the
production set ran 2.25x routing only's bytecodes and 2.28x its instructions on the tree that added this.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py --peers production,routing --reps 1 \\
        --requests 1000 --opcodes /tmp/opc
    .venv/bin/python bench/opcode_count.py /tmp/opc production routing [--by area] [--top 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

#: A function: (file, qualified name). Not its line, so that a function is the same row in two trees.
Function = tuple[str, str]


class OpcodeCounter:
    """Counts the bytecodes each Python function runs between ``enable()`` and ``disable()``, in every
    thread started meanwhile and in the one that enabled it. About 30 times slower than running free:
    a count, not a time."""

    def __init__(self) -> None:
        self.opcodes: Counter[Function] = Counter()
        self.calls: Counter[Function] = Counter()  # entries, a coroutine's resumptions included
        self._before: tuple[Any, Any] = (None, None)  # the tracers it replaced (a debugger's, coverage's)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        frame.f_trace_opcodes = True
        code = frame.f_code
        self.calls[(code.co_filename, code.co_qualname)] += 1
        return self._opcode

    def _opcode(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            self.opcodes[(code.co_filename, code.co_qualname)] += 1
        return self._opcode

    def enable(self) -> None:
        self._before = (sys.gettrace(), threading.gettrace())
        sys.settrace(self._call)
        threading.settrace(self._call)

    def disable(self) -> None:
        sys.settrace(self._before[0])
        threading.settrace(self._before[1])

    def dump(self, path: str | Path, requests: int) -> None:
        rows = [[*key, count, self.calls.get(key, 0)] for key, count in self.opcodes.items()]
        Path(path).write_text(json.dumps({"requests": requests, "functions": rows}))


def short_name(filename: str) -> str:
    """A function's file as a path in the repository (``plugins/cache/keys.py``), in the environment
    (``uvicorn/...``) or in the standard library (``asyncio/locks.py``)."""
    for marker in ("site-packages/", "/lib/python3."):
        if marker in filename:
            rest = filename.split(marker, 1)[1]
            return rest.split("/", 1)[1] if marker.startswith("/lib/") else rest
    for top in ("/gateway/", "/plugins/", "/bench/"):
        if top in filename:
            return top[1:] + filename.rsplit(top, 1)[1]
    return filename


def area(filename: str) -> str:
    """What a function belongs to: a plugin (``plugins/cache``), a part of the core (``gateway/infra``),
    or a library (``uvicorn``, ``asyncio``)."""
    name = short_name(filename)
    parts = name.split("/")
    if parts[0] in ("gateway", "plugins") and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0] if len(parts) > 1 else name


def per_request(prefix: str, peer: str, by: str = "function") -> dict[str, float]:
    """Bytecodes per request by function (``file:qualified name``) or by ``area`` for ``peer``'s dump."""
    path = Path(f"{prefix}.{peer}.json")
    if not path.exists():
        raise SystemExit(f"no opcode counts for {peer!r}: {path} is missing")
    dump = json.loads(path.read_text())
    out: Counter[str] = Counter()
    for filename, name, count, _calls in dump["functions"]:
        key = area(filename) if by == "area" else f"{short_name(filename)}:{name}"
        out[key] += count
    return {key: count / dump["requests"] for key, count in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix")
    parser.add_argument("peers", nargs="+", help="peer names as the dumps have them (production, routing@base)")
    parser.add_argument("--by", choices=("function", "area"), default="function")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    tables = [per_request(args.prefix, peer, args.by) for peer in args.peers]
    first, second = tables[0], tables[1] if len(tables) > 1 else {}
    names = sorted(first.keys() | second.keys(), key=lambda n: second.get(n, 0) - first.get(n, 0))
    print(" | ".join(f"{peer:>14s}" for peer in args.peers) + f" | {args.by}")
    for name in names[: args.top]:
        print(" | ".join(f"{table.get(name, 0):14,.1f}" for table in tables) + f" | {name[:110]}")
    print(" | ".join(f"{sum(table.values()):14,.1f}" for table in tables) + " | all")


if __name__ == "__main__":
    main()
