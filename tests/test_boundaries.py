"""The package import contract holds, and the check catches a broken one."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.boundaries import find_violations

PACKAGES_DIR = Path(__file__).resolve().parents[1] / "packages"


def test_no_package_crosses_its_boundary() -> None:
    assert find_violations(PACKAGES_DIR) == []


def test_check_catches_a_deliberately_broken_cross_import(tmp_path: Path) -> None:
    copy = tmp_path / "packages"
    shutil.copytree(PACKAGES_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    bad = copy / "merak-pipe" / "src" / "merak_pipe" / "_bad.py"
    bad.write_text("def f():\n    from merak_tp import layers\n    return layers\n")
    sneaky = copy / "merak-tp" / "src" / "merak_tp" / "_sneaky.py"
    sneaky.write_text("import importlib\nm = importlib.import_module('merak_core.trainer')\n")
    violations = find_violations(copy)
    assert len(violations) == 2, violations
    assert "merak_pipe imports merak_tp" in violations[0]
    assert "merak_tp imports merak_core" in violations[1]


def test_core_may_import_the_three_libraries(tmp_path: Path) -> None:
    copy = tmp_path / "packages"
    shutil.copytree(PACKAGES_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    ok = copy / "merak-core" / "src" / "merak_core" / "_ok.py"
    ok.write_text("import merak_pipe\nimport merak_graph\nfrom merak_tp import __version__\n")
    assert find_violations(copy) == []
