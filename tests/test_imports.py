"""The package's modules import each other in one direction: no circle, counting the imports made inside
functions (a circle kept alive by a deferred import is still one: each side must know the other's insides); and
finetune/'s entries stand in layers (docs/architecture.md's table of packages), each importing only from those
below it."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import finetune

PACKAGE = Path(finetune.__file__).parent


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str], for_types: bool = False) -> set[str]:
    """The package's modules that `path` imports at run time (imports under `if TYPE_CHECKING:` are for types,
    counted with `for_types`)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not for_types and isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
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
    assert graph["finetune.run.build"], "the import graph came out empty: the test reads nothing"
    circle = _circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


# The layers, top first, as docs/architecture.md's table of packages lists them: an entry imports only from the
# rows below its own.
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def layers(doc: Path = ARCHITECTURE) -> list[str]:
    """The top-level entries of finetune/ in the order of docs/architecture.md's package table, top first."""
    table = doc.read_text().split("## The packages")[1].split("\n## ")[0]
    return [match.group(1) for match in re.finditer(r"^\| `finetune/(\w+)(?:/|\.py)`", table, re.MULTILINE)]


def _entry(module: str) -> str:
    """The top-level entry of finetune/ a module belongs to: `finetune.model.adapters` -> model."""
    return module.split(".")[1]


def upward_imports(package: Path, order: list[str]) -> list[str]:
    """Every import (deferred ones and those for types included) from an entry of `package` into one above it."""
    paths = {_module_name(path, package): path for path in package.rglob("*.py")}
    rank = {entry: len(order) - i for i, entry in enumerate(order)}
    found = []
    for module, path in sorted(paths.items()):
        if module in ("finetune", "finetune.__main__"):
            continue
        for imported in sorted(_imports(path, set(paths), for_types=True)):
            if rank[_entry(imported)] > rank[_entry(module)]:
                found.append(f"{module} imports {imported}")
    return found


def test_the_package_table_names_every_entry_of_the_tree_once():
    entries = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" or (path / "__init__.py").is_file()}
    assert sorted(layers()) == sorted(entries - {"__init__", "__main__"})
    assert len(layers()) <= 12, "finetune/ holds more than 12 entries: group them"


def test_no_package_imports_from_a_layer_above_its_own():
    assert upward_imports(PACKAGE, layers()) == []


def test_a_planted_upward_import_is_found(tmp_path):
    tree = tmp_path / "finetune"
    shutil.copytree(PACKAGE, tree, ignore=shutil.ignore_patterns("__pycache__"))
    engine = tree / "engine" / "wrap.py"
    engine.write_text(engine.read_text() + "\n\ndef _planted():\n    from finetune.run.loop import run_steps\n")
    assert upward_imports(tree, layers()) == ["finetune.engine.wrap imports finetune.run.loop"]


def test_every_package_says_what_it_holds_and_what_it_may_import():
    """Each package's docstring ends by naming the entries below it in the table: what it may import."""
    order = layers()
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        name = init.parent.name
        assert "May import:" in doc, f"finetune/{name}/__init__.py: its docstring says what the package may import"
        named = re.findall(r"`(\w+)`", doc.split("May import:")[1])
        assert named == order[order.index(name) + 1 :], f"finetune/{name}/__init__.py names other layers below it"


def test_no_module_outgrows_what_one_reader_holds():
    """No module over 600 lines (config.py, the recipe's one schema, apart) and no function over 90: a module that
    grows a second concern is cut along it, not left to grow."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if len(text.splitlines()) > 600 and path != PACKAGE / "config.py":
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 90:
                too_long.append(f"{name}: {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []
