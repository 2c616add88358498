"""No import cycles inside ``fedsim`` and ``attacker``, read from the source with ``ast`` (nothing is imported).

A cycle works only as long as every module in it happens to use the others' names late enough (at call
time, or under ``TYPE_CHECKING``); the next edit that moves a use to import time breaks it with a partially
initialized module. So every import counts, wherever it is written: at the top, inside a function, under
``if TYPE_CHECKING:``.

The graph's rules:

* A node is a module; a package is the node of its ``__init__.py`` (``fedsim.models``).
* ``import a.b.c`` and ``from a.b.c import y`` make edges to ``a.b.c`` and to the packages ``a`` and ``a.b``
  that Python runs first; ``from a.b import c`` where ``c`` is a submodule makes edges to ``a.b.c`` too.
  So an edge ``X -> P`` to a package means "X depends on P's ``__init__``", which is a real dependency when
  that ``__init__`` re-exports names from its submodules.
* Edges out of a package's ``__init__`` into modules of its own package (submodules and subpackages, at any
  depth) are skipped: re-exporting its own modules is what an ``__init__`` is for, and a submodule always
  runs its package's ``__init__`` first anyway, so such edges are no design dependency. A module ``P.a`` that
  imports ``P`` (whose ``__init__`` re-exports ``P.b``, which imports ``P.a``) therefore has no cycle through
  ``P``; it still has one if ``P.b`` and ``P.a`` import each other directly. Edges from an ``__init__`` to
  modules outside its package do count.
* Imports of anything outside the two packages (the standard library, torch, flwr) are not nodes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedsim", "attacker")


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by dotted name; a package's ``__init__.py`` is the package."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _with_packages(name: str, modules: Mapping[str, Path]) -> set[str]:
    """``name`` and every package above it that is a node: what importing ``name`` runs."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules}


def _longest_module(name: str, modules: Mapping[str, Path]) -> str | None:
    """The deepest node that ``name`` names or lies in (``fedsim.data.load_dataset`` -> ``fedsim.data``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The nodes ``module`` imports anywhere in its source (functions and ``TYPE_CHECKING`` blocks included)."""
    is_package = path.name == "__init__.py"
    # The package a relative import of level 1 starts from: the module's own package (itself for an __init__).
    here = module.split(".") if is_package else module.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = _longest_module(alias.name, modules)
                if found:
                    targets |= _with_packages(found, modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found = _longest_module(base, modules)
            if found is None:
                continue
            targets |= _with_packages(found, modules)
            if found == base:  # `from pkg import name`: a submodule name is an import of that submodule
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        targets.add(f"{base}.{alias.name}")
    if is_package:  # an __init__'s edges into its own package are no dependency (see the module docstring)
        targets = {t for t in targets if t != module and not t.startswith(module + ".")}
    targets.discard(module)
    return targets


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules it imports, for every module of ``packages``."""
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected_components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit): the components of more than one node, and
    single nodes with an edge to themselves, each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        # Each frame: the node and an iterator over its remaining successors.
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        components.append(sorted(component))
    return sorted(components)


def cycle_in(component: list[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """One cycle through the component's first node, as a path that ends where it starts (breadth-first,
    so the shortest such cycle): a readable witness of the component."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph.get(node, ())):
                if succ not in members:
                    continue
                if succ == start:
                    path = [start]
                    while node != start:
                        path.append(node)
                        node = came_from[node]
                    return [start, *reversed(path[1:]), start]
                if succ not in came_from:
                    came_from[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def cycle_report(graph: Mapping[str, Iterable[str]]) -> str:
    """One line per import cycle, ``a -> b -> c -> a``; empty when there is none."""
    lines = []
    for component in strongly_connected_components(graph):
        cycle = cycle_in(component, graph)
        line = " -> ".join(cycle)
        if len(component) > len(cycle) - 1:  # the component holds more modules than this one cycle names
            line += f"   (one cycle of a component of {len(component)}: {', '.join(component)})"
        lines.append(line)
    return "\n".join(lines)


def test_cycle_finder_reports_a_synthetic_cycle() -> None:
    graph = {
        "a": {"b"},
        "b": {"c", "d"},
        "c": {"a"},
        "d": set(),
        "e": {"e"},  # a module importing itself is a cycle too
        "f": {"g"},
        "g": {"f"},
    }
    assert strongly_connected_components(graph) == [["a", "b", "c"], ["e"], ["f", "g"]]
    assert cycle_report(graph) == "a -> b -> c -> a\ne -> e\nf -> g -> f"
    assert cycle_report({"a": {"b"}, "b": {"c"}, "c": set()}) == ""


def test_graph_rules_on_a_synthetic_package(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from .a import A\nfrom .b import B\n",
        "pkg/a.py": "import pkg\n",  # through pkg's __init__, which re-exports b: no cycle by the rules
        "pkg/b.py": "def f():\n    from .a import A\n",
        "pkg/sub/__init__.py": "from ..c import C\n",  # an __init__'s edge out of its own package counts
        "pkg/sub/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
        "pkg/c.py": "from pkg.sub.d import D\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg"},
        "pkg.b": {"pkg", "pkg.a"},
        "pkg.c": {"pkg", "pkg.sub", "pkg.sub.d"},
        "pkg.sub": {"pkg", "pkg.c"},
        "pkg.sub.d": {"pkg", "pkg.c"},
    }
    assert cycle_report(graph) == (
        "pkg.c -> pkg.sub -> pkg.c   (one cycle of a component of 3: pkg.c, pkg.sub, pkg.sub.d)"
    )


def test_the_graph_sees_the_packages() -> None:
    graph = import_graph()
    # A guard against a graph that is empty (wrong root) and so never has a cycle.
    assert {"fedsim.cli", "fedsim.models.registry", "attacker.cli", "attacker.engine.runner"} <= set(graph)
    assert {"fedsim", "fedsim.models", "fedsim.models.own"} <= graph["attacker.cli"]  # from fedsim.models.own import
    assert sum(len(targets) for targets in graph.values()) > 100


def test_no_import_cycles() -> None:
    report = cycle_report(import_graph())
    if report:
        pytest.fail(f"import cycles in {' and '.join(PACKAGES)}:\n{report}", pytrace=False)


def test_the_registry_spec_is_what_the_own_adapter_reads() -> None:
    # own (own/spec.py) names the spec fields it uses (a Protocol) rather than importing the registry, which imports it.
    from fedsim.models import ModelSpec, own

    assert isinstance(ModelSpec("mlp", "mnist", 0.25, 0, {}), own.ModelSpec)
    assert not isinstance(object(), own.ModelSpec)
