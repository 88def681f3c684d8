"""The code's shape: no module of the Coordinator and its tools over 600 lines, no import cycle inside a package,
no code that branches on an endpoint's route or API where its family (serving/families/) should be asked.

Each rule lists what breaks it today, a set that may only shrink: a module or cycle not listed fails, and so
does a listed one that no longer breaks the rule (remove it from the list), so the list stays true.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import grimp

from serving.families import FAMILIES, Family

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


# A test of a request's route or API (docs/architecture.md, Endpoint families), by path and the line's text.
ROUTE_TEST = re.compile(
    r"\broute (==|!=|in|not in) |\.route (==|!=|in|not in) |\bapi (==|!=) |== (MESSAGES|RESPONSES|CHAT|COMPLETIONS|COUNT_TOKENS)\b"
)
# Where one is still made today: /v1/models' two shapes (not a family), and scheduling's prompt kinds (not
# routes). None: add none.
ROUTE_TESTS = {
    ("handlers/models.py", "if api == ANTHROPIC:"),
    ("handlers/models.py", "if api == ANTHROPIC:  # one page holds them all"),
    (
        "scheduling/tokens.py",
        'return messages, body.get("tools") or None, body.get("system") if kind == MESSAGES else None',
    ),
}
NOT_ROUTED = NOT_MEASURED | {"engine_sim"}  # the simulator is an engine: its routes are its own


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


def test_no_code_tests_a_route_where_its_family_should_be_asked():
    found = set()
    for path in _modules():
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_ROUTED:
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if ROUTE_TEST.search(line):
                found.add((str(rel), line.strip()))
    assert not found - ROUTE_TESTS, (
        f"ask the request's family (serving/families/) instead: {sorted(found - ROUTE_TESTS)}"
    )
    assert not ROUTE_TESTS - found, f"no longer there, remove from ROUTE_TESTS: {sorted(ROUTE_TESTS - found)}"


def test_every_family_module_is_registered_once():
    """A family module's instance is in FAMILIES (its registration line), and no two families share a route."""
    modules = sorted(p.stem for p in (ROOT / "serving" / "families").glob("*.py") if p.stem not in ("__init__", "base"))
    defined = []
    for name in modules:
        module = importlib.import_module(f"serving.families.{name}")
        defined += [v for v in vars(module).values() if isinstance(v, Family) and v.__module__ == module.__name__]
    assert len(defined) == len(modules), "one family per module"
    assert sorted(map(id, defined)) == sorted(map(id, FAMILIES)), "a family's instance goes into FAMILIES"
    assert len({f.route for f in FAMILIES}) == len(FAMILIES)
