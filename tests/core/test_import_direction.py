"""merak-core's folders import downward only, counting every import a reader sees.

merak-core is layered by concern (each folder's ``__init__`` docstring says what it owns and what it
may import). From low to high::

    lora < parallel < config < data < (checkpoint, generation) < hf < job < checks < run
         < planner < autoplan < trainer < launch < the package's __init__ < cli

A module may import modules of its own folder and of lower layers only; two folders on the same
layer do not import each other. The entry objects at the top are ordered too: the Trainer, then
``launch`` (``python -m merak_core.launch``, which builds the Trainer), the package's ``__init__``
(which re-exports the Trainer) and last ``cli`` (``merak``, which runs ``launch``). Every import statement counts: top-level ones, ones inside
functions (deferred, they still tie the modules together) and ones under ``if TYPE_CHECKING:`` (an
annotation that names a higher layer is a dependency a reader must follow). This replaces, for
merak-core, the cycle check of ``tests/test_import_cycles.py``: a strict downward order has no cycle
between folders, and within a folder the cycle check below still runs.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_import_cycles import find_cycles, import_graph, module_name

SRC = Path(__file__).resolve().parents[2] / "packages" / "merak-core" / "src" / "merak_core"

# (folder or top-level module) -> layer; higher imports lower, never the reverse
LAYERS: dict[str, int] = {
    "lora": 0,
    "parallel": 1,
    "config": 2,
    "data": 3,
    "checkpoint": 4,
    "generation": 4,
    "hf": 5,
    "job": 6,
    "checks": 7,
    "run": 8,
    "planner": 9,
    "autoplan": 10,
    "trainer": 11,
    "launch": 12,
    "": 13,  # merak_core/__init__.py
    "cli": 14,
}


def unit(module: str) -> str:
    """The folder or top-level module that ``module`` belongs to ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(src: Path, layers: dict[str, int]) -> list[str]:
    """``a -> b`` for each import of a module ``b`` not below (or beside, in its folder) ``a``."""
    graph = import_graph(src, type_checking=True)
    out = []
    for importer in sorted(graph):
        for target in sorted(graph[importer]):
            a, b = unit(importer), unit(target)
            if a == b:
                continue
            if a not in layers or b not in layers:
                out.append(f"{importer} -> {target} (a folder with no layer: add it to LAYERS)")
            elif layers[b] >= layers[a]:
                out.append(f"{importer} -> {target}")
    return out


def test_merak_core_imports_downward_only() -> None:
    found = violations(SRC, LAYERS)
    assert found == [], (
        "merak-core imports upward or sideways (TYPE_CHECKING and deferred imports count):\n"
        + ("\n".join(found))
    )


def test_every_folder_and_top_level_module_has_a_layer() -> None:
    units = {unit(module_name(SRC, p)) for p in SRC.rglob("*.py")}
    assert units - set(LAYERS) == set()


def test_no_import_cycle_inside_a_folder() -> None:
    cycles = find_cycles(import_graph(SRC, type_checking=True))
    assert cycles == [], f"merak-core import cycles (TYPE_CHECKING and deferred imports count): {cycles}"


def test_scan_catches_type_checking_and_deferred_upward_imports(tmp_path: Path) -> None:
    src = tmp_path / "merak_core"
    for folder in ("parallel", "run", "planner"):
        (src / folder).mkdir(parents=True)
        (src / folder / "__init__.py").write_text("")
    (src / "__init__.py").write_text("")
    (src / "parallel" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from merak_core.run.mid import Thing\n"
    )
    (src / "run" / "mid.py").write_text("def f():\n    from ..planner import high\n    return high\n")
    (src / "planner" / "high.py").write_text("from merak_core.parallel import low\nfrom . import other\n")
    (src / "planner" / "other.py").write_text("")
    layers = {"parallel": 0, "run": 1, "planner": 2, "": 3}
    assert violations(src, layers) == [
        "merak_core.parallel.low -> merak_core.run.mid",
        "merak_core.run.mid -> merak_core.planner.high",
    ]
    (src / "cli").mkdir()
    (src / "cli" / "x.py").write_text("import merak_core.parallel.low\n")
    (src / "parallel" / "y.py").write_text("from merak_core.cli import x\n")
    assert "merak_core.parallel.y -> merak_core.cli.x (a folder with no layer: add it to LAYERS)" in (
        violations(src, layers)
    )
