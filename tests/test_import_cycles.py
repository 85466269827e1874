"""No import cycle between the modules of merak-pipe, merak-graph and merak-tp, and the check catches one.

merak-core is held to more: its folders import downward only, ``TYPE_CHECKING`` imports included
(``tests/core/test_import_direction.py``, which uses :func:`find_cycles` from here within a folder).

The check reads every module with ``ast``. It counts every import that runs: top-level ones and
ones inside functions (a deferred import still ties the two modules together; it only hides the
cycle from the interpreter). It does not count imports under ``if TYPE_CHECKING:``, which never run
and exist only for annotations. An import names a module explicitly: ``import a.b.c`` and
``from a.b import c`` (``c`` a submodule) point at ``a.b.c``; ``from a.b import name`` points at
``a.b``; relative imports are resolved against the importing module. The parent packages that the
interpreter initialises on the way (``a`` and ``a.b`` for ``a.b.c``) are not counted: a package's
``__init__`` that re-exports its modules would otherwise make every module that imports a sibling
part of a cycle.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGES_DIR = Path(__file__).resolve().parents[1] / "packages"
PACKAGES = ("merak_pipe", "merak_graph", "merak_tp")  # merak_core: tests/core/test_import_direction.py


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, *, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` that can run (with ``type_checking``, those under
    ``if TYPE_CHECKING:`` too)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(src: Path, *, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (see the module docstring); with
    ``type_checking``, the imports under ``if TYPE_CHECKING:`` count too (merak-core's direction test)."""
    paths = {module_name(src, p): p for p in sorted(src.rglob("*.py"))}
    modules = set(paths)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree, type_checking=type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle through the component's first module, for the message."""
    members, start = set(component), component[0]
    trail, seen = [start], {start}
    while True:
        nxt = sorted(graph[trail[-1]] & members)
        back = [w for w in nxt if w == start]
        if back and len(trail) > 1:
            return " -> ".join([*trail, start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:  # the component is strongly connected: fall back to listing it
            return ", ".join(component)
        trail.append(fresh[0])
        seen.add(fresh[0])


def package_cycles(packages_dir: Path, pkg: str) -> list[str]:
    """One cycle per strongly connected group of ``pkg``'s modules, as ``a -> b -> a``."""
    graph = import_graph(packages_dir / pkg.replace("_", "-") / "src" / pkg)
    return [_path(graph, c) for c in find_cycles(graph)]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_cycle_inside_a_package(pkg: str) -> None:
    cycles = package_cycles(PACKAGES_DIR, pkg)
    assert cycles == [], f"{pkg} has import cycles (deferred imports count too): {cycles}"


def test_check_catches_a_deferred_cycle_and_ignores_type_checking(tmp_path: Path) -> None:
    copy = tmp_path / "packages"
    shutil.copytree(PACKAGES_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    src = copy / "merak-tp" / "src" / "merak_tp"
    (src / "_first.py").write_text("from merak_tp import _second\n")
    (src / "_second.py").write_text("def f():\n    from merak_tp._first import thing\n    return thing\n")
    (src / "_third.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from merak_tp import _fourth\n"
    )
    (src / "_fourth.py").write_text("from . import _third\n")
    cycles = package_cycles(copy, "merak_tp")
    assert cycles == ["merak_tp._first -> merak_tp._second -> merak_tp._first"], cycles


def test_relative_imports_resolve_against_the_module(tmp_path: Path) -> None:
    src = tmp_path / "pkg"
    (src / "sub").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "sub" / "__init__.py").write_text("from .a import x\n")
    (src / "sub" / "a.py").write_text("from ..b import y\nx = 1\n")
    (src / "b.py").write_text("from .sub import a\ny = 2\n")
    graph = import_graph(src)
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.a"}, "pkg.sub.a": {"pkg.b"}, "pkg.b": {"pkg.sub.a"}}
    assert find_cycles(graph) == [["pkg.b", "pkg.sub.a"]]
