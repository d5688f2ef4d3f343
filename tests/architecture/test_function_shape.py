"""Functions on the request path stay small enough to hold in mind: at most about 50 lines (55 here, a
signature and docstring included) and blocks nested at most four deep. A longer or deeper function is
split into named steps before it lands; ``elif`` chains count as one level, as they read.

The request path: the server, the proxy, the pipeline, talking to workers, the wire protocol, the
protocol clients, and every built-in plugin."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUEST_PATH = [
    "gateway/server",
    "gateway/proxy",
    "gateway/pipeline",
    "gateway/upstream",
    "gateway/wire",
    "gateway/infra",
    "plugins",
]
MAX_LINES = 55
MAX_NESTING = 4

_BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.TryStar, ast.Match)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def nesting(node: ast.AST, depth: int = 0) -> int:
    """How deep blocks nest under ``node`` (a nested function or class is measured on its own)."""
    deepest = depth
    for field, value in ast.iter_fields(node):
        children = value if isinstance(value, list) else [value]
        for child in children:
            if not isinstance(child, ast.AST) or isinstance(child, _SCOPES):
                continue
            is_elif = isinstance(node, ast.If) and field == "orelse" and len(children) == 1
            opens = isinstance(child, _BLOCKS) and not (is_elif and isinstance(child, ast.If))
            deepest = max(deepest, nesting(child, depth + 1 if opens else depth))
    return deepest


def functions(source: str, name: str) -> Iterator[tuple[str, int, int]]:
    """(where, lines, nesting) of every function in ``source``."""
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            yield f"{name}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1, nesting(node)


def request_path_functions() -> Iterator[tuple[str, int, int]]:
    for root in REQUEST_PATH:
        for path in sorted((ROOT / root).rglob("*.py")):
            yield from functions(path.read_text(), str(path.relative_to(ROOT)))


def test_request_path_functions_are_short_and_shallow() -> None:
    found = list(request_path_functions())
    too_long = [f"{where}: {lines} lines" for where, lines, _ in found if lines > MAX_LINES]
    too_deep = [f"{where}: nested {depth} deep" for where, _, depth in found if depth > MAX_NESTING]
    assert not too_long + too_deep, "split these into named steps:\n" + "\n".join(too_long + too_deep)


def test_the_request_path_is_found() -> None:
    found = list(request_path_functions())
    assert len(found) > 1000  # every package above was read (a renamed one would leave this test empty)


SHAPES = {
    "flat": ("def f(x):\n    return x\n", 0),
    "four": (
        "def f(x):\n    for a in x:\n        if a:\n            with a:\n                try:\n"
        "                    pass\n                except E:\n                    pass\n",
        4,
    ),
    "five": (
        "def f(x):\n    for a in x:\n        if a:\n            with a:\n                while a:\n"
        "                    if a:\n                        pass\n",
        5,
    ),
    "elif chain": (
        "def f(x):\n    if x:\n        pass\n    elif x:\n        pass\n    elif x:\n        if x:\n            pass\n",
        2,
    ),
    "else with more": (
        "def f(x):\n    if x:\n        pass\n    else:\n        y = 1\n        if x:\n            pass\n",
        2,
    ),
    "nested function apart": (
        "def f(x):\n    if x:\n        def g():\n            if x:\n                if x:\n                    pass\n",
        1,
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_nesting_is_measured_as_it_reads(name: str) -> None:
    source, expected = SHAPES[name]
    depths = {where.rsplit(" ", 1)[1]: depth for where, _, depth in functions(source, name)}
    assert depths["f"] == expected
