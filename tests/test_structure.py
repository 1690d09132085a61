"""The code's shape, checked on its source: no import cycle, library files and functions short
enough to read in one go, and no dispatch that search and types cannot see."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("vattn", "serving", "measure", "benchmarks", "paper_repro")
LIBRARY = ("vattn", "serving")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS = {("serving/server/cli.py", "parser")}
"""The CLI's declarative parser: one add_argument after another."""


@cache
def sources() -> dict[str, Path]:
    """Every first-party module by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    """The first-party modules `name` imports anywhere in its source (in functions too)."""
    modules = sources()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from a import b`: the module a.b where b is one, else a itself
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
            targets = [t if t in modules else node.module for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycles() -> None:
    graph = {name: imports(name, path) for name, path in sources().items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycle = [*trail[trail.index(target) :], target]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, [*trail, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_model_package_imports_nothing_of_the_engine() -> None:
    """serving.model reads its settings (serving.config) and vattn's operators, nothing else of serving."""
    for name, path in sources().items():
        if name == "serving.model" or name.startswith("serving.model."):
            outside = {
                target
                for target in imports(name, path)
                if target.startswith("serving") and not target.startswith("serving.model")
            }
            assert outside <= {"serving", "serving.config"}, f"{name} imports {sorted(outside)}"


def library_files() -> list[Path]:
    return sorted(path for package in LIBRARY for path in (ROOT / package).rglob("*.py"))


def test_library_files_and_functions_stay_short() -> None:
    long_files, long_functions = set(), set()
    for path in library_files():
        relative = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.add(relative)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long_functions.add((relative, node.name))
    assert not long_files, f"over {MAX_FILE_LINES} lines: {sorted(long_files)}"
    assert long_functions <= LONG_FUNCTIONS, f"functions over {MAX_FUNCTION_LINES} lines: {sorted(long_functions)}"


def test_no_hidden_dispatch() -> None:
    """No class answers attribute lookups it does not define (a module's lazy exports may), and
    the engine needs no `type: ignore`."""
    for path in library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
                assert not methods & {"__getattr__", "__getattribute__"}, f"{path}: {node.name} dispatches by name"
    assert "type: ignore" not in (ROOT / "serving" / "engine.py").read_text()
