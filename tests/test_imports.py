"""The package's modules import each other in one direction: no circle, counting the imports made inside
functions (a circle kept alive by a deferred import is still one: each side must know the other's insides)."""

from __future__ import annotations

import ast
from pathlib import Path

import finetune

PACKAGE = Path(finetune.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports at run time (imports under `if TYPE_CHECKING:` are for types)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return (found & modules) - {"finetune"}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as the modules along it, or None (depth-first search)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module] - {module}):
            if state.get(imported) == "open":
                return path[path.index(imported) :] + [imported]
            if imported not in state and (circle := visit(imported)):
                return circle
        state[module] = "done"
        path.pop()
        return None

    return next((circle for module in sorted(graph) if module not in state and (circle := visit(module))), None)


def test_no_module_of_the_package_imports_itself_back():
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {module: _imports(path, set(paths)) for module, path in paths.items()}
    assert graph["finetune.build"], "the import graph came out empty: the test reads nothing"
    circle = _circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)
