"""The import contract between Merak's packages, checked from source.

merak-pipe, merak-graph and merak-tp never import each other or merak-core;
merak-core may import all three. The check parses every module with ``ast``
(so it sees imports inside functions and ``TYPE_CHECKING`` blocks too) and
also catches ``importlib.import_module("merak_x")`` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("merak_pipe", "merak_graph", "merak_tp", "merak_core")
ALLOWED: dict[str, set[str]] = {
    "merak_pipe": set(),
    "merak_graph": set(),
    "merak_tp": set(),
    "merak_core": {"merak_pipe", "merak_graph", "merak_tp"},
}


def _imported_roots(tree: ast.AST) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value.split(".")[0], node.lineno))
    return found


def find_violations(packages_dir: Path) -> list[str]:
    """Every import that crosses a forbidden package boundary, as ``file:line: message``."""
    violations = []
    for pkg in PACKAGES:
        src = packages_dir / pkg.replace("_", "-") / "src" / pkg
        for path in sorted(src.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for root, line in _imported_roots(tree):
                if root in PACKAGES and root != pkg and root not in ALLOWED[pkg]:
                    violations.append(
                        f"{path}:{line}: {pkg} imports {root}; allowed: {sorted(ALLOWED[pkg]) or 'none'}"
                    )
    return violations
