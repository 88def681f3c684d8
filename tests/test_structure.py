"""The code's shape: no module of the Coordinator and its tools over 600 lines, no import cycle inside a package.

Each rule lists what breaks it today, a set that may only shrink: a module or cycle not listed fails, and so
does a listed one that no longer breaks the rule (remove it from the list), so the list stays true.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600
# The benchmarks and the tests are not held to the length rule.
NOT_MEASURED = {"bench", "tests"}

# Modules over MAX_LINES today, by path from the repository root. None: add none.
LONG_MODULES: set[str] = set()

# Import cycles between the modules of one package today, each as the set of modules that import one another
# round (a strongly connected component of the package's import graph; imports inside functions and under
# TYPE_CHECKING count: they hide a cycle, they do not remove it).
KNOWN_CYCLES: set[frozenset[str]] = set()  # None: add none.


def _modules() -> list[Path]:
    """The Python files of the repository's packages (a directory with an __init__.py) and its top level."""
    files = list(ROOT.glob("*.py"))
    for package in ROOT.iterdir():
        if package.is_dir() and package.name not in NOT_MEASURED and (package / "__init__.py").is_file():
            files += package.rglob("*.py")
    return files


def test_no_module_is_longer_than_600_lines():
    lines = {str(f.relative_to(ROOT)): len(f.read_text(encoding="utf-8").splitlines()) for f in _modules()}
    assert len(lines) > 50  # the walk found the code
    long = {path for path, n in lines.items() if n > MAX_LINES}
    assert not long - LONG_MODULES, f"over {MAX_LINES} lines: {sorted((p, lines[p]) for p in long - LONG_MODULES)}"
    assert not LONG_MODULES - long, f"no longer over {MAX_LINES} lines, remove from LONG_MODULES: {LONG_MODULES - long}"


def _cycles(graph: grimp.ImportGraph, package: str) -> set[frozenset[str]]:
    """The strongly connected components of more than one module among `package`'s modules (Tarjan)."""
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.find_modules_directly_imported_by(module) & modules:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while not component or module not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.add(frozenset(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_inside_a_package():
    with open(ROOT / "pyproject.toml", "rb") as f:
        packages = tomllib.load(f)["tool"]["importlinter"]["root_packages"]
    graph = grimp.build_graph(*packages, cache_dir=None)
    cycles = set().union(*(_cycles(graph, package) for package in packages))
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not new, f"modules importing one another round: {new}"
    assert not gone, f"no longer a cycle as listed, update KNOWN_CYCLES: {gone}"
