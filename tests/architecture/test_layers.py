"""The package layout is the architecture: layers import downwards only, and no module imports another
that (directly or through others) imports it back, type-only imports included.

The layers, top to bottom (``gateway/__init__.py`` says the same for a reader of the tree):
the CLI; ``server`` (ASGI side); ``batch`` (the Files and Batch APIs, their runner);
``proxy`` (a request's trip through the pipeline to a worker);
``pipeline`` (plugin contract, context, runtime, config); ``upstream`` (talking to workers); ``wire``
(the OpenAI protocol: shapes, errors, SSE); ``ops`` (metrics, logs, traces, settings); and at the
bottom ``infra`` (protocol clients the project owns) and ``engine`` (managed vLLM workers).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"

LAYERS: list[tuple[str, ...]] = [
    ("gateway.cli",),
    ("gateway.server",),
    ("gateway.batch",),
    ("gateway.proxy",),
    ("gateway.pipeline",),
    ("gateway.upstream",),
    ("gateway.wire",),
    ("gateway.ops",),
    ("gateway.infra", "gateway.engine"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None  # gateway/__init__.py and package roots above every layer


def imported_modules(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every ``gateway`` module that ``module`` imports, wherever the import stands (function bodies and
    ``if TYPE_CHECKING:`` blocks included), with its line number."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                yield (candidate if candidate in MODULES else source), node.lineno


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        graph[module] = {
            target
            for target, _ in imported_modules(module, path)
            if target.startswith("gateway") and target != module and target in MODULES
        }
    return graph


def test_every_module_belongs_to_a_layer() -> None:
    homeless = [m for m in MODULES if layer_of(m) is None and m != "gateway"]
    assert not homeless, f"modules outside every layer (add them to a layer package): {homeless}"


def test_layers_import_only_downwards() -> None:
    upward = []
    for module, path in MODULES.items():
        own = layer_of(module)
        if own is None:
            continue
        for target, line in imported_modules(module, path):
            other = layer_of(target)
            if other is not None and other < own:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target} (a higher layer)")
    assert not upward, "\n".join(upward)


def side_by_side_imports(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Imports between packages that share a layer (``infra`` and ``engine``): each must stand alone."""
    found = []
    for module, path in modules.items():
        own = layer_of(module)
        if own is None or len(LAYERS[own]) < 2:
            continue
        mine = next(p for p in LAYERS[own] if module == p or module.startswith(p + "."))
        for target, line in imported_modules(module, path):
            other = next((p for p in LAYERS[own] if target == p or target.startswith(p + ".")), None)
            if other is not None and other != mine:
                found.append(f"{path.relative_to(root)}:{line} imports {target} (beside it, not below)")
    return found


def test_infra_and_engine_never_import_each_other() -> None:
    found = side_by_side_imports(MODULES)
    assert not found, "\n".join(found)


def test_the_side_by_side_check_finds_such_an_import(tmp_path: Path) -> None:
    fake = tmp_path / "gateway" / "engine" / "uses_infra.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from gateway.infra import http1\n")
    assert side_by_side_imports({"gateway.engine.uses_infra": fake}, tmp_path) == [
        "gateway/engine/uses_infra.py:1 imports gateway.infra.http1 (beside it, not below)"
    ]


def test_the_core_never_imports_a_plugin() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for module, path in MODULES.items()
        for target, line in imported_modules(module, path)
        if target == "plugins" or target.startswith("plugins.")
    ]
    assert not found, "\n".join(found)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None (iterative DFS, three colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 unseen, 1 on the stack, 2 done
    for start in graph:
        if colour[start]:
            continue
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
            elif colour[child] == 1:
                path = [n for n, _ in stack]
                return [*path[path.index(child) :], child]
            elif colour[child] == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a2"}, "a2": set(), "b": {"b"}}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], has_cycle: bool) -> None:
    assert (find_cycle(graph) is not None) is has_cycle


def test_every_package_says_what_lives_there_and_what_it_may_import() -> None:
    for module, path in MODULES.items():
        if path.name == "__init__.py" and module != "gateway":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and "import" in doc.lower(), (
                f"{path.relative_to(ROOT)} needs a docstring naming what it may import"
            )


def test_the_walker_sees_imports_of_every_kind() -> None:
    """The checks above are only as good as the graph: it must hold plain, type-only and function-local
    imports (a graph that saw nothing would pass every check)."""
    graph = import_graph()
    assert "gateway.pipeline.config" in graph["gateway.server.app"]  # a plain import
    assert "gateway.pipeline.config" in graph["gateway.pipeline.context"]  # under TYPE_CHECKING
    assert sum(len(targets) for targets in graph.values()) > 100
