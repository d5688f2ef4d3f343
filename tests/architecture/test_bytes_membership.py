"""No ``needle in data`` with a bytes needle on the request path: ``data.find(needle) >= 0`` instead.

For a bytes needle, CPython's ``bytes.__contains__`` first tries the needle as an integer, raising and
clearing a ``TypeError``, before it searches: a test on a short piece costs two to three times a
``find``. The stream path makes several such tests per read, and the router several per request.

Found by reading the code, not by running it: a needle is bytes when it is a bytes literal, a module
constant bound to one, or a name imported from a module where it is bytes."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator

from tests.architecture.test_function_shape import REQUEST_PATH, ROOT


def _is_bytes(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, bytes)


def _module_bytes_names(tree: ast.Module) -> set[str]:
    """Names this module binds to bytes at its top level, or imports as bytes from another module."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_bytes(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _is_bytes(node.value):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith(("gateway", "plugins")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if isinstance(getattr(module, alias.name, None), bytes):
                    names.add(alias.asname or alias.name)
    return names


def bytes_membership_tests(source: str, name: str) -> Iterator[str]:
    """``where: the test`` for every ``in`` / ``not in`` in ``source`` whose needle is bytes."""
    tree = ast.parse(source, name)
    constants = _module_bytes_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            needle_is_bytes = _is_bytes(left) or (isinstance(left, ast.Name) and left.id in constants)
            if isinstance(op, ast.In | ast.NotIn) and needle_is_bytes:
                yield f"{name}:{node.lineno} {ast.unparse(node)}"
            left = right


def test_the_request_path_tests_bytes_with_find() -> None:
    found = [
        problem
        for root in REQUEST_PATH
        for path in sorted((ROOT / root).rglob("*.py"))
        for problem in bytes_membership_tests(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, "bytes `in` tests (use data.find(needle) >= 0):\n" + "\n".join(found)


def test_the_check_finds_literals_constants_and_imported_constants() -> None:
    source = "\n".join(
        [
            "from gateway.wire.streaming import USAGE_MEMBER",
            '_MARK = b"data:"',
            "def f(piece, text, table):",
            '    a = b"x" in piece',
            "    b = _MARK not in piece",
            "    c = USAGE_MEMBER in piece",
            '    d = "x" in text or "k" in table or piece in table',
            "    return 0 < len(piece) and b'y' in piece",
        ]
    )
    found = list(bytes_membership_tests(source, "m.py"))
    assert [line.split(" ", 1)[0] for line in found] == ["m.py:4", "m.py:5", "m.py:6", "m.py:8"]
